"""Channel states through the processor (processor/collectives.py steps 9-11) and the analyzer's hang
steps 5, 5b and 5c (analyzer/collectives.py), on batches built like a collector's."""
from __future__ import annotations

import pytest

from test_collectives import MS, T0, W, job_batches

from trainscope.analyzer.collectives import CollectiveState, CollectivesConfig
from trainscope.analyzer.model import LINK
from trainscope.processor.collectives import CollectiveWindowConfig, CollectiveWindows, TriggerConfig, validate
from trainscope.processor.selfmetrics import SelfMetrics
from trainscope.proto.model import Resource
from trainscope.proto.v1 import telemetry_pb2

S = 1000 * MS


def state(seq, channel, ready, transmitted, done, peer, *, total=12, stuck_s=30.0, at=None, group=0):
    return telemetry_pb2.ChannelState(group=group, seq=seq, channel=channel, time_ns=at or T0 + 40 * S,
                                      total_chunks=total, gpu_ready=ready, rdma_transmitted=transmitted,
                                      rdma_done=done, stuck_ns=int(stuck_s * S), peer=peer)


def link_hang_batches(ranks=4, steps=6, dead=1, stuck_s=30.0):
    """A ring all-reduce per step; at the last step every member enters and the NIC of rank ``dead`` dies:
    every member stays in flight; its flows in and out are posted, never delivered."""
    batches = job_batches(ranks=ranks, steps=steps)
    seq = steps + 1
    for r, b in batches.items():
        enter = T0 + 10 * S + r * MS
        b.records.add(group=0, seq=seq, op="allreduce", bytes=4096, dtype="float32", enqueue_ns=enter,
                      start_ns=enter, iteration=steps)
        b.now_ns = enter + 40 * S
        nxt = (r + 1) % ranks
        through = r == dead or nxt == dead
        for c in (0, 1):
            b.states.append(state(seq, c, 2, 2, 0 if through else 2, nxt, stuck_s=stuck_s, at=b.now_ns))
    return batches, seq


def windows_of(batches, world=4):
    """The batches through the processor's validation and windows (states count as records at ingest)."""
    out, m = [], SelfMetrics()
    cw = CollectiveWindows(CollectiveWindowConfig(), out.append, m)
    for r, b in batches.items():
        payload, n, _ = validate(b, world, 2**62, m)
        assert n == len(b.records) + len(b.states)
        cw.add(Resource(job_id="j", rank=r, world_size=world), payload)
    cw.flush()
    return {o.collectives.resource.rank: o.collectives for o in out}


def state_of(batches, **cfg):
    st = CollectiveState(CollectivesConfig(**{"hang_settle_s": 0.0, **cfg}))
    for r, w in windows_of(batches).items():
        st.absorb(r, w)
    return st


def test_a_link_hang_names_the_dead_nic_with_its_table4_state_and_the_seq():
    batches, seq = link_hang_batches()
    st = state_of(batches)
    st.late_starts("j", W)
    (f,) = st.hangs("j", W)
    (s,) = f.suspects
    assert f.kind == "stall" and s.rank == 1 and s.role == LINK
    assert f.evidence["seq"] == seq and f.evidence["link"] == "NIC of rank 1" and f.evidence["absent_ranks"] == []
    assert s.evidence["state"] == "not delivered" and s.evidence["stuck_s"] == pytest.approx(30.0)
    assert "not delivered" in s.evidence["why"] and "stuck 30 s" in s.evidence["why"]
    assert sorted(f.evidence["waiting_ranks"]) == [0, 2, 3]
    assert st.hangs("j", W) == []                  # reported once
    # the verdict names the NIC as a link (network side), not its rank as a culprit that stopped
    from trainscope.analyzer.merge import merge
    res = {r: Resource(job_id="j", rank=r, world_size=4) for r in range(4)}
    v = merge("j", W, [f], res)
    assert v.state == "stalled" and [(x.rank, x.role) for x in v.ranks] == [(1, "link")]
    assert "collective hang in the network" in v.ranks[0].why and "NIC of rank 1 not delivered" in v.ranks[0].why


