"""The ``trainscope`` argument parser (split from ``cli.py``, which keeps ``main`` and the commands).

``build_parser(handlers, description)`` builds every subcommand's flags and binds
each to its handler (``handlers["processor"]`` is ``cli.cmd_processor``, and so
on; ``report`` binds its own, ``report_cmd.py``). Window-mode choices come from
``proto/contracts.WindowMode``; every flag's help shows its default
(``_DefaultsFormatter``, checked by ``tests/unit/test_cli_help.py``).
"""
from __future__ import annotations

import argparse
from typing import Callable, Mapping

from trainscope.deploy import secure_flags
from trainscope.proto import env
from trainscope.proto.contracts import FIXED_WINDOW_MODES, WINDOW_MODES, WindowMode

#: Subcommand name -> the function that runs it (returns the exit status).
Handlers = Mapping[str, Callable[[argparse.Namespace], int]]


def build_parser(handlers: Handlers, description: str) -> argparse.ArgumentParser:
    """The whole ``trainscope`` tree; each subcommand's ``func`` is ``handlers[name]``."""
    p = argparse.ArgumentParser(prog="trainscope", description=description)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="run a small multi-rank job through the whole pipeline")
    d.add_argument("--ranks", type=int, default=32, help="simulated ranks (a multiple of 4, at least 8)")
    d.add_argument("--home", help="state directory (default ./.trainscope)")
    d.add_argument("--force", action="store_true", help="replace HOME/store.sqlite when an earlier run left one")
    d.set_defaults(func=handlers["demo"])

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
    an.add_argument("--partitioned", action="store_true",
                    help="share each job's L3 with the group's other analyzers, by comparison group (needs Kafka "
                         "and processors run with --kafka-key-by group)")
    an.add_argument("--keep-windows", type=int, metavar="N",
                    help="age out each job's diagnoses and verdicts of windows older than its newest N (counted; default: keep all)")
    an.add_argument("--deep-dive-processor", action="append", metavar="ADDR",
                    help="send triggered deep dives (degradation, stall, verdict) to this processor; repeat "
                         "for each host (default: triggers are counted, nothing is requested)")
    an.add_argument("--deep-dive-url", metavar="URL",
                    help="analyse the deep dives the processors uploaded there (every host's ranks; the processors' "
                         "--deep-dive-url) instead of the local deep-dive directory")
    _add_verdict_flags(an)
    secure_flags.add_kafka_flags(an)
    secure_flags.add_tls_flags(an, grpc=False)
    an.set_defaults(func=handlers["analyzer"])

    pr = sub.add_parser("processor", help="run the per-host processor daemon")
    pr.add_argument("--listen", help=f"gRPC address (env {env.PROCESSOR}; default unix socket)")
    pr.add_argument("--window-mode", choices=[m.value for m in WINDOW_MODES], default=WindowMode.AUTO.value,
                    help="auto: iterations when the ranks send iteration marks, else time (default: auto)")
    pr.add_argument("--window-length-s", type=float, default=10.0,
                    help="window length in seconds when windows are cut by time")
    pr.add_argument("--window-iterations", type=int, default=10,
                    help="iterations per window when windows are cut by iterations")
    pr.add_argument("--keep-windows", type=int, metavar="N",
                    help="age out each job's stored records of windows older than its newest N (counted; default: keep all)")
    pr.add_argument("--collective-raw", choices=["all", "triggered"], default="all",
                    help="raw collective records passed on: every window's, or only around a Mycroft trigger "
                         "(summaries always; default: all)")
    pr.add_argument("--deep-dive-url", metavar="URL",
                    help="upload each rank's deep-dive trace to this fsspec URL or directory (s3://B/P, gs://B/P, "
                         "file:///DIR; credentials from the environment or fsspec config; default: traces stay local)")
    pr.add_argument("--deep-dive-local", choices=("keep", "remove"), default="keep",
                    help="with --deep-dive-url: keep the local trace after its upload, or remove it")
    pr.add_argument("--deep-dive-upload-max-mib", type=int, default=256, metavar="MIB",
                    help="with --deep-dive-url: a larger trace is not uploaded (kept local, counted)")
    _add_sink_flags(pr)
    secure_flags.add_tls_flags(pr, grpc=True)
    pr.set_defaults(func=handlers["processor"])

    r = sub.add_parser("replay", help="feed PyTorch profiler traces through the pipeline")
    r.add_argument("dir", help="directory of rank-<N>.json[.gz] (+ optional topology.json)")
    r.add_argument("--stats-out", help="write the kernel cluster stats here (JSON)")
    r.add_argument("--json", help="write the diagnoses here (JSON, the replay contract's format)")
    r.add_argument("--no-analyze", action="store_true", help="only summarise; run no detectors")
    r.add_argument("--window-iterations", type=int,
                   help="iterations per window (default: 5; a capture of under 15 steps is judged as one window)")
    r.add_argument("--force", action="store_true",
                   help="replace HOME/store.sqlite when an earlier run left one, and --json/--stats-out files")
    _add_verdict_flags(r)
    _add_sink_flags(r)
    r.set_defaults(func=handlers["replay"])

    s = sub.add_parser("sim", help="simulate a hybrid-parallel job with injected faults through the pipeline")
    s.add_argument("--ranks", type=int, help="world size (default 64)")
    for dim in ("tp", "pp", "ep", "cp"):
        s.add_argument(f"--{dim}", type=int, help=f"{dim.upper()} degree (default 1)")
    s.add_argument("--order", help="Megatron rank order (default tp-cp-ep-dp-pp)")
    s.add_argument("--gpus-per-host", type=int, help="GPUs per host (default 8, or the world size when smaller)")
    s.add_argument("--nics-per-host", type=int, help="RDMA NICs per host (default 4, at most --gpus-per-host)")
    s.add_argument("--micro-batches", type=int, help="micro-batches per iteration (default 4)")
    s.add_argument("--layers", type=int, help="layers per pipeline stage (default 2; kernels scale with it)")
    s.add_argument("--iteration-time", help="healthy iteration time in simulated seconds, e.g. 2.5s (default 3s)")
    s.add_argument("--duration", help="simulated time to run, e.g. 300s (default: --iterations decides)")
    s.add_argument("--iterations", type=int, help="iterations to run (default 20 without --duration)")
    s.add_argument("--fault", action="append", default=[], metavar="TYPE:KEY=VALUE,...",
                   help="inject a fault (repeatable); --list-faults shows the types")
    s.add_argument("--scenario", help="JSON file with a list of faults")
    s.add_argument("--list-faults", action="store_true", help="print the fault catalogue and exit")
    s.add_argument("--seed", type=int, help="random seed of the simulation (default 0)")
    s.add_argument("--job-id", help="the simulated job's id (default sim)")
    s.add_argument("--exporters", type=int, help="collector exporters (gRPC streams) to spread hosts over (default 4)")
    s.add_argument("--processor", help="send to this processor (ADDR) instead of starting an embedded one")
    s.add_argument("--traces-out", help="also write PyTorch-profiler traces here (for trainscope replay)")
    s.add_argument("--no-analyze", action="store_true", help="embedded processor only; run no detectors")
    s.add_argument("--ground-truth", help="ground-truth JSON path (default HOME/sim-ground-truth.json)")
    s.add_argument("--json", dest="json_out", help="write the run summary here (JSON)")
    s.add_argument("--window-mode", choices=[m.value for m in FIXED_WINDOW_MODES],
                   help="how the embedded processor cuts windows (default iterations)")
    s.add_argument("--window-iterations", type=int, help="iterations per window (default 10)")
    s.add_argument("--window-length-s", type=float, help="window length in seconds with --window-mode time (default 30)")
    s.add_argument("--collective-steps", action="store_true", default=None,
                   help="collective records carry every algorithm step (Vedrfolnir step records: slow links named)")
    s.add_argument("--force", action="store_true",
                   help="replace HOME/store.sqlite when an earlier run left one (embedded processor), "
                   "and --ground-truth/--json files")
    _add_sink_flags(s)
    s.set_defaults(func=handlers["sim"])
    _add_query_parser(sub, handlers)
    _add_run_parser(sub, handlers)
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
        if action.required:
            return text if "required" in text else f"{text} (required)".strip()
        if "default" in text.lower() or action.default is argparse.SUPPRESS or action.nargs == 0:
            return text
        if not action.option_strings:
            return text  # positionals are required: no default to show
        shown = "none" if action.default is None or action.default == [] else "%(default)s"
        return f"{text} (default: {shown})".strip()


