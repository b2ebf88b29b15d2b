"""One self-contained HTML incident report of a job (``trainscope report``).

Read from the local store (the :class:`~trainscope.analyzer.query.Query`
facade and the stores under it), drawn with plotly, its JavaScript inlined
once so the file opens anywhere without a network:

1. the job's verdict merged over its windows: state, confidence, suspects with
   their impact (s/iteration), the comparison used, next steps;
2. iteration time per rank over the windows (processor's iteration records);
3. a rank x window heatmap of the impact each rank was named with in that
   window's findings, rows grouped by host;
4. the top suspect's kernel CDFs against its peers' (ranks of the same TP and
   PP coordinates when there are any), each rebuilt from the stored
   ``(count, p50, p99)`` clusters as a lognormal mixture (ARGUS §6.2,
   ``analyzer/cdf.py``), over the windows since the verdict's onset;
5. the phases: each phase's time per iteration across ranks, the suspect marked.

plotly is an optional dependency (``pip install 'trainscope[report]'``),
imported only here.
"""
from __future__ import annotations

import dataclasses
import html
import os
import time
from typing import Any

import numpy as np

from trainscope.analyzer import cdf
from trainscope.analyzer.query import Query, QueryConfig
from trainscope.analyzer.query_model import RankInfo, VerdictView
from trainscope.proto.contracts import Signal
from trainscope.proto.errors import ConfigError

MAX_PEERS = 16
"""Peer CDFs drawn per kernel (more only hide each other)."""
MAX_KERNELS = 4
"""Kernels of the suspect whose CDFs are drawn."""
SUSPECT_COLOR = "#d62728"
PEER_COLOR = "rgba(90, 90, 90, 0.35)"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ReportConfig:
    store_path: str
    """The SQLite store the processor and analyzer wrote (``<home>/store.sqlite``)."""
    out: str
    """The HTML file to write."""
    job: str | None = None
    """Job id; None: the store's only job."""
    force: bool = False
    """Replace ``out`` when it exists (never otherwise)."""
    store_setting: str = "--store"

    def __post_init__(self) -> None:
        if not self.out:
            raise ConfigError("-o", self.out, "needs a file name")
        if os.path.isdir(self.out):
            raise ConfigError("-o", self.out, "is a directory; name the HTML file")
        if os.path.exists(self.out) and not self.force:
            raise ConfigError("-o", self.out, "exists; pass --force to replace it")
        parent = os.path.dirname(os.path.abspath(self.out))
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
            raise ConfigError("-o", self.out, f"cannot write in {parent}")


def _plotly():
    try:
        import plotly.graph_objects as go
        import plotly.offline
    except ImportError as exc:
        raise ConfigError("report", "plotly", "is not installed: pip install 'trainscope[report]'") from exc
    return go, plotly.offline


# ------------------------------------------------------------------ data
@dataclasses.dataclass(slots=True)
class ReportData:
    job: str
    verdict: VerdictView
    ranks: dict[int, RankInfo]
    iterations: dict[int, dict[int, float]]  # rank -> window -> mean s
    impact: dict[int, dict[int, float]]  # rank -> window -> max impact s/iteration
    phases: dict[str, dict[int, float]]  # phase -> rank -> s per iteration
    kernels: dict[str, dict[int, tuple[list, list, list]]]  # kernel -> rank -> (counts, p50 ns, p99 ns)
    suspect: int | None
    peers: list[int]


