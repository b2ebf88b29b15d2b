"""The ``trainscope`` command line: parse into configs, call a facade, render.

    trainscope demo                      # the main job on the embedded default
    trainscope processor [options]       # the per-host daemon
    trainscope replay DIR [--stats-out F]
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from typing import Sequence

from trainscope.deploy import env
from trainscope.proto.errors import ConfigError, TrainscopeError


def _home(args) -> str:
    return args.home or os.environ.get(env.HOME) or os.path.join(os.getcwd(), ".trainscope")


def _sink_configs(args) -> dict:
    """Kafka / Prometheus / Perfetto configs from flags, then environment."""
    out: dict = {"kafka": None, "prometheus": None, "perfetto": None}
    bootstrap = getattr(args, "kafka_bootstrap", None) or os.environ.get(env.KAFKA_BOOTSTRAP)
    if bootstrap:
        from trainscope.processor.kafka_sink import KafkaSinkConfig
        out["kafka"] = KafkaSinkConfig(bootstrap=bootstrap,
                                       spool_dir=os.path.join(_home(args), "kafka-spool"))
    port = getattr(args, "prometheus_port", None)
    if port is None and os.environ.get(env.PROMETHEUS_PORT):
        try:
            port = int(os.environ[env.PROMETHEUS_PORT])
        except ValueError:
            raise ConfigError(env.PROMETHEUS_PORT, os.environ[env.PROMETHEUS_PORT], "must be a port number") from None
    rw = getattr(args, "remote_write_url", None) or os.environ.get(env.REMOTE_WRITE_URL)
    if port is not None or rw:
        from trainscope.processor.prom_exporter import PrometheusConfig
        out["prometheus"] = PrometheusConfig(port=port or 0, remote_write_url=rw or None)
    if getattr(args, "perfetto_url", None):
        from trainscope.processor.perfetto_sink import PerfettoConfig
        out["perfetto"] = PerfettoConfig(url=args.perfetto_url)
    return out


def _add_sink_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kafka-bootstrap", help=f"Kafka bootstrap servers (env {env.KAFKA_BOOTSTRAP}); "
                   "default: the embedded bus")
    p.add_argument("--prometheus-port", type=int, help="serve /metrics on 127.0.0.1:PORT (0 = any)")
    p.add_argument("--remote-write-url", help="Prometheus remote-write endpoint")
    p.add_argument("--perfetto-url", help="directory or fsspec URL for per-window Perfetto traces")
    p.add_argument("--home", help=f"state directory (env {env.HOME}; default ./.trainscope)")


def cmd_processor(args) -> int:
    from trainscope.processor.daemon import Processor, ProcessorConfig
    from trainscope.processor.windows import WindowConfig

    cfg = ProcessorConfig(
        listen=args.listen or os.environ.get(env.PROCESSOR) or ProcessorConfig.listen,
        window=WindowConfig(mode=args.window_mode, length_s=args.window_length_s,
                            iterations=args.window_iterations),
        store_path=os.path.join(_home(args), "store.sqlite"),
        **_sink_configs(args),
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with Processor(cfg) as proc:
        print(f"trainscope processor listening on {proc.address}", flush=True)
        if proc.metrics_server is not None:
            print(f"metrics on {proc.metrics_server.url}", flush=True)
        stop.wait()
        proc.drain(30.0)
    return 0


def cmd_replay(args) -> int:
    from trainscope.deploy.replay import kernel_stats_json, run_replay, write_json

    res = run_replay(args.dir, home=_home(args), window_iterations=args.window_iterations,
                     **_sink_configs(args))
    total = sum(res.kernel_events_sent.values())
    print(f"replayed job {res.job_id!r}: {len(res.ranks)} ranks, {total:,} kernel events "
          f"in {res.seconds:.2f} s", flush=True)
    for r in res.ranks:
        skipped = sum(res.skipped[r].values())
        print(f"  rank {r}: {res.kernel_events_sent[r]:,} kernel events"
              + (f", {skipped} skipped" if skipped else "")
              + (f", {res.exporter_drops[r]} dropped" if res.exporter_drops[r] else ""))
    stats = kernel_stats_json(res.store_path, res.job_id)
    n_clusters = sum(len(s["clusters"]) for s in stats["kernel_stats"])
    print(f"summarised into {len(stats['kernel_stats']):,} (kernel, stream, rank, window) keys, "
          f"{n_clusters:,} clusters; store: {res.store_path}")
    if args.stats_out:
        write_json(stats, args.stats_out)
        print(f"kernel stats written to {args.stats_out}")
    return 0 if not any(res.exporter_drops.values()) else 1


def cmd_demo(args) -> int:
    from trainscope.deploy.demo import run_demo

    return run_demo(home=_home(args), ranks=args.ranks, out=sys.stdout)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trainscope", description=__doc__.split("\n\n")[0])
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="run a small multi-rank job through the whole pipeline")
    d.add_argument("--ranks", type=int, default=8)
    d.add_argument("--home", help="state directory (default ./.trainscope)")
    d.set_defaults(func=cmd_demo)

    pr = sub.add_parser("processor", help="run the per-host processor daemon")
    pr.add_argument("--listen", help=f"gRPC address (env {env.PROCESSOR}; default unix socket)")
    pr.add_argument("--window-mode", choices=("time", "iterations"), default="time")
    pr.add_argument("--window-length-s", type=float, default=10.0)
    pr.add_argument("--window-iterations", type=int, default=10)
    _add_sink_flags(pr)
    pr.set_defaults(func=cmd_processor)

    r = sub.add_parser("replay", help="feed PyTorch profiler traces through the pipeline")
    r.add_argument("dir", help="directory of rank-<N>.json[.gz] (+ optional topology.json)")
    r.add_argument("--stats-out", help="write the kernel cluster stats here (JSON)")
    r.add_argument("--window-iterations", type=int, default=1000)
    _add_sink_flags(r)
    r.set_defaults(func=cmd_replay)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ConfigError, TrainscopeError) as e:
        print(f"trainscope: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
