"""The ``trainscope`` command line: parse into configs, call a facade, render.

    trainscope demo                      # the main job on the embedded default
    trainscope processor [options]       # the per-host daemon
    trainscope replay DIR [--stats-out F]
    trainscope run [options] -- CMD      # CMD with the collector in every rank process
    trainscope sim --ranks 1024 --tp 8 --pp 4 --ep 8 --fault gpu_throttle:rank=137,onset=60s --duration 300s
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import re
import signal
import sys
import threading
from typing import Sequence

from trainscope.deploy import cli_parser, secure_flags
from trainscope.proto import env
from trainscope.deploy.render import (Progress, SimProgress, render_evaluation, render_query, render_sim,
                                      render_verdicts, window_label)
from trainscope.proto.errors import ConfigError, TrainscopeError


def _home(args) -> str:
    return args.home or env.text(env.HOME) or os.path.join(os.getcwd(), ".trainscope")


def writable_home(home: str) -> str:
    """``home``, created (0700) when missing; a ConfigError (one line, exit 2) when it cannot be written."""
    try:
        os.makedirs(home, mode=0o700, exist_ok=True)
    except OSError as e:
        raise ConfigError("--home", home, f"cannot create it: {e.strerror}") from None
    if not os.access(home, os.W_OK | os.X_OK):
        raise ConfigError("--home", home, "not writable; pass --home DIR or set " + env.HOME)
    return home


def output_file(setting: str, path: str | None, *, force: bool) -> None:
    """An output file, checked before the run that writes it (not after minutes of work): not a
    directory, an existing file only with --force, in a directory it can be written in (tried with a
    probe file: root passes every permission check, yet cannot write in /proc)."""
    if not path:
        return
    if os.path.isdir(path):
        raise ConfigError(setting, path, "is a directory; name the file to write")
    if os.path.lexists(path) and not force:
        raise ConfigError(setting, path, "exists; pass --force to replace it, or name another file")
    _probe(setting, path, os.path.dirname(os.path.abspath(path)))


def output_dir(setting: str, path: str | None) -> None:
    """An output directory, checked before the run that fills it: new or empty (never mixed with
    files that were there), and creatable or writable. Nothing is created here."""
    if not path:
        return
    if os.path.lexists(path) and not os.path.isdir(path):
        raise ConfigError(setting, path, "exists and is not a directory")
    if os.path.isdir(path) and os.listdir(path):
        raise ConfigError(setting, path, "is not empty; name a new or empty directory")
    base = os.path.abspath(path)
    while not os.path.exists(base):
        base = os.path.dirname(base)
    _probe(setting, path, base)


def _probe(setting: str, path: str, directory: str) -> None:
    import tempfile
    try:
        os.rmdir(tempfile.mkdtemp(dir=directory, prefix=".trainscope-probe-"))
    except OSError as e:
        raise ConfigError(setting, path, f"cannot write in {directory}: {e.strerror}") from None


def _sink_configs(args) -> dict:
    """Kafka / Prometheus / Perfetto configs from flags, then environment."""
    out: dict = {"kafka": None, "prometheus": None, "perfetto": None}
    bootstrap = getattr(args, "kafka_bootstrap", None) or env.text(env.KAFKA_BOOTSTRAP)
    if bootstrap:
        from trainscope.processor.kafka_config import KafkaSinkConfig
        out["kafka"] = KafkaSinkConfig(bootstrap=bootstrap, extra=secure_flags.kafka_extra(args),
                                       spool_dir=os.path.join(_home(args), "kafka-spool"),
                                       key_by=getattr(args, "kafka_key_by", None) or "job")
    port = getattr(args, "prometheus_port", None)
    if port is None:
        port = env.integer(env.PROMETHEUS_PORT, None)
    rw = getattr(args, "remote_write_url", None) or env.text(env.REMOTE_WRITE_URL)
    if port is not None or rw:
        from trainscope.processor.prom_exporter import PrometheusConfig
        out["prometheus"] = PrometheusConfig(port=port or 0, remote_write_url=rw or None,
                                             host=getattr(args, "metrics_host", None) or "127.0.0.1",
                                             security=secure_flags.metrics_security(args))
    if getattr(args, "perfetto_url", None):
        from trainscope.processor.perfetto_sink import PerfettoConfig
        out["perfetto"] = PerfettoConfig(url=args.perfetto_url)
    return out


def _dive_upload_config(args):
    """``--deep-dive-url`` and its settings (processor/dive_upload.py); None without a URL."""
    if args.deep_dive_url is None:
        return None
    from trainscope.processor.dive_upload import DiveUploadConfig, check_url

    check_url(args.deep_dive_url, "--deep-dive-url")
    if not 1 <= args.deep_dive_upload_max_mib <= 1 << 20:
        raise ConfigError("--deep-dive-upload-max-mib", args.deep_dive_upload_max_mib, "must be 1 to 1048576 MiB")
    return DiveUploadConfig(url=args.deep_dive_url, keep_local=args.deep_dive_local == "keep",
                            max_bytes=args.deep_dive_upload_max_mib << 20)


def cmd_processor(args) -> int:
    from trainscope.processor.collectives import CollectiveWindowConfig, TriggerConfig
    from trainscope.processor.daemon import Processor, ProcessorConfig
    from trainscope.processor.windows import WindowConfig

    cfg = ProcessorConfig(
        listen=args.listen or env.text(env.PROCESSOR) or env.DEFAULT_PROCESSOR_TARGET,
        window=WindowConfig(mode=args.window_mode, length_s=args.window_length_s,
                            iterations=args.window_iterations),
        store_path=os.path.join(writable_home(_home(args)), "store.sqlite"),
        store_keep_windows=args.keep_windows,
        collectives=CollectiveWindowConfig(trigger=TriggerConfig(
            raw_records="triggered" if args.collective_raw == "triggered" else "always")),
        security=secure_flags.grpc_security(args),
        embedded_bus=False,  # no analyzer in this process reads it: the store and Kafka carry the records
        deep_dive_upload=_dive_upload_config(args),
        **_sink_configs(args),
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with Processor(cfg) as proc:
        print(f"trainscope processor listening on {proc.address}", flush=True)
        if proc.metrics_server is not None:
            print(f"metrics on {proc.metrics_server.url}", flush=True)
        rc = proc.serve(stop)  # 1 when the processing thread died: exit loudly, not serve as if alive
        proc.drain(30.0)
    return rc


def cmd_replay(args) -> int:
    from trainscope.analyzer.service import AnalyzerConfig
    from trainscope.deploy.replay import kernel_stats_json, run_replay, write_json

    analyzer_config = AnalyzerConfig(**verdict_settings(args))  # a bad --impact-floor/--persist: refused first

    output_file("--stats-out", args.stats_out, force=args.force)  # before the replay, not after it
    output_file("--json", args.json, force=args.force)
    with Progress(f"trainscope replay {args.dir}", unit="ranks fed") as progress:
        res = run_replay(args.dir, home=writable_home(_home(args)), window_iterations=args.window_iterations,
                         analyze=not args.no_analyze, replace_store=args.force, progress=progress,
                         analyzer_config=analyzer_config, **_sink_configs(args))
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
    if _say_undelivered(res.processor, args):
        return 1
    if not args.no_analyze:
        from trainscope.analyzer.report import report
        rep = report(res.store_path, res.job_id)
        print(render_verdicts(res.verdicts))
        if args.json:
            write_json(rep, args.json)
            print(f"diagnoses written to {args.json}")
    return 0 if not any(res.exporter_drops.values()) else 1


def _say_undelivered(processor_metrics: dict, args) -> bool:
    """One line on stderr when the final Kafka flush left records behind (the run then exits 1)."""
    from trainscope.deploy.embedded import undelivered_kafka_bytes

    left = undelivered_kafka_bytes(processor_metrics)
    if left:
        spool = os.path.join(_home(args), "kafka-spool")
        print(f"trainscope: {left:,} bytes of records were not delivered to Kafka "
              f"{getattr(args, 'kafka_bootstrap', None) or env.text(env.KAFKA_BOOTSTRAP)}; they stay in {spool} "
              "and the next processor with this home sends them", file=sys.stderr)
    return left > 0


def verdict_settings(args) -> dict:
    """``--impact-floor`` and ``--persist`` as ``AnalyzerConfig`` fields (a ConfigError names a bad one)."""
    from trainscope.analyzer.impact import ImpactConfig

    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", args.persist or "")
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)) <= 64:
        raise ConfigError("--persist", args.persist, "must be K/N with 1 <= K <= N <= 64, e.g. 2/3")
    floor = args.impact_floor
    if not (math.isfinite(floor) and 0 <= floor < 100):
        raise ConfigError("--impact-floor", floor, "must be a percentage in [0, 100)")
    return {"impact": ImpactConfig(floor_pct=floor), "persist_k": int(m.group(1)), "persist_n": int(m.group(2))}


def cmd_analyzer(args) -> int:
    """The analyzer service (deploy/analyzer_daemon.py): Kafka consumer group, or tail of the local store."""
    from trainscope.deploy.analyzer_daemon import AnalyzerDaemon, AnalyzerDaemonConfig, default_instance_id

    home = _home(args)
    store_path = args.store or os.path.join(home, "store.sqlite")
    if args.deep_dive_url is not None:   # refused before anything starts (exit 2, one line)
        from trainscope.processor.dive_upload import check_url
        check_url(args.deep_dive_url, "--deep-dive-url")
    cfg = AnalyzerDaemonConfig(
        store_path=store_path, spool_dir=os.path.join(home, "analyzer-spool"),
        kafka_bootstrap=args.kafka_bootstrap or env.text(env.KAFKA_BOOTSTRAP) or None,
        group_id=args.group_id, window_timeout_s=args.window_timeout_s, prometheus_port=args.prometheus_port,
        kafka_extra=secure_flags.kafka_extra(args), metrics_security=secure_flags.metrics_security(args),
        group_instance_id=args.group_instance_id or default_instance_id(home), session_timeout_s=args.session_timeout_s,
        deep_dive_processors=tuple(args.deep_dive_processor or ()), keep_windows=args.keep_windows,
        verdict=verdict_settings(args), partitioned=args.partitioned)
    daemon = AnalyzerDaemon(cfg)
    follower = None
    try:
        daemon.start()
        # completed deep dives of this host analysed (L4) and merged into the verdicts (analyzer/deepdive/results.py)
        from trainscope.analyzer.deepdive.results import DeepDiveFollower
        from trainscope.analyzer.store import DiagnosisStore
        follower = DeepDiveFollower(env.deep_dive_dir(), DiagnosisStore(store_path, keep_windows=args.keep_windows),
                                    url=args.deep_dive_url)
        follower.start()
        if daemon.metrics_server is not None:
            print(f"metrics on {daemon.metrics_server.url}", flush=True)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        print(f"trainscope analyzer reading {daemon.where}; diagnoses to {store_path}", flush=True)
        daemon.run(stop, lambda v: print(f"[{v.job_id} {window_label(v.window)}] {v.summary}", flush=True))
    finally:
        if follower is not None:
            follower.close()
            follower.store.close()
        daemon.stop()
    return 0


def cmd_demo(args) -> int:
    from trainscope.deploy.demo import check_ranks, run_demo

    check_ranks(args.ranks)  # before the home is made
    return run_demo(home=writable_home(_home(args)), ranks=args.ranks, out=sys.stdout, replace_store=args.force)


def cmd_sim(args) -> int:
    from trainscope.collector.sim import FAULT_TYPES, sim_config
    from trainscope.deploy.embedded import run_sim_embedded

    if args.list_faults:
        for k in FAULT_TYPES.values():
            defaults = ",".join(f"{p}={v:g}" for p, v in k.params.items())
            print(f"{k.name:<17} {'+'.join(k.levels):<6} {k.summary}" + (f"  [{defaults}]" if defaults else ""))
        return 0
    if args.processor is not None:
        env.check_target("--processor", args.processor)
        from trainscope.collector.exporter_socket import reachable
        if not reachable(args.processor, 2.0):  # the exporters would retry it until the final flush's bound
            print(f"trainscope: no processor answers at {args.processor}: start `trainscope processor "
                  f"--listen {args.processor}` first, or leave out --processor; nothing was sent", file=sys.stderr)
            return 1
    cfg = sim_config(
        ranks=args.ranks, tp=args.tp, pp=args.pp, ep=args.ep, cp=args.cp, order=args.order,
        gpus_per_host=args.gpus_per_host, nics_per_host=args.nics_per_host,
        micro_batches=args.micro_batches, layers=args.layers, iteration_s=args.iteration_time,
        duration=args.duration, iterations=args.iterations, faults=args.fault, scenario=args.scenario,
        seed=args.seed, job_id=args.job_id, exporters=args.exporters, home=_home(args),
        ground_truth_path=args.ground_truth, traces_out=args.traces_out, window_mode=args.window_mode,
        window_iterations=args.window_iterations, window_length_s=args.window_length_s,
        collective_steps=args.collective_steps,
    )
    output_file("--ground-truth", args.ground_truth, force=args.force)  # checked before the run, not after
    output_file("--json", args.json_out, force=args.force)
    output_dir("--traces-out", args.traces_out)
    writable_home(cfg.home)
    options = dict(_sink_configs(args), replace_store=args.force) if args.processor is None else {}
    analysis = None
    if args.processor is None and not args.no_analyze:
        from trainscope.deploy.embedded import SimAnalysis
        analysis = SimAnalysis()
    progress = Progress(f"trainscope sim (job {cfg.job_id})", cfg.iterations, "iterations")
    try:
        res = run_sim_embedded(cfg, args.processor, processor_options=options, sinks=[SimProgress(progress)],
                      **(analysis.hooks() if analysis else {}))
    finally:
        progress.close()
    render_sim(res, sys.stdout)
    if analysis is not None:
        from trainscope.analyzer.evaluate import evaluate, load_truth
        print(render_verdicts(analysis.verdicts))
        ev = evaluate(analysis.verdicts, load_truth(res.ground_truth_path), cfg.window_iterations)
        print(render_evaluation(ev))
    if args.json_out:
        from trainscope.deploy.replay import write_json
        write_json(res.to_dict(), args.json_out)
    if args.processor is None and _say_undelivered(res.processor or {}, args):
        return 1
    if args.processor is not None and res.dropped:
        ex = res.exporter
        why = ", ".join(f"{k} {n:,}" for k, n in sorted({**ex.get("dropped", {}),
                                                          **ex.get("rejected_by_reason", {})}.items()) if n)
        print(f"trainscope: {res.dropped:,} batches were not delivered to the processor at {args.processor}"
              + (f" (batches by reason: {why})" if why else ""), file=sys.stderr)
    return 0 if not res.dropped else 1


def cmd_query(args) -> int:
    """``trainscope query WHAT``: parse, ask the facade, render (exit 1 when it cannot answer)."""
    import json
    import time

    from trainscope.analyzer.query import Query, QueryConfig
    from trainscope.analyzer.query_model import QueryError, as_json

    if args.what == "deep-dive":   # read from the deep-dive directory, not the store
        from trainscope.analyzer.query import deep_dives, render_deep_dives
        if args.deep_dive_url is not None:
            from trainscope.processor.dive_upload import check_url
            check_url(args.deep_dive_url, "--deep-dive-url")
        dives = deep_dives(args.deep_dive_dir or env.deep_dive_dir(), args.job, url=args.deep_dive_url)
        print(json.dumps(dives, indent=2) if args.json else render_deep_dives(dives))
        return 0
    if args.store:
        path, setting = args.store, "--store"
    else:
        path = os.path.join(_home(args), "store.sqlite")
        setting = "--home" if args.home else env.HOME if env.text(env.HOME) else "--home (default ./.trainscope)"
    if os.path.exists(path):  # a missing one: the facade says where it looked (Prometheus answers need none)
        from trainscope.deploy.report_cmd import check_store
        check_store(path, setting)
    cfg = QueryConfig(store_path=path, store_setting=setting, prometheus_url=getattr(args, "prometheus", None))
    since_ns = parse_since(getattr(args, "since", None), time.time())
    ask = {
        "jobs": lambda q: q.jobs(),
        "verdict": lambda q: q.verdict(args.job, args.window),
        "stragglers": lambda q: q.stragglers(args.job, since_ns),
        "kernels": lambda q: q.kernels(args.job, args.rank, args.top, since_ns, args.last),
        "iterations": lambda q: q.iterations(args.job, args.rank, args.last),
        "ranks": lambda q: q.ranks(args.job, args.rank, args.host),
    }[args.what]
    import sqlite3
    try:
        with Query(cfg) as q, Progress(f"trainscope query {args.what}: reading {path}").ticking():
            result = ask(q)
    except sqlite3.DatabaseError as e:
        raise ConfigError(setting, path, f"not a readable trainscope store: {e}") from None
    except QueryError as e:
        print(f"trainscope query: {e}", file=sys.stderr)
        return 1
    print(json.dumps(as_json(result), indent=2) if args.json else render_query(result))
    return 0


def parse_since(text: str | None, now_s: float) -> int:
    """``--since``: ``90s``/``30m``/``2h``/``1d``/``1h30m`` ago or an ISO-8601 time, as unix ns (0: none).

    An ISO time without a zone is local time; add ``Z`` or ``+02:00`` otherwise.
    """
    import datetime
    import re

    if not text:
        return 0
    t = text.strip()
    if re.fullmatch(r"(\d+(\.\d+)?[smhdw])+", t):
        unit = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
        return int((now_s - sum(float(n) * unit[u] for n, u in re.findall(r"([\d.]+)([smhdw])", t))) * 1e9)
    try:
        return int(datetime.datetime.fromisoformat(t).timestamp() * 1e9)
    except ValueError:
        raise ConfigError("--since", text, "use a duration like 90s, 30m, 2h, 1d or an ISO time "
                                           "like 2024-05-01T12:00:00Z") from None


def cmd_run(args) -> int:
    from trainscope.collector.bootstrap import install_autostart_pth
    from trainscope.deploy import launcher as launch

    command = list(args.command[1:] if args.command[:1] == ["--"] else args.command)
    extra = []
    for item in args.set or ():
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ConfigError("run --set", item, "expected NAME=VALUE")
        extra.append((name, value))
    if args.install_pth is not None:
        print(f"wrote {install_autostart_pth(args.install_pth or None)}; "
              "set TRAINSCOPE_AUTOSTART=1 in the job's environment to enable collection")
        return 0
    if not command and not args.print_env:
        raise ConfigError("run", "", "no command: trainscope run [options] -- CMD ARGS...")
    cfg = launch.RunConfig(
        command=tuple(command) or ("<none>",) if args.print_env else tuple(command),
        processor=args.processor or "", start_processor=not args.no_processor, stacks=not args.no_stacks,
        stacks_window_s=args.stacks_window_s, job_id=args.job_id or "", match=args.match,
        run_dir=args.run_dir or "", home=args.home or "", extra_env=tuple(extra))
    if args.print_env:
        launch.print_env(cfg)
        return 0
    import shutil
    if shutil.which(command[0]) is None:
        raise ConfigError("run", command[0], "command not found (not on PATH and not an executable path)")
    result = launch.run(cfg)
    print("\n".join(launch.summary_lines(result)), file=sys.stderr)
    return result.returncode


def build_parser() -> argparse.ArgumentParser:
    """The parser (``cli_parser.py``) with each subcommand bound to its ``cmd_*`` above."""
    return cli_parser.build_parser(
        {"demo": cmd_demo, "analyzer": cmd_analyzer, "processor": cmd_processor, "replay": cmd_replay,
         "sim": cmd_sim, "query": cmd_query, "run": cmd_run},
        description="Always-on tracing and fail-slow diagnosis for distributed PyTorch training. "
                    "Start with `trainscope demo`; `trainscope COMMAND --help` for each command.")


def _quiet_grpc() -> None:
    """gRPC's C core prints its own log lines (``E1124 ... add_port.cc:83] Failed to add port``) beside
    the CLI's one-line message. It reads GRPC_VERBOSITY once, at import: set to NONE for that import
    only (unless the user set it), so the commands the CLI starts (``run``'s job) keep the user's
    environment. ``-v`` leaves gRPC's lines on."""
    if env.GRPC_VERBOSITY in os.environ or "grpc" in sys.modules:
        return
    os.environ[env.GRPC_VERBOSITY] = "NONE"
    try:
        import grpc  # noqa: F401
    except ImportError:
        pass
    finally:
        del os.environ[env.GRPC_VERBOSITY]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        _quiet_grpc()
    try:
        return args.func(args)
    except (ConfigError, TrainscopeError) as e:
        print(f"trainscope: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `trainscope query ... | head`: the reader left; no traceback, and none again at exit's flush
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # what a shell reports for a tool ended by SIGPIPE


if __name__ == "__main__":
    raise SystemExit(main())
