"""Every environment variable trainscope reads, named once (STYLE.md point 4), and one way to parse them.

Resolution order everywhere: CLI flag, then environment variable, then default.
A contract shared by the collector (inside the training process), the
processor and the CLI, so it lives in ``proto/`` which every stage may import.
A bad value raises :class:`~trainscope.proto.errors.ConfigError` naming the
variable (the CLI turns it into one line and exit 2).
"""
import os
import tempfile
from typing import Mapping

from trainscope.proto.errors import ConfigError



def runtime_dir(environ: Mapping[str, str] = os.environ) -> str:
    """The per-user directory of the default socket (not created here).

    ``$XDG_RUNTIME_DIR/trainscope`` (systemd makes ``$XDG_RUNTIME_DIR`` 0700 for
    the user), else ``<tmp>/trainscope-<uid>``, which the processor creates 0700
    and refuses when another user owns it (``proto/securefs.py``). A shared
    ``/tmp/trainscope`` let whoever created it first replace the socket and
    receive every rank's telemetry (issue #11).
    """
    xdg = environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isabs(xdg):
        return os.path.join(xdg, "trainscope")
    return os.path.join(tempfile.gettempdir(), f"trainscope-{os.geteuid()}")


def deep_dive_dir(environ: Mapping[str, str] = os.environ) -> str:
    """Root of the deep-dive traces (issue #14): ``TRAINSCOPE_DEEP_DIVE_DIR``, else ``<runtime dir>/deepdive``.

    A local directory shared by the ranks, the processor and the analyzer of one host; the
    processor uploads each rank's trace from it to object storage when ``--deep-dive-url`` is
    set (``processor/dive_upload.py``). Not created here.
    """
    return environ.get(DEEP_DIVE_DIR) or os.path.join(runtime_dir(environ), "deepdive")


def nccl_ring_dir(environ: Mapping[str, str] = os.environ) -> str:
    """Where the NCCL profiler plugin writes ``ring-<pid>``: ``TRAINSCOPE_NCCL_DIR``, else
    ``<runtime dir>/nccl`` (the C plugin computes the same path; it creates ``nccl/`` 0700 when
    the runtime directory exists and is this user's, and stays off otherwise)."""
    return environ.get(NCCL_DIR) or os.path.join(runtime_dir(environ), "nccl")


def deep_dive_trace_dir(root: str, job_id: str, dive_id: str) -> str:
    """``<root>/<job>/<dive>``: one deep dive's traces and manifest (the job id made one safe path
    component: ``[A-Za-z0-9_.-]``, at most 64 characters, no leading dot)."""
    import re
    job = re.sub(r"[^A-Za-z0-9_.-]", "_", job_id)[:64].lstrip(".") or "job"
    return os.path.join(root, job, dive_id)


#: The processor's default listen address and the collector's default target (per user).
DEFAULT_PROCESSOR_TARGET = "unix://" + os.path.join(runtime_dir(), "processor.sock")
#: Seconds of stack sampling per window (collector/stacks.py, launch.py).
DEFAULT_STACKS_WINDOW_S = 10.0
#: Values that turn a switch off ("0" and friends, case-insensitive).
OFF = ("0", "false", "no", "off")

