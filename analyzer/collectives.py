"""Collective root cause from per-collective records: late start and hang (Mycroft §4.3, §5).

Input: ``CollectiveWindow`` records (one per rank and short processor window,
``processor/collectives.py``), each with the rank's collectives keyed by
(group, seq): the n-th collective on a group is the same collective on every
member. ``CollectiveState`` (one per job, bounded) joins them across ranks.

Late start versus slow transfer (Mycroft §5, Table 3 "late start"; Algorithm 2
asks which rank of the group is behind), per collective complete on every
member, clock-free:

1. A synchronising collective ends at about the same moment on every member,
   so the member that entered last waited least: ``wait_r = end_r - enqueue_r``;
   the last entrant is ``argmin wait`` and its lateness is the median wait of
   the others minus its own. No cross-host clock is compared.
2. The transfer time of the collective is the last entrant's wait (it found
   everyone there): ``transfer = min wait``.
3. Judged per analysed window: the collectives of its iterations (the hooks
   number iterations as the marks do; time windows: by enqueue time), in seq
   order without holes; the share below is read on the window's own
   collectives (a backlog judged late does not dilute it). A collective counts against its last entrant only when
   it was clearly late (``late_factor`` times its transfer and ``min_late_ms``:
   someone is always last, by scheduler noise). Per group, a rank clearly late
   to at least ``min_share`` of them, by a median of ``late_factor`` transfer
   times and ``min_late_ms``, is a culprit (late start: compute or
   host side); its impact is its total lateness per iteration, and the members
   that waited for it are waiters. In a pair, where either member is last by
   chance, only where P(X >= k; n, 1/2) <= ``last_alpha`` / 2 as well. The first collective it was late to (group,
   seq) is the evidence an engineer looks up. Groups whose members sit in
   different pipeline stages (Megatron's grad-norm all-reduce over the
   model-parallel group) are not judged: in 1F1B the first stage finishes its
   last backward last, so it enters them late every iteration by design.
3b. One sync point a step: FSDP issues several collectives a step on one
   group (a 4-rank FSDP2 job: 9, all-gathers and reduce-scatters), and a rank
   delayed once a step (host side, before its backward) is last on one of
   them (1/9 of the collectives, under ``min_share``) while the others wait
   for it every step. In groups of three or more (in a pair either member is
   last by chance), a rank clearly late to the collective at the same
   position of its iteration in at least ``min_share`` of the window's
   iterations, by the same two margins, is a culprit too; its impact is its
   total lateness per iteration. (Random noise seldom makes one member last
   at the same position of most iterations.) Only where that group is the
   only one the rank synchronises in and it is in no pipeline (pure data
   parallel, FSDP): a rank whose tensor-parallel partner or previous
   pipeline stage is slow inherits exactly this pattern (a 64-rank job whose
   rank 29 stalled in its data loader named its TP partner and both of
   their next-stage ranks late to their DP all-reduce every step).
3c. Intermittent: a rank stalled in a few iterations only (300 ms before its
   backward one step in five: 2 of a 10-iteration window's collectives) is
   under ``min_share``, yet those stalls are the job's loss. In groups of
   three or more, where it synchronises only there (as 3b), a rank late in at
   least two iterations by at least ``intermittent_min_step`` of the step each
   (a host stall, far beyond scheduler noise), holding ``intermittent_share``
   of the group's clear lateness, and costing ``intermittent_min_pct`` % of the
   step per iteration, is a culprit too; its impact is those latenesses per
   iteration (issue #22: the DDP stall named nobody).
3d. Consistently last on a busy host: beside other processes the collective itself
   slows (a 4-rank gloo all-reduce 3-4 ms idle, 7-14 ms beside one busy core) and
   a rank 15 ms late every step is under ``late_factor`` transfer times in most
   of them (issue #22: DDP and FSDP2 with one rank's forward slower named nobody).
   Scheduler noise makes any member the last entrant, each with probability 1/m
   (m members); in groups of three or more (a pair is the dependency comparison's,
   L2 and attribution: who waited for whom), a rank last by at least ``min_late_ms`` to the collective at the
   same position of k of the window's n iterations, with k >= ``min_share`` n and
   the binomial tail P(X >= k; n, 1/m) at most ``last_alpha`` / (m x positions),
   is a culprit too, where it synchronises only in that group (as 3b); its
   impact is those latenesses per iteration.
3f. The latest member of most iterations, over windows: host contention on one
   rank's core (three busy processes beside it) made it last, by about 10 ms of a
   48 ms step, to 7 of 10 plain all-reduces of most windows: under 3d's bar in
   any one window (P(X >= 7; 10, 1/4) = 0.0035), the job 20 % slower and named
   nobody; with FSDP2's 9 collectives a step its lateness spread over all of
   them (last at each position in 30-55 % of iterations, everywhere under the
   bar). The evidence is added up twice. Over positions: per iteration, the
   member with the largest total lateness (its latenesses of ``min_late_ms`` or
   more when last) is the iteration's latest; with no late member each is it
   with probability 1/m (exchangeable members). Over windows: the group keeps
   the latest member of each of its last ``last_pool_iterations`` judged
   iterations (a backlog judged late included: a contended rank's own records
   come late). A rank that is the latest in k of those n iterations with
   P(X >= k; n, 1/m) <= ``last_alpha`` / m (50 iterations of 4 members: 22 or
   more; 3d's "most iterations" would miss a rank the latest in half of them
   as often as not, and the lateness counted is ``min_late_ms`` or more
   already), and at least n_w/m of this
   window's n_w iterations (the evidence is still current), is a culprit
   where 3d did not name it and it synchronises only in that group (as 3b);
   its impact is this window's latenesses per iteration. (The contended
   FSDP2 rank was the latest in 59-61 of 70 iterations; a healthy FSDP2 job's
   members in 14-24 each.)
3e. The late member of a pair on a busy host: 3d needs three members (in a pair
   either one is last by chance), and beside a busy process the pair's
   collective slows as 3d says, so a member 15 ms late every step is under
   ``late_factor`` transfer times in most iterations (a two-group gloo job
   with one rank's forward slower: the tensor-parallel partner's lateness to
   its data-parallel all-reduce, inherited, was all that was named). In a
   pair the question is a paired one: at the same position of each
   iteration, d_i = how late member a entered against b (negative when b was
   last). With no late member the sign of d_i is a coin and its size the
   scheduler's, symmetric; Wilcoxon's signed-rank statistic W+ (the sum of
   the ranks of |d_i| over d_i > 0) has an exact null distribution, and a
   member is a culprit when P(W+ ≥ w) ≤ ``last_alpha`` / (2 × positions),
   it was last by at least ``min_late_ms`` in ``min_share`` of those
   iterations, and its median lateness there is at least ``min_late_ms``
   and the collective's median transfer time (Wilcoxon 1945; Hollander &
   Wolfe, *Nonparametric Statistical Methods* §3.1). The test says who is
   last more than chance allows; the size, what it costs against the
   collective itself (step 1 asks ``late_factor`` transfers of each
   collective; the consistency earns half of that): a scheduler beside a
   busy process can keep one member of a healthy pair a few ms behind its
   partner for whole windows (a healthy two-group job: 2.7 ms against a
   ~10 ms all-reduce, named before this bound). Its impact is those
   latenesses per iteration. A member of several groups may have inherited
   its lateness (its partner in another group made it wait): the finding
   stands, and attribution follows its measured wait to the rank it waited
   for (``attribution.py`` step 3).
4. Slow transfer (network side): no rank late, but the group's transfer time of
   these collectives ``slow_factor`` times its own earlier median for the same
   (op, size class): reported as evidence (informational: gloo gives no
   per-link records to name a link; the NCCL profiler plugin would).

Slow link (Vedrfolnir §III), per analysed window, on the same judged collectives:

6. Collectives whose every member's record carries step records (fields
   14-19: each flow step's destination, bytes, start and end) are kept as
   one (5, flows) integer array per rank and collective (``StepColumns``;
   bounded by ``max_step_flows``), stacked per shape
   (``waiting_graph.step_blocks``) and rated by ``provenance.root_cause``:
   step triggers, provenance graph, contributor rating (eqs. 1-3), naming a
   rank's NIC/NVLink, a link src → dst or a pair a ↔ b, the steps it slowed
   and its impact in s/iteration (kind ``slow_link``, role ``link``).
7. The others, where their records carry the ring summary (fields 10-13), go
   through the per-rank waiting graph (``waiting_graph.slow_links``); a link
   or rank step 6 already named in this window is not named again. In a
   window where step 6 named nothing, the collectives with steps go through
   it too: a congestion of a whole host spreads eq. (3)'s rating over its
   NICs, none of which reaches ``min_rating`` alone (8 NICs of a host at
   0.04-0.08 each on a 64-rank job), while the waiting graph judges each
   rank's links pooled and names every one of them (the verdict: their host).

A host's network as one element (Mycroft §5, from the affected ranks to the
root cause; ARGUS §9.2 case 2), per analysed window, after steps 6-7:

8. Congestion on a host's network slows every link of its ranks, but only in
   bursts: a NIC found slow in a fifth of a window's collectives, each of
   its rings carrying a share of the excess, and the point-to-point sends
   (PP) that collective records never show, leave every one of the host's
   findings under the impact floor while the job loses several % of its
   step (``net_congestion`` factor 2, bursts of 6 s every 30 s: eight NIC
   findings at 0.7-0.8 % each, the job 2.6-3.1 % slower than its healthy
   twin). When two or more ranks of one host H are named by steps 6-7, all
   of them on H and each under the floor, and the iterations they were slow
   in leave at least ``host_min_clean`` iterations of the window clean, H's
   network is judged as one element: its impact is what those slow
   iterations cost the job, the excess of the job's step (median over
   ranks) in each over the median step of the clean ones, summed and spread
   over the window's iterations. The finding (kind ``slow_link``, role
   ``link`` for each of H's named ranks, all at that impact) names the host;
   the per-rank findings stay as evidence. A fault slow in every iteration
   (a degraded NIC) leaves no clean iterations to compare with and is
   judged by steps 6-7 alone. In a large job every data-parallel ring crosses
   the congested host, so the bursts also make steps 6-7 name a few links of
   hosts downstream of it, in the same slow iterations: priced by those
   iterations, every such host would cost the job the same. Of the hosts that
   qualify, only those whose named links carry at least ``host_dominance``
   of the strongest host's evidence (the sum of their findings' impacts)
   are named (a 1,024-rank job with host 1 congested: 8 of its 8 ranks
   named, against 2-4 on each of 20 other hosts).

Hang (Mycroft §4.3 trigger "no completion for a timeout", then §5's "which rank
has not started the op"), checked on every analyzer step, not per window:

5. A collective (group, seq) that some members report in flight (state records,
   ``end_ns = 0``) for ``hang_timeout_s`` or more on their own clocks, while
   other members never reported that seq: those others are stuck before it. The
   first-stuck rank is the one whose last collective on the group is the
   oldest (lowest seq); it is the culprit of a ``stall`` finding naming the
   group and seq; the members in flight are its waiters. A member that is
   itself stuck in flight in another collective (for half of
   ``hang_timeout_s``: a chain of groups enters its collectives moments apart,
   each member's wait read on its own clock) is not a root (Mycroft §5.2: "a single responsible group whose stuck rank
   propagates problems to other groups"): it waits there, and that
   collective's own rule names the root; a group whose absent members all
   wait elsewhere gets no finding. Where channel states of the collective are
   held, the culprit's upstream channels corroborate (``channel_states``
   step 5: typically "not transmitted: receiver not ready").
5c. One hang per job at a time (Mycroft §5.2, Algorithm 2: the group whose
   stuck rank propagates to the others): of the collectives steps 5 and 5b
   localise in one call, the one stuck longest on its members' own clocks
   is reported; the others stuck by then, and any stuck later while it is
   still in flight, are its consequences (marked, not reported). A test job
   whose culprit's tensor-parallel partner waits in its all-reduce leaves
   the partner absent from its data-parallel group's next collective: without
   5 and 5c the partner would be named there too. A member whose upstream's
   channel states show it took their data entered (its own records are
   late: a batch on its way) and is not named; where the collective has
   states, a member is named only once the row and the set of ranks in
   flight held still between two calls ``hang_settle_s`` (2 s) apart, or at
   the end of a replay (windows may be on their way: a
   member absent here may turn out to wait in another stuck collective);
   should a member named as never entered report the collective, or turn
   up in flight in another stuck one, the hang is judged again.
5b. Every member entered and every one is in flight (the link hang): the
   newest channel states of that (group, seq) (``CollectiveWindow.states``,
   Mycroft §4.2) are read by ``channel_states.localise`` (Mycroft §5.2-5.3,
   Table 3 "each flow should complete", Table 4, sender versus receiver):
   the NIC of a rank all of whose flows are stuck at the network, else the
   blocked flow src → dst with the least progress. It is the root of a
   ``stall`` finding, role ``link``, its evidence the Table 4 state and
   stuck time (``why``), the other members listed as waiting ranks. Without
   states, or with none stuck at the network, nothing is named (as before).

Channel states as evidence of a slow link (steps 6-8): each named rank's
recent state samples (the last ``state_samples`` of every collective it
reported in flight), when there are any, add a line to its evidence
(``channel_states``): the commonest unfinished Table 4 state and its share,
e.g. "②>③ (not delivered) on 60 % of 10 samples: NIC side".

Stall and late-start findings carry the group's stack grid when its py-spy dumps
are in (Mycroft §5 evidence, ``stack_grid.py``).
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import Callable, Mapping

import numpy as np

from trainscope.analyzer import channel_states, provenance, stack_grid, waiting_graph
from trainscope.analyzer.model import CULPRIT, LINK, WAITER, Finding, Scope, SuspectRank
from trainscope.proto.errors import ConfigError
from trainscope.proto.v1 import records_pb2

LEVEL = "collectives"
#: Step 5: a member in flight in another collective this share of ``hang_timeout_s`` waits there (not a root).
ELSEWHERE_SHARE = 0.5


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CollectivesConfig:
    hang_timeout_s: float = 15.0
    """Step 5: a collective in flight this long on some members, never entered by others, is a hang."""
    min_collectives: int = 3
    """Step 3: collectives of a group judged in a window before a late start is named."""
    min_share: float = 0.5
    """Step 3: share of those a rank must have entered last."""
    late_factor: float = 2.0
    """Step 3: its mean lateness in transfer times (the last entrant's wait)."""
    min_late_ms: float = 2.0
    """Step 3: ... and in milliseconds (scheduler noise on a busy host is below it)."""
    intermittent_min_step: float = 0.5
    """Step 3c: a lateness counts toward an intermittent late start from this share of the step on ..."""
    intermittent_share: float = 2 / 3
    """... the rank holds at least this share of the group's clear lateness in the window ..."""
    intermittent_min_pct: float = 5.0
    """... and those latenesses cost the job at least this % of the step per iteration."""
    last_alpha: float = 1e-2
    """Step 3d: false-alarm rate of "last to the same collective by chance" per group and window
    (split over its members x positions, Bonferroni)."""
    last_pool_iterations: int = 50
    """Step 3f: a group's judged iterations whose latest members 3d's test reads across windows (0: off)."""
    slow_factor: float = 3.0
    """Step 4: transfer time against the group's own earlier median, same op and size class."""
    max_seqs_per_group: int = 4096
    """Collectives kept per group (oldest dropped): bounds memory."""
    max_groups: int = 1024
    """Groups tracked per job."""
    waiting_graph: waiting_graph.WaitingGraphConfig = dataclasses.field(
        default_factory=waiting_graph.WaitingGraphConfig)
    """Step 7: slow links from the ring summary (``waiting_graph.py``)."""
    provenance: provenance.ProvenanceConfig = dataclasses.field(default_factory=provenance.ProvenanceConfig)
    """Step 6: slow links from step records (``provenance.py``)."""
    max_step_flows: int = 4_000_000
    """Step 6: flow steps held per job (40 bytes each); records beyond it keep no steps (counted)."""
    host_min_clean: int = 3
    """Step 8: iterations of the window without a slow link of the host, the baseline of its cost."""
    host_dominance: float = 0.5
    """Step 8: a host is named when its links' evidence is at least this share of the strongest host's."""
    stack_grid: stack_grid.StackGridConfig = dataclasses.field(default_factory=stack_grid.StackGridConfig)
    """The py-spy dumps of a triggering group, clustered and attached to stall and late-start findings."""
    state_stuck_s: float = 5.0
    """Step 5b: a flow whose channel counters have not moved this long is stuck."""
    max_states_per_group: int = 65_536
    """Step 5b: channel states held per group (the newest per (seq, rank, channel)); beyond it dropped, counted."""
    state_samples: int = 64
    """Slow-link evidence: Table 4 states of the latest channel states kept per rank."""
    hang_settle_s: float = 2.0
    """Step 5 with channel states: the stuck row and the ranks in flight hold still this long (analyzer clock,
    and two calls) before a member is named as never entered (its window may be on its way)."""

    def __post_init__(self) -> None:
        for f in ("hang_timeout_s", "late_factor", "min_late_ms", "slow_factor", "state_stuck_s"):
            if not getattr(self, f) > 0:
                raise ConfigError(f"analyzer.collectives.{f}", getattr(self, f), "must be > 0")
        if not self.hang_settle_s >= 0:
            raise ConfigError("analyzer.collectives.hang_settle_s", self.hang_settle_s, "must be >= 0")
        if not 0 < self.min_share <= 1:
            raise ConfigError("analyzer.collectives.min_share", self.min_share, "must be in (0, 1]")
        if not 0 < self.last_alpha < 1:
            raise ConfigError("analyzer.collectives.last_alpha", self.last_alpha, "must be in (0, 1)")
        if not (isinstance(self.last_pool_iterations, int) and 0 <= self.last_pool_iterations <= 10_000):
            raise ConfigError("analyzer.collectives.last_pool_iterations", self.last_pool_iterations,
                              "must be an integer in [0, 10000]")
        if not 0 < self.host_dominance <= 1:
            raise ConfigError("analyzer.collectives.host_dominance", self.host_dominance, "must be in (0, 1]")
        for f in ("min_collectives", "max_seqs_per_group", "max_groups", "max_step_flows", "host_min_clean",
                  "max_states_per_group", "state_samples"):
            if not (isinstance(getattr(self, f), int) and getattr(self, f) >= 1):
                raise ConfigError(f"analyzer.collectives.{f}", getattr(self, f), "must be an integer >= 1")


class StepColumns:
    """Step 6: one rank's step records of one collective (fields 15-19) as a single (5, flows)
    int64 array, no Python object per step; read by ``waiting_graph.step_blocks`` through the
    ``CollectiveRecord`` attribute names."""

    __slots__ = ("op", "algo", "iteration", "cols")

    def __init__(self, op: str, algo: str, iteration: int, cols: np.ndarray) -> None:
        self.op, self.algo, self.iteration, self.cols = op, algo, iteration, cols

    @classmethod
    def of(cls, r) -> "StepColumns | None":
        """The record's step columns; None without steps or with lists of unequal lengths."""
        n = len(r.step_index)
        if not n or not (len(r.step_dst) == len(r.step_bytes) == len(r.step_start_ns) == len(r.step_end_ns) == n):
            return None
        cols = np.empty((5, n), dtype=np.int64)
        for i, f in enumerate((r.step_index, r.step_dst, r.step_bytes, r.step_start_ns, r.step_end_ns)):
            cols[i] = np.fromiter(f, dtype=np.uint64, count=n).astype(np.int64)
        return cls(r.op, r.algo, int(r.iteration), cols)

    step_index = property(lambda self: self.cols[0])
    step_dst = property(lambda self: self.cols[1])
    step_bytes = property(lambda self: self.cols[2])
    step_start_ns = property(lambda self: self.cols[3])
    step_end_ns = property(lambda self: self.cols[4])

    @property
    def flows(self) -> int:
        return self.cols.shape[1]


class _Group:
    __slots__ = ("members", "seqs", "judged", "transfer_hist", "reported_hang", "states", "n_states", "last_pool",
                 "open_iteration")

    def __init__(self, members: tuple[int, ...]) -> None:
        self.members = members
        # seq -> rank -> (op, bytes, enqueue_ns, end_ns, iteration, ring_steps, ring_next, send_busy_ns,
        # recv_wait_ns, StepColumns | None); end 0 = in flight
        self.seqs: dict[int, dict[int, tuple]] = {}
        self.judged = 0                     # highest seq judged for late start
        self.transfer_hist: dict[tuple[str, int], collections.deque] = {}
        self.reported_hang: set[int] = set()
        # step 5b: seq -> (rank, channel) -> the newest state as a channel_states.FIELDS tuple
        self.states: dict[int, dict[tuple[int, int], tuple]] = {}
        self.n_states = 0
        # step 3f: (iteration, its latest member or -1) of the group's recent judged iterations (bounded
        # by CollectivesConfig.last_pool_iterations), and the iteration still being added up
        self.last_pool: collections.deque = collections.deque()
        self.open_iteration: tuple[int, collections.Counter] | None = None

    def forget(self, seq: int) -> None:
        """A seq leaves ``seqs`` (judged, or the oldest over the bound): its channel states go with it."""
        held = self.states.pop(seq, None)
        if held:
            self.n_states -= len(held)


def _binomial_tail(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p) (steps 3, 3d, 3f). ``bdtrc``: n may be a TP group's hundreds of
    collectives (step 3 in a pair), where a sum of ``math.comb`` terms overflows a float."""
    from scipy.special import bdtrc   # scipy.special is loaded already (sequential's stdtrit)
    return float(bdtrc(k - 1, n, p)) if k > 0 else 1.0


def _pair_beyond_chance(k: int, n: int, alpha: float) -> bool:
    """Step 3 in a pair: either member is the last entrant of each collective by chance (1/2), so being
    clearly late to k of n is named only where P(X >= k; n, 1/2) <= alpha / 2 (a healthy two-group job
    of 12 processes beside a busy one on 2 cores had a TP member clearly late, 8.6 ms, to 6 of 10:
    P = 0.38)."""
    return _binomial_tail(k, n, 0.5) <= alpha / 2


def _signed_rank_tail(d: np.ndarray) -> float:
    """Step 3e: one-sided P(W+ >= w) of Wilcoxon's signed-rank statistic for the differences ``d``
    (zeros dropped; ranks of |d| ordinal: ties between nanosecond timings are rare), exact: the null
    distribution of W+ over n ranks is that of a sum of a random subset of 1..n (n a window's
    iterations, small)."""
    d = d[d != 0]
    n = d.size
    if n == 0:
        return 1.0
    ranks = np.empty(n, dtype=np.int64)
    ranks[np.argsort(np.abs(d), kind="stable")] = np.arange(1, n + 1)
    return float(_signed_rank_null(n)[int(ranks[d > 0].sum()):].sum())


@functools.lru_cache(maxsize=64)
def _signed_rank_null(n: int) -> np.ndarray:
    """P(W+ = w), w = 0 .. n(n+1)/2: the number of subsets of 1..n summing to w, over 2^n (built once
    per n: both members of every pair, every position and window ask for the same few n)."""
    counts = np.zeros(n * (n + 1) // 2 + 1)
    counts[0] = 1.0
    for k in range(1, n + 1):          # subsets of 1..k: add k to every subset of 1..k-1
        counts[k:] = counts[k:] + counts[:-k].copy()
    out = counts / 2.0 ** n
    out.flags.writeable = False
    return out


def _latest(iteration: tuple[int, collections.Counter]) -> tuple[int, int]:
    """Step 3f: (iteration, the member with the largest total lateness in it, or -1 when none was late)."""
    it, lates = iteration
    return it, (max(lates, key=lates.get) if lates else -1)


def _in_window(row: Mapping[int, tuple], window: records_pb2.Window) -> bool:
    """The collective belongs to this window or an earlier one: by iteration for iteration windows
    (the hooks number iterations as the marks do), else by its members' enqueue times."""
    if window.kind == records_pb2.WINDOW_KIND_ITERATIONS and window.last_iteration >= window.first_iteration:
        return max(v[4] for v in row.values()) <= window.last_iteration
    if window.end_ns:
        return max(v[2] for v in row.values()) <= window.end_ns
    return True


def _iteration(row: Mapping[int, tuple]) -> int:
    return max(v[4] for v in row.values())


class CollectiveState:
    """One job's collectives joined by (group, seq); bounded (``CollectivesConfig``)."""

    def __init__(self, config: CollectivesConfig = CollectivesConfig(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock                 # step 5's settling (hang_settle_s)
        self.config = config
        self.groups: dict[str, _Group] = {}
        self.now_ns: dict[int, int] = {}    # rank -> its clock at its latest record
        self.hosts: dict[int, str] = {}     # rank -> host (the waiting graph tells NIC from NVLink)
        self.stages: dict[int, int] = {}    # rank -> pipeline stage, when the resource says (step 3)
        self.records = 0
        self.step_flows = 0                 # step 6: flow steps held (bounded by max_step_flows)
        self.steps_dropped = 0              # records whose steps were not kept (bound reached)
        self.grids = stack_grid.GridBook(config.stack_grid)   # Mycroft §5 evidence (analyzer/stack_grid.py)
        self.states_dropped = 0             # channel states over max_states_per_group
        # step 5c: the hang reported while stuck: (group, seq, the rank named as never entered or -1, the seqs
        # marked with it)
        self.hung: tuple[str, int, int, list] | None = None
        # step 5: stuck rows settling: ((members, ranks in flight), first seen on the analyzer clock)
        self._seen_rows: dict[tuple[str, int], tuple] = {}
        self.samples: dict[int, collections.deque] = {}   # rank -> Table 4 states of its latest channel states

    def _release(self, row: Mapping[int, tuple]) -> None:
        self.step_flows -= sum(v[9].flows for v in row.values() if v[9] is not None)

    def absorb(self, rank: int, rec: records_pb2.CollectiveWindow) -> None:
        cfg = self.config
        if rec.now_ns > self.now_ns.get(rank, 0):
            self.now_ns[rank] = rec.now_ns
        if rec.resource.host and rank not in self.hosts:
            self.hosts[rank] = rec.resource.host
        if rec.resource.coords.pp_size > 1:
            self.stages[rank] = rec.resource.coords.pp
        if rec.dumps:
            self.grids.absorb(rank, rec.dumps)
        ids = []
        for g in rec.groups:
            grp = self.groups.get(g.id)
            if grp is None and len(self.groups) < cfg.max_groups:
                grp = self.groups[g.id] = _Group(tuple(g.members))
            ids.append(grp)
        for r in rec.records:
            grp = ids[r.group] if r.group < len(ids) else None
            if grp is None or r.seq <= grp.judged and r.seq not in grp.seqs:
                continue   # untracked group, or a collective already judged and forgotten
            row = grp.seqs.get(r.seq)
            if row is None:
                row = grp.seqs[r.seq] = {}
                if len(grp.seqs) > cfg.max_seqs_per_group:
                    oldest = min(grp.seqs)
                    self._release(grp.seqs.pop(oldest))
                    grp.forget(oldest)
            old = row.get(rank)
            if old is None or not old[3]:   # a completion replaces the state record
                steps = None
                if r.end_ns and len(r.step_index):
                    if self.step_flows + len(r.step_index) <= cfg.max_step_flows:
                        steps = StepColumns.of(r)
                    else:
                        self.steps_dropped += 1
                if old is not None:
                    self._release({rank: old})
                if steps is not None:
                    self.step_flows += steps.flows
                row[rank] = (r.op, r.bytes, r.enqueue_ns, r.end_ns, r.iteration, r.ring_steps, r.ring_next,
                             r.send_busy_ns, r.recv_wait_ns, steps)
            self.records += 1
        if rec.states:
            self._absorb_states(rank, rec, ids)

    def _absorb_states(self, rank: int, rec: records_pb2.CollectiveWindow, ids: list) -> None:
        """Step 5b's input: the newest state per (group, seq, rank, channel), bounded; the Table 4 state of
        each into the rank's samples (slow-link evidence)."""
        cfg = self.config
        sample = self.samples.get(rank)
        if sample is None:
            sample = self.samples[rank] = collections.deque(maxlen=cfg.state_samples)
        st = channel_states.table4([x.gpu_ready for x in rec.states], [x.rdma_transmitted for x in rec.states],
                                   [x.rdma_done for x in rec.states], [x.total_chunks for x in rec.states])
        sample.extend(st.tolist())
        for x in rec.states:
            grp = ids[x.group] if x.group < len(ids) else None
            if grp is None or x.seq <= grp.judged and x.seq not in grp.seqs:
                continue    # untracked group, or a collective judged (completed) already
            held = grp.states.setdefault(x.seq, {})
            key = (rank, x.channel)
            old = held.get(key)
            if old is not None and old[2] > x.time_ns:
                continue    # an older sample than the one held
            if old is None:
                if grp.n_states >= cfg.max_states_per_group:
                    self.states_dropped += 1
                    continue
                grp.n_states += 1
            held[key] = (rank, x.channel, x.time_ns, x.total_chunks, x.gpu_ready, x.rdma_transmitted, x.rdma_done,
                         x.stuck_ns, x.peer)

    # ------------------------------------------------------------ steps 1-4
    def late_starts(self, job_id: str, window: records_pb2.Window,
                    iterations: Mapping[int, float] | None = None, step_ns: float = 0.0) -> list[Finding]:
        """Steps 1-4 and the waiting graph's slow links over the collectives completed since the last call."""
        cfg = self.config
        out: list[Finding] = []
        judged: list = []      # (group, members, seq, row) for the waiting graph
        for gid, grp in self.groups.items():
            members = set(grp.members)
            done = []
            for s in sorted(x for x in grp.seqs if x > grp.judged):
                row = grp.seqs[s]
                if not (members <= set(row) and all(row[m][3] for m in members)):
                    break   # judge a prefix without holes: later records may still be on their way
                if not _in_window(row, window):
                    break   # a later window's (records arrive ahead of the windows; a replay has them all)
                done.append(s)
            if not done:
                continue
            grp.judged = done[-1]
            if len(members) < 2:
                continue
            if len({self.stages.get(m, -1) for m in members}) > 1:   # spans pipeline stages: step 3
                judged += [(gid, grp.members, s, grp.seqs.pop(s)) for s in done]
                for s_ in done:
                    grp.forget(s_)
                continue
            transfer, first_late = [], {}
            late_of: dict[int, list[float]] = collections.defaultdict(list)   # significant latenesses
            waits_of: dict[int, list[float]] = collections.defaultdict(list)
            ranks = sorted(members)
            # the share is read on this window's own collectives when it has enough: a backlog judged at
            # once (records that arrived after the previous window's analysis) must not dilute it
            basis = [x for x in done if _iteration(grp.seqs[x]) >= window.first_iteration] \
                if window.kind == records_pb2.WINDOW_KIND_ITERATIONS else done
            if len(basis) < cfg.min_collectives:
                basis = done
            basis_set = set(basis)
            # step 1 for every collective at once: (collectives x members) waits, the last entrant waits
            # least, its lateness = the others' median wait minus its own (one sort, not a median per row)
            all_waits = np.array([[grp.seqs[s][m][3] - grp.seqs[s][m][2] for m in ranks] for s in done],
                                 dtype=np.float64)
            last = np.argmin(all_waits, axis=1)
            lateness_all = np.median(np.sort(all_waits, axis=1)[:, 1:], axis=1) - all_waits.min(axis=1)
            # step 3b: (rank, position of the collective in its iteration) -> (iteration, lateness, seq)
            at_position: dict[tuple[int, int], list[tuple[int, float, int]]] = collections.defaultdict(list)
            # step 3d: (rank, position) -> its latenesses of min_late_ms or more, and the others' waits then
            last_at: dict[tuple[int, int], list[tuple[int, float, int]]] = collections.defaultdict(list)
            last_waits: dict[tuple[int, int], dict[int, list[float]]] = collections.defaultdict(
                lambda: collections.defaultdict(list))
            per_position: collections.Counter = collections.Counter()
            # step 3e (pairs): position -> [(d: how late ranks[0] entered against ranks[1], ns; seq)]
            paired: dict[int, list[tuple[float, int]]] = collections.defaultdict(list)
            basis_its: set[int] = set()
            position, prev_it = 0, None
            for k, s in enumerate(done):
                row = grp.seqs[s]
                waits = all_waits[k]
                i = int(last[k])                                    # step 1: the last entrant
                lateness = float(lateness_all[k])
                it_now = _iteration(row)
                position = position + 1 if it_now == prev_it else 0
                prev_it = it_now
                if len(members) >= 3 and cfg.last_pool_iterations:     # step 3f, backlog included
                    self._add_up(grp, it_now, ranks[i], lateness)
                if s in basis_set:
                    basis_its.add(it_now)
                    per_position[position] += 1
                    if len(members) == 2:
                        paired[position].append((lateness if i == 0 else -lateness, s))
                    if len(members) >= 3 and lateness >= cfg.min_late_ms * 1e6:
                        last_at[(ranks[i], position)].append((it_now, lateness, s))
                        for j, m in enumerate(ranks):
                            if j != i:
                                last_waits[(ranks[i], position)][m].append(float(waits[j] - waits[i]))
                transfer.append((row[ranks[i]][0], row[ranks[i]][1], float(waits[i])))    # step 2
                # one collective counts against its last entrant only when it was clearly late:
                # some member is always last, by scheduler noise on a busy host
                if s in basis_set and lateness >= max(cfg.min_late_ms * 1e6, cfg.late_factor * waits[i]):
                    late_of[ranks[i]].append(lateness)
                    first_late.setdefault(ranks[i], (s, row[ranks[i]][0]))
                    at_position[(ranks[i], position)].append((it_now, lateness, s))
                    for j, m in enumerate(ranks):
                        if j != i:
                            waits_of[m].append(float(waits[j] - waits[i]))
            med_transfer = float(np.median([t for _, _, t in transfer]))
            found = False
            named: set[int] = set()
            clearly = lambda typical: (typical >= cfg.late_factor * med_transfer       # noqa: E731
                                       and typical >= cfg.min_late_ms * 1e6)
            if len(basis) >= cfg.min_collectives:
                for r, lates in late_of.items():
                    typical = float(np.median(lates))   # robust to one start-up skew of seconds
                    if (len(lates) / len(basis) >= cfg.min_share and clearly(typical)
                            and (len(members) > 2 or _pair_beyond_chance(len(lates), len(basis), cfg.last_alpha))):
                        out += self._late_finding(job_id, window, gid, grp, r, lates, len(basis), med_transfer,
                                                  first_late[r], waits_of, iterations)
                        found = True
                        named.add(r)
            if len(members) >= 3 and len(basis_its) >= cfg.min_collectives:
                # step 3b: late to the same collective of most iterations (one sync point a step)
                for (r, pos), evs in sorted(at_position.items(), key=lambda kv: (-len(kv[1]), kv[0])):
                    its_late = {e[0] for e in evs}
                    typical = float(np.median([e[1] for e in evs]))
                    if r in named or len(its_late) / len(basis_its) < cfg.min_share or not clearly(typical):
                        continue
                    if not self._synchronises_only_in(r, gid):
                        continue   # its lateness may be inherited from a partner of another group
                    first = min(evs, key=lambda e: e[2])
                    out += self._late_finding(job_id, window, gid, grp, r, late_of[r], len(basis), med_transfer,
                                              (first[2], grp.seqs[first[2]][r][0]), waits_of, iterations,
                                              {"per_iteration": True, "position": pos,
                                               "late_iterations": len(its_late), "iterations": len(basis_its),
                                               "median_late_ms": round(typical / 1e6, 3)})
                    found = True
                    named.add(r)
            if len(members) >= 3 and len(basis_its) >= cfg.min_collectives:
                # step 3d: last to the same collective of most iterations by more than chance allows
                tests = len(members) * max(len(per_position), 1)
                for (r, pos), evs in sorted(last_at.items(), key=lambda kv: (-len(kv[1]), kv[0])):
                    n, k = per_position[pos], len(evs)
                    if r in named or k < cfg.min_share * n:
                        continue
                    p = _binomial_tail(k, n, 1.0 / len(members))
                    if p > cfg.last_alpha / tests or not self._synchronises_only_in(r, gid):
                        continue
                    first = min(evs, key=lambda e: e[2])
                    out += self._late_finding(job_id, window, gid, grp, r, [e[1] for e in evs], len(basis),
                                              med_transfer, (first[2], grp.seqs[first[2]][r][0]),
                                              last_waits[(r, pos)], iterations,
                                              {"consistently_last": True, "position": pos, "last_iterations": k,
                                               "iterations": n, "p_value": float(f"{p:.3g}")})
                    found = True
                    named.add(r)
            if len(members) >= 3 and len(basis_its) >= cfg.min_collectives:
                # step 3f: the latest member of most of the group's recent iterations, across windows
                for r, k, n, p in self._latest_over_windows(grp, gid, basis_its, named):
                    now = [e for (r_, _), evs in last_at.items() if r_ == r for e in evs]
                    if not now:     # the latest only by lateness judged in an earlier call (a split iteration)
                        continue
                    waits: dict[int, list[float]] = collections.defaultdict(list)
                    for (r_, pos_), per in last_waits.items():
                        if r_ == r:
                            for m_, w_ in per.items():
                                waits[m_] += w_
                    first = min(now, key=lambda e: e[2])
                    out += self._late_finding(job_id, window, gid, grp, r, [e[1] for e in now], len(basis),
                                              med_transfer, (first[2], grp.seqs[first[2]][r][0]), waits, iterations,
                                              {"consistently_last": True, "accumulated": True,
                                               "last_iterations": k, "iterations": n, "p_value": float(f"{p:.3g}")})
                    found = True
                    named.add(r)
            if len(members) == 2 and len(basis_its) >= cfg.min_collectives:
                # step 3e: the member of a pair late to the same collective of its iterations (signed ranks)
                tests = 2 * max(len(paired), 1)
                for pos, rows in sorted(paired.items()):
                    if len(rows) < cfg.min_collectives:
                        continue
                    d = np.array([x for x, _ in rows], dtype=np.float64)
                    for sign, r in ((1.0, ranks[0]), (-1.0, ranks[1])):
                        lates = [(sign * x, s_) for x, s_ in rows if sign * x >= cfg.min_late_ms * 1e6]
                        if (r in named or len(lates) < cfg.min_share * len(rows)
                                or float(np.median([x for x, _ in lates])) < max(cfg.min_late_ms * 1e6, med_transfer)):
                            continue
                        p = _signed_rank_tail(sign * d)
                        if p > cfg.last_alpha / tests:
                            continue
                        other = ranks[1] if r == ranks[0] else ranks[0]
                        first = min(s_ for _, s_ in lates)
                        out += self._late_finding(job_id, window, gid, grp, r, [x for x, _ in lates], len(basis),
                                                  med_transfer, (first, grp.seqs[first][r][0]),
                                                  {other: [x for x, _ in lates]}, iterations,
                                                  {"paired": True, "position": pos, "last_iterations": len(lates),
                                                   "iterations": len(rows), "p_value": float(f"{p:.3g}")})
                        found = True
                        named.add(r)
            if len(members) >= 3 and step_ns > 0 and late_of:
                # step 3c: an intermittent late start (a stall one step in five)
                for r, first, lates in self._intermittent(late_of, named, first_late, at_position, basis_its,
                                                          iterations, step_ns, gid):
                    out += self._late_finding(job_id, window, gid, grp, r, lates, len(basis), med_transfer,
                                              first, waits_of, iterations,
                                              {"intermittent": True, "late_iterations": len(lates),
                                               "iterations": len(basis_its)})
                    found = True
                    named.add(r)
            if not found:
                slow = self._slow_transfer(job_id, window, gid, grp, transfer)
                if slow is not None:
                    out.append(slow)
            for op, nbytes, t in transfer:   # step 4's history, after the check
                h = grp.transfer_hist.setdefault((op, int(nbytes).bit_length()), collections.deque(maxlen=256))
                h.append(t)
            for s in done:
                judged.append((gid, grp.members, s, grp.seqs.pop(s)))
                grp.forget(s)
        if judged:
            out += self._slow_links(job_id, window, judged, iterations, step_ns)
        return out

    def _slow_links(self, job_id, window, judged, iterations, step_ns) -> list[Finding]:
        """Steps 6-7: the provenance rating on the collectives with step records, the ring-summary
        waiting graph on the others (on all of them when the rating named nothing); a rank named by
        step 6 is not named again by step 7."""
        cfg = self.config
        stepped, plain = [], []
        for gid, members, seq, row in judged:
            if len(members) >= 2 and all(m in row and row[m][9] is not None for m in members):
                stepped.append((gid, members, seq, {m: row[m][9] for m in members}))
            else:
                plain.append((gid, members, seq, row))
        out: list[Finding] = []
        if stepped:
            its = [float(v) for v in (iterations or {}).values() if v]
            blocks = provenance.collect(stepped, self.hosts)
            out = provenance.root_cause(job_id, window, blocks, self.hosts, float(np.median(its)) if its else None,
                                        cfg.provenance, step_ns)
        for _, _, _, row in judged:
            self._release(row)
        if not out:     # the rating named nothing: the ring summary of the same records may (step 7)
            plain = judged
        if plain:
            named = {s.rank for f in out for s in f.suspects}
            out += [f for f in waiting_graph.slow_links(job_id, window, plain, self.hosts, iterations,
                                                        cfg.waiting_graph, step_ns)
                    if not named & {s.rank for s in f.suspects}]
        return self.state_evidence(out) if self.samples else out

    def _add_up(self, grp: _Group, iteration: int, last: int, lateness: float) -> None:
        """Step 3f: one judged collective into its iteration's latenesses; an iteration that ended goes
        into the pool as its latest member (-1: nobody late by ``min_late_ms``)."""
        cfg = self.config
        if grp.open_iteration is not None and grp.open_iteration[0] != iteration:
            grp.last_pool.append(_latest(grp.open_iteration))
            while len(grp.last_pool) > cfg.last_pool_iterations:
                grp.last_pool.popleft()
            grp.open_iteration = None
        if grp.open_iteration is None:
            grp.open_iteration = (iteration, collections.Counter())
        if lateness >= cfg.min_late_ms * 1e6:
            grp.open_iteration[1][last] += lateness

    def _latest_over_windows(self, grp: _Group, gid: str, basis_its: set[int], named: set[int]):
        """Step 3f: (rank, k, n, p) for each rank the latest member of k of the pool's n iterations by
        more than chance allows, where the pool reaches beyond this window and the rank is the latest
        in at least n_w/m of this window's n_w iterations in it."""
        cfg, m = self.config, len(grp.members)
        pool = list(grp.last_pool)
        if grp.open_iteration is not None and grp.open_iteration[0] in basis_its:   # this window's last
            pool = (pool + [_latest(grp.open_iteration)])[-cfg.last_pool_iterations:]
        n = len(pool)
        mine = [r for it, r in pool if it in basis_its]
        if n <= len(mine) or not mine:
            return      # nothing beyond this window: 3d's own
        for r, k in collections.Counter(r for _, r in pool if r >= 0).most_common():
            now = mine.count(r)
            if r in named or now == 0 or now * m < len(mine):
                continue
            p = _binomial_tail(k, n, 1.0 / m)
            if p <= cfg.last_alpha / m and self._synchronises_only_in(r, gid):
                yield r, k, n, p

    def _synchronises_only_in(self, rank: int, gid: str) -> bool:
        """Step 3b: ``gid`` is the only group of two or more that ``rank`` synchronises in, and it is
        in no pipeline (pure data parallel, FSDP): nothing else can have made it late."""
        if rank in self.stages:
            return False
        return all(g == gid for g, grp in self.groups.items() if len(grp.members) > 1 and rank in grp.members)

    def _intermittent(self, late_of, named, first_late, at_position, basis_its, iterations, step_ns, gid):
        """Step 3c: the rank whose clear latenesses are the group's story though under ``min_share`` (late
        in a few iterations only): yields (rank, first late (seq, op), its latenesses)."""
        cfg = self.config
        total = {r: float(sum(v)) for r, v in late_of.items()}
        everyone = sum(total.values())
        for r, lates in late_of.items():
            if r in named or not self._synchronises_only_in(r, gid):
                continue
            its_late = {e[0] for (rr, _), evs in at_position.items() if rr == r for e in evs}
            it = max(float((iterations or {}).get(r, len(basis_its) or 1)), 1.0)
            big = [x for x in lates if x >= cfg.intermittent_min_step * step_ns]
            if (len(its_late) >= 2 and len(big) >= 2 and total[r] >= cfg.intermittent_share * everyone
                    and sum(big) / it >= cfg.intermittent_min_pct / 100 * step_ns):
                yield r, first_late[r], big

    def _late_finding(self, job_id, window, gid, grp, rank, lates, judged, transfer, first,
                      waits_of, iterations, extra: dict | None = None) -> list[Finding]:
        it = max(float((iterations or {}).get(rank, 1.0)), 1.0)
        seq, op = first
        n, late_total, typical = len(lates), float(sum(lates)), float(np.median(lates))
        ev = {"group": gid, "op": op, "seq": seq, "late_collectives": n, "judged": judged,
              "median_late_ms": round(typical / 1e6, 3), "transfer_ms": round(transfer / 1e6, 3),
              "function": f"late start to {op} (group {gid}, seq {seq})", "late_start": True, **(extra or {})}
        # in a group of two the late member is compared with its partner: the pair comparison
        # (``individual.py``'s, the same two ranks), not a majority of peers
        compared = "pair" if len(grp.members) == 2 else "peers"
        culprit = Finding(
            level=LEVEL, kind="late_start", job_id=job_id, window=window, scope=Scope(group="collective"),
            suspects=(SuspectRank(rank, typical / max(transfer, 1.0), ev, impact_ns=late_total / it,
                                  role=CULPRIT),),
            severity=typical / max(transfer, 1.0), comparison=compared,
            evidence={"communication": False, "group": gid, "seq": seq, "op": op, "rule": "Mycroft §5 late start",
                      "members": list(grp.members)})
        waiters = tuple(
            SuspectRank(m, 1.0, {"waited_ms": round(sum(w) / len(w) / 1e6, 3), "group": gid, "seq": seq,
                                 "ratio": 2.0}, impact_ns=sum(w) / it, role=WAITER, waited_for=rank)
            for m, w in sorted(waits_of.items()) if m != rank and w)
        out = [self.grids.attach(culprit, gid, 0, grp.members)]
        if waiters:
            out.append(Finding(level=LEVEL, kind="collective_wait", job_id=job_id, window=window,
                               scope=Scope(group="collective"), suspects=waiters, comparison=compared,
                               severity=1.0, evidence={"communication": True, "group": gid, "seq": seq,
                                                       "waited_for": rank}))
        return out

    def _slow_transfer(self, job_id, window, gid, grp, transfer) -> Finding | None:
        worst = None
        for (op, size), h in grp.transfer_hist.items():
            now = [t for o, b, t in transfer if o == op and int(b).bit_length() == size]
            if len(h) < 8 or len(now) < self.config.min_collectives:
                continue
            base, cur = float(np.median(h)), float(np.median(now))
            if base > 0 and cur >= self.config.slow_factor * base and (worst is None or cur / base > worst[0]):
                worst = (cur / base, op, size, base, cur)
        if worst is None:
            return None
        ratio, op, size, base, cur = worst
        # informational: no rank is late, and gloo gives no per-link record to name a link
        return Finding(level=LEVEL, kind="slow_transfer", job_id=job_id, window=window,
                       scope=Scope(group="collective"), severity=ratio, informational=True, comparison="own_history",
                       evidence={"communication": True, "group": gid, "op": op, "size_class": size - 1,
                                 "transfer_ms": round(cur / 1e6, 3), "usual_ms": round(base / 1e6, 3),
                                 "members": list(grp.members), "rule": "Mycroft §5 slow transfer"})

    # ------------------------------------------------------------ step 5
    def hangs(self, job_id: str, window: records_pb2.Window, ended: set[int] = frozenset(),
              final: bool = False) -> list[Finding]:
        """Steps 5 and 5b, for every group: the first-stuck rank of a collective others wait in, or the
        link or NIC of a collective every member is stuck in. ``final``: every record has been read (the
        end of a replay): nothing to settle."""
        cfg = self.config
        out = []
        timeout = int(cfg.hang_timeout_s * 1e9)
        stuck = []        # (gid, grp, seq, row, waiting) of every collective in flight past the timeout
        # step 5: a member stuck in flight elsewhere waits there; it is not the root of this one. "Stuck"
        # there from half the timeout: the members of a chain of groups entered their collectives moments
        # apart, and each one's wait is read on its own clock from its latest records (a two-group job's
        # DP peer, in flight in its DP all-reduce for the hung rank, was a few ms under the timeout there
        # when its TP partner crossed it waiting for the peer, and was named beside the hung rank)
        elsewhere: dict[int, set[str]] = collections.defaultdict(set)
        for gid, grp in self.groups.items():
            for seq in sorted(grp.seqs, reverse=True)[:4]:   # the newest few: a hang is at the front
                row = grp.seqs[seq]
                waiting = {r: self.now_ns.get(r, 0) - v[2] for r, v in row.items() if not v[3]}
                for r, w in waiting.items():
                    if w >= ELSEWHERE_SHARE * timeout:
                        elsewhere[r].add(gid)
                if seq not in grp.reported_hang and waiting and max(waiting.values()) >= timeout:
                    stuck.append((gid, grp, seq, row, waiting))
        if self.hung is not None:     # step 5c: the hang reported is still there: the rest follows from it
            gid0, seq0, named0, marked = self.hung
            g0 = self.groups.get(gid0)
            if g0 is not None and seq0 in g0.seqs and not all(v[3] for v in g0.seqs[seq0].values()):
                if named0 >= 0 and (named0 in g0.seqs[seq0] or elsewhere.get(named0, set()) - {gid0}):
                    # the rank named as never entered did enter, or waits in another stuck collective
                    # (its records came late): judge again
                    for g_, s_ in marked:
                        g_.reported_hang.discard(s_)
                    self.hung = None
                    return self.hangs(job_id, window, ended, final)
                for gid, grp, seq, _, _ in stuck:
                    grp.reported_hang.add(seq)
                    marked.append((grp, seq))
                return self.grids.updates()
            self.hung = None
        found = []        # (the longest wait, gid, seq, finding)
        done: set[str] = set()
        for gid, grp, seq, row, waiting in stuck:
            if gid in done:
                continue      # one finding per group: the newest stuck seq
            absent = [m for m in grp.members if m not in row and m not in ended]
            if absent:
                roots = [m for m in absent if not elsewhere.get(m, set()) - {gid}]
                snap = self._snapshot(grp, seq)
                if snap is not None and roots:
                    ready = {m: channel_states.receiver_ready(snap, m) for m in roots}
                    sure = [m for m in roots if ready[m] is False]       # its upstream: receiver not ready
                    roots = sure or [m for m in roots if ready[m] is None]   # True: it entered, records late
                    if roots and not final and self._settling(gid, seq, row, elsewhere):
                        continue  # judged once the row and the ranks in flight held still a call
                if not roots:
                    continue  # every absent member waits in another stuck collective (or entered): not here
                f = self._never_entered(job_id, window, gid, grp, seq, row, waiting, absent, roots)
            elif len(row) == len(grp.members):
                f = self._link_hang(job_id, window, gid, grp, seq, row, waiting)     # step 5b
                if f is None:
                    continue  # no states, or none stuck at the network: not localised
            else:
                continue      # the members not in the row ended (their final batch): nothing to name
            done.add(gid)
            found.append((max(waiting.values()), gid, seq, f))
        if found:
            # step 5c (Mycroft §5.2: a single responsible group): the collective stuck longest (on the
            # ranks' own clocks) is the hang; the others stuck since are its consequences
            _, gid, seq, f = max(found, key=lambda x: (x[0], x[1]))
            named = f.suspects[0].rank if f.evidence.get("absent_ranks") else -1    # step 5's, not 5b's
            self.hung = (gid, seq, named, [(grp, s_) for _, grp, s_, _, _ in stuck])
            for _, grp, seq_, _, _ in stuck:
                grp.reported_hang.add(seq_)
            out.append(self.grids.attach(f, gid, seq, self.groups[gid].members))   # its stack grid, when in
        return out + self.grids.updates()   # stalls issued again once their stack grid is in

    def _settling(self, gid: str, seq: int, row, elsewhere) -> bool:
        """Step 5: True the first call a stuck row is seen with these members and these ranks in flight
        (windows may still be coming: a simulated run's last chunk at once, one rank's window after
        another's); False once both held still between two calls."""
        key, now, t = (gid, seq), (frozenset(row), frozenset(elsewhere)), self._clock()
        seen = self._seen_rows.get(key)
        if seen is not None and seen[0] == now:
            return t - seen[1] < self.config.hang_settle_s
        if len(self._seen_rows) >= 1024:
            self._seen_rows.clear()
        self._seen_rows[key] = (now, t)
        return True

    def _snapshot(self, grp: _Group, seq: int) -> channel_states.Snapshot | None:
        held = grp.states.get(seq)
        return channel_states.Snapshot.of(held.values()) if held else None

    def _never_entered(self, job_id, window, gid, grp, seq, row, waiting, absent, roots) -> Finding:
        """Step 5: the first-stuck rank of the members that never entered (and wait nowhere else)."""
        cfg = self.config
        last_seen = {m: max((s for s, rw in grp.seqs.items() if m in rw), default=grp.judged) for m in roots}
        first = min(roots, key=lambda m: (last_seen[m], m))
        op = next(iter(row.values()))[0]
        waited = max(waiting.values())
        ev = {"group": gid, "seq": seq, "op": op, "last_seq": last_seen[first],
              "function": f"never entered {op} (group {gid}, seq {seq})", "waited_s": round(waited / 1e9, 3)}
        evidence = {"rule": "collective hang (Mycroft §4.3 timeout, §5 not started)", "group": gid,
                    "seq": seq, "op": op, "first_stuck_rank": first,
                    "waiting_ranks": sorted(waiting), "absent_ranks": absent,
                    "waited_s": round(waited / 1e9, 3), "hang_timeout_s": cfg.hang_timeout_s}
        snap = self._snapshot(grp, seq)
        if snap is not None:       # channel_states step 5: its upstream's channels to it
            line = channel_states.upstream_of(snap, first, int(cfg.state_stuck_s * 1e9))
            if line:
                ev["channel_states"] = evidence["channel_states"] = line
        suspects = (SuspectRank(first, waited / 1e9, ev, impact_ns=float(waited), role=CULPRIT),)
        return Finding(level=LEVEL, kind="stall", job_id=job_id, window=window, scope=Scope(group="collective"),
                       suspects=suspects, severity=waited / 1e9, job_impact_ns=float(waited), comparison="job",
                       evidence=evidence)

    def _link_hang(self, job_id, window, gid, grp, seq, row, waiting) -> Finding | None:
        """Step 5b: every member in flight; the channel states name the NIC or the link."""
        cfg = self.config
        snap = self._snapshot(grp, seq)
        if snap is None:
            return None
        root = channel_states.localise(snap, int(cfg.state_stuck_s * 1e9))
        if root is None:
            return None
        op = next(iter(row.values()))[0]
        waited = max(waiting.values())
        why = root.why()
        hw = "NIC" if root.element == "nic" else "link"
        ev = {"group": gid, "seq": seq, "op": op, "link": root.name, "hardware": hw,
              "src": root.rank, "dst": root.dst, "state": channel_states.STATES[root.state],
              "condition": channel_states.CONDITION[root.state], "stuck_s": round(root.stuck_ns / 1e9, 3),
              "function": root.short(), "why": f"{why} (group {gid}, seq {seq}, {op})",
              "waited_s": round(waited / 1e9, 3), "channel_states": why,
              "waiters": sorted(r for r in waiting if r != root.rank)}
        flows = [{"src": f.src, "dst": f.dst, "state": channel_states.STATES[f.state],
                  "progress": round(f.progress, 3), "stuck_s": round(f.stuck_ns / 1e9, 3)} for f in root.flows[:16]]
        return Finding(
            level=LEVEL, kind="stall", job_id=job_id, window=window, scope=Scope(group="collective"),
            suspects=(SuspectRank(root.rank, waited / 1e9, ev, impact_ns=float(waited), role=LINK),),
            severity=waited / 1e9, job_impact_ns=float(waited), comparison="job",
            evidence={"rule": "link hang (Mycroft §5.2 least-progress flow, §5.3 Table 4, sender vs receiver)",
                      "communication": True, "group": gid, "seq": seq, "op": op, "link": root.name,
                      "hardware": hw, "state": ev["state"], "stuck_s": ev["stuck_s"], "flows": flows,
                      "waiting_ranks": sorted(r for r in waiting if r != root.rank), "absent_ranks": [],
                      "waited_s": round(waited / 1e9, 3), "hang_timeout_s": cfg.hang_timeout_s,
                      "channel_states": why})

    def state_evidence(self, findings: list[Finding]) -> list[Finding]:
        """Slow links (steps 6-8): each named rank's recent Table 4 states, when there are any, as a line of
        its evidence (``channel_states``)."""
        out = []
        for f in findings:
            if f.kind != waiting_graph.KIND or not any(self.samples.get(s.rank) for s in f.suspects):
                out.append(f)
                continue
            sus = []
            for s in f.suspects:
                line = channel_states.share_line(np.fromiter(self.samples.get(s.rank, ()), dtype=np.int64))
                sus.append(dataclasses.replace(s, evidence={**s.evidence, "channel_states": line}) if line else s)
            out.append(dataclasses.replace(f, suspects=tuple(sus)))
        return out


def host_network(findings: list[Finding], hosts: Mapping[int, str], its: np.ndarray, steps: np.ndarray,
                 floor_ns: float, cfg: CollectivesConfig = CollectivesConfig()) -> list[Finding]:
    """Step 8: the slow-link findings of one host, each under ``floor_ns``, judged as the host's
    network by what their slow iterations cost the job. ``its``/``steps``: the window's
    iterations and the job's step in each (``job_pace.job_step_series``). Returns the host
    findings to add (none when no host qualifies)."""
    by_host: dict[str, list[Finding]] = collections.defaultdict(list)
    for f in findings:
        if f.kind != waiting_graph.KIND or not f.suspects or "slow_iterations" not in f.suspects[0].evidence:
            continue
        on = {hosts.get(s.rank, "") for s in f.suspects}
        if len(on) == 1 and "" not in on:
            by_host[on.pop()].append(f)
    out: list[Finding] = []
    if its.size == 0:
        return out
    qualify = {h: fs for h, fs in by_host.items()
               if len({s.rank for f in fs for s in f.suspects}) >= 2 and all(f.impact_ns < floor_ns for f in fs)}
    # one rank, or a finding that stands on its own (steps 6-7 name it), does not qualify; of the
    # rest, hosts downstream of the congested one are named in the same bursts with less evidence
    strength = {h: sum(float(f.impact_ns) for f in fs) for h, fs in qualify.items()}
    top = max(strength.values(), default=0.0)
    for host, fs in sorted(qualify.items()):
        if strength[host] < cfg.host_dominance * top:
            continue
        ranks = sorted({s.rank for f in fs for s in f.suspects})
        slow_its = {int(i) for f in fs for i in f.suspects[0].evidence["slow_iterations"]}
        slow = np.isin(its, list(slow_its))
        if not slow.any() or int((~slow).sum()) < cfg.host_min_clean:
            continue
        clean = float(np.median(steps[~slow]))
        excess = np.maximum(steps[slow] - clean, 0.0)
        impact = float(excess.sum()) / its.size
        ratios = [float(s.evidence.get("ratio", 0.0)) for f in fs for s in f.suspects]
        ev = {"host": host, "hardware": "host network", "link": f"network of {host}",
              "function": f"slow network of {host}", "ratio": round(float(np.median(ratios)), 3),
              "slow_iterations": sorted(slow_its), "clean_iterations": int((~slow).sum()),
              "slow_step_pct": round(100.0 * float(np.median(steps[slow])) / clean - 100.0, 2) if clean > 0 else 0.0,
              "ranks": ranks}
        out.append(Finding(
            level=LEVEL, kind=waiting_graph.KIND, job_id=fs[0].job_id, window=fs[0].window,
            scope=Scope(group="collective"), severity=ev["ratio"], comparison="peers", step_ns=fs[0].step_ns,
            suspects=tuple(SuspectRank(r, ev["ratio"], ev, impact_ns=impact, role=LINK) for r in ranks),
            evidence={"communication": True, "host": host, "hardware": "host network", "ranks": ranks,
                      "slow_iterations": sorted(slow_its), "clean_iterations": ev["clean_iterations"],
                      "slow_step_pct": ev["slow_step_pct"],
                      "rule": "host network (step 8): every slow link on one host, priced by its slow iterations"}))
    return out


__all__ = ["CollectiveState", "CollectivesConfig", "LEVEL", "host_network"]
