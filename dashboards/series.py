"""Every Prometheus series the dashboards read, in one place.

When a metric is renamed or gains a label (processor/prom_exporter.py,
processor/selfmetrics.py, analyzer/metrics.py), change it here and run
``python dashboards/build.py`` to regenerate the checked-in JSON.
"""

# processor/prom_exporter.py: per-rank series, labels job, rank (+ phase)
RANK_INFO = "trainscope_rank_info"  # {job, rank, host, dp, tp, pp, ep, cp} 1
ITERATION_S = "trainscope_iteration_seconds"
ITERATIONS = "trainscope_iterations_total"
PHASE_S = "trainscope_phase_seconds"

# processor/selfmetrics.py: the processor's own health
P = "trainscope_processor_"
EVENTS_IN = P + "events_in_total"  # {signal}
BYTES_IN = P + "bytes_in_total"  # {signal}
RECORDS_OUT = P + "records_out_total"  # {sink, signal}
BATCHES_REJECTED = P + "batches_rejected_total"  # {reason}
RECORDS_REJECTED = P + "records_rejected_total"  # {reason}
DROPS = P + "drops_total"  # {where}
SINK_ERRORS = P + "sink_errors_total"  # {sink}
LAG_S = P + "lag_seconds"  # {signal}
SPOOL_BYTES = P + "spool_bytes"  # {sink}
WINDOW_CLOSE_MAX_S = P + "window_close_seconds_max"
COLLECTOR_DROPPED = P + "collector_dropped"  # {job, rank}

# analyzer/metrics.py: diagnoses and verdicts
SUSPECT_SCORE = "trainscope_suspect_score"  # {job, level, kind, rank, phase, kernel}; s/iteration
# not read by a board yet: trainscope_stall_seconds {job, level, rank} s (peers' wait),
# trainscope_rank_missing {job, rank} 1
DIAGNOSES = "trainscope_diagnoses_total"  # {job, level, kind}
VERDICT_STATE = "trainscope_verdict_state"  # {job, state} 1 = current
VERDICT_CONFIDENCE = "trainscope_verdict_confidence"  # {job} 0-1
VERDICT_IMPACT_S = "trainscope_verdict_suspect_impact_seconds"  # {job, rank, role, host}
JOB_STALLED = "trainscope_job_stalled"  # {job}
A = "trainscope_analyzer_"
ANALYZER_RECORDS_IN = A + "records_in_total"
ANALYZER_WINDOWS = A + "windows_analyzed_total"
ANALYZER_BAD = A + "bad_records_total"
ANALYZER_LATE = A + "late_records_total"
DETECTOR_FAILURES = A + "detector_failures_total"  # {level}

ALL = sorted(v for k, v in dict(globals()).items() if k.isupper() and k not in ("P", "A", "ALL"))