ENABLED = "TRAINSCOPE_ENABLED"            # "0" turns the in-process collector into a no-op
PROCESSOR = "TRAINSCOPE_PROCESSOR"        # gRPC target of the host's processor
JOB_ID = "TRAINSCOPE_JOB_ID"              # job id; default from the launcher (TORCHELASTIC_RUN_ID)
TOPOLOGY = "TRAINSCOPE_TOPOLOGY"          # "tp=2,pp=4,ep=1,cp=1,order=tp-cp-ep-dp-pp"
NIC = "TRAINSCOPE_NIC"                    # the NIC this rank's collectives leave by (e.g. "mlx5_3"), for verdicts
SWITCH = "TRAINSCOPE_SWITCH"              # the network switch the host hangs off (e.g. "leaf-12"), for verdicts
HOME = "TRAINSCOPE_HOME"                  # where the embedded default keeps its store and traces
KAFKA_BOOTSTRAP = "KAFKA_BOOTSTRAP"       # bootstrap servers of a real Kafka cluster
PROMETHEUS_PORT = "TRAINSCOPE_PROMETHEUS_PORT"
REMOTE_WRITE_URL = "TRAINSCOPE_REMOTE_WRITE_URL"
# Enablement of the in-process collectors (collector/launch.py) and of the
# start-up hook (collector/bootstrap/_trainscope_boot.py, which imports this
# module: keep it standard-library only).
AUTOSTART = "TRAINSCOPE_AUTOSTART"        # "1": every Python process checks whether it is a rank
RANK_PID = "TRAINSCOPE_RANK_PID"          # set by a rank that started its collector; children are not ranks
RUN_PID = "TRAINSCOPE_RUN_PID"            # pid of `trainscope run`; its direct child is rank 0 of 1
MATCH = "TRAINSCOPE_MATCH"                # regex the rank's command line must match
DEBUG_BOOT = "TRAINSCOPE_DEBUG_BOOT"      # "1": the start-up hook prints its decision
RUN_DIR = "TRAINSCOPE_RUN_DIR"            # where ranks announce themselves and leave their counters
STACKS = "TRAINSCOPE_STACKS"              # "0" off, "1" local rank 0 starts the sidecar, "external"
STACKS_WINDOW_S = "TRAINSCOPE_STACKS_WINDOW_S"
CPU_OPS = "TRAINSCOPE_CPU_OPS"            # "0" off, or "period_s=30,window_s=0.05,first_after_s=5"
CUPTI = "TRAINSCOPE_CUPTI"                # "0" never try CUPTI
HOOKS = "TRAINSCOPE_HOOKS"                # "0" off, or a subset "dataloader,optimizer,module,collectives"
SHUTDOWN_TIMEOUT_S = "TRAINSCOPE_SHUTDOWN_TIMEOUT_S"
SHIP_INTERVAL_S = "TRAINSCOPE_SHIP_INTERVAL_S"  # phases/iterations handed to the exporter at most this often
DDP_COMM_HOOK = "TRAINSCOPE_DDP_COMM_HOOK"  # "0": leave DDP modules alone (collector/torch_ddp.py)
REPLAY_MAX_BYTES = "TRAINSCOPE_REPLAY_MAX_BYTES"  # cap on a trace file and its gzip content (sources/replay.py)
DEEP_DIVE = "TRAINSCOPE_DEEP_DIVE"        # "0": the collector opens no control stream (no triggered profiling)
DEEP_DIVE_DIR = "TRAINSCOPE_DEEP_DIVE_DIR"  # where deep-dive traces go (default <runtime dir>/deepdive)
# The NCCL profiler plugin (collector/nccl_plugin/, read by collector/nccl_profiler.py); the C plugin
# reads the TRAINSCOPE_NCCL_* ones, NCCL reads NCCL_PROFILER_PLUGIN.
NCCL_DIR = "TRAINSCOPE_NCCL_DIR"          # where the plugin's rings are (default <runtime dir>/nccl)
NCCL_RING_SLOTS = "TRAINSCOPE_NCCL_RING_SLOTS"  # ring capacity in 64-byte slots (a power of two, 65536)
NCCL_POOL_COLLS = "TRAINSCOPE_NCCL_POOL_COLLS"  # collectives tracked in flight per process (256)
NCCL_POOL_OPS = "TRAINSCOPE_NCCL_POOL_OPS"      # proxy ops and kernel channels tracked per process (2048)
NCCL_PROFILER_PLUGIN = "NCCL_PROFILER_PLUGIN"   # NCCL's: the profiler plugin library (path or name)
# Network security (proto/security.py; issue #11 item 8). Secrets come from a file
# (the *_FILE variables, preferred) or the variable itself, never from argv.
TLS_CA = "TRAINSCOPE_TLS_CA"                  # exporter: CA bundle that signed the processor's certificate
TLS_CLIENT_CERT = "TRAINSCOPE_TLS_CLIENT_CERT"  # exporter: its certificate for mutual TLS
TLS_CLIENT_KEY = "TRAINSCOPE_TLS_CLIENT_KEY"    # exporter: the key of that certificate (0600)
TLS_SERVER_NAME = "TRAINSCOPE_TLS_SERVER_NAME"  # exporter: name to verify instead of the target's host
TLS_CERT = "TRAINSCOPE_TLS_CERT"              # processor/analyzer: server certificate (gRPC and /metrics)
TLS_KEY = "TRAINSCOPE_TLS_KEY"                # processor/analyzer: its key (0600)
TLS_CLIENT_CA = "TRAINSCOPE_TLS_CLIENT_CA"    # processor: require client certificates signed by this CA
TOKEN = "TRAINSCOPE_TOKEN"                    # bearer token of the ingest stream (both ends)
TOKEN_FILE = "TRAINSCOPE_TOKEN_FILE"          # ... read from this file instead
METRICS_TOKEN = "TRAINSCOPE_METRICS_TOKEN"    # bearer token of /metrics and /healthz
METRICS_TOKEN_FILE = "TRAINSCOPE_METRICS_TOKEN_FILE"
# Kafka client security (processor's sink and analyzer's source), librdkafka names in capitals.
KAFKA_SECURITY_PROTOCOL = "KAFKA_SECURITY_PROTOCOL"      # security.protocol: plaintext, ssl, sasl_ssl, ...
KAFKA_SASL_MECHANISM = "KAFKA_SASL_MECHANISM"            # sasl.mechanism: PLAIN, SCRAM-SHA-256, ...
KAFKA_SASL_USERNAME = "KAFKA_SASL_USERNAME"
KAFKA_SASL_PASSWORD = "KAFKA_SASL_PASSWORD"
KAFKA_SASL_PASSWORD_FILE = "KAFKA_SASL_PASSWORD_FILE"
KAFKA_SSL_CA = "KAFKA_SSL_CA_LOCATION"                   # ssl.ca.location
KAFKA_SSL_CERT = "KAFKA_SSL_CERTIFICATE_LOCATION"        # ssl.certificate.location
KAFKA_SSL_KEY = "KAFKA_SSL_KEY_LOCATION"                 # ssl.key.location
KAFKA_SSL_KEY_PASSWORD = "KAFKA_SSL_KEY_PASSWORD"
KAFKA_SSL_KEY_PASSWORD_FILE = "KAFKA_SSL_KEY_PASSWORD_FILE"
NCCL_TIMING = "TORCH_NCCL_ENABLE_TIMING"  # read by PyTorch: NCCL work times itself on its stream
GRPC_VERBOSITY = "GRPC_VERBOSITY"  # read by gRPC's C core once, at import: the CLI sets NONE for its own
# Set by torchrun / torch.distributed launchers; read, never written.
RANK = "RANK"
LOCAL_RANK = "LOCAL_RANK"
WORLD_SIZE = "WORLD_SIZE"
LAUNCHER_RUN_ID = "TORCHELASTIC_RUN_ID"


