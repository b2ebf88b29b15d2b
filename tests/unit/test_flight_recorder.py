"""Flight Recorder dumps (collector/flight_recorder.py) built by hand to the layout of torch 2.13's writer
(``torch/include/torch/csrc/distributed/c10d/FlightRecorderDetail.hpp``); dumps from a real gloo job are
parsed in ``tests/integration/test_collective_sources.py``."""
from __future__ import annotations

import json
import os
import pickle

import pytest

from trainscope.collector import flight_recorder as fr


def entry(seq, name="gloo:all_reduce", *, pg=("0", "default_pg"), pg_id=0, state="scheduled", retired=True,
          sizes=((1000,),), dtypes=("Float",), started=None, completed=None, p2p=False, **extra):
    e = {"record_id": seq - 1, "pg_id": pg_id, "process_group": pg, "collective_seq_id": seq, "p2p_seq_id": 0,
         "op_id": seq, "profiling_name": name, "time_created_ns": 10**18 + seq * 1000,
         "input_sizes": [list(s) for s in sizes], "input_dtypes": list(dtypes),
         "output_sizes": [list(s) for s in sizes], "output_dtypes": list(dtypes), "state": state,
         "time_discovered_started_ns": started, "time_discovered_completed_ns": completed, "retired": retired,
         "timeout_ms": 1800000, "is_p2p": p2p, "thread_id": "1", "thread_name": "python3",
         "frames": [{"name": "all_reduce", "filename": "x.py", "line": 1}]}
    e.update(extra)
    return e


def dump(entries, status=None, pg_config=None, version="2.10"):
    return {"version": version, "pg_config": pg_config if pg_config is not None else
            {"": {"name": "", "desc": "", "ranks": "[]"}}, "comm_lib_version": "",
            "pg_status": status or {"0": {"last_enqueued_collective": 3, "last_started_collective": -1,
                                          "last_completed_collective": 2}},
            "entries": entries}


def gloo_dump():
    return dump([entry(1), entry(2, "gloo:all_gather", sizes=((10,),)), entry(3, "gloo:barrier", retired=False,
                                                                              sizes=(), dtypes=())])


def test_a_gloo_pickle_dump_its_states_ops_and_bytes():
    d = fr.parse(pickle.dumps(gloo_dump()))
    assert d.version == "2.10" and d.groups == {} and d.status == {0: (3, -1, 2)}
    got = [(e.group, e.seq, e.op, e.backend, e.nbytes, e.dtype, e.state) for e in d.entries]
    assert got == [("0", 1, "allreduce", "gloo", 4000, "float32", "completed"),   # retired: completed
                   ("0", 2, "allgather", "gloo", 40, "float32", "completed"),
                   ("0", 3, "barrier", "gloo", 0, "", "scheduled")]           # in flight
    assert [e.seq for e in d.in_flight()] == [3]


def test_json_dump_writes_times_as_zero_and_status_as_strings():
    raw = gloo_dump()
    for e in raw["entries"]:
        e["time_discovered_started_ns"] = e["time_discovered_completed_ns"] = 0
        e["process_group"] = list(e["process_group"])
        del e["frames"]
    raw["pg_status"] = {"0": {k: str(v) for k, v in raw["pg_status"]["0"].items()}}
    d = fr.parse(json.dumps(raw).encode())
    assert d.status == {0: (3, -1, 2)} and [e.state for e in d.entries] == ["completed", "completed", "scheduled"]


def test_completion_counted_by_the_group_status_when_not_retired():
    raw = dump([entry(1, retired=False), entry(2, retired=False), entry(3, retired=False)])
    assert [e.state for e in fr.parse(pickle.dumps(raw)).entries] == ["completed", "completed", "scheduled"]


