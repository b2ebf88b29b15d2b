from trainscope.proto.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DeepDiveOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DEEP_DIVE_OUTCOME_UNSPECIFIED: _ClassVar[DeepDiveOutcome]
    DEEP_DIVE_OUTCOME_DONE: _ClassVar[DeepDiveOutcome]
    DEEP_DIVE_OUTCOME_TRUNCATED: _ClassVar[DeepDiveOutcome]
    DEEP_DIVE_OUTCOME_MISSED: _ClassVar[DeepDiveOutcome]
    DEEP_DIVE_OUTCOME_OVERSIZE: _ClassVar[DeepDiveOutcome]
    DEEP_DIVE_OUTCOME_UNAVAILABLE: _ClassVar[DeepDiveOutcome]
    DEEP_DIVE_OUTCOME_FAILED: _ClassVar[DeepDiveOutcome]
    DEEP_DIVE_OUTCOME_BUSY: _ClassVar[DeepDiveOutcome]
DEEP_DIVE_OUTCOME_UNSPECIFIED: DeepDiveOutcome
DEEP_DIVE_OUTCOME_DONE: DeepDiveOutcome
DEEP_DIVE_OUTCOME_TRUNCATED: DeepDiveOutcome
DEEP_DIVE_OUTCOME_MISSED: DeepDiveOutcome
DEEP_DIVE_OUTCOME_OVERSIZE: DeepDiveOutcome
DEEP_DIVE_OUTCOME_UNAVAILABLE: DeepDiveOutcome
DEEP_DIVE_OUTCOME_FAILED: DeepDiveOutcome
DEEP_DIVE_OUTCOME_BUSY: DeepDiveOutcome

class ControlHello(_message.Message):
    __slots__ = ("resource", "protocol", "profiler_available", "unavailable_reason")
    RESOURCE_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    PROFILER_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    UNAVAILABLE_REASON_FIELD_NUMBER: _ClassVar[int]
    resource: _common_pb2.Resource
    protocol: int
    profiler_available: bool
    unavailable_reason: str
    def __init__(self, resource: _Optional[_Union[_common_pb2.Resource, _Mapping]] = ..., protocol: _Optional[int] = ..., profiler_available: _Optional[bool] = ..., unavailable_reason: _Optional[str] = ...) -> None: ...

