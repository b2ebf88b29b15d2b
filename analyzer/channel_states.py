"""Mycroft's channel states read: which flow of a stuck collective is the root (Mycroft §5.2-5.3).

Input: the newest state of each channel of one collective (group, seq) on each
member that reported it (``ChannelState``, Mycroft §4.2 state log, Table 2
"Chunk": ``stuck_time, total_chunks, GPU_ready, RDMA_transmitted, RDMA_done``),
as numpy columns (``Snapshot``). A channel sends to one ``peer``, so a
member's channel is the sender's view of one flow src → peer.

1. Table 4 (§5.3), vectorised (``table4``): with ① GPU_ready, ② RDMA_transmitted,
   ③ RDMA_done of ``total`` chunks: ① = ② = ③ = 0 *not started* (local:
   uninitialised; remote: blocked); ① > ② *not transmitted* (RDMA issue;
   receiver not ready); ② > ③ *not delivered* (RDMA issue; receiver failed);
   ① = ② = ③ > 0 *GPU not ready* (GPU issue, or its upstream's data not
   there); ③ ≥ total *done*. Several conditions can hold at once (the table's
   note): the first in that order names the state, ``nic_side`` keeps both
   network conditions.
2. Stuck flows (Table 3, flow level, failure: "each flow should complete"):
   a flow is stuck when every channel of it is unfinished and its counters
   have not moved for ``stuck_ns`` (a healthy flow's counters move every
   chunk: its snapshot names nobody, whatever Table 4 says of it at that
   instant). It is stuck *at the network* when a channel shows ① > ② or
   ② > ③ (data ready at the NIC, not sent or not delivered).
3. Sender versus receiver (§5.3, "comparing states between ranks"): a flow
   stuck at the network whose receiver's own channels show ① = ② = ③ (it
   sent all it had and waits for data) is *blocked*: the data does not get
   from src to dst.
4. The root (§5.2: "Mycroft pinpoints the network flow that either fails to
   complete transmission or makes the least progress ... when all flows of a
   rank are stuck, the rank is likely the root cause"):
   a. a member all of whose flows the snapshot shows, in and out (two or
      more), are stuck at the network: its NIC (least progress first when
      several are);
   b. else the blocked flow with the least progress (③ / total): the link
      src → dst;
   c. else the flow stuck at the network with the least progress: the link;
   d. else (every stuck flow waits for its GPU or its upstream): nobody; the
      snapshot cannot tell a network root.
5. Corroboration of a member that never entered (``upstream_of``,
   ``receiver_ready``): its upstream's channels to it, typically *not
   transmitted* (receiver not ready); channels to it in another state say it
   did enter (its own records are late); and a slow link's share of Table 4 states over recent samples of a
   rank (``share_line``), e.g. "②>③ (not delivered) on 60 % of 10 samples:
   NIC side".

Pure functions over arrays; the analyzer's collectives level (``collectives.py``
steps 5, 5b and the slow-link evidence) holds the states.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import numpy as np

#: Table 4's states, in the order that names a state when several conditions hold.
STATES = ("not started", "not transmitted", "not delivered", "GPU not ready", "done")
NOT_STARTED, NOT_TRANSMITTED, NOT_DELIVERED, GPU_NOT_READY, DONE = range(5)
CONDITION = ("①=②=③=0", "①>②", "②>③", "①=②=③>0", "③=total")
LOCAL_CAUSE = ("uninitialised", "RDMA issue", "RDMA issue", "GPU issue", "-")
REMOTE_CAUSE = ("blocked", "receiver not ready", "receiver failed", "upstream data not there", "-")
#: Step 2: a flow whose counters have not moved for this long is stuck (default of ``localise``).
STUCK_NS = 1_000_000_000

#: Step 2: a flow's state is its worst channel's; priority per Table 4 state (lower: worse).
_PRIO = np.array([2, 0, 1, 3, 4], dtype=np.int8)
_BY_PRIO = np.array([NOT_TRANSMITTED, NOT_DELIVERED, NOT_STARTED, GPU_NOT_READY, DONE], dtype=np.int8)

#: Column order of a state tuple (``Snapshot.of``).
FIELDS = ("rank", "channel", "time_ns", "total", "ready", "transmitted", "done", "stuck_ns", "peer")


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Snapshot:
    """The newest state per (rank, channel) of one collective: int64 columns."""

    rank: np.ndarray
    channel: np.ndarray
    time_ns: np.ndarray
    total: np.ndarray
    ready: np.ndarray
    transmitted: np.ndarray
    done: np.ndarray
    stuck_ns: np.ndarray
    peer: np.ndarray

    @classmethod
    def of(cls, rows: Iterable[Sequence[int]]) -> "Snapshot":
        """From tuples in ``FIELDS`` order."""
        a = np.asarray(list(rows), dtype=np.int64).reshape(-1, len(FIELDS))
        return cls(*(a[:, i] for i in range(len(FIELDS))))

    def __len__(self) -> int:
        return len(self.rank)

    @property
    def state(self) -> np.ndarray:
        return table4(self.ready, self.transmitted, self.done, self.total)


def table4(ready, transmitted, done, total) -> np.ndarray:
    """Step 1: Table 4's state per row (indices into ``STATES``)."""
    r, t, d, n = (np.asarray(x, dtype=np.int64) for x in (ready, transmitted, done, total))
    return np.select([(r == 0) & (t == 0) & (d == 0) & (n > 0), r > t, t > d, (n > 0) & (d >= n)],
                     [NOT_STARTED, NOT_TRANSMITTED, NOT_DELIVERED, DONE], GPU_NOT_READY).astype(np.int8)


