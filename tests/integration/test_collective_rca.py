"""Collective root cause on real gloo jobs under ``trainscope run`` (issue #13, Mycroft §4.3, §5).

Real 4-rank torch jobs (``tests/support/train_collectives.py``, CPU, gloo on
127.0.0.1) run under ``trainscope run`` against a real processor on
127.0.0.1:0 (in this process), whose embedded bus a live analyzer reads while
the job runs. The collective records come from the collector's
``torch.distributed`` wrappers (plain ``all_reduce``; FSDP2's ``all_gather_single`` and
``reduce_scatter_single``) and from its DDP
communication hook (DDP). Nothing in the training script knows trainscope.

* late start: one rank sleeps before it enters the gradient all-reduce (plain,
  DDP) or before its backward (FSDP2: late to one of the step's 9 collectives)
  → the verdict names it as culprit with the collective's group and sequence
  number; on the plain job the processor's straggler trigger also takes stack
  grids, and the late-start finding's grid shows the late rank alone in its
  delay (``late_start``) while the others wait in the all-reduce, with the
  Flight Recorder view beside it (the others entered seq N, the late rank at
  N - 1) and the processor's Flight Recorder counters (one read per dump);
* hang: one rank stops before its next collective and never enters it (DDP: the
  bucket all-reduce; FSDP2: the first all-gather of its backward) → a stalled
  verdict names it as the first-stuck rank, with the sequence number, well
  before the iteration-based stall rule (about 75 s on this job, naming nobody);
* healthy (DDP): nobody is named by the collective level, and the job's
  results with the collector's communication hook equal those without trainscope;
* stack grid (Mycroft §5): at the hang trigger every rank is dumped by the real
  py-spy and the dumps, clustered by stack, set the stuck rank apart in the
  stall finding's evidence and the culprit's why; each dump's Flight Recorder
  view (torch's own ledger) says which seq each rank entered (rank 2 behind).
Five 4-rank jobs under trainscope and one without (~2.5 min on 2 cores): the DDP and FSDP2 late starts run
on into their hang, one job each; the plain hang is the stack-grid test's.
"""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from google.protobuf.json_format import MessageToDict

from support.livejob import LiveJob, clean_env
from support.livejob import torchrun as _torchrun
from trainscope.analyzer.collectives import CollectivesConfig
from trainscope.analyzer.report import contract_verdict_json
from trainscope.analyzer.service import AnalyzerConfig
from trainscope.processor.collectives import CollectiveWindowConfig, TriggerConfig

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.integration

TRAIN = Path(__file__).resolve().parents[1] / "support" / "train_collectives.py"
WORLD = 4
LATE_RANK, LATE_S, LATE_FROM = 1, 0.15, 10
HANG_RANK, HANG_FROM = 2, 50


def torchrun(*args: str) -> list[str]:
    return _torchrun(*args, world=WORLD, script=TRAIN)


def names(v, rank: int, role: str = "culprit") -> bool:
    return any(s.rank == rank and s.role == role for s in v.ranks)


def collective_findings(v, kind: str) -> list:
    return [f for f in v.findings if f.level == "collectives" and f.kind == kind]


def run_to_end(tmp: Path, job_id: str, *args: str, **live):
    job = LiveJob(tmp / "job", job_id, *args, **live)
    try:
        out = job.finish()
    finally:
        job.close()
    assert job.job.returncode == 0, out[-3000:]
    return job, out


#: The plain late-start job also carries the late start's stack grid and Flight Recorder view: the processor's
#: straggler trigger (Mycroft §4.3: the completion interval doubles) learns its baseline on a 1 s horizon over
#: 0.5 s windows during a longer healthy start, then fires at the onset and again every 2 s (each a grid) for as
#: long as the interval stays doubled. So the delay there is 0.4 s: a 0.15 s delay on a step of 0.15-0.2 s (this
#: job beside other work on 2 cores) stretches the interval 1.8-2x, and the trigger then fired once at the onset
#: and never again, one grid, one py-spy moment per rank (measured: that grid caught rank 1 in the all-reduce
#: like the others, in 2 of 2 full suite runs). At 0.4 s the late rank spends most of each step in its delay.
GRID_LATE_FROM, GRID_LATE_S, GRID_LATE_STEPS = 100, 0.4, 30
GRID_TRIGGER = CollectiveWindowConfig(length_s=0.5, trigger=TriggerConfig(horizon_s=1.0, hot_s=2.0,
                                                                          grid_cooldown_s=2.0))


