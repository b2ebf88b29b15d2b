"""FSDP2 collectives and real Flight Recorder dumps from a 2-rank gloo job (issue #13).

One real job (``tests/support/train_fsdp_fr.py``: 2 processes, CPU, gloo over a
FileStore, ``TORCH_FR_BUFFER_SIZE=2000``, ~10 s on 2 cores) under the collector's
torch hooks: FSDP2 (``fully_shard``) for 3 steps, then rank 0 enters an
all-reduce rank 1 has not entered yet and both dump torch's Flight Recorder
(pickle and JSON, torch 2.13's in-process dump functions) at that moment.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainscope.collector import flight_recorder as fr

pytest.importorskip("torch")
pytestmark = pytest.mark.integration

JOB = Path(__file__).resolve().parents[1] / "support" / "train_fsdp_fr.py"
WORLD = 2


def _run(out: Path) -> list[subprocess.CompletedProcess]:
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINSCOPE_") and k != "PYTHONPATH"}
    env["TORCH_FR_BUFFER_SIZE"] = "2000"
    procs = [subprocess.Popen([sys.executable, str(JOB), str(r), str(WORLD), str(out)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(WORLD)]
    done = []
    for p in procs:
        try:
            o, _ = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        done.append(subprocess.CompletedProcess(p.args, p.returncode, o, ""))
    return done


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fsdp_fr") / "job"
    done = _run(out)
    assert all(p.returncode == 0 for p in done), "\n".join(p.stdout[-2000:] for p in done)
    return out


def test_fsdp2_all_gathers_and_reduce_scatters_give_collective_records(job):
    recs = {r: json.loads((job / f"records-{r}.json").read_text()) for r in range(WORLD)}
    for r, rows in recs.items():
        assert rows, f"rank {r}: FSDP2 produced no collective record"
        assert {(g, tuple(m)) for g, m, *_ in rows} == {("0", (0, 1))}
        seqs = [s for _, _, s, *_ in rows]
        assert seqs == list(range(1, len(seqs) + 1))          # every collective, numbered without holes
        ops = [op for _, _, _, op, *_ in rows]
        assert ops.count("allgather") >= 3 * 2 and ops.count("reducescatter") >= 3 * 2   # 3 steps, 2 Linears
        assert all(done and nbytes > 0 and dtype == "float32" for *_, nbytes, dtype, done in rows)
    # the n-th collective of the group is the same one on both ranks
    assert [(s, op) for _, _, s, op, *_ in recs[0]] == [(s, op) for _, _, s, op, *_ in recs[1]]
    print(f"\nFSDP2: {len(recs[0])} collective records per rank "
          f"({sum(op == 'allgather' for *_, op, _, _, _ in recs[0])} all-gathers)")


def test_real_flight_recorder_dumps_parse_in_both_formats(job):
    hooks = json.loads((job / "records-0.json").read_text())
    n = len(hooks)
    for r in range(WORLD):
        pkl, js = fr.read(str(job / f"fr-{r}.pkl")), fr.read(str(job / f"fr-{r}.json"))
        assert pkl.version == js.version and pkl.version.startswith("2.")
        for d in (pkl, js):
            coll = [e for e in d.entries if e.group == "0" and not e.is_p2p]
            assert all(e.backend == "gloo" for e in coll)
            # torch's own sequence numbers equal the hooks' for the FSDP part
            assert [e.seq for e in coll[:n]] == list(range(1, n + 1))
            assert [e.op for e in coll[:n] if e.op == "allgather"] == [o for *_, o, _, _, _ in hooks if o == "allgather"]
            assert all(e.state == "completed" and e.completed_ns == 0 for e in coll[:n])   # gloo: no end time
    # the hang: rank 0 is in seq n+1 (in flight), rank 1 never entered it (Mycroft Algorithm 2's min op)
    r0, r1 = fr.read(str(job / "fr-0.pkl")), fr.read(str(job / "fr-1.pkl"))
    last0 = [e for e in r0.entries if e.group == "0"][-1]
    assert (last0.seq, last0.op, last0.state, last0.nbytes) == (n + 1, "allreduce", "scheduled", 256 * 4)
    assert max(e.seq for e in r1.entries if e.group == "0") == n
    assert r0.status[0][0] == n + 1 and r1.status[0][0] == n     # last enqueued per group, from pg_status
    batch, counts = fr.to_batch(r0, {"0": (0, 1)})
    assert [(b.seq, b.op, b.end_ns) for b in batch.records] == [(n + 1, "allreduce", 0)]   # a state record
    assert counts["untimed_completed"] == len(r0.entries) - 1


def test_in_process_snapshot_gives_a_state_record_with_the_members(job):
    snap = json.loads((job / "snapshot-0.json").read_text())
    n = len(json.loads((job / "records-0.json").read_text()))
    assert snap["records"] == [["0", [0, 1], n + 1, "allreduce", 0]]


def test_a_truncated_real_dump_is_one_clear_error(job, tmp_path):
    for name in ("fr-0.pkl", "fr-0.json"):
        data = (job / name).read_bytes()
        cut = tmp_path / name
        cut.write_bytes(data[: len(data) // 2])
        with pytest.raises(fr.FlightRecorderError, match="truncated"):
            fr.read(str(cut))