def nic_side(ready, transmitted, done) -> np.ndarray:
    """Step 1: ① > ② or ② > ③ (either network condition of Table 4)."""
    r, t, d = (np.asarray(x, dtype=np.int64) for x in (ready, transmitted, done))
    return (r > t) | (t > d)


@dataclasses.dataclass(frozen=True, slots=True)
class Flow:
    src: int
    dst: int
    state: int           # Table 4 state of its worst channel (network states first)
    progress: float      # ③ / total over its channels
    stuck_ns: int        # the least stuck time of its channels
    at_network: bool


@dataclasses.dataclass(frozen=True, slots=True)
class Root:
    """Step 4's answer."""

    element: str                 # "nic" | "link"
    rank: int                    # the NIC's rank, or the link's source
    dst: int                     # the link's destination (-1 for a NIC)
    state: int                   # Table 4 state of the named flow (src's view)
    stuck_ns: int
    flows: tuple[Flow, ...]      # the stuck flows that support it
    receiver_idle: bool          # step 3: the receiver shows ① = ② = ③

    @property
    def name(self) -> str:
        return f"NIC of rank {self.rank}" if self.element == "nic" else f"link {self.rank} -> {self.dst}"

    def why(self) -> str:
        """One line: the element, Table 4's state and causes, how long it has not moved."""
        f = self.flows[0]
        flows = ", ".join(f"{x.src}->{x.dst} {STATES[x.state]} ({CONDITION[x.state]})" for x in self.flows[:4])
        tail = f"; receiver {f.dst} shows ①=②=③ (it waits for data)" if self.receiver_idle else ""
        return (f"{self.name}: {STATES[self.state]} ({CONDITION[self.state]}: {LOCAL_CAUSE[self.state]} or "
                f"{REMOTE_CAUSE[self.state]}), stuck {self.stuck_ns / 1e9:.3g} s; stuck flows {flows}{tail}")

    def short(self) -> str:
        """At most 48 characters (a verdict's ``why`` quotes 48 of a finding's function)."""
        return f"{self.name} {STATES[self.state]}, stuck {self.stuck_ns / 1e9:.3g} s"[:48]


def flows(snap: Snapshot) -> list[Flow]:
    """Step 2: every flow src -> peer the snapshot shows (its channels pooled); ``Flow.stuck_ns``: the
    least stuck time of its unfinished channels (−1: all finished)."""
    if not len(snap):
        return []
    keep = snap.peer >= 0
    src, dst = snap.rank[keep], snap.peer[keep]
    st = table4(snap.ready[keep], snap.transmitted[keep], snap.done[keep], snap.total[keep])
    net = nic_side(snap.ready[keep], snap.transmitted[keep], snap.done[keep])
    key = src * (int(dst.max(initial=0)) + 1) + dst
    uniq, inv = np.unique(key, return_inverse=True)
    n = len(uniq)
    done = np.bincount(inv, weights=snap.done[keep], minlength=n)
    total = np.bincount(inv, weights=snap.total[keep], minlength=n)
    big = np.iinfo(np.int64).max
    stuck = np.full(n, big)
    np.minimum.at(stuck, inv, np.where(st == DONE, big, snap.stuck_ns[keep]))   # its unfinished channels
    stuck[stuck == big] = -1                                                    # all finished: not stuck
    at_net = np.zeros(n, dtype=bool)
    np.logical_or.at(at_net, inv, net)
    # the flow's state: its worst channel's, the network states first (not transmitted, not delivered)
    prio = _PRIO[st]
    worst = np.full(n, len(_PRIO), dtype=np.int8)
    np.minimum.at(worst, inv, prio)
    state = _BY_PRIO[worst]
    pos = np.zeros(n, dtype=np.int64)
    pos[inv[::-1]] = np.arange(len(inv))[::-1]          # each flow's first row
    out = [Flow(int(src[pos[i]]), int(dst[pos[i]]), int(state[i]), float(done[i] / total[i]) if total[i] else 0.0,
                int(stuck[i]), bool(at_net[i])) for i in range(n)]
    return out