def test_a_late_rank_is_named_with_the_collective_sequence_number(tmp_path):
    """Plain all-reduce: the late start, its stack grid and Flight Recorder view (DDP and FSDP2: their late
    starts are checked on the jobs of the hang test, which run on after the late rank was named)."""
    grid = shutil.which("py-spy") is not None
    late_from, late_s = (GRID_LATE_FROM, GRID_LATE_S) if grid else (LATE_FROM, LATE_S)
    job, _ = run_to_end(tmp_path, "late-plain", "--mode", "plain",
                        "--steps", str(late_from + (GRID_LATE_STEPS if grid else 50)),
                        "--late-rank", str(LATE_RANK), "--late-s", str(late_s), "--late-from", str(late_from),
                        *(("--flight-recorder", "64") if grid else ()), **({"collectives": GRID_TRIGGER} if grid else {}))
    assert_late_start_named(job, "plain", late_from, late_s)
    if grid:
        # the straggler trigger's dumps may arrive after the window that named the rank: the late start is
        # then issued again with its grid (stack_grid.GridBook.attach), never left without one
        assert_late_start_grid(job)


def assert_late_start_named(job: LiveJob, mode: str, late_from: int, late_s: float) -> None:
    """The late rank is named culprit by the collective level, with the group, op and sequence number of
    the collective it was late to; the others are never culprits there; nobody before the fault."""
    for v in job.seen():
        for f in collective_findings(v, "late_start"):
            print(f"window {v.window.index}: late_start {'named' if f.suspects else 'candidate'} "
                  f"{dict(f.evidence).get('seq')}")
    named = [v for v in job.seen() if names(v, LATE_RANK) and collective_findings(v, "late_start")]
    assert named, [v.summary for v in job.seen()]
    f = collective_findings(named[0], "late_start")[0]
    s = f.suspects[0]
    print(f"\nlate start ({mode}): rank {s.rank} named in window {named[0].window.index}, "
          f"{dict(s.evidence)['median_late_ms']:.0f} ms late (injected {late_s * 1e3:.0f} ms), "
          f"seq {dict(s.evidence)['seq']:.0f}")
    assert s.rank == LATE_RANK and s.role == "culprit"
    ev = dict(s.evidence)
    if mode == "fsdp":
        # FSDP2: 9 collectives a step on the group (all-gathers, reduce-scatters); the late rank is
        # last on one of them, the first all-gather of its backward, every step (step 3b)
        assert ev["group"] == "0" and ev["op"] == "allgather" and ev["per_iteration"]
        assert ev["late_iterations"] >= 0.5 * ev["iterations"]
        assert ev["seq"] >= 9 * late_from
    else:
        assert ev["group"] == "0" and ev["op"] == "allreduce"
        # plain: one all-reduce per step (seq = step + 1); DDP: one per bucket and step, this model one bucket
        assert ev["seq"] >= late_from + 1
    assert ev["median_late_ms"] == pytest.approx(late_s * 1e3, rel=0.5)
    # the others only waited (they are never culprits of the collective level)
    for v in job.seen():
        for f in collective_findings(v, "late_start"):
            assert all(x.rank == LATE_RANK for x in f.suspects), v.summary
    # nobody named before the fault: the first late seq of every finding naming a rank is at or after it
    # (a finding not yet persistent names nobody: its candidates are evidence only)
    firsts = [dict(f.suspects[0].evidence)["seq"] for v in job.seen() for f in collective_findings(v, "late_start")
              if f.suspects]
    assert min(firsts) >= (9 * late_from if mode == "fsdp" else late_from + 1), firsts


def _grids_on_late_starts(job: LiveJob) -> list:
    """(verdict, finding, evidence) of every late-start finding naming a rank that carries a stack grid."""
    found = []
    for v in job.seen():
        for f in collective_findings(v, "late_start"):
            ev = MessageToDict(f.evidence)
            if f.suspects and "stack_grid" in ev:
                found.append((v, f, ev))
    return found


