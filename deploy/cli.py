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
import os
import signal
import sys
import threading
from typing import Sequence

from trainscope.deploy import secure_flags
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


def _sink_configs(args) -> dict:
    """Kafka / Prometheus / Perfetto configs from flags, then environment."""
    out: dict = {"kafka": None, "prometheus": None, "perfetto": None}
    bootstrap = getattr(args, "kafka_bootstrap", None) or env.text(env.KAFKA_BOOTSTRAP)
    if bootstrap:
        from trainscope.processor.kafka_config import KafkaSinkConfig
        out["kafka"] = KafkaSinkConfig(bootstrap=bootstrap, extra=secure_flags.kafka_extra(args),
                                       spool_dir=os.path.join(_home(args), "kafka-spool"))
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


def _add_sink_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kafka-bootstrap", help=f"Kafka bootstrap servers (env {env.KAFKA_BOOTSTRAP}); "
                   "default: the embedded bus")
    p.add_argument("--prometheus-port", type=int, help="serve /metrics on 127.0.0.1:PORT (0 = any)")
    p.add_argument("--remote-write-url", help="Prometheus remote-write endpoint")
    p.add_argument("--perfetto-url", help="directory or fsspec URL for per-window Perfetto traces")
    p.add_argument("--home", help=f"state directory (env {env.HOME}; default ./.trainscope)")
    secure_flags.add_kafka_flags(p)


