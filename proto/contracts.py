"""Names the stages agree on: signals, their record types and topics, window modes.

The wire messages are in ``v1/*.proto``; this module holds the Python-side
contract around them, so no stage spells a signal name or a window mode as a
string literal of its own (docs/architecture.md, "Contracts").

The enums are ``str`` enums: a member *is* its value (``Signal.KERNELS ==
"kernels"``, ``f"{Signal.KERNELS}" == "kernels"``), so metric labels, store
tables, Kafka topic names and config files keep their spelling.
"""
from __future__ import annotations

import enum

from trainscope.proto.v1 import records_pb2


class _StrEnum(str, enum.Enum):
    # str() and format() give the value (plain ``str, Enum`` would give "Signal.KERNELS").
    __str__ = str.__str__
    __format__ = str.__format__


class Signal(_StrEnum):
    """What a window holds; metric labels, Kafka topic suffixes, store tables."""

    KERNELS = "kernels"
    PHASES = "phases"
    ITERATIONS = "iterations"
    STACKS = "stacks"
    COLLECTIVES = "collectives"   # per-collective records joined across ranks (Mycroft §4.2)


SIGNALS: tuple[Signal, ...] = tuple(Signal)

#: The record each signal's windows become (Kafka values, store rows, bus messages).
RECORD_TYPES = {
    Signal.KERNELS: records_pb2.KernelWindow,
    Signal.PHASES: records_pb2.PhaseWindow,
    Signal.ITERATIONS: records_pb2.IterationWindow,
    Signal.STACKS: records_pb2.StackWindow,
    Signal.COLLECTIVES: records_pb2.CollectiveWindow,
}

#: Topic prefix of every signal and of the analyzer's outputs (Kafka and embedded bus alike).
TOPIC_PREFIX = "trainscope"


def topic_for(signal: str, prefix: str = TOPIC_PREFIX) -> str:
    """The topic of one signal: ``<prefix>.<signal>.v1`` (Kafka and embedded bus alike)."""
    return f"{prefix}.{signal}.v1"


class WindowMode(_StrEnum):
    """How the processor cuts a rank's telemetry into windows (``processor/windows.py``)."""

    AUTO = "auto"              # iterations once a rank sends iteration marks, else time
    TIME = "time"
    ITERATIONS = "iterations"


WINDOW_MODES: tuple[WindowMode, ...] = tuple(WindowMode)
#: The modes that are one rule for every rank (not ``auto``): what a simulated run may ask for.
FIXED_WINDOW_MODES: tuple[WindowMode, ...] = (WindowMode.ITERATIONS, WindowMode.TIME)


def one_of(members) -> str:
    """``'a', 'b' or 'c'``: the allowed values in a ``ConfigError``'s reason."""
    quoted = [f"'{m}'" for m in members]
    return f"{', '.join(quoted[:-1])} or {quoted[-1]}" if len(quoted) > 1 else "".join(quoted)


class AnalyzerOutput(_StrEnum):
    """What the analyzer publishes (topic suffixes, like the signals)."""

    DIAGNOSES = "diagnoses"
    VERDICTS = "verdicts"


# --- The ingest stream (collector/exporter.py → processor/ingest.py) -------------------
# One client-streaming RPC of ``v1/telemetry.proto``, registered by hand on both ends
# (generic handler, raw bytes), so its name is spelled here once.

#: The gRPC service of ``v1/telemetry.proto``.
INGEST_SERVICE = "trainscope.v1.Ingest"
#: Its one method, as a channel names it.
INGEST_METHOD = f"/{INGEST_SERVICE}/Stream"
#: Stream metadata of the restart contract (``processor/durability.py``): the processor's
#: boot id in its initial metadata; the exporter's name for itself; ``"1"`` on a replay stream.
BOOT_METADATA = "trainscope-boot"
SENDER_METADATA = "trainscope-sender"
REPLAY_METADATA = "trainscope-replay"


# --- The control path of a triggered deep dive (issue #14, ``v1/control.proto``) ---------
# analyzer / ``trainscope profile`` → processor (``Request``) → every collector of the job on
# that host (``Subscribe``, a server stream the collector opens; the training process listens
# on no port). Registered by hand on both ends, like the ingest stream.

#: The gRPC service of ``v1/control.proto`` (on the processor's port, beside ``Ingest``).
CONTROL_SERVICE = "trainscope.v1.Control"
CONTROL_SUBSCRIBE = f"/{CONTROL_SERVICE}/Subscribe"
CONTROL_REPORT = f"/{CONTROL_SERVICE}/Report"
CONTROL_REQUEST = f"/{CONTROL_SERVICE}/Request"
CONTROL_STATUS = f"/{CONTROL_SERVICE}/Status"
#: Version of the control messages a collector speaks (``ControlHello.protocol``).
CONTROL_PROTOCOL = 1


class Trigger(_StrEnum):
    """Why a deep dive was opened (``DeepDiveCommand.trigger``; a label of the analyzer's metrics)."""

    MANUAL = "manual"             # ``trainscope profile``
    DEGRADATION = "degradation"   # iteration time >= 5 % over the recent minimum (EROICA §4.1 (1))
    STALL = "stall"               # no iteration for 5x the mean iteration (EROICA §4.1 (2))
    VERDICT = "verdict"           # a verdict named suspects (ARGUS §6.3: L4 confirms L1-L3)


#: A deep dive's id names its trace directory: letters, digits, ``_ . -``, at most 64.
DIVE_ID_PATTERN = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}"