def assert_late_start_grid(job: LiveJob) -> None:
    """The late start's stack grid and Flight Recorder view (Mycroft §5 evidence) on the real plain job: the
    straggler trigger's grids ride on the late-start findings. Each py-spy dump is one moment of its rank,
    taken within the dumps' spread of each other (~0.1-0.5 s here, steps of ~0.2 s), so a grid shows the late
    rank in its delay most of the time, not always: one grid of the several must set it apart, alone in
    ``late_start``, a function no other rank runs, while waiters sit in the all-reduce; no grid ever puts
    another rank in it."""
    found = _grids_on_late_starts(job)
    assert found, "no late-start finding carried a stack grid"
    good = []
    for v, f, ev in found:
        g = ev["stack_grid"]
        assert g["trigger"] == "straggler" and g["group"] == "0", g
        for c in g["clusters"]:
            if any(x.startswith("late_start (") for x in c["stack"]):
                assert [int(r) for r in c["ranks"]] == [LATE_RANK], g["summary"]
        alone = [c for c in g["clusters"] if [int(r) for r in c["ranks"]] == [LATE_RANK]
                 and c["stack"][0].startswith("late_start (") and "train_collectives.py:" in c["stack"][0]]
        waiting = [int(r) for c in g["clusters"] for r in c["ranks"] if any(x.startswith("all_reduce (") for x in c["stack"])]
        if g["complete"] and alone and waiting and LATE_RANK in [int(r) for r in g["odd_ranks"]]:
            good.append((v, f, ev))
        print(f"late-start grid {g['grid']} (window {v.window.index}): {g['summary']}"
              + "".join(f"\n  rank {m['rank']}: {m['why']}" for m in g["missing"]))
    print(f"{len(good)} of {len(found)} late-start findings' grids set rank {LATE_RANK} apart in late_start")
    assert good, [ev["stack_grid"]["summary"] for _, _, ev in found]
    v, f, ev = good[-1]
    # the Flight Recorder view beside it: every rank's recorder read, compared on the group's all-reduces
    fr = ev["flight_recorder"]
    print(f"flight recorder: {fr['summary']}")
    assert fr["group"] == "0" and fr["op"] == "allreduce" and fr["missing"] == [], fr
    assert sorted(int(r["rank"]) for r in fr["ranks"]) == list(range(WORLD))
    assert dict(f.suspects[0].evidence)["flight_recorder"] == fr["summary"]
    (culprit,) = [s for s in v.ranks if s.rank == LATE_RANK and s.role == "culprit"]
    assert "; stack grid: in `late_start (" in culprit.why and f"; flight recorder: {fr['summary']}" in culprit.why, \
        culprit.why
    (js,) = [x for x in contract_verdict_json(v)["suspects"] if x["rank"] == LATE_RANK]
    assert js["evidence"]["stack_grid"].startswith("in `late_start (") and js["evidence"]["flight_recorder"] == fr["summary"]
    # the processor counted every rank's Flight Recorder read with its dump (outcome ok: a view each; a grid
    # asked for as the job ends may miss dumps of ranks that exited)
    m = job.proc.metrics
    sent, dumps = m.get("stack_grid_requests", outcome="sent"), m.get("stack_grid_dumps")
    assert sent >= 1 and WORLD <= dumps <= WORLD * sent
    assert m.get("flight_recorder_views", outcome="ok") == dumps == m.get("flight_recorder_views")
    assert m.get("flight_recorder_entries") == 64 * dumps        # --flight-recorder 64: a full ring read each time
    assert 0 < m.get("flight_recorder_read_seconds_max") <= m.get("flight_recorder_read_seconds_sum")
    print(f"{sent:g} grids, {dumps:g} dumps; Flight Recorder reads: {m.get('flight_recorder_views'):g} ok, "
          f"{m.get('flight_recorder_entries') / m.get('flight_recorder_views'):.0f} entries and "
          f"{m.get('flight_recorder_read_seconds_sum') / m.get('flight_recorder_views') * 1e3:.1f} ms each on average "
          f"(max {m.get('flight_recorder_read_seconds_max') * 1e3:.1f} ms)")


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])     # plain: the late-start and stack-grid tests
def test_a_late_rank_then_a_hang_are_named_with_their_sequence_numbers(tmp_path, mode):
    """One job, two faults one after the other: rank 1 late to every step's collectives from step 10 (named
    while the job runs on), then rank 2 stops at step 50 (named as the first-stuck rank of a stall)."""
    hang_file = tmp_path / "hang.txt"
    # the analyzer's hang timeout at 5 s (default 15 s: the same rule, 10 s less suite time)
    analyzer = AnalyzerConfig(collectives=CollectivesConfig(hang_timeout_s=5.0))
    job = LiveJob(tmp_path, f"late-hang-{mode}", "--mode", mode, "--steps", "200",
                  "--late-rank", str(LATE_RANK), "--late-s", str(LATE_S), "--late-from", str(LATE_FROM),
                  "--hang-rank", str(HANG_RANK), "--hang-from", str(HANG_FROM), "--hang-file", str(hang_file),
                  analyzer=analyzer)
    try:
        # the late rank, named from the windows of steps 10-49 (beside load the analyzer may judge some of them
        # after the stall verdict)
        late, _ = job.wait_for(lambda x: names(x, LATE_RANK) and collective_findings(x, "late_start"), timeout_s=90)
        assert late is not None, [x.summary for x in job.seen()][-5:]
        v, at = job.wait_for(lambda v: v.state == "stalled" and names(v, HANG_RANK), timeout_s=90)
        assert v is not None, [x.summary for x in job.seen()][-5:]
        assert_late_start_named(job, mode, LATE_FROM, LATE_S)
        (f,) = [f for f in v.findings if f.level == "collectives" and f.kind == "stall"]
        ev = dict(f.evidence)
        assert ev["first_stuck_rank"] == HANG_RANK and sorted(ev["waiting_ranks"]) == [0, 1, 3]
        # the healthy ranks are not named: they are waiters, never culprits (rank 1 may still be held for
        # its late starts, which were real)
        assert [s.rank for s in v.ranks if s.role == "culprit" and s.rank != LATE_RANK] == [HANG_RANK], v.summary
        assert v.ranks[0].rank == HANG_RANK, v.summary
        if mode == "fsdp":
            # FSDP2 (fully_shard on the 3 Linear layers and the root): per step 3 parameter all-gathers in forward,
            # 3 in backward (reshard after forward), 3 gradient reduce-scatters, so 9 collectives a step. Rank 2
            # stops between forward and backward: the others wait in the first all-gather of step 25's backward,
            # the 4th collective of that step
            assert ev["group"] == "0" and ev["op"] == "allgather"
            assert ev["seq"] == 9 * HANG_FROM + 4
        else:
            assert ev["group"] == "0" and ev["op"] == "allreduce"
            assert ev["seq"] > HANG_FROM
        stopped = float(hang_file.read_text())
        latency = at - stopped
        print(f"\nhang ({mode}): rank {HANG_RANK} named {latency:.1f} s after it stopped "
              f"(timeout {job.analyzer.config.collectives.hang_timeout_s:g} s)")
        assert latency < 45, latency       # the iteration stall rule took ~75 s and named nobody
        # nobody but the late rank was named by the collective level before the hang
        early = [x for x in job.seen() if x is not v and any(
            f.level == "collectives" and f.kind != "stall"
            and any(s.rank != LATE_RANK and s.role != "waiter" for s in f.suspects)
            for f in x.findings)]
        assert early == [], [x.summary for x in early]
    finally:
        job.close()


