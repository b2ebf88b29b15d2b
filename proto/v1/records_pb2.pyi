from trainscope.proto.v1 import common_pb2 as _common_pb2
from trainscope.proto.v1 import telemetry_pb2 as _telemetry_pb2
from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WindowKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WINDOW_KIND_TIME: _ClassVar[WindowKind]
    WINDOW_KIND_ITERATIONS: _ClassVar[WindowKind]
WINDOW_KIND_TIME: WindowKind
WINDOW_KIND_ITERATIONS: WindowKind

class Window(_message.Message):
    __slots__ = ("kind", "index", "start_ns", "end_ns", "first_iteration", "last_iteration", "final", "signals")
    KIND_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    START_NS_FIELD_NUMBER: _ClassVar[int]
    END_NS_FIELD_NUMBER: _ClassVar[int]
    FIRST_ITERATION_FIELD_NUMBER: _ClassVar[int]
    LAST_ITERATION_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    SIGNALS_FIELD_NUMBER: _ClassVar[int]
    kind: WindowKind
    index: int
    start_ns: int
    end_ns: int
    first_iteration: int
    last_iteration: int
    final: bool
    signals: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, kind: _Optional[_Union[WindowKind, str]] = ..., index: _Optional[int] = ..., start_ns: _Optional[int] = ..., end_ns: _Optional[int] = ..., first_iteration: _Optional[int] = ..., last_iteration: _Optional[int] = ..., final: _Optional[bool] = ..., signals: _Optional[_Iterable[str]] = ...) -> None: ...

class KernelCluster(_message.Message):
    __slots__ = ("count", "p50_ns", "p99_ns", "min_ns", "max_ns", "shape")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    P50_NS_FIELD_NUMBER: _ClassVar[int]
    P99_NS_FIELD_NUMBER: _ClassVar[int]
    MIN_NS_FIELD_NUMBER: _ClassVar[int]
    MAX_NS_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    count: int
    p50_ns: float
    p99_ns: float
    min_ns: float
    max_ns: float
    shape: int
    def __init__(self, count: _Optional[int] = ..., p50_ns: _Optional[float] = ..., p99_ns: _Optional[float] = ..., min_ns: _Optional[float] = ..., max_ns: _Optional[float] = ..., shape: _Optional[int] = ...) -> None: ...

class KernelStats(_message.Message):
    __slots__ = ("kernel", "stream", "kind", "clusters", "count", "total_ns", "kernel_id")
    KERNEL_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    CLUSTERS_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NS_FIELD_NUMBER: _ClassVar[int]
    KERNEL_ID_FIELD_NUMBER: _ClassVar[int]
    kernel: str
    stream: int
    kind: _telemetry_pb2.KernelKind
    clusters: _containers.RepeatedCompositeFieldContainer[KernelCluster]
    count: int
    total_ns: float
    kernel_id: int
    def __init__(self, kernel: _Optional[str] = ..., stream: _Optional[int] = ..., kind: _Optional[_Union[_telemetry_pb2.KernelKind, str]] = ..., clusters: _Optional[_Iterable[_Union[KernelCluster, _Mapping]]] = ..., count: _Optional[int] = ..., total_ns: _Optional[float] = ..., kernel_id: _Optional[int] = ...) -> None: ...

class KernelName(_message.Message):
    __slots__ = ("id", "name")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    id: int
    name: str
    def __init__(self, id: _Optional[int] = ..., name: _Optional[str] = ...) -> None: ...

class KernelNames(_message.Message):
    __slots__ = ("job_id", "names", "scheme", "processor")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    SCHEME_FIELD_NUMBER: _ClassVar[int]
    PROCESSOR_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    names: _containers.RepeatedCompositeFieldContainer[KernelName]
    scheme: int
    processor: str
    def __init__(self, job_id: _Optional[str] = ..., names: _Optional[_Iterable[_Union[KernelName, _Mapping]]] = ..., scheme: _Optional[int] = ..., processor: _Optional[str] = ...) -> None: ...