def localise(snap: Snapshot, stuck_ns: int = STUCK_NS) -> Root | None:
    """Steps 2-4 on one stuck collective's snapshot; None when no flow is stuck at the network."""
    fl = flows(snap)
    stuck = [f for f in fl if f.stuck_ns >= stuck_ns and f.state != DONE]
    net = [f for f in stuck if f.at_network]
    if not net:
        return None                                                      # step 4d
    # step 3: a receiver whose own channels all show ① = ② = ③ waits for data
    eq = (snap.ready == snap.transmitted) & (snap.transmitted == snap.done)
    idle = {int(r) for r in np.unique(snap.rank) if eq[snap.rank == r].all()}
    order = lambda f: (f.progress, -f.stuck_ns, f.src, f.dst)            # noqa: E731  least progress first
    # step 4a: a rank all of whose flows (in and out, two or more) are stuck at the network
    net_keys = {(f.src, f.dst) for f in net}
    nics = []
    for r in sorted({x for f in net for x in (f.src, f.dst)}):
        mine = [f for f in fl if r in (f.src, f.dst)]
        if len(mine) >= 2 and all((f.src, f.dst) in net_keys for f in mine):
            nics.append((min(f.progress for f in mine), r, sorted(mine, key=lambda f: (f.src != r, order(f)))))
    if nics:
        _, r, mine = min(nics)
        out = next((f for f in mine if f.src == r), mine[0])
        return Root("nic", r, -1, out.state, max(f.stuck_ns for f in mine), tuple(mine),
                    out.dst in idle and out.src == r)
    blocked = sorted((f for f in net if f.dst in idle), key=order)      # step 4b
    pick = blocked[0] if blocked else sorted(net, key=order)[0]         # step 4c
    return Root("link", pick.src, pick.dst, pick.state, pick.stuck_ns,
                (pick,) + tuple(f for f in sorted(net, key=order) if f is not pick), bool(blocked))


def upstream_of(snap: Snapshot, rank: int, stuck_ns: int = STUCK_NS) -> str:
    """Step 5: the channels that send to ``rank``, in one line ("" when none is in the snapshot)."""
    to = [f for f in flows(snap) if f.dst == rank and f.stuck_ns >= stuck_ns]
    if not to:
        return ""
    parts = [f"rank {f.src}'s channels to rank {rank}: {STATES[f.state]} ({CONDITION[f.state]}: "
             f"{REMOTE_CAUSE[f.state]}), stuck {f.stuck_ns / 1e9:.3g} s" for f in sorted(to, key=lambda f: f.src)[:3]]
    return "; ".join(parts)


def receiver_ready(snap: Snapshot, rank: int) -> bool | None:
    """Step 5: did ``rank`` enter, by its upstream's channels to it? False when one shows *not
    transmitted* or *not started* (the receiver is not ready: it never entered), True when they
    show another state (it took their data), None when no channel sends to it in the snapshot."""
    to = snap.peer == rank
    if not to.any():
        return None
    st = table4(snap.ready[to], snap.transmitted[to], snap.done[to], snap.total[to])
    return not bool(np.isin(st, (NOT_TRANSMITTED, NOT_STARTED)).any())


def share_line(states: np.ndarray) -> str:
    """Step 5: the most common unfinished Table 4 state among a rank's recent samples, as a share."""
    s = np.asarray(states, dtype=np.int64)
    s = s[s != DONE]
    if not len(s):
        return ""
    counts = np.bincount(s, minlength=len(STATES))
    top = int(np.argmax(counts))
    side = {NOT_TRANSMITTED: "NIC side", NOT_DELIVERED: "NIC side", GPU_NOT_READY: "GPU side (or upstream)",
            NOT_STARTED: "not started"}[top]
    return (f"{CONDITION[top]} ({STATES[top]}) on {100.0 * counts[top] / len(s):.0f} % of {len(s)} "
            f"samples: {side}")


__all__ = ["CONDITION", "DONE", "FIELDS", "Flow", "GPU_NOT_READY", "LOCAL_CAUSE", "NOT_DELIVERED", "NOT_STARTED",
           "NOT_TRANSMITTED", "REMOTE_CAUSE", "Root", "STATES", "STUCK_NS", "Snapshot", "flows", "localise",
           "nic_side", "receiver_ready", "share_line", "table4", "upstream_of"]
