"""Helpers shared by tests that run a real processor in-process on 127.0.0.1:0."""
from __future__ import annotations

import time

import grpc

from trainscope.proto.contracts import INGEST_METHOD
from trainscope.processor.daemon import Processor, ProcessorConfig
from trainscope.processor.kernel_names import KERNEL_NAMES, fill_names
from trainscope.proto.contracts import RECORD_TYPES, Signal, topic_for
from trainscope.processor.windows import WindowConfig
from trainscope.proto.columnar import KernelColumns
from trainscope.proto.model import Resource
from trainscope.proto.v1 import telemetry_pb2



def start_processor(listen: str = "127.0.0.1:0", **kw) -> Processor:
    kw.setdefault("window", WindowConfig(length_s=10, lateness_s=1))
    return Processor(ProcessorConfig(listen=listen, **kw)).start()


def kernel_book(proc: Processor) -> dict[int, str]:
    """Every kernel-name dictionary entry on the processor's bus, id -> name."""
    from trainscope.proto.v1 import records_pb2
    book: dict[int, str] = {}
    for r in proc.bus.poll(topic_for(KERNEL_NAMES), 0, max_records=1_000_000):
        book.update((e.id, e.name) for e in records_pb2.KernelNames.FromString(r.value).names)
    return book


def bus_records(proc: Processor, signal: str) -> list:
    out, off = [], 0
    topic = topic_for(signal)
    while True:
        recs = proc.bus.poll(topic, off)
        if not recs:
            break
        out += [RECORD_TYPES[signal].FromString(r.value) for r in recs]
        off = recs[-1].offset + 1
    if signal == Signal.KERNELS:   # windows carry kernel ids: named from the jobs' dictionaries
        book = kernel_book(proc)
        for kw in out:
            fill_names(kw, book.get)
    return out


def kernel_count(proc: Processor) -> int:
    return sum(kw.events for kw in bus_records(proc, "kernels"))


def batch(resource: Resource, seq: int, kernels: KernelColumns | None = None, **payload) -> bytes:
    b = telemetry_pb2.TelemetryBatch(resource=resource.to_pb(), seq=seq)
    if kernels is not None:
        b.kernels.CopyFrom(kernels.to_pb())
    for k, v in payload.items():
        getattr(b, k).CopyFrom(v)
    return b.SerializeToString()


def raw_stream(address: str, messages: list[bytes], timeout: float = 10.0):
    """Send raw byte messages on one ingest stream; returns the summary or raises RpcError."""
    with grpc.insecure_channel(address) as ch:
        call = ch.stream_unary(INGEST_METHOD, request_serializer=None,
                               response_deserializer=telemetry_pb2.IngestSummary.FromString)
        return call(iter(messages), timeout=timeout)


def wait_for(pred, timeout: float = 10.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()
