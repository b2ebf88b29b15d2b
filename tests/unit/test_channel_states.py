"""Mycroft's channel states (analyzer/channel_states.py): Table 4 per state, the sender-versus-receiver
comparison, the NIC whose every flow is stuck, and snapshots that must name nobody; hand-built."""
from __future__ import annotations

import numpy as np
import pytest

from trainscope.analyzer import channel_states as cs

S = 1_000_000_000
T = 1_700_000_000 * S


def snap(rows):
    """rows: (rank, peer, ready, transmitted, done, total, stuck_s), two channels each alike."""
    out = []
    for rank, peer, r, t, d, n, stuck in rows:
        for c in (0, 1):
            out.append((rank, c, T, n, r, t, d, int(stuck * S), peer))
    return cs.Snapshot.of(out)


@pytest.mark.parametrize("counters, state", [
    ((0, 0, 0, 8), cs.NOT_STARTED),
    ((4, 2, 2, 8), cs.NOT_TRANSMITTED),
    ((4, 4, 1, 8), cs.NOT_DELIVERED),
    ((4, 4, 4, 8), cs.GPU_NOT_READY),
    ((8, 8, 8, 8), cs.DONE),
    ((5, 4, 1, 8), cs.NOT_TRANSMITTED),      # both network conditions: the table's order names it
])
def test_table4_names_each_state(counters, state):
    r, t, d, n = counters
    assert cs.table4([r], [t], [d], [n]).tolist() == [state]
    assert cs.nic_side([r], [t], [d]).tolist() == [state in (cs.NOT_TRANSMITTED, cs.NOT_DELIVERED)]


def test_table4_is_vectorised():
    got = cs.table4([0, 4, 4, 4, 8], [0, 2, 4, 4, 8], [0, 2, 1, 4, 8], [8] * 5)
    assert got.tolist() == [cs.NOT_STARTED, cs.NOT_TRANSMITTED, cs.NOT_DELIVERED, cs.GPU_NOT_READY, cs.DONE]


def test_a_nic_whose_every_flow_is_stuck_is_named():
    """Ring 0->1->2->3->0, rank 1's NIC dead: 0->1 and 1->2 posted, never delivered; 2 and 3 wait upstream."""
    root = cs.localise(snap([(0, 1, 2, 2, 0, 12, 40), (1, 2, 2, 2, 0, 12, 40),
                             (2, 3, 2, 2, 2, 12, 40), (3, 0, 2, 2, 2, 12, 40)]))
    assert root is not None and (root.element, root.rank, root.dst) == ("nic", 1, -1)
    assert root.state == cs.NOT_DELIVERED and root.stuck_ns == 40 * S
    assert {(f.src, f.dst) for f in root.flows} == {(0, 1), (1, 2)}
    assert root.receiver_idle                       # rank 2 shows 1=2=3: the data does not reach it
    why = root.why()
    assert "NIC of rank 1" in why and "not delivered" in why and "stuck 40 s" in why
    assert len(root.short()) <= 48 and "NIC of rank 1" in root.short()


def test_a_blocked_flow_is_the_link_when_no_rank_has_all_its_flows_stuck():
    """Only 1->2 is stuck at the network; its receiver 2 shows 1=2=3 (it waits for data)."""
    root = cs.localise(snap([(0, 1, 2, 2, 2, 12, 30), (1, 2, 3, 3, 1, 12, 30),
                             (2, 3, 2, 2, 2, 12, 30), (3, 0, 2, 2, 2, 12, 30)]))
    assert (root.element, root.rank, root.dst, root.state) == ("link", 1, 2, cs.NOT_DELIVERED)
    assert root.receiver_idle and "link 1 -> 2" in root.why()


def test_sender_versus_receiver_picks_the_blocked_flow_over_the_least_progress():
    """0->1 makes the least progress but its receiver 1 is busy sending (1>2, moving); 2->3's receiver
    3 shows 1=2=3: Mycroft §5.3's comparison blames the flow into the idle receiver."""
    rows = [(0, 1, 3, 3, 1, 12, 30),        # stuck, not delivered, progress 1/12
            (1, 2, 6, 4, 4, 12, 0.01),      # moving: not stuck, receiver 1 not idle
            (2, 3, 7, 7, 6, 12, 30),        # stuck, not delivered, progress 6/12
            (3, 0, 2, 2, 2, 12, 30)]        # waits upstream
    root = cs.localise(snap(rows))
    assert (root.element, root.rank, root.dst) == ("link", 2, 3) and root.receiver_idle
    # without an idle receiver the least progress decides (step 4c)
    rows[3] = (3, 0, 3, 2, 2, 12, 0.01)
    root = cs.localise(snap(rows))
    assert (root.rank, root.dst) == (0, 1) and not root.receiver_idle


@pytest.mark.parametrize("rows", [
    # moving: every counter advanced within the last 50 ms, whatever Table 4 says at this instant
    [(0, 1, 5, 4, 3, 12, 0.05), (1, 2, 6, 6, 5, 12, 0.02), (2, 3, 4, 3, 3, 12, 0.01), (3, 0, 7, 7, 7, 12, 0.03)],
    # stuck, but every flow waits for its GPU or its upstream (1=2=3): no network root (step 4d)
    [(0, 1, 2, 2, 2, 12, 40), (1, 2, 2, 2, 2, 12, 40), (2, 3, 2, 2, 2, 12, 40), (3, 0, 2, 2, 2, 12, 40)],
    # finished channels are not stuck
    [(0, 1, 12, 12, 12, 12, 40), (1, 2, 12, 12, 12, 12, 40)],
], ids=["moving", "gpu-side", "done"])
def test_snapshots_without_a_network_stall_name_nobody(rows):
    assert cs.localise(snap(rows)) is None


def test_the_upstream_of_a_rank_that_never_entered_shows_receiver_not_ready():
    """Rank 2 never entered: rank 1's channels to it hold ready chunks, none posted."""
    s = snap([(0, 1, 2, 2, 2, 12, 20), (1, 2, 2, 0, 0, 12, 20), (3, 0, 2, 2, 2, 12, 20)])
    line = cs.upstream_of(s, 2)
    assert line.startswith("rank 1's channels to rank 2: not transmitted") and "receiver not ready" in line
    assert cs.upstream_of(s, 3) == ""          # nobody's channel sends to 3 in this snapshot


def test_share_line_reports_the_commonest_unfinished_state():
    line = cs.share_line(np.array([cs.NOT_DELIVERED] * 6 + [cs.GPU_NOT_READY] * 4 + [cs.DONE] * 5))
    assert line == "②>③ (not delivered) on 60 % of 10 samples: NIC side"
    assert cs.share_line(np.array([cs.DONE, cs.DONE])) == ""


def test_an_empty_snapshot_names_nobody():
    assert cs.localise(cs.Snapshot.of([])) is None and cs.flows(cs.Snapshot.of([])) == []
