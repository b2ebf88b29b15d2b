"""The three trainscope dashboards, built with grafana-foundation-sdk.

* ``trainscope-fleet``: every job, its verdict, confidence, open suspects and
  whether the pipeline is healthy;
* ``trainscope-job``: one job drilled down (iteration time per rank, a
  rank x time heatmap of suspect impact grouped by host, a DP x PP matrix,
  phase spread per pipeline stage, the kernels furthest from their peers,
  links to the runbook and to the suspect's and a healthy peer's Perfetto
  traces);
* ``trainscope-pipeline``: the pipeline's own health (ingest, drops, rejects,
  lag, spool, sink errors, the analyzer's throughput and failures).

Every target's ``legendFormat`` names the labels the panel shows;
``tests/integration/test_dashboards_promql.py`` runs every expression against
a real Prometheus and checks those labels are there. Metric names come from
``series.py`` only.
"""
from __future__ import annotations

from grafana_foundation_sdk.builders import (
    dashboard, heatmap, prometheus, stat, table, timeseries,
)
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import prometheus as pm

import series as S

DS = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE = "$__rate_interval"
#: The runbook link's default: the repository path; set ``runbook_base`` to where you serve it.
RUNBOOK_DEFAULT = "deploy/runbook.md"
JOB = 'job="$job"'
SEL = 'job="$job", rank=~"$rank"'
INFO = f'{S.RANK_INFO}{{job="$job", host=~"$host", rank=~"$rank"}}'


def q(expr: str, legend: str = "", *, instant: bool = False, table_fmt: bool = False,
      ref: str = "A") -> prometheus.Dataquery:
    d = prometheus.Dataquery().expr(" ".join(expr.split())).legend_format(legend).ref_id(ref).datasource(DS)
    if instant:
        d = d.instant()
    else:
        d = d.range()
    if table_fmt:
        d = d.format(pm.PromQueryFormat.TABLE)
    return d


def zero_if_absent(expr: str) -> str:
    """Error counters appear only once an error happened: show 0, not "No data"."""
    return f"({expr}) or on() vector(0)"


def padded_rank(expr: str) -> str:
    """Add ``trace_rank``: the rank zero-padded to 5 digits, as Perfetto trace paths
    name it (``{job}/rank-{rank:05d}/``; label_replace regexes are anchored)."""
    for width in range(1, 6):
        expr = (f'label_replace({expr}, "trace_rank", "{"0" * (5 - width)}$1", '
                f'"rank", "({"[0-9]" * width})")')
    return expr


def ts(title: str, unit: str, *targets: prometheus.Dataquery, w: int = 12, h: int = 8,
       desc: str = "") -> timeseries.Panel:
    p = timeseries.Panel().title(title).unit(unit).datasource(DS).height(h).span(w).description(desc)
    for t in targets:
        p = p.with_target(t)
    return p


def tbl(title: str, unit: str, *targets: prometheus.Dataquery, w: int = 12, h: int = 8,
        desc: str = "", links: list | None = None) -> table.Panel:
    p = table.Panel().title(title).unit(unit).datasource(DS).height(h).span(w).description(desc)
    for t in targets:
        p = p.with_target(t)
    # one row per series, labels as columns, the instant value last
    p = p.with_transformation(dm.DataTransformerConfig(id_val="organize", options={
        "excludeByName": {"Time": True, "__name__": True}}))
    if links:
        p = p.data_links(links)
    return p


def stat_panel(title: str, unit: str, target: prometheus.Dataquery, w: int = 6, h: int = 4,
               desc: str = "") -> stat.Panel:
    return (stat.Panel().title(title).unit(unit).datasource(DS).height(h).span(w)
            .description(desc).with_target(target))


def datasource_var() -> dashboard.DatasourceVariable:
    return dashboard.DatasourceVariable("datasource").label("Prometheus").type("prometheus")


def job_vars() -> list:
    job = (dashboard.QueryVariable("job").label("Job").datasource(DS)
           .query(f"label_values({S.RANK_INFO}, job)").refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
           .sort(dm.VariableSort.ALPHABETICAL_ASC))
    host = (dashboard.QueryVariable("host").label("Host").datasource(DS)
            .query(f'label_values({S.RANK_INFO}{{job="$job"}}, host)')
            .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED).multi(True).include_all(True).all_value(".*")
            .sort(dm.VariableSort.ALPHABETICAL_ASC))
    rank = (dashboard.QueryVariable("rank").label("Rank").datasource(DS)
            .query(f'label_values({S.RANK_INFO}{{job="$job", host=~"$host"}}, rank)')
            .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED).multi(True).include_all(True).all_value(".*")
            .sort(dm.VariableSort.NUMERICAL_ASC))
    traces = (dashboard.TextBoxVariable("trace_base").label("Perfetto trace base URL")
              .description("Where the processors' --perfetto-url is served over HTTP"))
    return [job, host, rank, traces]