def test_nccl_entries_with_times_give_completed_records_and_pg_config_gives_members():
    raw = dump([entry(1, "nccl:_allgather_base", state="completed", started=5, completed=9, duration_ms=0.5),
                entry(2, "nccl:reduce_scatter_tensor_coalesced", state="started", retired=False, started=7,
                      dtypes=("BFloat16",)),
                entry(3, "nccl:send 0->1", p2p=True, retired=False)],
               status={"0": {"last_enqueued_collective": 2, "last_started_collective": 2,
                             "last_completed_collective": 1}},
               pg_config={"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"}})
    d = fr.parse(pickle.dumps(raw))
    assert d.groups == {"0": ("default_pg", (0, 1, 2, 3))}
    assert [(e.op, e.state) for e in d.entries] == [("allgather", "completed"), ("reducescatter", "started"),
                                                    ("send", "scheduled")]
    assert d.entries[0].duration_ms == 0.5 and d.entries[1].nbytes == 2000 and d.entries[1].dtype == "bfloat16"
    batch, counts = fr.to_batch(d, now_ns=99)
    assert counts == {"records": 2, "p2p": 1, "untimed_completed": 0, "no_members": 0}
    assert list(batch.groups[0].members) == [0, 1, 2, 3] and batch.now_ns == 99
    assert [(r.seq, r.op, r.start_ns, r.end_ns) for r in batch.records] == [(1, "allgather", 5, 9),
                                                                            (2, "reducescatter", 7, 0)]


def test_to_batch_needs_members_for_gloo_groups():
    d = fr.parse(pickle.dumps(gloo_dump()))
    batch, counts = fr.to_batch(d)
    assert len(batch.records) == 0 and counts["no_members"] == 1 and counts["untimed_completed"] == 2
    batch, counts = fr.to_batch(d, {"0": (0, 1)})
    assert [(r.seq, r.op, r.end_ns, r.bytes) for r in batch.records] == [(3, "barrier", 0, 0)]


@pytest.mark.parametrize("data, match", [
    (b"", "empty"),
    (pickle.dumps(gloo_dump())[:200], "truncated"),
    (json.dumps(dump([])).encode()[:40], "truncated or invalid JSON"),
    (pickle.dumps([1, 2]), "top level is list"),
    (pickle.dumps({"entries": []}), "no 'version'"),
    (pickle.dumps(dump([], version="3.0")), "version '3.0'"),
    (pickle.dumps(dump([entry(1, state="running")])), "entry 0: 'state'"),
    (pickle.dumps(dump([{k: v for k, v in entry(1).items() if k != "collective_seq_id"}])),
     "entry 0 has no 'collective_seq_id'"),
    (pickle.dumps(dump([entry(1), entry(2, sizes=(("x",),))])), r"entry 1.input_sizes\[0\] must be an integer"),
    (pickle.dumps(dump([entry(1, pg="0")])), "'process_group' must be"),
    (pickle.dumps(dump([], pg_config={"0": {"ranks": "0,1"}})), "must look like"),
    (pickle.dumps(dump([entry(1, retired="yes")])), "must be booleans"),
    (b"not a dump at all", "pickle"),
])
def test_malformed_dumps_are_one_clear_error(data, match):
    with pytest.raises(fr.FlightRecorderError, match=match) as e:
        fr.parse(data, "dump.pkl")
    assert str(e.value).startswith("bad_flight_recorder_dump: dump.pkl: ") and "\n" not in str(e.value)


def test_a_pickle_with_code_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    with pytest.raises(fr.FlightRecorderError, match="refuses the pickled object"):
        fr.parse(pickle.dumps({"version": "2.10", "entries": [Evil()]}))
    assert not marker.exists()


def test_read_names_the_file_and_never_needs_torch(tmp_path):
    with pytest.raises(fr.FlightRecorderError, match="missing.pkl: cannot read"):
        fr.read(str(tmp_path / "missing.pkl"))
    p = tmp_path / "d.pkl"
    p.write_bytes(pickle.dumps(gloo_dump()))
    assert len(fr.read(str(p)).entries) == 3


def test_op_names():
    assert [fr._op(n) for n in ("gloo:all_reduce", "nccl:_allgather_base", "nccl:_reduce_scatter_base",
                                "nccl:all_to_all", "nccl:alltoall_base", "nccl:recv 1<-0", "gloo:barrier",
                                "nccl:all_gather_into_tensor_coalesced")] == [
        ("gloo", "allreduce"), ("nccl", "allgather"), ("nccl", "reducescatter"), ("nccl", "alltoall"),
        ("nccl", "alltoall"), ("nccl", "recv"), ("gloo", "barrier"), ("nccl", "allgather")]