def identity(environ) -> tuple[int, int, int] | None:
    """(rank, world_size, local_rank) from the launcher's variables, or None."""
    for rank, world, local in (("RANK", "WORLD_SIZE", "LOCAL_RANK"),
                               ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
                               ("PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK"),
                               ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")):
        r, w = environ.get(rank), environ.get(world)
        if r is not None and w is not None:
            try:
                return int(r), int(w), int(environ.get(local, "0") or 0)
            except ValueError:
                return None
    return None


def unix_path(target: str) -> str | None:
    """The socket path of a ``unix:`` gRPC target (``unix:///abs/path`` or ``unix:rel/path``);
    None for ``host:port``."""
    if not target.startswith("unix:"):
        return None
    return target[len("unix://"):] if target.startswith("unix://") else target[len("unix:"):]


def check_target(setting: str, target: str, *, listen: bool = False) -> str:
    """``target`` when it is a gRPC address: ``unix:///path`` (or ``unix:path`` to connect to) or
    ``host:port`` with a port in 1..65535 (0, any free port, only where ``listen``); a ConfigError
    naming ``setting`` otherwise (grpc would retry a malformed target forever, or bind a port
    number modulo 65536)."""
    path = unix_path(target)
    if path is not None:
        if not path or (listen and not target.startswith("unix://")):
            raise ConfigError(setting, target, "expected unix:///path or host:port")
        return target
    host, sep, port = target.rpartition(":")
    if not sep or not host:
        raise ConfigError(setting, target, "expected unix:///path or host:port")
    low = 0 if listen else 1
    if not (port.isascii() and port.isdigit() and low <= int(port) <= 65535):
        raise ConfigError(setting, target, f"the port must be a number in {low}..65535"
                          + (", 0 meaning any free port" if listen else ""))
    return target


def _env(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def text(name: str, default: str = "", environ: Mapping[str, str] | None = None) -> str:
    """The variable's value, ``default`` when unset or empty."""
    return _env(environ).get(name) or default


def switch(name: str, default: bool = True, environ: Mapping[str, str] | None = None) -> bool:
    """False when set to one of :data:`OFF`, True when set to anything else, ``default`` when unset/empty."""
    v = _env(environ).get(name)
    if not v:
        return default
    return v.strip().lower() not in OFF


def number(name: str, default: float, environ: Mapping[str, str] | None = None) -> float:
    """A float; ``default`` when unset or empty; ConfigError naming the variable otherwise."""
    v = _env(environ).get(name)
    if v is None or v == "":
        return default
    try:
        return float(v)
    except ValueError:
        raise ConfigError(name, v, "must be a number") from None


def integer(name: str, default: int | None, environ: Mapping[str, str] | None = None) -> int | None:
    """An int; ``default`` when unset or empty; ConfigError naming the variable otherwise."""
    v = _env(environ).get(name)
    if v is None or v == "":
        return default
    try:
        return int(v)
    except ValueError:
        raise ConfigError(name, v, "must be an integer") from None
