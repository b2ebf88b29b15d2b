from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ParallelCoords(_message.Message):
    __slots__ = ("dp", "tp", "pp", "ep", "cp", "dp_size", "tp_size", "pp_size", "ep_size", "cp_size", "order")
    DP_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    PP_FIELD_NUMBER: _ClassVar[int]
    EP_FIELD_NUMBER: _ClassVar[int]
    CP_FIELD_NUMBER: _ClassVar[int]
    DP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    EP_SIZE_FIELD_NUMBER: _ClassVar[int]
    CP_SIZE_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    dp: int
    tp: int
    pp: int
    ep: int
    cp: int
    dp_size: int
    tp_size: int
    pp_size: int
    ep_size: int
    cp_size: int
    order: str
    def __init__(self, dp: _Optional[int] = ..., tp: _Optional[int] = ..., pp: _Optional[int] = ..., ep: _Optional[int] = ..., cp: _Optional[int] = ..., dp_size: _Optional[int] = ..., tp_size: _Optional[int] = ..., pp_size: _Optional[int] = ..., ep_size: _Optional[int] = ..., cp_size: _Optional[int] = ..., order: _Optional[str] = ...) -> None: ...

class Resource(_message.Message):
    __slots__ = ("job_id", "host", "pid", "rank", "local_rank", "world_size", "device", "coords", "attributes")
    class AttributesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    COORDS_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    host: str
    pid: int
    rank: int
    local_rank: int
    world_size: int
    device: str
    coords: ParallelCoords
    attributes: _containers.ScalarMap[str, str]
    def __init__(self, job_id: _Optional[str] = ..., host: _Optional[str] = ..., pid: _Optional[int] = ..., rank: _Optional[int] = ..., local_rank: _Optional[int] = ..., world_size: _Optional[int] = ..., device: _Optional[str] = ..., coords: _Optional[_Union[ParallelCoords, _Mapping]] = ..., attributes: _Optional[_Mapping[str, str]] = ...) -> None: ...