def test_a_link_hang_without_states_names_nobody():
    batches, _ = link_hang_batches()
    for b in batches.values():
        del b.states[:]
    st = state_of(batches)
    assert st.hangs("j", W) == []


def test_a_stuck_collective_whose_flows_all_wait_for_their_gpu_names_nobody():
    batches, _ = link_hang_batches(dead=-5)            # no NIC dead: every flow shows 1=2=3
    st = state_of(batches)
    assert st.hangs("j", W) == []


def test_a_rank_that_never_entered_is_named_with_its_upstream_channels():
    batches = job_batches(steps=30, hang_rank=2, hang_at=12)
    b1 = batches[1]
    for c in (0, 1):   # rank 1 sends to 2, which never entered: receiver not ready
        b1.states.append(state(13, c, 2, 0, 0, 2, at=b1.now_ns))
    st = state_of(batches)
    st.late_starts("j", W)
    assert st.hangs("j", W) == []                 # with states: named once nothing changed for a call
    (f,) = st.hangs("j", W)
    assert f.suspects[0].rank == 2 and f.evidence["seq"] == 13
    assert "rank 1's channels to rank 2: not transmitted" in f.evidence["channel_states"]
    assert "receiver not ready" in f.suspects[0].evidence["channel_states"]


def test_a_rank_waiting_in_another_stuck_collective_is_not_named():
    """Rank 2 never enters group A's seq 13 (its group-A peers wait); rank 1 waits in group A and so never
    enters group B's next collective, where rank 3 waits: only rank 2 is named (steps 5 and 5c)."""
    batches = job_batches(steps=30, hang_rank=2, hang_at=12)
    later = T0 + 10 * S
    for r, b in batches.items():
        b.groups.add(id="B", members=[1, 3])
        if r == 3:   # rank 3 entered B's seq 1 later than group A's members entered A's seq 13
            b.records.add(group=1, seq=1, op="allreduce", bytes=64, dtype="float32", enqueue_ns=later,
                          start_ns=later, iteration=12)
            b.now_ns = max(b.now_ns, later + 18 * S)
    st = state_of(batches)
    st.late_starts("j", W)
    found = st.hangs("j", W)
    assert [(f.evidence["group"], f.suspects[0].rank) for f in found] == [("0", 2)]
    assert st.hangs("j", W) == []                  # B's stall follows from it: not reported later either


def _cw(**kw):
    out, m = [], SelfMetrics()
    return CollectiveWindows(CollectiveWindowConfig(**kw), out.append, m), out, m


def test_processor_validates_states_and_counts_the_rejected():
    m = SelfMetrics()
    b = job_batches(steps=2)[0]
    b.states.extend([state(3, 0, 2, 2, 0, 1),
                     state(3, 1, 2, 2, 0, 1, group=5),          # no such group
                     state(3, 2, 13, 2, 0, 1),                  # ready above total
                     state(3, 3, 2, 4, 0, 1),                   # transmitted before ready
                     state(3, 4, 2, 2, 0, 9),                   # peer outside the world
                     state(0, 5, 2, 2, 0, 1)])                  # no seq
    payload, n, _ = validate(b, 4, 2**62, m)
    assert [x.channel for x in payload[5]] == [0] and n == 2 + 1
    assert m.get("records_rejected", reason="channel_state") == 5
    only = telemetry_pb2.CollectiveBatch(groups=b.groups, states=[state(3, 0, 2, 2, 0, 1)])
    assert len(validate(only, 4, 2**62, m)[0][5]) == 1         # a batch may hold states only