class KernelWindow(_message.Message):
    __slots__ = ("resource", "window", "kernels", "events", "iterations")
    RESOURCE_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    KERNELS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    resource: _common_pb2.Resource
    window: Window
    kernels: _containers.RepeatedCompositeFieldContainer[KernelStats]
    events: int
    iterations: int
    def __init__(self, resource: _Optional[_Union[_common_pb2.Resource, _Mapping]] = ..., window: _Optional[_Union[Window, _Mapping]] = ..., kernels: _Optional[_Iterable[_Union[KernelStats, _Mapping]]] = ..., events: _Optional[int] = ..., iterations: _Optional[int] = ...) -> None: ...

class PhaseStats(_message.Message):
    __slots__ = ("phase", "count", "mean_ns", "p50_ns", "p99_ns", "max_ns", "total_ns", "clock")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    MEAN_NS_FIELD_NUMBER: _ClassVar[int]
    P50_NS_FIELD_NUMBER: _ClassVar[int]
    P99_NS_FIELD_NUMBER: _ClassVar[int]
    MAX_NS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NS_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    phase: str
    count: int
    mean_ns: float
    p50_ns: float
    p99_ns: float
    max_ns: float
    total_ns: float
    clock: _telemetry_pb2.PhaseClock
    def __init__(self, phase: _Optional[str] = ..., count: _Optional[int] = ..., mean_ns: _Optional[float] = ..., p50_ns: _Optional[float] = ..., p99_ns: _Optional[float] = ..., max_ns: _Optional[float] = ..., total_ns: _Optional[float] = ..., clock: _Optional[_Union[_telemetry_pb2.PhaseClock, str]] = ...) -> None: ...

class PhaseWindow(_message.Message):
    __slots__ = ("resource", "window", "phases")
    RESOURCE_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    PHASES_FIELD_NUMBER: _ClassVar[int]
    resource: _common_pb2.Resource
    window: Window
    phases: _containers.RepeatedCompositeFieldContainer[PhaseStats]
    def __init__(self, resource: _Optional[_Union[_common_pb2.Resource, _Mapping]] = ..., window: _Optional[_Union[Window, _Mapping]] = ..., phases: _Optional[_Iterable[_Union[PhaseStats, _Mapping]]] = ...) -> None: ...

class IterationWindow(_message.Message):
    __slots__ = ("resource", "window", "marks", "mean_ns", "p50_ns", "max_ns")
    RESOURCE_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    MARKS_FIELD_NUMBER: _ClassVar[int]
    MEAN_NS_FIELD_NUMBER: _ClassVar[int]
    P50_NS_FIELD_NUMBER: _ClassVar[int]
    MAX_NS_FIELD_NUMBER: _ClassVar[int]
    resource: _common_pb2.Resource
    window: Window
    marks: _containers.RepeatedCompositeFieldContainer[_telemetry_pb2.IterationMark]
    mean_ns: float
    p50_ns: float
    max_ns: float
    def __init__(self, resource: _Optional[_Union[_common_pb2.Resource, _Mapping]] = ..., window: _Optional[_Union[Window, _Mapping]] = ..., marks: _Optional[_Iterable[_Union[_telemetry_pb2.IterationMark, _Mapping]]] = ..., mean_ns: _Optional[float] = ..., p50_ns: _Optional[float] = ..., max_ns: _Optional[float] = ...) -> None: ...

class StackWindow(_message.Message):
    __slots__ = ("resource", "window", "samples", "idle_samples", "stacks")
    RESOURCE_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    IDLE_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    STACKS_FIELD_NUMBER: _ClassVar[int]
    resource: _common_pb2.Resource
    window: Window
    samples: int
    idle_samples: int
    stacks: _containers.RepeatedCompositeFieldContainer[_telemetry_pb2.FoldedStack]
    def __init__(self, resource: _Optional[_Union[_common_pb2.Resource, _Mapping]] = ..., window: _Optional[_Union[Window, _Mapping]] = ..., samples: _Optional[int] = ..., idle_samples: _Optional[int] = ..., stacks: _Optional[_Iterable[_Union[_telemetry_pb2.FoldedStack, _Mapping]]] = ...) -> None: ...

