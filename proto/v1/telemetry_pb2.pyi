from trainscope.proto.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KernelKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KERNEL_KIND_KERNEL: _ClassVar[KernelKind]
    KERNEL_KIND_MEMCPY: _ClassVar[KernelKind]
    KERNEL_KIND_MEMSET: _ClassVar[KernelKind]

class PhaseClock(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PHASE_CLOCK_UNSPECIFIED: _ClassVar[PhaseClock]
    PHASE_CLOCK_CUDA_EVENT: _ClassVar[PhaseClock]
    PHASE_CLOCK_CPU: _ClassVar[PhaseClock]
KERNEL_KIND_KERNEL: KernelKind
KERNEL_KIND_MEMCPY: KernelKind
KERNEL_KIND_MEMSET: KernelKind
PHASE_CLOCK_UNSPECIFIED: PhaseClock
PHASE_CLOCK_CUDA_EVENT: PhaseClock
PHASE_CLOCK_CPU: PhaseClock

class KernelBatch(_message.Message):
    __slots__ = ("names", "start_ns", "duration_ns", "name_id", "stream", "kind", "device")
    NAMES_FIELD_NUMBER: _ClassVar[int]
    START_NS_FIELD_NUMBER: _ClassVar[int]
    DURATION_NS_FIELD_NUMBER: _ClassVar[int]
    NAME_ID_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    start_ns: bytes
    duration_ns: bytes
    name_id: bytes
    stream: bytes
    kind: bytes
    device: int
    def __init__(self, names: _Optional[_Iterable[str]] = ..., start_ns: _Optional[bytes] = ..., duration_ns: _Optional[bytes] = ..., name_id: _Optional[bytes] = ..., stream: _Optional[bytes] = ..., kind: _Optional[bytes] = ..., device: _Optional[int] = ...) -> None: ...

class PhaseTiming(_message.Message):
    __slots__ = ("name", "start_ns", "duration_ns", "iteration", "stream", "clock", "micro_batch")
    NAME_FIELD_NUMBER: _ClassVar[int]
    START_NS_FIELD_NUMBER: _ClassVar[int]
    DURATION_NS_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    name: str
    start_ns: int
    duration_ns: int
    iteration: int
    stream: int
    clock: PhaseClock
    micro_batch: int
    def __init__(self, name: _Optional[str] = ..., start_ns: _Optional[int] = ..., duration_ns: _Optional[int] = ..., iteration: _Optional[int] = ..., stream: _Optional[int] = ..., clock: _Optional[_Union[PhaseClock, str]] = ..., micro_batch: _Optional[int] = ...) -> None: ...

class PhaseBatch(_message.Message):
    __slots__ = ("phases",)
    PHASES_FIELD_NUMBER: _ClassVar[int]
    phases: _containers.RepeatedCompositeFieldContainer[PhaseTiming]
    def __init__(self, phases: _Optional[_Iterable[_Union[PhaseTiming, _Mapping]]] = ...) -> None: ...

class IterationMark(_message.Message):
    __slots__ = ("iteration", "start_ns", "end_ns")
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    START_NS_FIELD_NUMBER: _ClassVar[int]
    END_NS_FIELD_NUMBER: _ClassVar[int]
    iteration: int
    start_ns: int
    end_ns: int
    def __init__(self, iteration: _Optional[int] = ..., start_ns: _Optional[int] = ..., end_ns: _Optional[int] = ...) -> None: ...

class IterationBatch(_message.Message):
    __slots__ = ("marks",)
    MARKS_FIELD_NUMBER: _ClassVar[int]
    marks: _containers.RepeatedCompositeFieldContainer[IterationMark]
    def __init__(self, marks: _Optional[_Iterable[_Union[IterationMark, _Mapping]]] = ...) -> None: ...

class FoldedStack(_message.Message):
    __slots__ = ("stack", "count", "thread_id", "idle")
    STACK_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    THREAD_ID_FIELD_NUMBER: _ClassVar[int]
    IDLE_FIELD_NUMBER: _ClassVar[int]
    stack: str
    count: int
    thread_id: int
    idle: bool
    def __init__(self, stack: _Optional[str] = ..., count: _Optional[int] = ..., thread_id: _Optional[int] = ..., idle: _Optional[bool] = ...) -> None: ...

class StackSnapshot(_message.Message):
    __slots__ = ("window_start_ns", "window_end_ns", "samples", "stacks")
    WINDOW_START_NS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_END_NS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    STACKS_FIELD_NUMBER: _ClassVar[int]
    window_start_ns: int
    window_end_ns: int
    samples: int
    stacks: _containers.RepeatedCompositeFieldContainer[FoldedStack]
    def __init__(self, window_start_ns: _Optional[int] = ..., window_end_ns: _Optional[int] = ..., samples: _Optional[int] = ..., stacks: _Optional[_Iterable[_Union[FoldedStack, _Mapping]]] = ...) -> None: ...

class StackBatch(_message.Message):
    __slots__ = ("snapshots",)
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    snapshots: _containers.RepeatedCompositeFieldContainer[StackSnapshot]
    def __init__(self, snapshots: _Optional[_Iterable[_Union[StackSnapshot, _Mapping]]] = ...) -> None: ...

class StackDump(_message.Message):
    __slots__ = ("grid_id", "group", "trigger", "seq", "expected_ranks", "taken_unix_ns", "took_s", "training_thread", "threads", "error", "flight_recorder", "flight_recorder_error", "flight_recorder_outcome", "flight_recorder_entries", "flight_recorder_read_s")
    GRID_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    TRIGGER_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_RANKS_FIELD_NUMBER: _ClassVar[int]
    TAKEN_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    TOOK_S_FIELD_NUMBER: _ClassVar[int]
    TRAINING_THREAD_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FLIGHT_RECORDER_FIELD_NUMBER: _ClassVar[int]
    FLIGHT_RECORDER_ERROR_FIELD_NUMBER: _ClassVar[int]
    FLIGHT_RECORDER_OUTCOME_FIELD_NUMBER: _ClassVar[int]
    FLIGHT_RECORDER_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    FLIGHT_RECORDER_READ_S_FIELD_NUMBER: _ClassVar[int]
    grid_id: str
    group: str
    trigger: str
    seq: int
    expected_ranks: _containers.RepeatedScalarFieldContainer[int]
    taken_unix_ns: int
    took_s: float
    training_thread: int
    threads: _containers.RepeatedCompositeFieldContainer[FoldedStack]
    error: str
    flight_recorder: _containers.RepeatedCompositeFieldContainer[FlightRecorderGroup]
    flight_recorder_error: str
    flight_recorder_outcome: str
    flight_recorder_entries: int
    flight_recorder_read_s: float
    def __init__(self, grid_id: _Optional[str] = ..., group: _Optional[str] = ..., trigger: _Optional[str] = ..., seq: _Optional[int] = ..., expected_ranks: _Optional[_Iterable[int]] = ..., taken_unix_ns: _Optional[int] = ..., took_s: _Optional[float] = ..., training_thread: _Optional[int] = ..., threads: _Optional[_Iterable[_Union[FoldedStack, _Mapping]]] = ..., error: _Optional[str] = ..., flight_recorder: _Optional[_Iterable[_Union[FlightRecorderGroup, _Mapping]]] = ..., flight_recorder_error: _Optional[str] = ..., flight_recorder_outcome: _Optional[str] = ..., flight_recorder_entries: _Optional[int] = ..., flight_recorder_read_s: _Optional[float] = ...) -> None: ...

class FlightRecorderEntry(_message.Message):
    __slots__ = ("seq", "op", "state", "retired", "bytes", "sizes", "created_unix_ns")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RETIRED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    op: str
    state: str
    retired: bool
    bytes: int
    sizes: str
    created_unix_ns: int
    def __init__(self, seq: _Optional[int] = ..., op: _Optional[str] = ..., state: _Optional[str] = ..., retired: _Optional[bool] = ..., bytes: _Optional[int] = ..., sizes: _Optional[str] = ..., created_unix_ns: _Optional[int] = ...) -> None: ...

class FlightRecorderGroup(_message.Message):
    __slots__ = ("group", "desc", "newest_seq", "last_completed_seq", "entries")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    DESC_FIELD_NUMBER: _ClassVar[int]
    NEWEST_SEQ_FIELD_NUMBER: _ClassVar[int]
    LAST_COMPLETED_SEQ_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    group: str
    desc: str
    newest_seq: int
    last_completed_seq: int
    entries: _containers.RepeatedCompositeFieldContainer[FlightRecorderEntry]
    def __init__(self, group: _Optional[str] = ..., desc: _Optional[str] = ..., newest_seq: _Optional[int] = ..., last_completed_seq: _Optional[int] = ..., entries: _Optional[_Iterable[_Union[FlightRecorderEntry, _Mapping]]] = ...) -> None: ...

class CollectiveGroup(_message.Message):
    __slots__ = ("id", "members")
    ID_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    id: str
    members: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, id: _Optional[str] = ..., members: _Optional[_Iterable[int]] = ...) -> None: ...