def collect(q: Query, job: str | None) -> ReportData:
    """Everything the report draws, from the store (numbered as in the module docstring)."""
    job = q.resolve_job(job)
    view = q.verdict(job)  # 1
    ranks = {r.rank: r for r in q.ranks(job).rows}
    records, diagnoses = q._open()
    iterations: dict[int, dict[int, float]] = {}
    for rec in records.records(Signal.ITERATIONS, job):  # 2
        iterations.setdefault(rec.resource.rank, {})[rec.window.index] = rec.mean_ns / 1e9
    impact: dict[int, dict[int, float]] = {}
    for d in diagnoses.diagnoses(job):  # 3
        if d.informational:
            continue
        for s in d.suspects:
            row = impact.setdefault(s.rank, {})
            row[d.window.index] = max(row.get(d.window.index, 0.0), s.impact_s)
    culprits = [s for s in view.suspects if s.role == "culprit"] or list(view.suspects)
    suspect = max(culprits, key=lambda s: s.impact_s).rank if culprits else None
    since = view.since_window if view.since_window is not None else 0
    kernels: dict[str, dict[int, tuple[list, list, list]]] = {}
    for rec in records.records(Signal.KERNELS, job):  # 4
        if rec.window.index < since:
            continue
        for k in rec.kernels:
            c = kernels.setdefault(k.kernel, {}).setdefault(rec.resource.rank, ([], [], []))
            for cl in k.clusters:
                if cl.count and cl.p50_ns > 0:
                    c[0].append(cl.count)
                    c[1].append(cl.p50_ns)
                    c[2].append(max(cl.p99_ns, cl.p50_ns))
    busy: dict[str, dict[int, float]] = {}
    for rec in records.records(Signal.PHASES, job):  # 5
        if rec.window.index >= since:
            for p in rec.phases:
                per = busy.setdefault(p.phase, {})
                per[rec.resource.rank] = per.get(rec.resource.rank, 0.0) + p.total_ns / 1e9
    n_its = _iterations_since(records, job, since)
    phases = {ph: {r: t / n_its[r] for r, t in per.items() if n_its.get(r)} for ph, per in busy.items()}
    peers = _peers(suspect, ranks)
    return ReportData(job=job, verdict=view, ranks=ranks, iterations=iterations, impact=impact,
                      phases=phases, kernels=kernels, suspect=suspect, peers=peers)


def _iterations_since(records, job: str, since: int) -> dict[int, int]:
    """Iterations each rank completed in windows >= ``since`` (phase totals become time per iteration)."""
    out: dict[int, int] = {}
    for rec in records.records(Signal.ITERATIONS, job):
        if rec.window.index >= since:
            out[rec.resource.rank] = out.get(rec.resource.rank, 0) + len(rec.marks)
    return out


def _peers(suspect: int | None, ranks: dict[int, RankInfo]) -> list[int]:
    """Ranks doing the suspect's work: same TP and PP coordinates, else every other rank."""
    if suspect is None or suspect not in ranks:
        return sorted(r for r in ranks if r != suspect)
    me = ranks[suspect]
    same = [r for r, i in ranks.items() if r != suspect and (i.tp, i.pp) == (me.tp, me.pp)]
    return sorted(same or (r for r in ranks if r != suspect))


# ------------------------------------------------------------------ figures
def _layout(fig, title: str, **kw) -> Any:
    fig.update_layout(title=title, template="plotly_white", height=kw.pop("height", 420),
                      margin=dict(l=70, r=30, t=60, b=60), **kw)
    return fig


def fig_iterations(go, d: ReportData):
    fig = go.Figure()
    for rank in sorted(d.iterations):
        xs = sorted(d.iterations[rank])
        hot = rank == d.suspect
        fig.add_trace(go.Scatter(
            x=xs, y=[d.iterations[rank][w] for w in xs], mode="lines", name=f"rank {rank}",
            line=dict(color=SUSPECT_COLOR if hot else None, width=3 if hot else 1),
            opacity=1.0 if hot else 0.6))
    return _layout(fig, "Iteration time per rank (mean per window)", xaxis_title="window",
                   yaxis_title="iteration time (s)", showlegend=len(d.iterations) <= 32)


def fig_heatmap(go, d: ReportData):
    rows = sorted(d.ranks or d.iterations, key=lambda r: (d.ranks[r].host if r in d.ranks else "", r))
    windows = sorted({w for r in d.iterations.values() for w in r} | {w for r in d.impact.values() for w in r})
    z = np.array([[d.impact.get(r, {}).get(w, 0.0) for w in windows] for r in rows])
    labels = [f"{d.ranks[r].host if r in d.ranks else '?'} / rank {r}" for r in rows]
    fig = go.Figure(go.Heatmap(z=z, x=windows, y=labels, colorscale="Reds", zmin=0,
                               colorbar=dict(title="s/iteration"),
                               hovertemplate="%{y}<br>window %{x}<br>impact %{z:.4f} s/iteration<extra></extra>"))
    return _layout(fig, "Impact each rank was named with, per window (rows grouped by host)",
                   xaxis_title="window", height=max(360, 18 * len(rows) + 120),
                   yaxis=dict(autorange="reversed", title="host / rank"))