class CollectiveStats(_message.Message):
    __slots__ = ("group", "op", "size_class", "count", "p50_ns", "p99_ns", "max_ns", "total_bytes")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    SIZE_CLASS_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    P50_NS_FIELD_NUMBER: _ClassVar[int]
    P99_NS_FIELD_NUMBER: _ClassVar[int]
    MAX_NS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    group: str
    op: str
    size_class: int
    count: int
    p50_ns: float
    p99_ns: float
    max_ns: float
    total_bytes: float
    def __init__(self, group: _Optional[str] = ..., op: _Optional[str] = ..., size_class: _Optional[int] = ..., count: _Optional[int] = ..., p50_ns: _Optional[float] = ..., p99_ns: _Optional[float] = ..., max_ns: _Optional[float] = ..., total_bytes: _Optional[float] = ...) -> None: ...

class CollectiveWindow(_message.Message):
    __slots__ = ("resource", "window", "groups", "records", "stats", "now_ns", "records_dropped", "collector_dropped", "dumps", "states")
    RESOURCE_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    NOW_NS_FIELD_NUMBER: _ClassVar[int]
    RECORDS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    COLLECTOR_DROPPED_FIELD_NUMBER: _ClassVar[int]
    DUMPS_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    resource: _common_pb2.Resource
    window: Window
    groups: _containers.RepeatedCompositeFieldContainer[_telemetry_pb2.CollectiveGroup]
    records: _containers.RepeatedCompositeFieldContainer[_telemetry_pb2.CollectiveRecord]
    stats: _containers.RepeatedCompositeFieldContainer[CollectiveStats]
    now_ns: int
    records_dropped: int
    collector_dropped: int
    dumps: _containers.RepeatedCompositeFieldContainer[_telemetry_pb2.StackDump]
    states: _containers.RepeatedCompositeFieldContainer[_telemetry_pb2.ChannelState]
    def __init__(self, resource: _Optional[_Union[_common_pb2.Resource, _Mapping]] = ..., window: _Optional[_Union[Window, _Mapping]] = ..., groups: _Optional[_Iterable[_Union[_telemetry_pb2.CollectiveGroup, _Mapping]]] = ..., records: _Optional[_Iterable[_Union[_telemetry_pb2.CollectiveRecord, _Mapping]]] = ..., stats: _Optional[_Iterable[_Union[CollectiveStats, _Mapping]]] = ..., now_ns: _Optional[int] = ..., records_dropped: _Optional[int] = ..., collector_dropped: _Optional[int] = ..., dumps: _Optional[_Iterable[_Union[_telemetry_pb2.StackDump, _Mapping]]] = ..., states: _Optional[_Iterable[_Union[_telemetry_pb2.ChannelState, _Mapping]]] = ...) -> None: ...

class DiagnosisScope(_message.Message):
    __slots__ = ("phase", "kernel", "stream", "group", "group_index")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    KERNEL_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    GROUP_INDEX_FIELD_NUMBER: _ClassVar[int]
    phase: str
    kernel: str
    stream: int
    group: str
    group_index: int
    def __init__(self, phase: _Optional[str] = ..., kernel: _Optional[str] = ..., stream: _Optional[int] = ..., group: _Optional[str] = ..., group_index: _Optional[int] = ...) -> None: ...

class Suspect(_message.Message):
    __slots__ = ("rank", "score", "evidence", "role", "impact_s", "impact_pct", "host", "why", "waited_for")
    RANK_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    EVIDENCE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    IMPACT_S_FIELD_NUMBER: _ClassVar[int]
    IMPACT_PCT_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    WHY_FIELD_NUMBER: _ClassVar[int]
    WAITED_FOR_FIELD_NUMBER: _ClassVar[int]
    rank: int
    score: float
    evidence: _struct_pb2.Struct
    role: str
    impact_s: float
    impact_pct: float
    host: str
    why: str
    waited_for: int
    def __init__(self, rank: _Optional[int] = ..., score: _Optional[float] = ..., evidence: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., role: _Optional[str] = ..., impact_s: _Optional[float] = ..., impact_pct: _Optional[float] = ..., host: _Optional[str] = ..., why: _Optional[str] = ..., waited_for: _Optional[int] = ...) -> None: ...