def _defaults_in_help(parser: argparse.ArgumentParser) -> None:
    """Every parser and sub-parser shows each flag's default in ``--help`` and takes no abbreviated flag:
    ``--kafka-sasl-password SECRET`` was taken for ``--kafka-sasl-password-file`` and ``--token SECRET`` for
    ``--token-file``, the secret left in ``ps`` (issue #24); a flag is spelt whole or refused."""
    parser.formatter_class = _DefaultsFormatter
    parser.allow_abbrev = False
    for action in parser._actions:
        if action.option_strings and not action.help and action.nargs != 0:
            action.help = "(default: none)" if action.default is None else "(default: %(default)s)"
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _defaults_in_help(child)


def _add_run_parser(sub, handlers: Handlers) -> None:
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
    ru.set_defaults(func=handlers["run"])

    from trainscope.deploy import nccl_plugin, profile_cmd, report_cmd
    report_cmd.add_parser(sub)
    profile_cmd.add_parser(sub)
    nccl_plugin.add_parser(sub)


def _add_query_parser(sub, handlers: Handlers) -> None:
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
    k.add_argument("--rank", type=int, required=True, help="the rank whose kernels are compared with its peers'")
    k.add_argument("--top", type=int, default=10, help="show this many kernels (default 10)")
    k.add_argument("--last", type=int, default=0,
                   help="compare over the job's last N kernel windows (default 0 = all; 1 answers fastest)")
    i = qs.add_parser("iterations", parents=[common, job], help="iteration time per window (job, or one --rank)")
    i.add_argument("--rank", type=int, help="one rank's windows instead of the job's")
    i.add_argument("--last", type=int, default=20, help="the last N windows (default 20; 0 = all)")
    r = qs.add_parser("ranks", parents=[common, job], help="rank -> host, device, parallel coordinates")
    r.add_argument("--rank", type=int, help="only this rank (default: every rank)")
    r.add_argument("--host", help="only this host's ranks (default: every host)")
    dd = qs.add_parser("deep-dive", parents=[common],
                       help="a job's deep dives (L4): traces, the functions found, the Perfetto view")
    dd.add_argument("--job", required=True, help="job id (required)")
    dd.add_argument("--deep-dive-dir", metavar="DIR",
                    help=f"root of the deep-dive traces (env {env.DEEP_DIVE_DIR}; default: the runtime dir's deepdive)")
    dd.add_argument("--deep-dive-url", metavar="URL",
                    help="list the dives uploaded to this fsspec URL (the processors' --deep-dive-url), with the "
                         "analyses of the analyzer run with it")
    q.set_defaults(func=handlers["query"])