def fig_kernel_cdfs(go, d: ReportData) -> list:
    if d.suspect is None:
        return []
    mine = {k: per[d.suspect] for k, per in d.kernels.items() if d.suspect in per and per[d.suspect][0]}
    flagged = list(d.verdict.kernels)
    # the verdict's kernels first, then the suspect's busiest kernels
    order = [k for k in flagged if k in mine] + sorted(
        (k for k in mine if k not in flagged), key=lambda k: -float(np.dot(mine[k][0], mine[k][1])))
    figs = []
    for kernel in order[:MAX_KERNELS]:
        peers = [r for r in d.peers if r in d.kernels[kernel] and d.kernels[kernel][r][0]][:MAX_PEERS]
        dists = [(r, d.kernels[kernel][r]) for r in [*peers, d.suspect]]
        lo, hi = cdf.support(np.concatenate([x[1] for _, x in dists]), np.concatenate([x[2] for _, x in dists]))
        grid = cdf.log_grid(lo, hi, 256)
        fig = go.Figure()
        for r, (counts, p50, p99) in dists:
            hot = r == d.suspect
            fig.add_trace(go.Scatter(
                x=grid / 1e6, y=cdf.mixture_cdf(counts, p50, p99, grid), mode="lines",
                name=f"rank {r}" + (" (suspect)" if hot else " (peer)"),
                line=dict(color=SUSPECT_COLOR if hot else PEER_COLOR, width=3 if hot else 1.5)))
        figs.append(_layout(fig, f"{kernel}: rank {d.suspect} against {len(peers)} peers",
                            xaxis=dict(type="log", title="kernel duration (ms)"),
                            yaxis=dict(title="CDF", range=[0, 1.02]), height=380))
    return figs


def fig_phases(go, d: ReportData):
    fig = go.Figure()
    for phase in sorted(d.phases):
        per = d.phases[phase]
        fig.add_trace(go.Box(y=list(per.values()), name=phase, boxpoints="all", jitter=0.4,
                             marker=dict(color="#1f77b4", size=4), line=dict(width=1),
                             text=[f"rank {r}" for r in per], showlegend=False))
        if d.suspect in per:
            fig.add_trace(go.Scatter(x=[phase], y=[per[d.suspect]], mode="markers", showlegend=False,
                                     marker=dict(color=SUSPECT_COLOR, size=12, symbol="diamond"),
                                     name=f"rank {d.suspect}"))
    marked = f" (diamond: rank {d.suspect})" if d.suspect is not None else ""
    return _layout(fig, f"Phase time per iteration across ranks{marked}",
                   yaxis_title="time per iteration (s)")