class Diagnosis(_message.Message):
    __slots__ = ("id", "job_id", "level", "kind", "window", "scope", "suspects", "severity", "evidence", "created_unix_ns", "informational", "impact_s", "impact_pct", "comparison")
    ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    SUSPECTS_FIELD_NUMBER: _ClassVar[int]
    SEVERITY_FIELD_NUMBER: _ClassVar[int]
    EVIDENCE_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    INFORMATIONAL_FIELD_NUMBER: _ClassVar[int]
    IMPACT_S_FIELD_NUMBER: _ClassVar[int]
    IMPACT_PCT_FIELD_NUMBER: _ClassVar[int]
    COMPARISON_FIELD_NUMBER: _ClassVar[int]
    id: str
    job_id: str
    level: str
    kind: str
    window: Window
    scope: DiagnosisScope
    suspects: _containers.RepeatedCompositeFieldContainer[Suspect]
    severity: float
    evidence: _struct_pb2.Struct
    created_unix_ns: int
    informational: bool
    impact_s: float
    impact_pct: float
    comparison: str
    def __init__(self, id: _Optional[str] = ..., job_id: _Optional[str] = ..., level: _Optional[str] = ..., kind: _Optional[str] = ..., window: _Optional[_Union[Window, _Mapping]] = ..., scope: _Optional[_Union[DiagnosisScope, _Mapping]] = ..., suspects: _Optional[_Iterable[_Union[Suspect, _Mapping]]] = ..., severity: _Optional[float] = ..., evidence: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., created_unix_ns: _Optional[int] = ..., informational: _Optional[bool] = ..., impact_s: _Optional[float] = ..., impact_pct: _Optional[float] = ..., comparison: _Optional[str] = ...) -> None: ...

class Verdict(_message.Message):
    __slots__ = ("job_id", "window", "ranks", "phases", "kernels", "findings", "summary", "created_unix_ns", "state", "confidence", "host", "since_window", "partial", "comparison", "step_s", "pending", "group", "nic", "switch_name")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    PHASES_FIELD_NUMBER: _ClassVar[int]
    KERNELS_FIELD_NUMBER: _ClassVar[int]
    FINDINGS_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    SINCE_WINDOW_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    COMPARISON_FIELD_NUMBER: _ClassVar[int]
    STEP_S_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    NIC_FIELD_NUMBER: _ClassVar[int]
    SWITCH_NAME_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    window: Window
    ranks: _containers.RepeatedCompositeFieldContainer[Suspect]
    phases: _containers.RepeatedScalarFieldContainer[str]
    kernels: _containers.RepeatedScalarFieldContainer[str]
    findings: _containers.RepeatedCompositeFieldContainer[Diagnosis]
    summary: str
    created_unix_ns: int
    state: str
    confidence: float
    host: str
    since_window: int
    partial: bool
    comparison: str
    step_s: float
    pending: _containers.RepeatedScalarFieldContainer[int]
    group: str
    nic: str
    switch_name: str
    def __init__(self, job_id: _Optional[str] = ..., window: _Optional[_Union[Window, _Mapping]] = ..., ranks: _Optional[_Iterable[_Union[Suspect, _Mapping]]] = ..., phases: _Optional[_Iterable[str]] = ..., kernels: _Optional[_Iterable[str]] = ..., findings: _Optional[_Iterable[_Union[Diagnosis, _Mapping]]] = ..., summary: _Optional[str] = ..., created_unix_ns: _Optional[int] = ..., state: _Optional[str] = ..., confidence: _Optional[float] = ..., host: _Optional[str] = ..., since_window: _Optional[int] = ..., partial: _Optional[bool] = ..., comparison: _Optional[str] = ..., step_s: _Optional[float] = ..., pending: _Optional[_Iterable[int]] = ..., group: _Optional[str] = ..., nic: _Optional[str] = ..., switch_name: _Optional[str] = ...) -> None: ...