def test_processor_keeps_the_newest_state_of_collectives_in_flight_bounded():
    cw, out, m = _cw(max_states_per_window=3)
    res = Resource(job_id="j", rank=0, world_size=4)
    g = [telemetry_pb2.CollectiveGroup(id="0", members=[0, 1, 2, 3])]
    done = telemetry_pb2.CollectiveRecord(group=0, seq=1, op="allreduce", enqueue_ns=T0, start_ns=T0, end_ns=T0 + MS)
    first = [state(1, 0, 2, 2, 0, 1, at=T0 + S), state(2, 0, 2, 2, 0, 1, at=T0 + S)]
    newer = [state(2, 0, 3, 3, 1, 1, at=T0 + 2 * S),
             state(2, 1, 2, 2, 0, 1, at=T0 + 2 * S),
             state(2, 2, 2, 2, 0, 1, at=T0 + 2 * S)]               # one over the bound
    backwards = [state(2, 0, 1, 1, 0, 1, at=T0 + 3 * S)]
    for b in (telemetry_pb2.CollectiveBatch(groups=g, records=[done], states=first),
              telemetry_pb2.CollectiveBatch(groups=g, states=newer),
              telemetry_pb2.CollectiveBatch(groups=g, states=backwards)):
        cw.add(res, validate(b, 4, 2**62, m)[0])
    cw.flush()
    (o,) = out
    kept = {(x.seq, x.channel): x for x in o.collectives.states}
    assert set(kept) == {(2, 0), (2, 1)}                  # seq 1 completed in the window
    assert kept[(2, 0)].rdma_done == 1                    # the newest, not the one that went backwards
    assert m.get("records_rejected", reason="channel_state_backwards") == 1
    assert m.get("channel_states", fate="dropped") == 1 and m.get("drops", where="channel_states") == 1
    assert m.get("channel_states", fate="completed") == 1 and m.get("channel_states", fate="kept") == 2
    assert m.get("channel_states", fate="superseded") == 1


def test_a_triggered_processor_sends_states_and_a_trigger_window_carries_them():
    """raw_records=triggered: a closed window carries its in-flight states even when its group is cold;
    the hang trigger's pulled window (records of the rank's ring) carries them too."""
    cw, out, m = _cw(trigger=TriggerConfig(raw_records="triggered", hang_s=10.0, stack_grid=False))
    batches, seq = link_hang_batches()
    held = {}
    for r, b in batches.items():
        rec = telemetry_pb2.CollectiveBatch()
        rec.CopyFrom(b)
        del rec.records[-1]                     # the in-flight record comes in a later batch
        held[r] = b.records[-1]
        cw.add(Resource(job_id="j", rank=r, world_size=4), validate(rec, 4, 2**62, m)[0])
    cw.flush()
    closed = {o.collectives.resource.rank: o.collectives for o in out}
    assert all(len(w.states) == 2 and not w.records for w in closed.values())   # cold group: no raw records
    out.clear()
    b = telemetry_pb2.CollectiveBatch(groups=batches[0].groups, records=[held[0]], now_ns=batches[0].now_ns)
    cw.add(Resource(job_id="j", rank=0, world_size=4), validate(b, 4, 2**62, m)[0])
    assert m.get("collective_triggers", kind="hang") == 1
    pulled = [o.collectives for o in out]
    assert pulled and all(len(w.states) == 2 and w.states[0].seq == seq for w in pulled)


def test_a_slow_link_gets_its_ranks_table4_share_as_evidence():
    """Steps 6-8's evidence line: the named rank's recent channel states (6 of 10 not delivered)."""
    from trainscope.analyzer.model import Finding, Scope, SuspectRank

    b = job_batches(steps=2)[1]
    b.records.add(group=0, seq=3, op="allreduce", bytes=4096, dtype="float32", enqueue_ns=T0 + S, start_ns=T0 + S)
    b.states.extend([state(3, c, 4, 4, 1, 2, stuck_s=0.01) for c in range(6)]
                    + [state(3, c, 3, 3, 3, 2, stuck_s=0.01) for c in range(6, 10)])
    st = state_of({1: b})
    link = Finding(level="collectives", kind="slow_link", job_id="j", window=W, scope=Scope(group="collective"),
                   suspects=(SuspectRank(1, 2.0, {"link": "NIC of rank 1"}, role=LINK),
                             SuspectRank(3, 2.0, {"link": "NIC of rank 3"}, role=LINK)))
    (f,) = st.state_evidence([link])
    assert f.suspects[0].evidence["channel_states"] == "②>③ (not delivered) on 60 % of 10 samples: NIC side"
    assert "channel_states" not in f.suspects[1].evidence          # no states of rank 3: nothing added
    other = Finding(level="collectives", kind="late_start", job_id="j", window=W, suspects=link.suspects)
    assert st.state_evidence([other]) == [other]