def runbook_var() -> dashboard.TextBoxVariable:
    return (dashboard.TextBoxVariable("runbook_base").label("Runbook URL").default_value(RUNBOOK_DEFAULT)
            .description("Where deploy/runbook.md is served (your repository's web view or a wiki page)"))


def base(uid: str, title: str, desc: str) -> dashboard.Dashboard:
    return (dashboard.Dashboard(title).uid(uid).description(desc).tags(["trainscope"])
            .refresh("30s").time("now-1h", "now").timezone("utc").editable()
            .link(dashboard.DashboardLink("trainscope").type(dm.DashboardLinkType.DASHBOARDS)
                  .tags(["trainscope"]).as_dropdown(True).include_vars(True).keep_time(True))
            .link(dashboard.DashboardLink("Runbook").type(dm.DashboardLinkType.LINK)
                  .url("${runbook_base}").target_blank(True).tooltip("deploy/runbook.md"))
            .with_variable(datasource_var()).with_variable(runbook_var()))


# -- fleet ---------------------------------------------------------------------

def fleet() -> dashboard.Dashboard:
    d = base("trainscope-fleet", "trainscope / fleet",
             "Every training job trainscope sees: verdict, confidence, suspects, pipeline health")
    d = d.with_row(dashboard.Row("Jobs"))
    d = d.with_panel(tbl(
        "Jobs and their verdict", "short",
        q(f"max by (job, state) ({S.VERDICT_STATE} == 1)", "{{job}} {{state}}", instant=True, table_fmt=True),
        w=8, desc="The analyzer's latest verdict state per job (healthy, suspected, degraded, stalled, unknown)"))
    d = d.with_panel(tbl(
        "Ranks per job", "short",
        q(f"count by (job) ({S.RANK_INFO})", "{{job}}", instant=True, table_fmt=True), w=4))
    d = d.with_panel(tbl(
        "Verdict confidence", "percentunit",
        q(f"max by (job) ({S.VERDICT_CONFIDENCE})", "{{job}}", instant=True, table_fmt=True), w=4))
    d = d.with_panel(tbl(
        "Stalled jobs (1 = no iteration for 5x the interval)", "bool_yes_no",
        q(f'max by (job) ({S.JOB_STALLED}) or max by (job) ({S.VERDICT_STATE}{{state="stalled"}})', "{{job}}",
          instant=True, table_fmt=True),
        w=8, desc="The analyzer's stall flag (EROICA §4.1), else whether the latest verdict is stalled"))
    d = d.with_panel(tbl(
        "Open verdicts: named suspects", "s",
        q(f"max by (job, rank, role, host) ({S.VERDICT_IMPACT_S})", "{{job}} rank {{rank}} {{role}} {{host}}",
          instant=True, table_fmt=True),
        w=12, desc="Impact: seconds lost per iteration by the suspect (the verdict's impact_s)",
        links=[dashboard.DashboardLink("Job drill-down").type(dm.DashboardLinkType.LINK)
               .url("/d/trainscope-job?var-job=${__data.fields.job}")]))
    d = d.with_panel(ts(
        "Iteration time per job (median over ranks)", "s",
        q(f"quantile by (job) (0.5, {S.ITERATION_S})", "{{job}}"), w=12))
    d = d.with_row(dashboard.Row("Pipeline health"))
    d = d.with_panel(stat_panel(
        "Ingest", "suffix: records/s", q(f"sum(rate({S.EVENTS_IN}[{RATE}]))")))
    d = d.with_panel(stat_panel(
        "Dropped", "suffix: records/s", q(zero_if_absent(f"sum(rate({S.DROPS}[{RATE}]))"))))
    d = d.with_panel(stat_panel(
        "Sink errors", "suffix: errors/s", q(zero_if_absent(f"sum(rate({S.SINK_ERRORS}[{RATE}]))"))))
    d = d.with_panel(stat_panel(
        "Windows analysed", "suffix: windows/s", q(f"sum(rate({S.ANALYZER_WINDOWS}[{RATE}]))")))
    return d


# -- job drill-down ------------------------------------------------------------