def cmd_processor(args) -> int:
    from trainscope.processor.daemon import Processor, ProcessorConfig
    from trainscope.processor.windows import WindowConfig

    cfg = ProcessorConfig(
        listen=args.listen or env.text(env.PROCESSOR) or env.DEFAULT_PROCESSOR_TARGET,
        window=WindowConfig(mode=args.window_mode, length_s=args.window_length_s,
                            iterations=args.window_iterations),
        store_path=os.path.join(writable_home(_home(args)), "store.sqlite"),
        security=secure_flags.grpc_security(args),
        embedded_bus=False,  # no analyzer in this process reads it: the store and Kafka carry the records
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
    from trainscope.deploy.replay import kernel_stats_json, run_replay, write_json

    with Progress(f"trainscope replay {args.dir}", unit="ranks fed") as progress:
        res = run_replay(args.dir, home=writable_home(_home(args)), window_iterations=args.window_iterations,
                         analyze=not args.no_analyze, replace_store=args.force, progress=progress,
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


def cmd_analyzer(args) -> int:
    """The analyzer service (deploy/analyzer_daemon.py): Kafka consumer group, or tail of the local store."""
    from trainscope.deploy.analyzer_daemon import AnalyzerDaemon, AnalyzerDaemonConfig, default_instance_id

    home = _home(args)
    store_path = args.store or os.path.join(home, "store.sqlite")
    cfg = AnalyzerDaemonConfig(
        store_path=store_path, spool_dir=os.path.join(home, "analyzer-spool"),
        kafka_bootstrap=args.kafka_bootstrap or env.text(env.KAFKA_BOOTSTRAP) or None,
        group_id=args.group_id, window_timeout_s=args.window_timeout_s, prometheus_port=args.prometheus_port,
        kafka_extra=secure_flags.kafka_extra(args), metrics_security=secure_flags.metrics_security(args),
        group_instance_id=args.group_instance_id or default_instance_id(home), session_timeout_s=args.session_timeout_s)
    daemon = AnalyzerDaemon(cfg)
    try:
        daemon.start()
        if daemon.metrics_server is not None:
            print(f"metrics on {daemon.metrics_server.url}", flush=True)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        print(f"trainscope analyzer reading {daemon.where}; diagnoses to {store_path}", flush=True)
        daemon.run(stop, lambda v: print(f"[{v.job_id} {window_label(v.window)}] {v.summary}", flush=True))
    finally:
        daemon.stop()
    return 0


def cmd_demo(args) -> int:
    from trainscope.deploy.demo import run_demo

    return run_demo(home=writable_home(_home(args)), ranks=args.ranks, out=sys.stdout, replace_store=args.force)


def cmd_sim(args) -> int:
    from trainscope.collector.sim import FAULT_TYPES, sim_config
    from trainscope.deploy.embedded import run_sim

    if args.list_faults:
        for k in FAULT_TYPES.values():
            defaults = ",".join(f"{p}={v:g}" for p, v in k.params.items())
            print(f"{k.name:<17} {'+'.join(k.levels):<6} {k.summary}" + (f"  [{defaults}]" if defaults else ""))
        return 0
    cfg = sim_config(
        ranks=args.ranks, tp=args.tp, pp=args.pp, ep=args.ep, cp=args.cp, order=args.order,
        gpus_per_host=args.gpus_per_host, nics_per_host=args.nics_per_host,
        micro_batches=args.micro_batches, layers=args.layers, iteration_s=args.iteration_time,
        duration=args.duration, iterations=args.iterations, faults=args.fault, scenario=args.scenario,
        seed=args.seed, job_id=args.job_id, exporters=args.exporters, home=writable_home(_home(args)),
        ground_truth_path=args.ground_truth, traces_out=args.traces_out, window_mode=args.window_mode,
        window_iterations=args.window_iterations, window_length_s=args.window_length_s,
    )
    options = dict(_sink_configs(args), replace_store=args.force) if args.processor is None else {}
    analysis = None
    if args.processor is None and not args.no_analyze:
        from trainscope.deploy.embedded import SimAnalysis
        analysis = SimAnalysis()
    progress = Progress(f"trainscope sim (job {cfg.job_id})", cfg.iterations, "iterations")
    try:
        res = run_sim(cfg, args.processor, processor_options=options, sinks=[SimProgress(progress)],
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
    return 0 if not res.dropped else 1


def cmd_query(args) -> int:
    """``trainscope query WHAT``: parse, ask the facade, render (exit 1 when it cannot answer)."""
    import json
    import time

    from trainscope.analyzer.query import Query, QueryConfig
    from trainscope.analyzer.query_model import QueryError, as_json

    if args.store:
        path, setting = args.store, "--store"
    else:
        path = os.path.join(_home(args), "store.sqlite")
        setting = "--home" if args.home else env.HOME if env.text(env.HOME) else "--home (default ./.trainscope)"
    _check_store_file(path, setting)
    cfg = QueryConfig(store_path=path, store_setting=setting, prometheus_url=getattr(args, "prometheus", None))
    since_ns = parse_since(getattr(args, "since", None), time.time())
    ask = {
        "jobs": lambda q: q.jobs(),
        "verdict": lambda q: q.verdict(args.job, args.window),
        "stragglers": lambda q: q.stragglers(args.job, since_ns),
        "kernels": lambda q: q.kernels(args.job, args.rank, args.top, since_ns),
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


def _check_store_file(path: str, setting: str) -> None:
    """A file that is not SQLite is refused before it is opened (opening would write to it)."""
    if not os.path.isfile(path):
        return  # the facade says where it looked and what to run first
    try:
        with open(path, "rb") as f:
            magic = f.read(16)
    except OSError as e:
        raise ConfigError(setting, path, f"cannot read it: {e.strerror}") from None
    if magic and magic != b"SQLite format 3\x00":
        raise ConfigError(setting, path, "not a trainscope store (not an SQLite file)")


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


def _add_query_parser(sub) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--store", help="the SQLite store (default HOME/store.sqlite)")
    common.add_argument("--home", help=f"state directory (env {env.HOME}; default ./.trainscope)")
    common.add_argument("--json", action="store_true", help="print JSON instead of a table")
    job = argparse.ArgumentParser(add_help=False)
    job.add_argument("--job", help="job id (default: the store's only job)")
    prom = argparse.ArgumentParser(add_help=False)
    prom.add_argument("--since", help="only findings since then: 90s, 30m, 2h, 1d or an ISO time")
    prom.add_argument("--prometheus", metavar="URL",
                      help="ask Prometheus (flagged now / over --since, default 1h) instead of the store")
    q = sub.add_parser("query", help="ask the store (or Prometheus) about a job's verdict, stragglers, kernels...")
    qs = q.add_subparsers(dest="what", required=True, metavar="WHAT")
    qs.add_parser("jobs", parents=[common], help="jobs in the store with their latest verdict")
    v = qs.add_parser("verdict", parents=[common, job], help="the latest verdict of a job: suspects, phases, kernels")
    v.add_argument("--window", type=int, help="this window's verdict (default: the job's verdict over all its windows)")
    qs.add_parser("stragglers", parents=[common, job, prom], help="ranks flagged as stragglers (L2) since a time")
    k = qs.add_parser("kernels", parents=[common, job, prom], help="a rank's degraded kernels (L3) against its peers")
    k.add_argument("--rank", type=int, required=True)
    k.add_argument("--top", type=int, default=10, help="show this many kernels (default 10)")
    i = qs.add_parser("iterations", parents=[common, job], help="iteration time per window (job, or one --rank)")
    i.add_argument("--rank", type=int, help="one rank's windows instead of the job's")
    i.add_argument("--last", type=int, default=20, help="the last N windows (default 20; 0 = all)")
    r = qs.add_parser("ranks", parents=[common, job], help="rank -> host, device, parallel coordinates")
    r.add_argument("--rank", type=int)
    r.add_argument("--host")
    q.set_defaults(func=cmd_query)


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
    p = argparse.ArgumentParser(prog="trainscope", description=__doc__.split("\n\n")[0])
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="run a small multi-rank job through the whole pipeline")
    d.add_argument("--ranks", type=int, default=32, help="simulated ranks (a multiple of 4)")
    d.add_argument("--home", help="state directory (default ./.trainscope)")
    d.add_argument("--force", action="store_true", help="replace HOME/store.sqlite when an earlier run left one")
    d.set_defaults(func=cmd_demo)

    an = sub.add_parser("analyzer", help="run the analyzer service (Kafka consumer group or local store)")
    an.add_argument("--kafka-bootstrap", help=f"consume from Kafka (env {env.KAFKA_BOOTSTRAP})")
    an.add_argument("--group-id", default="trainscope-analyzer", help="Kafka consumer group")
    an.add_argument("--group-instance-id", help="static group member id, unique per analyzer: a restart resumes "
                    "at once (default: host name + hash of --home)")
    an.add_argument("--session-timeout-s", type=float, default=10.0,
                    help="Kafka session timeout: how long a vanished analyzer holds its partitions")
    an.add_argument("--store", help="processor store to tail when there is no broker (default HOME/store.sqlite)")
    an.add_argument("--prometheus-port", type=int, help="serve flagged-suspect series on 127.0.0.1:PORT")
    an.add_argument("--window-timeout-s", type=float, default=60.0,
                    help="analyse a window this long after its first record even if ranks are missing")
    an.add_argument("--home", help=f"state directory (env {env.HOME}; default ./.trainscope)")
    secure_flags.add_kafka_flags(an)
    secure_flags.add_tls_flags(an, grpc=False)
    an.set_defaults(func=cmd_analyzer)

    pr = sub.add_parser("processor", help="run the per-host processor daemon")
    pr.add_argument("--listen", help=f"gRPC address (env {env.PROCESSOR}; default unix socket)")
    pr.add_argument("--window-mode", choices=("auto", "time", "iterations"), default="auto",
                    help="auto: iterations when the ranks send iteration marks, else time (default: auto)")
    pr.add_argument("--window-length-s", type=float, default=10.0)
    pr.add_argument("--window-iterations", type=int, default=10)
    _add_sink_flags(pr)
    secure_flags.add_tls_flags(pr, grpc=True)
    pr.set_defaults(func=cmd_processor)

    r = sub.add_parser("replay", help="feed PyTorch profiler traces through the pipeline")
    r.add_argument("dir", help="directory of rank-<N>.json[.gz] (+ optional topology.json)")
    r.add_argument("--stats-out", help="write the kernel cluster stats here (JSON)")
    r.add_argument("--json", help="write the diagnoses here (JSON, the replay contract's format)")
    r.add_argument("--no-analyze", action="store_true", help="only summarise; run no detectors")
    r.add_argument("--window-iterations", type=int, default=5)
    r.add_argument("--force", action="store_true", help="replace HOME/store.sqlite when an earlier run left one")
    _add_sink_flags(r)
    r.set_defaults(func=cmd_replay)

    s = sub.add_parser("sim", help="simulate a hybrid-parallel job with injected faults through the pipeline")
    s.add_argument("--ranks", type=int, help="world size (default 64)")
    for dim in ("tp", "pp", "ep", "cp"):
        s.add_argument(f"--{dim}", type=int, help=f"{dim.upper()} degree (default 1)")
    s.add_argument("--order", help="Megatron rank order (default tp-cp-ep-dp-pp)")
    s.add_argument("--gpus-per-host", type=int)
    s.add_argument("--nics-per-host", type=int)
    s.add_argument("--micro-batches", type=int, help="micro-batches per iteration (default 4)")
    s.add_argument("--layers", type=int, help="layers per pipeline stage (default 2; kernels scale with it)")
    s.add_argument("--iteration-time", help="healthy iteration time, e.g. 3s (default)")
    s.add_argument("--duration", help="simulated time to run, e.g. 300s")
    s.add_argument("--iterations", type=int, help="iterations to run (default 20 without --duration)")
    s.add_argument("--fault", action="append", default=[], metavar="TYPE:KEY=VALUE,...",
                   help="inject a fault (repeatable); --list-faults shows the types")
    s.add_argument("--scenario", help="JSON file with a list of faults")
    s.add_argument("--list-faults", action="store_true", help="print the fault catalogue and exit")
    s.add_argument("--seed", type=int)
    s.add_argument("--job-id")
    s.add_argument("--exporters", type=int, help="collector exporters (gRPC streams) to spread hosts over")
    s.add_argument("--processor", help="send to this processor (ADDR) instead of starting an embedded one")
    s.add_argument("--traces-out", help="also write PyTorch-profiler traces here (for trainscope replay)")
    s.add_argument("--no-analyze", action="store_true", help="embedded processor only; run no detectors")
    s.add_argument("--ground-truth", help="ground-truth JSON path (default HOME/sim-ground-truth.json)")
    s.add_argument("--json", dest="json_out", help="write the run summary here (JSON)")
    s.add_argument("--window-mode", choices=("iterations", "time"), help="embedded processor windows")
    s.add_argument("--window-iterations", type=int)
    s.add_argument("--window-length-s", type=float)
    s.add_argument("--force", action="store_true",
                   help="replace HOME/store.sqlite when an earlier run left one (embedded processor)")
    _add_sink_flags(s)
    s.set_defaults(func=cmd_sim)
    _add_query_parser(sub)
    _add_run_parser(sub)
    _defaults_in_help(p)
    return p


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("trainscope")
    except PackageNotFoundError:
        return "unknown (not installed)"


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` unless the help already says its default; switches are off by default."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text.lower() or action.default is argparse.SUPPRESS or action.nargs == 0:
            return text
        if not action.option_strings:
            return text  # positionals are required: no default to show
        shown = "none" if action.default is None or action.default == [] else "%(default)s"
        return f"{text} (default: {shown})".strip()


def _defaults_in_help(parser: argparse.ArgumentParser) -> None:
    """Every parser and sub-parser shows each flag's default in ``--help``."""
    parser.formatter_class = _DefaultsFormatter
    for action in parser._actions:
        if action.option_strings and not action.help and action.nargs != 0:
            action.help = "(default: none)" if action.default is None else "(default: %(default)s)"
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _defaults_in_help(child)


def _add_run_parser(sub) -> None:
    ru = sub.add_parser("run", help="run a training command with the collector in every rank process",
                        description="trainscope run [options] -- torchrun --nproc-per-node 8 train.py ...")
    ru.add_argument("--processor", help=f"processor address (env {env.PROCESSOR}; default the host's socket)")
    ru.add_argument("--no-processor", action="store_true", help="do not start a processor when none answers")
    ru.add_argument("--no-stacks", action="store_true", help="no py-spy stack sidecar")
    ru.add_argument("--stacks-window-s", type=float, default=env.DEFAULT_STACKS_WINDOW_S,
                    help="stack sampling window (whole seconds)")
    ru.add_argument("--job-id", help=f"job id (env {env.JOB_ID}; default generated)")
    ru.add_argument("--match", help="regex rank command lines must match (default: the script or -m module)")
    ru.add_argument("--run-dir", help="rank registry and counters (default a temporary directory)")
    ru.add_argument("--home", help="state directory of a processor started here (default ./.trainscope)")
    ru.add_argument("--set", action="append", metavar="NAME=VALUE", help="extra environment for the job")
    ru.add_argument("--print-env", action="store_true",
                    help="print the environment that enables collection (for launchers that cannot be wrapped)")
    ru.add_argument("--install-pth", nargs="?", const="", metavar="SITE_DIR",
                    help="install a .pth hook so TRAINSCOPE_AUTOSTART=1 alone enables collection")
    ru.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    ru.set_defaults(func=cmd_run)

    from trainscope.deploy import report_cmd
    report_cmd.add_parser(sub)


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
    except BrokenPipeError:
        # `trainscope query ... | head`: the reader left; no traceback, and none again at exit's flush
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # what a shell reports for a tool ended by SIGPIPE


if __name__ == "__main__":
    raise SystemExit(main())