def test_a_healthy_ddp_job_names_nobody_and_the_comm_hook_changes_no_result(tmp_path):
    """Healthy: no collective finding names anyone. And the relay hook divides then all-reduces, as DDP
    does without a hook: the parameters equal those of the same job without trainscope, bit for bit."""
    steps = 40
    ref = tmp_path / "ref.json"
    plain = subprocess.run(
        torchrun("--mode", "ddp", "--steps", str(steps), "--out", str(ref)), env=clean_env(),
        capture_output=True, text=True, timeout=150)
    assert plain.returncode == 0, plain.stderr[-2000:]
    got = tmp_path / "got.json"
    job, _ = run_to_end(tmp_path, "healthy", "--mode", "ddp", "--steps", str(steps), "--out", str(got))
    assert json.loads(got.read_text()) == json.loads(ref.read_text())
    state = job.analyzer._jobs["healthy"].collectives
    assert state.records >= WORLD * steps            # DDP's all-reduces were recorded and arrived
    assert max(g.judged for g in state.groups.values()) >= steps   # ... and judged
    bad = [v for v in job.seen() if any(f.level == "collectives" and not f.informational for f in v.findings)]
    assert bad == [], [v.summary for v in bad]


def test_a_hang_carries_the_stack_grid_that_sets_the_stuck_rank_apart(tmp_path):
    """The stack grid (Mycroft §5) on a real hang: rank 2 of a 4-rank plain job stops before its
    all-reduce; the processor's hang trigger (3 s here) sends a dump command over each rank's control
    stream, every rank's collector runs the real py-spy on itself (root here: ptrace allowed), the
    dumps come back on the ingest stream and the analyzer clusters them: rank 2 alone in the training
    script's main, ranks 0, 1, 3 together in the all-reduce. One grid for the group (rate-limited).
    The job turns torch's Flight Recorder on (``--flight-recorder``): each collector's view of it, taken
    with its dump, says ranks 0, 1, 3 entered the all-reduce of seq 11 and rank 2 is behind at seq 10."""
    if shutil.which("py-spy") is None:
        pytest.skip("py-spy is not installed")
    trigger = CollectiveWindowConfig(trigger=TriggerConfig(hang_s=3.0))
    hang_file = tmp_path / "hang.txt"
    job = LiveJob(tmp_path, "grid", "--mode", "plain", "--steps", "400", "--hang-rank", str(HANG_RANK),
                  "--hang-from", "10", "--hang-file", str(hang_file), "--flight-recorder", "64", analyzer=AnalyzerConfig(collectives=CollectivesConfig(hang_timeout_s=3.0)),
                  collectives=trigger)

    def grid_of(v) -> dict | None:
        """The stall's evidence once its grid is complete: a finding is issued at once with the dumps in so
        far and again when the last one arrives (``GridBook.updates``; beside a busy core rank 1's py-spy
        dump came after the first issue)."""
        for f in collective_findings(v, "stall"):
            ev = MessageToDict(f.evidence)
            if "stack_grid" in ev and ev["stack_grid"]["complete"]:
                return ev
        return None

    try:
        v, at = job.wait_for(lambda v: v.state == "stalled" and grid_of(v) is not None, timeout_s=60)
        assert v is not None, [x.summary for x in job.seen()][-5:]
        print(f"\njob started -> stuck {float(hang_file.read_text()) - job.started:.1f} s, "
              f"stuck -> verdict with the grid {at - float(hang_file.read_text()):.1f} s")
        ev = grid_of(v)
        grid = ev["stack_grid"]
        print(f"\nstack grid {grid['grid']}: {grid['summary']}")
        assert ev["first_stuck_rank"] == HANG_RANK and ev["seq"] == 10 + 1      # the all-reduce of step 10
        assert sorted(int(r) for r in ev["waiting_ranks"]) == [0, 1, 3] and ev["op"] == "allreduce"
        # before the hang, nobody was named by the collective level
        early = [x for x in job.seen() if x.window.index < v.window.index and any(
            f.level == "collectives" and not f.informational and f.kind != "stall" for f in x.findings)]
        assert early == [], [x.summary for x in early]
        assert grid["trigger"] == "hang" and grid["group"] == "0" and grid["seq"] == 10 + 1
        assert grid["ranks_dumped"] == WORLD and grid["missing"] == [] and grid["complete"], grid["missing"]
        assert [int(r) for r in grid["odd_ranks"]] == [HANG_RANK]
        big, odd = grid["clusters"]
        assert [int(r) for r in big["ranks"]] == [0, 1, 3] and [int(r) for r in odd["ranks"]] == [HANG_RANK]
        # the waiting ranks' training thread is inside the all-reduce; the stuck one is in the script itself
        assert any(f.startswith("all_reduce (") for f in big["stack"]), big["stack"]
        assert odd["stack"][0].startswith("main (") and "train_collectives.py:" in odd["stack"][0], odd["stack"]
        assert not any("all_reduce" in f for f in odd["stack"])
        assert grid["summary"].startswith(f"rank {HANG_RANK}: 1 of {WORLD} ranks in `main ("), grid["summary"]
        assert "; ranks 0,1,3 in `" in grid["summary"]
        (culprit,) = [s for s in v.ranks if s.rank == HANG_RANK]
        assert "; stack grid: in `main (" in culprit.why, culprit.why
        # the replay contract's JSON (trainscope query verdict --json, replay --json) carries it too
        (js,) = [x for x in contract_verdict_json(v)["suspects"] if x["rank"] == HANG_RANK]
        assert js["evidence"]["stack_grid"].startswith("in `main (") and "stack grid" in js["why"]
        # the Flight Recorder view taken with each dump (gloo: entries stay 'scheduled', completion is
        # 'retired'): ranks 0,1,3 entered the all-reduce of seq 11, rank 2's newest entry is seq 10
        fr = ev["flight_recorder"]
        print(f"\nflight recorder: {fr['summary']}")
        assert fr["group"] == "0" and fr["seq"] == 10 + 1 and fr["op"] == "allreduce" and fr["missing"] == []
        assert [int(r) for r in fr["entered"]] == [0, 1, 3] and [int(r) for r in fr["behind"]] == [HANG_RANK]
        assert {int(r["rank"]): int(r["newest_seq"]) for r in fr["ranks"]} == {0: 11, 1: 11, 2: 10, 3: 11}
        assert fr["summary"].startswith("ranks 0,1,3 entered allreduce seq 11 on group 0 (in flight, "), fr
        assert f"; rank {HANG_RANK}'s newest entry is seq 10 (allreduce, completed)" in fr["summary"], fr
        assert "; flight recorder: ranks 0,1,3 entered allreduce seq 11" in culprit.why, culprit.why
        assert js["evidence"]["flight_recorder"] == fr["summary"]
        m = job.proc.metrics
        assert m.get("stack_grid_requests", outcome="sent") == 1      # one grid per group and cool-down
        assert m.get("stack_grid_dumps", outcome="ok") == WORLD
    finally:
        job.close()