# ------------------------------------------------------------------ page
CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:1200px;color:#222}
h1{font-size:1.6em;margin-bottom:0} .sub{color:#666;margin-top:4px}
.state{display:inline-block;padding:2px 10px;border-radius:4px;color:#fff;font-weight:600}
.healthy{background:#2ca02c}.degraded{background:#ff7f0e}.stalled{background:#d62728}.unknown{background:#7f7f7f}
table{border-collapse:collapse;margin:8px 0 16px} td,th{border-bottom:1px solid #ddd;padding:4px 10px;text-align:left}
th{background:#f5f5f5} code{background:#f2f2f2;padding:1px 4px;border-radius:3px}
section{margin-top:28px}
"""


def _next_steps(d: ReportData) -> list[str]:
    v, job = d.verdict, d.job
    steps = []
    if d.suspect is not None:
        host = d.ranks[d.suspect].host if d.suspect in d.ranks else ""
        steps.append(f"Look at rank {d.suspect}'s kernels against its peers: "
                     f"<code>trainscope query kernels --job {html.escape(job)} --rank {d.suspect}</code>")
        if host:
            steps.append(f"Check host <b>{html.escape(host)}</b> (GPU clocks and temperature, NIC counters, "
                         f"other tenants); the runbook's section for the firing alert says how.")
        steps.append(f"Open rank {d.suspect}'s Perfetto trace beside a healthy peer's"
                     + (f" (rank {d.peers[0]})" if d.peers else "")
                     + ": <code>&lt;perfetto-url&gt;/" + html.escape(job) + f"/rank-{d.suspect:05d}/</code>")
    if v.state == "stalled":
        steps.append("The job is stalled: look at the named ranks' py-spy stacks first (deploy/runbook.md).")
    if v.state == "unknown":
        steps.append("No comparison could be made: check that every rank's collector reports (query ranks).")
    if not steps:
        steps.append("Nothing to act on: no rank lost a significant share of the step.")
    steps.append(f"Follow the job: <code>trainscope query verdict --job {html.escape(job)}</code>")
    return steps


def _verdict_html(d: ReportData) -> str:
    v = d.verdict
    e = html.escape
    rows = "".join(
        f"<tr><td>{s.rank}</td><td>{e(s.role)}</td><td>{s.impact_s:.4f} s</td><td>{s.impact_pct:.1f} %</td>"
        f"<td>{e(s.host)}</td><td>{e(s.coords)}</td><td>{e(', '.join(s.where[:6]))}</td></tr>"
        for s in sorted(v.suspects, key=lambda s: -s.impact_s))
    table = ("<table><tr><th>rank</th><th>role</th><th>impact (s/iteration)</th><th>of the step</th>"
             "<th>host</th><th>coordinates</th><th>where</th></tr>" + rows + "</table>") if rows else \
        "<p>No rank is named.</p>"
    facts = [f"confidence <b>{v.confidence:.2f}</b> (0-1)", f"comparison <b>{e(v.comparison or '-')}</b>"]
    if v.host:
        facts.append(f"host <b>{e(v.host)}</b>")
    if v.since_window is not None:
        facts.append(f"since window <b>{v.since_window}</b>")
    steps = "".join(f"<li>{s}</li>" for s in _next_steps(d))
    return (f'<section id="verdict"><h2>Verdict</h2><p><span class="state {e(v.state)}">{e(v.state)}</span> '
            f"{e(v.summary)}</p><p>{' · '.join(facts)}</p>{table}<h3>Next steps</h3><ol>{steps}</ol></section>")


def render(d: ReportData) -> str:
    go, offline = _plotly()
    sections = [("iterations", "Iteration time per rank", [fig_iterations(go, d)]),
                ("heatmap", "Ranks over windows", [fig_heatmap(go, d)]),
                ("kernels", "Kernel CDFs: suspect against peers", fig_kernel_cdfs(go, d)),
                ("phases", "Phases", [fig_phases(go, d)] if d.phases else [])]
    body = [_verdict_html(d)]
    for sid, title, figs in sections:
        empty = ("No rank is named: there is no suspect to compare with its peers."
                 if sid == "kernels" and d.suspect is None else "No data recorded for this section.")
        parts = [f.to_html(full_html=False, include_plotlyjs=False, config={"displaylogo": False})
                 for f in figs] or [f"<p>{empty}</p>"]
        body.append(f'<section id="{sid}"><h2>{html.escape(title)}</h2>{"".join(parts)}</section>')
    made = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>trainscope report: {html.escape(d.job)}</title><style>{CSS}</style>"
            f"<script>{offline.get_plotlyjs()}</script></head><body>"
            f"<h1>trainscope report: {html.escape(d.job)}</h1>"
            f"<p class=\"sub\">{len(d.ranks)} ranks · generated {made} · self-contained: open it anywhere</p>"
            + "".join(body) + "</body></html>")


def write_report(config: ReportConfig) -> str:
    """Build the report and write it (0600, atomically); returns the path written."""
    _plotly()  # say so before reading anything when plotly is missing
    with Query(QueryConfig(store_path=config.store_path, store_setting=config.store_setting)) as q:
        page = render(collect(q, config.job))
    tmp = f"{config.out}.tmp{os.getpid()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(page)
            if os.path.exists(config.out) and not config.force:  # appeared meanwhile
                raise ConfigError("-o", config.out, "exists; pass --force to replace it")
            os.replace(tmp, config.out)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as exc:
        raise ConfigError("-o", config.out, f"cannot be written: {exc.strerror}") from None
    return config.out