class DeepDiveCommand(_message.Message):
    __slots__ = ("dive_id", "job_id", "start_iteration", "iterations", "max_duration_s", "max_bytes", "with_stack", "trigger", "ranks")
    DIVE_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    START_ITERATION_FIELD_NUMBER: _ClassVar[int]
    ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_DURATION_S_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    WITH_STACK_FIELD_NUMBER: _ClassVar[int]
    TRIGGER_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    dive_id: str
    job_id: str
    start_iteration: int
    iterations: int
    max_duration_s: float
    max_bytes: int
    with_stack: bool
    trigger: str
    ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dive_id: _Optional[str] = ..., job_id: _Optional[str] = ..., start_iteration: _Optional[int] = ..., iterations: _Optional[int] = ..., max_duration_s: _Optional[float] = ..., max_bytes: _Optional[int] = ..., with_stack: _Optional[bool] = ..., trigger: _Optional[str] = ..., ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class StackDumpCommand(_message.Message):
    __slots__ = ("grid_id", "job_id", "group", "trigger", "seq", "ranks", "timeout_s")
    GRID_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    TRIGGER_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    grid_id: str
    job_id: str
    group: str
    trigger: str
    seq: int
    ranks: _containers.RepeatedScalarFieldContainer[int]
    timeout_s: float
    def __init__(self, grid_id: _Optional[str] = ..., job_id: _Optional[str] = ..., group: _Optional[str] = ..., trigger: _Optional[str] = ..., seq: _Optional[int] = ..., ranks: _Optional[_Iterable[int]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class ControlCommand(_message.Message):
    __slots__ = ("sent_unix_ns", "deep_dive", "ping", "stack_dump")
    SENT_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    DEEP_DIVE_FIELD_NUMBER: _ClassVar[int]
    PING_FIELD_NUMBER: _ClassVar[int]
    STACK_DUMP_FIELD_NUMBER: _ClassVar[int]
    sent_unix_ns: int
    deep_dive: DeepDiveCommand
    ping: bool
    stack_dump: StackDumpCommand
    def __init__(self, sent_unix_ns: _Optional[int] = ..., deep_dive: _Optional[_Union[DeepDiveCommand, _Mapping]] = ..., ping: _Optional[bool] = ..., stack_dump: _Optional[_Union[StackDumpCommand, _Mapping]] = ...) -> None: ...

class DeepDiveReport(_message.Message):
    __slots__ = ("resource", "dive_id", "outcome", "first_iteration", "last_iteration", "start_unix_ns", "end_unix_ns", "trace_path", "summary_path", "trace_bytes", "detail", "profiler_stop_s")
    RESOURCE_FIELD_NUMBER: _ClassVar[int]
    DIVE_ID_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    FIRST_ITERATION_FIELD_NUMBER: _ClassVar[int]
    LAST_ITERATION_FIELD_NUMBER: _ClassVar[int]
    START_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    END_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    TRACE_PATH_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_PATH_FIELD_NUMBER: _ClassVar[int]
    TRACE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    PROFILER_STOP_S_FIELD_NUMBER: _ClassVar[int]
    resource: _common_pb2.Resource
    dive_id: str
    outcome: DeepDiveOutcome
    first_iteration: int
    last_iteration: int
    start_unix_ns: int
    end_unix_ns: int
    trace_path: str
    summary_path: str
    trace_bytes: int
    detail: str
    profiler_stop_s: float
    def __init__(self, resource: _Optional[_Union[_common_pb2.Resource, _Mapping]] = ..., dive_id: _Optional[str] = ..., outcome: _Optional[_Union[DeepDiveOutcome, str]] = ..., first_iteration: _Optional[int] = ..., last_iteration: _Optional[int] = ..., start_unix_ns: _Optional[int] = ..., end_unix_ns: _Optional[int] = ..., trace_path: _Optional[str] = ..., summary_path: _Optional[str] = ..., trace_bytes: _Optional[int] = ..., detail: _Optional[str] = ..., profiler_stop_s: _Optional[float] = ...) -> None: ...

class ControlAck(_message.Message):
    __slots__ = ("ok", "detail")
    OK_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    detail: str
    def __init__(self, ok: _Optional[bool] = ..., detail: _Optional[str] = ...) -> None: ...

class DeepDiveRequest(_message.Message):
    __slots__ = ("job_id", "ranks", "iterations", "duration_s", "start_iteration", "trigger", "dive_id", "reason")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    START_ITERATION_FIELD_NUMBER: _ClassVar[int]
    TRIGGER_FIELD_NUMBER: _ClassVar[int]
    DIVE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    ranks: _containers.RepeatedScalarFieldContainer[int]
    iterations: int
    duration_s: float
    start_iteration: int
    trigger: str
    dive_id: str
    reason: str
    def __init__(self, job_id: _Optional[str] = ..., ranks: _Optional[_Iterable[int]] = ..., iterations: _Optional[int] = ..., duration_s: _Optional[float] = ..., start_iteration: _Optional[int] = ..., trigger: _Optional[str] = ..., dive_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class DeepDiveAck(_message.Message):
    __slots__ = ("accepted", "dive_id", "start_iteration", "iterations", "ranks_reached", "detail", "latest_iteration", "directory")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DIVE_ID_FIELD_NUMBER: _ClassVar[int]
    START_ITERATION_FIELD_NUMBER: _ClassVar[int]
    ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    RANKS_REACHED_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    LATEST_ITERATION_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    dive_id: str
    start_iteration: int
    iterations: int
    ranks_reached: int
    detail: str
    latest_iteration: int
    directory: str
    def __init__(self, accepted: _Optional[bool] = ..., dive_id: _Optional[str] = ..., start_iteration: _Optional[int] = ..., iterations: _Optional[int] = ..., ranks_reached: _Optional[int] = ..., detail: _Optional[str] = ..., latest_iteration: _Optional[int] = ..., directory: _Optional[str] = ...) -> None: ...

class DeepDiveQuery(_message.Message):
    __slots__ = ("job_id", "dive_id")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    DIVE_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    dive_id: str
    def __init__(self, job_id: _Optional[str] = ..., dive_id: _Optional[str] = ...) -> None: ...

class DeepDiveRecord(_message.Message):
    __slots__ = ("dive_id", "job_id", "trigger", "requested_unix_ns", "start_iteration", "iterations", "ranks_expected", "reports", "complete", "partial", "reason")
    DIVE_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TRIGGER_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    START_ITERATION_FIELD_NUMBER: _ClassVar[int]
    ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    RANKS_EXPECTED_FIELD_NUMBER: _ClassVar[int]
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    dive_id: str
    job_id: str
    trigger: str
    requested_unix_ns: int
    start_iteration: int
    iterations: int
    ranks_expected: _containers.RepeatedScalarFieldContainer[int]
    reports: _containers.RepeatedCompositeFieldContainer[DeepDiveReport]
    complete: bool
    partial: bool
    reason: str
    def __init__(self, dive_id: _Optional[str] = ..., job_id: _Optional[str] = ..., trigger: _Optional[str] = ..., requested_unix_ns: _Optional[int] = ..., start_iteration: _Optional[int] = ..., iterations: _Optional[int] = ..., ranks_expected: _Optional[_Iterable[int]] = ..., reports: _Optional[_Iterable[_Union[DeepDiveReport, _Mapping]]] = ..., complete: _Optional[bool] = ..., partial: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class DeepDiveStatus(_message.Message):
    __slots__ = ("dives",)
    DIVES_FIELD_NUMBER: _ClassVar[int]
    dives: _containers.RepeatedCompositeFieldContainer[DeepDiveRecord]
    def __init__(self, dives: _Optional[_Iterable[_Union[DeepDiveRecord, _Mapping]]] = ...) -> None: ...