def test_members_whose_records_come_late_are_not_taken_for_the_root():
    """The windows of a link hang arrive rank by rank (a simulated run's last chunk comes at once, its
    windows one by one): rank 1 looks absent, but rank 0's channel to it took data: it entered. Rank 2
    has no channel state sent to it yet: not named while the row still changes; named once it held
    still a call; once its in-flight record arrives the hang is judged again, from the states: the
    NIC of rank 1."""
    batches, seq = link_hang_batches()
    ws = windows_of(batches)
    st = CollectiveState(CollectivesConfig(hang_settle_s=0.0))
    for r in (0, 3):
        st.absorb(r, ws[r])
    st.late_starts("j", W)
    assert st.hangs("j", W) == []                 # settling: rank 2's upstream may be on its way
    (f,) = st.hangs("j", W)
    assert f.suspects[0].rank == 2 and f.evidence["absent_ranks"] == [1, 2]
    for r in (1, 2):
        st.absorb(r, ws[r])
    st.late_starts("j", W)
    (g,) = st.hangs("j", W)
    assert g.evidence["link"] == "NIC of rank 1" and g.evidence["seq"] == seq and g.suspects[0].role == LINK
    assert st.hangs("j", W) == []


def test_windows_that_arrive_while_a_row_settles_name_the_link_at_once():
    batches, seq = link_hang_batches()
    ws = windows_of(batches)
    st = CollectiveState(CollectivesConfig(hang_settle_s=0.0))
    for r in (0, 3):
        st.absorb(r, ws[r])
    assert st.hangs("j", W) == []
    for r in (1, 2):
        st.absorb(r, ws[r])
    (f,) = st.hangs("j", W)
    assert f.evidence["link"] == "NIC of rank 1" and f.evidence["seq"] == seq


def test_a_rank_named_as_never_entered_that_turns_up_stuck_elsewhere_is_judged_again():
    """Group A = {0, 1}: rank 1 is absent from A's seq 13 (0 waits, its channel to 1 not transmitted); rank
    1's window, coming later, shows it in flight in group B = {1, 2, 3} since earlier, where rank 3 never
    entered: the hang is B's, and rank 3 is named."""
    t_b, t_a = T0 + 5 * S, T0 + 8 * S
    g = [telemetry_pb2.CollectiveGroup(id="A", members=[0, 1]),
         telemetry_pb2.CollectiveGroup(id="B", members=[1, 2, 3])]

    def batch(recs, states=(), now=T0 + 40 * S):
        b = telemetry_pb2.CollectiveBatch(groups=g, now_ns=now, states=list(states))
        for grp, seq, t in recs:
            b.records.add(group=grp, seq=seq, op="allreduce", bytes=64, dtype="float32", enqueue_ns=t, start_ns=t)
        return b
    rank0 = batch([(0, 13, t_a)], [state(13, 0, 2, 0, 0, 1, at=T0 + 40 * S)])
    rank1 = batch([(1, 7, t_b)], [state(7, 0, 2, 2, 2, 2, group=1)])
    rank2 = batch([(1, 7, t_b)], [state(7, 0, 2, 0, 0, 3, group=1)])
    ws = windows_of({0: rank0, 1: rank1, 2: rank2})
    st = CollectiveState(CollectivesConfig(hang_settle_s=0.0))
    st.absorb(0, ws[0])
    assert st.hangs("j", W) == []
    (f,) = st.hangs("j", W)                          # rank 1 named: nothing says otherwise yet
    assert f.suspects[0].rank == 1 and f.evidence["group"] == "A"
    st.absorb(1, ws[1])
    st.absorb(2, ws[2])
    assert st.hangs("j", W) == []                    # judged again: settling
    (g_,) = st.hangs("j", W)
    assert g_.evidence["group"] == "B" and g_.suspects[0].rank == 3
    assert "not transmitted" in g_.evidence["channel_states"]


