"""The summariser's (kernel, stream) keys: the bincount numbering equals numpy.unique's, on every path."""
import numpy as np
import pytest

from trainscope.processor.kernel_names import kernel_id
from trainscope.processor.model import ClosedWindow
from trainscope.processor.summarize import Summarizer, _keys
from trainscope.proto.columnar import KernelColumns
from trainscope.proto.model import Resource
from trainscope.proto.v1 import records_pb2


@pytest.mark.parametrize("streams", [[0, 7, 13, 20], [0, 7, 65535, 65536, 2**32 - 1], [3]])
def test_keys_equal_numpy_unique_of_the_composite(streams):
    rng = np.random.default_rng(len(streams))
    for n_names in (1, 5, 300):
        for n in (1, 17, 5000):
            nid = rng.integers(0, n_names, n).astype(np.uint32)
            st = rng.choice(streams, n).astype(np.uint32)
            uniq, inv = _keys(nid, st, n_names)
            want_u, want_i = np.unique((nid.astype(np.uint64) << np.uint64(32)) | st.astype(np.uint64),
                                       return_inverse=True)
            assert uniq.dtype == np.uint64
            assert np.array_equal(uniq, want_u) and np.array_equal(inv, want_i.ravel())


def test_window_summary_has_one_entry_per_kernel_and_stream_with_its_count():
    names = ("gemm", "nccl", "copy")
    nid = [0, 0, 1, 2, 0, 1, 1]
    st = [7, 7, 13, 7, 13, 13, 13]
    k = KernelColumns.build(names, np.arange(7) * 1000 + 1, [100, 110, 500, 30, 120, 510, 490], nid, st)
    cw = ClosedWindow(resource=Resource(job_id="j", rank=0, world_size=1), window=records_pb2.Window(index=0),
                      kernels=k, phases=(), iterations=(), stacks=())
    out = Summarizer().kernels(cw, cw.resource.to_pb())
    by_id = {kernel_id(n): n for n in names}   # windows carry dictionary ids, no names
    assert all(not ks.kernel for ks in out.kernels)
    got = [(by_id[ks.kernel_id], ks.stream, ks.count, ks.total_ns) for ks in out.kernels]
    assert got == [("gemm", 7, 2, 210.0), ("gemm", 13, 1, 120.0), ("nccl", 13, 3, 1500.0), ("copy", 7, 1, 30.0)]