def _add_sink_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kafka-bootstrap", help=f"Kafka bootstrap servers (env {env.KAFKA_BOOTSTRAP}); "
                   "default: the embedded bus")
    p.add_argument("--prometheus-port", type=int, help="serve /metrics on 127.0.0.1:PORT (0 = any)")
    p.add_argument("--remote-write-url", help="Prometheus remote-write endpoint")
    p.add_argument("--perfetto-url", help="directory or fsspec URL for per-window Perfetto traces")
    p.add_argument("--kafka-key-by", choices=("job", "group"), default="job",
                   help="key of kernel windows on Kafka: job (default), or group (job and data-parallel group: "
                        "for analyzers run with --partitioned)")
    p.add_argument("--home", help=f"state directory (env {env.HOME}; default ./.trainscope)")
    secure_flags.add_kafka_flags(p)


def _add_verdict_flags(p) -> None:
    """When a finding may name a rank: the impact floor and persistence (issue #10 items 2, 3)."""
    p.add_argument("--impact-floor", type=float, default=1.0, metavar="PCT",
                   help="findings costing less than PCT %% of the step are informational: they name nobody "
                        "and raise no alert (default 1)")
    p.add_argument("--persist", default="2/3", metavar="K/N",
                   help="name a rank once it was flagged in K of the last N windows; stalls and hangs at once "
                        "(default 2/3; 1/1 names on the first window)")