def job() -> dashboard.Dashboard:
    d = base("trainscope-job", "trainscope / job",
             "One job: where its time goes per rank, host, parallel group, phase and kernel")
    for v in job_vars():
        d = d.with_variable(v)
    with_host = f"* on (job, rank) group_left (host) {INFO}"
    flagged = f"max by (job, rank) ({S.SUSPECT_SCORE}{{{JOB}}})"
    impact_all_ranks = f"({flagged} or on (job, rank) (0 * {S.RANK_INFO}{{{JOB}}}))"
    d = d.with_row(dashboard.Row("Verdict"))
    d = d.with_panel(stat_panel(
        "Verdict", "short", q(f"max by (state) ({S.VERDICT_STATE}{{{JOB}}} == 1)", "{{state}}", instant=True),
        w=4).text_mode(cm.BigValueTextMode.NAME))
    d = d.with_panel(stat_panel(
        "Confidence", "percentunit", q(f"max by (job) ({S.VERDICT_CONFIDENCE}{{{JOB}}})", "{{job}}", instant=True),
        w=4))
    suspect_traces = [dashboard.DashboardLink("Perfetto traces of this rank").type(dm.DashboardLinkType.LINK)
                      .url("${trace_base}/${job}/rank-${__data.fields.trace_rank}/").target_blank(True)]
    d = d.with_panel(tbl(
        "Named suspects (impact, s/iteration)", "s",
        q(padded_rank(f"max by (job, rank, role, host) ({S.VERDICT_IMPACT_S}{{{JOB}}})"),
          "rank {{rank}} {{role}} {{host}} {{trace_rank}}", instant=True, table_fmt=True),
        w=8, links=suspect_traces,
        desc="The verdict's suspects; the link opens the rank's Perfetto traces (set trace_base)"))
    d = d.with_panel(tbl(
        "Healthy peers (one per pipeline stage, not flagged)", "short",
        # a waiter is not flagged here: its GPU did its work and only waited in the collectives
        # (every DP and TP peer of a slow rank is one once collective records name waiters)
        q(padded_rank(f"bottomk by (pp) (1, {S.RANK_INFO}{{{JOB}}} unless on (job, rank) "
                      f"{S.VERDICT_IMPACT_S}{{role!=\"waiter\"}})"),
          "rank {{rank}} pp {{pp}} {{host}} {{trace_rank}}", instant=True, table_fmt=True),
        w=8, links=suspect_traces,
        desc="A peer to compare the suspect's trace with: same pipeline stage, not named by the verdict "
             "except as a rank that waited"))
    d = d.with_row(dashboard.Row("Ranks"))
    d = d.with_panel(ts(
        "Iteration time per rank", "s",
        q(f"{S.ITERATION_S}{{{SEL}}} {with_host}", "rank {{rank}} ({{host}})"), w=24,
        desc="Mean iteration time of each rank's latest window (processor)"))
    d = d.with_panel(
        heatmap.Panel().title("Suspect impact, rank x time, grouped by host (s/iteration)").datasource(DS)
        .unit("s").height(10).span(12).calculate(False).show_tooltip()
        .with_target(q(f"max by (host, rank) ({impact_all_ranks} {with_host})", "{{host}} / rank {{rank}}"))
        .description("Rows are ranks sorted by host; 0 where a rank is not flagged"))
    d = d.with_panel(tbl(
        "Suspect impact by DP x PP (s/iteration)", "s",
        q(f"max by (dp, pp) ({impact_all_ranks} * on (job, rank) group_left (dp, pp) {INFO})",
          "dp {{dp}} pp {{pp}}", instant=True, table_fmt=True),
        w=12, h=10, desc="Rows are pipeline stages, columns data-parallel replicas; the cell's colour is its "
                         "impact (green 0, red the largest); only the ranks of $host and $rank")
        .with_transformation(dm.DataTransformerConfig(id_val="groupingToMatrix", options={
            "columnField": "dp", "rowField": "pp", "valueField": "Value", "emptyValue": "null"}))
        .min(0).color_scheme(dashboard.FieldColor().mode(dm.FieldColorModeId.CONTINUOUS_GR_YL_RD))
        .override_by_field_type("number", [dm.DynamicConfigValue(
            id_val="custom.cellOptions", value={"type": "color-background", "mode": "gradient"})]))
    d = d.with_row(dashboard.Row("Phases and kernels"))
    grouped = f"{S.PHASE_S}{{{SEL}}} * on (job, rank) group_left (pp) {INFO}"  # the ranks of $host, $rank
    d = d.with_panel(ts(
        "Phase spread per pipeline stage (slowest - fastest rank)", "s",
        q(f"max by (pp, phase) ({grouped}) - min by (pp, phase) ({grouped})", "pp {{pp}} {{phase}}"),
        w=12, desc="Ranks of one stage do the same work: a wide spread is a straggler (ARGUS §9)"))
    d = d.with_panel(tbl(
        "Kernels furthest from their peers (impact, s/iteration)", "s",
        q(f'topk(15, max by (rank, kernel) ({S.SUSPECT_SCORE}{{{SEL}, level="L3", kernel!=""}}'
          f' and on (job, rank) {INFO}))',
          "rank {{rank}} {{kernel}}", instant=True, table_fmt=True),
        w=12, desc="L3: each rank's kernel distribution against its peers' (the ranks of $host and $rank)"))
    return d