class CollectiveRecord(_message.Message):
    __slots__ = ("group", "seq", "op", "bytes", "dtype", "enqueue_ns", "start_ns", "end_ns", "iteration", "ring_steps", "ring_next", "send_busy_ns", "recv_wait_ns", "algo", "step_index", "step_dst", "step_bytes", "step_start_ns", "step_end_ns")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ENQUEUE_NS_FIELD_NUMBER: _ClassVar[int]
    START_NS_FIELD_NUMBER: _ClassVar[int]
    END_NS_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    RING_STEPS_FIELD_NUMBER: _ClassVar[int]
    RING_NEXT_FIELD_NUMBER: _ClassVar[int]
    SEND_BUSY_NS_FIELD_NUMBER: _ClassVar[int]
    RECV_WAIT_NS_FIELD_NUMBER: _ClassVar[int]
    ALGO_FIELD_NUMBER: _ClassVar[int]
    STEP_INDEX_FIELD_NUMBER: _ClassVar[int]
    STEP_DST_FIELD_NUMBER: _ClassVar[int]
    STEP_BYTES_FIELD_NUMBER: _ClassVar[int]
    STEP_START_NS_FIELD_NUMBER: _ClassVar[int]
    STEP_END_NS_FIELD_NUMBER: _ClassVar[int]
    group: int
    seq: int
    op: str
    bytes: int
    dtype: str
    enqueue_ns: int
    start_ns: int
    end_ns: int
    iteration: int
    ring_steps: int
    ring_next: int
    send_busy_ns: int
    recv_wait_ns: int
    algo: str
    step_index: _containers.RepeatedScalarFieldContainer[int]
    step_dst: _containers.RepeatedScalarFieldContainer[int]
    step_bytes: _containers.RepeatedScalarFieldContainer[int]
    step_start_ns: _containers.RepeatedScalarFieldContainer[int]
    step_end_ns: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, group: _Optional[int] = ..., seq: _Optional[int] = ..., op: _Optional[str] = ..., bytes: _Optional[int] = ..., dtype: _Optional[str] = ..., enqueue_ns: _Optional[int] = ..., start_ns: _Optional[int] = ..., end_ns: _Optional[int] = ..., iteration: _Optional[int] = ..., ring_steps: _Optional[int] = ..., ring_next: _Optional[int] = ..., send_busy_ns: _Optional[int] = ..., recv_wait_ns: _Optional[int] = ..., algo: _Optional[str] = ..., step_index: _Optional[_Iterable[int]] = ..., step_dst: _Optional[_Iterable[int]] = ..., step_bytes: _Optional[_Iterable[int]] = ..., step_start_ns: _Optional[_Iterable[int]] = ..., step_end_ns: _Optional[_Iterable[int]] = ...) -> None: ...

