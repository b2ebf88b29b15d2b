"""The restart contract's bookkeeping (processor/durability.py), without processes."""
import numpy as np

from trainscope.processor.durability import Durability, drop_stored
from trainscope.processor.ingest import Decoded
from trainscope.processor.model import ClosedWindow, WindowOutput
from trainscope.proto.columnar import KernelColumns
from trainscope.proto.model import Resource
from trainscope.proto.v1 import records_pb2, telemetry_pb2

RES = Resource(job_id="j", rank=3, world_size=4)


def closed(end_ns, rank=3):
    res = Resource(job_id="j", rank=rank, world_size=4)
    cw = ClosedWindow(resource=res, window=records_pb2.Window(index=0, start_ns=0, end_ns=end_ns),
                      kernels=KernelColumns.build([], [], [], [], []))
    return WindowOutput(raw=cw)


def test_a_batch_is_durable_once_its_rank_closed_a_window_past_it():
    d = Durability()
    for seq, end in ((1, 100), (2, 200), (3, 300)):
        d.admitted("s", seq, "j", 3, end)
    assert d.durable_seq("s") == 0          # nothing closed yet
    d.export(closed(150, rank=2))            # another rank's window: no help
    assert d.durable_seq("s") == 0
    d.export(closed(250))
    assert d.durable_seq("s") == 2           # batches ending at 100 and 200 are in closed windows
    d.export(closed(300))
    assert d.durable_seq("s") == 3
    d.admitted("s", 4, "j", 3, 0)            # a final marker carries no records: durable at once
    assert d.durable_seq("s") == 4
    assert d.durable_seq("unknown") == 0


def test_a_store_backlog_holds_durability_back():
    backlog = [1]
    d = Durability(store_backlog=lambda: backlog[0])
    d.admitted("s", 1, "j", 3, 100)
    d.export(closed(200))
    assert d.durable_seq("s") == 0           # the window is in memory (the store's backlog), not written
    backlog[0] = 0
    d.export(closed(200))
    assert d.durable_seq("s") == 1


def test_replayed_records_of_stored_windows_are_dropped():
    cols = KernelColumns.build(["k"], np.array([50, 150, 250, 350]), [10] * 4, [0] * 4, [7] * 4)
    b = Decoded(RES, "kernels", cols, 4, 100, 0, 0, 5, 4, 360)
    kept, n = drop_stored(b, 200)
    assert n == 2 and kept.records == 2 and list(kept.payload.start_ns) == [250, 350]
    assert drop_stored(b, 0) == (b, 0)
    assert drop_stored(b, 10**9) == (None, 4)
    phases = tuple(telemetry_pb2.PhaseTiming(name="fwd", start_ns=s, duration_ns=5) for s in (10, 300))
    kept, n = drop_stored(Decoded(RES, "phases", phases, 2, 10, 0, 0, 6, 5, 305), 200)
    assert n == 1 and [p.start_ns for p in kept.payload] == [300]