# -- pipeline ------------------------------------------------------------------

def pipeline() -> dashboard.Dashboard:
    d = base("trainscope-pipeline", "trainscope / pipeline",
             "trainscope's own health: if this is red, diagnoses may be incomplete")
    d = d.with_row(dashboard.Row("Processor"))
    d = d.with_panel(ts("Ingest rate", "suffix: records/s",
                        q(f"sum by (signal) (rate({S.EVENTS_IN}[{RATE}]))", "{{signal}}"), w=8))
    d = d.with_panel(ts("Ingest bytes", "Bps",
                        q(f"sum by (signal) (rate({S.BYTES_IN}[{RATE}]))", "{{signal}}"), w=8))
    d = d.with_panel(ts("Delivered per sink", "suffix: records/s",
                        q(f"sum by (sink) (rate({S.RECORDS_OUT}[{RATE}]))", "{{sink}}"), w=8))
    d = d.with_panel(ts("Drops", "suffix: records/s",
                        q(zero_if_absent(f"sum by (where) (rate({S.DROPS}[{RATE}]))"), "{{where}}"), w=8,
                        desc="Unlabelled 0: nothing dropped since the processor started"))
    d = d.with_panel(ts("Rejects", "suffix: /s",
                        q(zero_if_absent(f"sum by (reason) (rate({S.BATCHES_REJECTED}[{RATE}]))"),
                          "batches {{reason}}"),
                        q(zero_if_absent(f"sum by (reason) (rate({S.RECORDS_REJECTED}[{RATE}]))"),
                          "records {{reason}}", ref="B"), w=8))
    d = d.with_panel(ts("Sink errors", "suffix: errors/s",
                        q(zero_if_absent(f"sum by (sink) (rate({S.SINK_ERRORS}[{RATE}]))"), "{{sink}}"), w=8))
    d = d.with_panel(ts("Lag (now - newest batch's send time)", "s",
                        q(f"max by (signal) ({S.LAG_S})", "{{signal}}"), w=8))
    d = d.with_panel(ts("Spool (records held while a sink is down)", "bytes",
                        q(zero_if_absent(f"sum by (sink) ({S.SPOOL_BYTES})"), "{{sink}}"), w=8))
    d = d.with_panel(ts("Longest window close", "s", q(f"max({S.WINDOW_CLOSE_MAX_S})"), w=8))
    d = d.with_panel(ts("Collector-side drops per job", "short",
                        q(f"sum by (job) ({S.COLLECTOR_DROPPED})", "{{job}}"), w=12,
                        desc="Batches the ranks' collectors dropped (queue full or processor away)"))
    d = d.with_row(dashboard.Row("Analyzer"))
    d = d.with_panel(ts("Analyzer throughput", "suffix: /s",
                        q(f"sum(rate({S.ANALYZER_RECORDS_IN}[{RATE}]))", "records"),
                        q(f"sum(rate({S.ANALYZER_WINDOWS}[{RATE}]))", "windows", ref="B"), w=12))
    d = d.with_panel(ts("Analyzer bad and late records", "suffix: records/s",
                        q(f"sum(rate({S.ANALYZER_BAD}[{RATE}]))", "bad"),
                        q(f"sum(rate({S.ANALYZER_LATE}[{RATE}]))", "late", ref="B"), w=12))
    d = d.with_panel(ts("Detector failures", "suffix: windows/s",
                        q(zero_if_absent(f"sum by (level) (rate({S.DETECTOR_FAILURES}[{RATE}]))"), "{{level}}"),
                        w=12))
    d = d.with_panel(ts("Diagnoses per job and kind", "suffix: diagnoses/s",
                        q(f"sum by (job, kind) (rate({S.DIAGNOSES}[{RATE}]))", "{{job}} {{kind}}"), w=12))
    return d


BOARDS = {"fleet": fleet, "job": job, "pipeline": pipeline}