class ChannelState(_message.Message):
    __slots__ = ("group", "seq", "channel", "time_ns", "total_chunks", "gpu_ready", "rdma_transmitted", "rdma_done", "stuck_ns", "peer")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    TIME_NS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    GPU_READY_FIELD_NUMBER: _ClassVar[int]
    RDMA_TRANSMITTED_FIELD_NUMBER: _ClassVar[int]
    RDMA_DONE_FIELD_NUMBER: _ClassVar[int]
    STUCK_NS_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    group: int
    seq: int
    channel: int
    time_ns: int
    total_chunks: int
    gpu_ready: int
    rdma_transmitted: int
    rdma_done: int
    stuck_ns: int
    peer: int
    def __init__(self, group: _Optional[int] = ..., seq: _Optional[int] = ..., channel: _Optional[int] = ..., time_ns: _Optional[int] = ..., total_chunks: _Optional[int] = ..., gpu_ready: _Optional[int] = ..., rdma_transmitted: _Optional[int] = ..., rdma_done: _Optional[int] = ..., stuck_ns: _Optional[int] = ..., peer: _Optional[int] = ...) -> None: ...

class CollectiveBatch(_message.Message):
    __slots__ = ("groups", "records", "now_ns", "dropped_records", "dumps", "states")
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    NOW_NS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_RECORDS_FIELD_NUMBER: _ClassVar[int]
    DUMPS_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[CollectiveGroup]
    records: _containers.RepeatedCompositeFieldContainer[CollectiveRecord]
    now_ns: int
    dropped_records: int
    dumps: _containers.RepeatedCompositeFieldContainer[StackDump]
    states: _containers.RepeatedCompositeFieldContainer[ChannelState]
    def __init__(self, groups: _Optional[_Iterable[_Union[CollectiveGroup, _Mapping]]] = ..., records: _Optional[_Iterable[_Union[CollectiveRecord, _Mapping]]] = ..., now_ns: _Optional[int] = ..., dropped_records: _Optional[int] = ..., dumps: _Optional[_Iterable[_Union[StackDump, _Mapping]]] = ..., states: _Optional[_Iterable[_Union[ChannelState, _Mapping]]] = ...) -> None: ...