def test_settling_waits_hang_settle_s_on_the_analyzer_clock():
    batches = job_batches(steps=30, hang_rank=2, hang_at=12)
    for c in (0, 1):
        batches[1].states.append(state(13, c, 2, 0, 0, 2, at=batches[1].now_ns))
    now = [100.0]
    st = CollectiveState(CollectivesConfig(hang_settle_s=2.0), clock=lambda: now[0])
    for r, w in windows_of(batches).items():
        st.absorb(r, w)
    assert st.hangs("j", W) == []
    now[0] += 1.0
    assert st.hangs("j", W) == []                  # held still 1 s of 2
    now[0] += 1.5
    (f,) = st.hangs("j", W)
    assert f.suspects[0].rank == 2


def test_the_end_of_a_replay_has_nothing_to_settle():
    batches = job_batches(steps=30, hang_rank=2, hang_at=12)
    for c in (0, 1):
        batches[1].states.append(state(13, c, 2, 0, 0, 2, at=batches[1].now_ns))
    st = CollectiveState(CollectivesConfig(hang_settle_s=2.0), clock=lambda: 5.0)
    for r, w in windows_of(batches).items():
        st.absorb(r, w)
    (f,) = st.hangs("j", W, final=True)          # every record read: named at once
    assert f.suspects[0].rank == 2


def test_a_dp_peer_in_flight_for_the_hung_rank_a_little_under_the_timeout_is_not_named():
    """The two-group job (tests/support/train_groups.py) with rank 1 hung before backward, no channel
    states (gloo): TP pairs A = {0, 1}, C = {2, 3}; DP pairs B = {0, 2}, D = {1, 3}. Rank 3 entered D's
    seq 41 and waits there for rank 1; rank 2 entered C's seq 42 moments later and waits for rank 3; on
    the ranks' own clocks rank 2 has crossed the 15 s timeout while rank 3's wait in D is 14.9 s. Rank 3
    waits (the real run named it beside rank 1); rank 1, absent from D, is the hang."""
    g = [telemetry_pb2.CollectiveGroup(id=i, members=m) for i, m in
         (("A", [0, 1]), ("C", [2, 3]), ("B", [0, 2]), ("D", [1, 3]))]
    t_d = T0 + 5 * S               # rank 3 enters D's seq 41
    t_c = t_d + 10 * MS            # rank 2 enters C's seq 42
    t_a = t_d + 20 * MS            # rank 0 enters A's seq 42

    def batch(recs, now):
        b = telemetry_pb2.CollectiveBatch(groups=g, now_ns=now)
        for grp, seq, t, end in recs:
            b.records.add(group=grp, seq=seq, op="allreduce", bytes=64, dtype="float32", enqueue_ns=t,
                          start_ns=t, end_ns=end)
        return b
    done = t_d - 50 * MS           # every pair's previous collectives ended before
    rank0 = batch([(0, 41, done - 5 * MS, done), (2, 41, done - 2 * MS, done), (0, 42, t_a, 0)], int(t_c + 15.1 * S))
    rank1 = batch([(0, 41, done - 5 * MS, done), (3, 40, done - 9 * MS, done)], done + MS)
    rank2 = batch([(1, 41, done - 4 * MS, done), (2, 41, done - 2 * MS, done), (1, 42, t_c, 0)], int(t_c + 15.1 * S))
    rank3 = batch([(1, 41, done - 4 * MS, done), (3, 40, done - 9 * MS, done), (3, 41, t_d, 0)], int(t_d + 14.9 * S))
    ws = windows_of({0: rank0, 1: rank1, 2: rank2, 3: rank3})
    st = CollectiveState(CollectivesConfig(hang_settle_s=0.0))
    for r, w in ws.items():
        st.absorb(r, w)
    named = {s.rank for f in st.hangs("j", W) for s in f.suspects} | {
        s.rank for f in st.hangs("j", W) for s in f.suspects}
    assert named == {1}, named
