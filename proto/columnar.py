"""Columnar kernel batches: numpy columns <-> ``trainscope.v1.KernelBatch``.

High-volume kernel activity travels as packed little-endian columns so that
both ends convert with ``numpy.frombuffer`` (ARCHITECTURE.md, "Wire format"):
no Python object per kernel on either side.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from trainscope.proto.errors import BadInput
from trainscope.proto.v1 import telemetry_pb2

# Column name -> little-endian dtype on the wire.
WIRE_DTYPES: dict[str, np.dtype] = {
    "start_ns": np.dtype("<u8"),
    "duration_ns": np.dtype("<u8"),
    "name_id": np.dtype("<u4"),
    "stream": np.dtype("<u4"),
    "kind": np.dtype("u1"),
}

KIND_KERNEL = telemetry_pb2.KERNEL_KIND_KERNEL
KIND_MEMCPY = telemetry_pb2.KERNEL_KIND_MEMCPY
KIND_MEMSET = telemetry_pb2.KERNEL_KIND_MEMSET


@dataclasses.dataclass(frozen=True, slots=True)
class KernelColumns:
    """Kernel activity records of one rank as parallel numpy arrays.

    ``names`` is the string table that ``name_id`` indexes. Arrays are in
    native byte order and may be read-only views of a received buffer.
    """

    names: tuple[str, ...]
    start_ns: np.ndarray
    duration_ns: np.ndarray
    name_id: np.ndarray
    stream: np.ndarray
    kind: np.ndarray
    device: int = 0

    def __len__(self) -> int:
        return int(self.start_ns.shape[0])

    @classmethod
    def build(
        cls,
        names: Sequence[str],
        start_ns,
        duration_ns,
        name_id,
        stream,
        kind=None,
        device: int = 0,
    ) -> "KernelColumns":
        """Build from array-likes, casting to the wire dtypes (``kind`` defaults to kernel)."""
        n = len(start_ns)
        return cls(
            names=tuple(names),
            start_ns=np.asarray(start_ns, dtype=np.uint64),
            duration_ns=np.asarray(duration_ns, dtype=np.uint64),
            name_id=np.asarray(name_id, dtype=np.uint32),
            stream=np.asarray(stream, dtype=np.uint32),
            kind=np.zeros(n, np.uint8) if kind is None else np.asarray(kind, dtype=np.uint8),
            device=device,
        )

    @classmethod
    def empty(cls) -> "KernelColumns":
        return cls.build((), [], [], [], [])

    def take(self, index) -> "KernelColumns":
        """A subset of the records (boolean mask or integer index), same string table."""
        return dataclasses.replace(
            self,
            start_ns=self.start_ns[index],
            duration_ns=self.duration_ns[index],
            name_id=self.name_id[index],
            stream=self.stream[index],
            kind=self.kind[index],
        )

    def to_pb(self) -> telemetry_pb2.KernelBatch:
        cols = {
            name: np.ascontiguousarray(getattr(self, name), dtype=dt).tobytes()
            for name, dt in WIRE_DTYPES.items()
        }
        return telemetry_pb2.KernelBatch(names=list(self.names), device=self.device, **cols)

    @classmethod
    def from_pb(cls, m: telemetry_pb2.KernelBatch) -> "KernelColumns":
        """Decode a batch, or raise ``BadInput`` if its columns disagree.

        Checks only the batch's shape (column byte lengths, string-table
        indices); per-record value checks belong to the receiver's validation.
        """
        cols: dict[str, np.ndarray] = {}
        n = None
        for name, dt in WIRE_DTYPES.items():
            raw = getattr(m, name)
            if len(raw) % dt.itemsize:
                raise BadInput(
                    "column_length",
                    f"column {name} has {len(raw)} bytes, not a multiple of {dt.itemsize}",
                )
            arr = np.frombuffer(raw, dtype=dt)
            if n is None:
                n = arr.shape[0]
            elif arr.shape[0] != n:
                raise BadInput(
                    "column_length",
                    f"column {name} has {arr.shape[0]} records, start_ns has {n}",
                )
            cols[name] = arr
        names = tuple(m.names)
        if n and int(cols["name_id"].max()) >= len(names):
            raise BadInput(
                "name_id",
                f"name_id {int(cols['name_id'].max())} outside the string table of {len(names)}",
            )
        return cls(names=names, device=m.device, **cols)