class TelemetryBatch(_message.Message):
    __slots__ = ("resource", "seq", "sent_unix_ns", "dropped_total", "submitted_total", "final", "kernels", "phases", "iterations", "stacks", "collectives")
    RESOURCE_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SENT_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    KERNELS_FIELD_NUMBER: _ClassVar[int]
    PHASES_FIELD_NUMBER: _ClassVar[int]
    ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    STACKS_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVES_FIELD_NUMBER: _ClassVar[int]
    resource: _common_pb2.Resource
    seq: int
    sent_unix_ns: int
    dropped_total: int
    submitted_total: int
    final: bool
    kernels: KernelBatch
    phases: PhaseBatch
    iterations: IterationBatch
    stacks: StackBatch
    collectives: CollectiveBatch
    def __init__(self, resource: _Optional[_Union[_common_pb2.Resource, _Mapping]] = ..., seq: _Optional[int] = ..., sent_unix_ns: _Optional[int] = ..., dropped_total: _Optional[int] = ..., submitted_total: _Optional[int] = ..., final: _Optional[bool] = ..., kernels: _Optional[_Union[KernelBatch, _Mapping]] = ..., phases: _Optional[_Union[PhaseBatch, _Mapping]] = ..., iterations: _Optional[_Union[IterationBatch, _Mapping]] = ..., stacks: _Optional[_Union[StackBatch, _Mapping]] = ..., collectives: _Optional[_Union[CollectiveBatch, _Mapping]] = ...) -> None: ...

class IngestSummary(_message.Message):
    __slots__ = ("batches_accepted", "batches_rejected", "records_accepted", "records_rejected", "rejected_by_reason", "durable_seq")
    class RejectedByReasonEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    BATCHES_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    BATCHES_REJECTED_FIELD_NUMBER: _ClassVar[int]
    RECORDS_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    RECORDS_REJECTED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_BY_REASON_FIELD_NUMBER: _ClassVar[int]
    DURABLE_SEQ_FIELD_NUMBER: _ClassVar[int]
    batches_accepted: int
    batches_rejected: int
    records_accepted: int
    records_rejected: int
    rejected_by_reason: _containers.ScalarMap[str, int]
    durable_seq: int
    def __init__(self, batches_accepted: _Optional[int] = ..., batches_rejected: _Optional[int] = ..., records_accepted: _Optional[int] = ..., records_rejected: _Optional[int] = ..., rejected_by_reason: _Optional[_Mapping[str, int]] = ..., durable_seq: _Optional[int] = ...) -> None: ...
