"""The telemetry contract from DESIGN.md ("Telemetry contract"), as the tests see it.

Written out here until ``torchtrace.semconv`` exists; then this module should read the
names from there instead, so that the library and the monitoring files cannot drift.
"""

from __future__ import annotations

COUNTER = "counter"
GAUGE = "gauge"
HISTOGRAM = "histogram"

#: Labels on every torchtrace series.
COMMON_LABELS = frozenset({"run_id", "rank"})

#: Labels Prometheus adds to every scraped series.
TARGET_LABELS = frozenset({"job", "instance"})

#: name as scraped -> (type, extra labels)
METRICS: dict[str, tuple[str, frozenset[str]]] = {
    "torchtrace_steps_total": (COUNTER, frozenset({"operation"})),
    "torchtrace_step_duration_seconds": (HISTOGRAM, frozenset({"operation"})),
    "torchtrace_loss": (GAUGE, frozenset({"operation"})),
    "torchtrace_grad_norm": (GAUGE, frozenset({"operation"})),
    "torchtrace_grad_nonfinite_tensors": (GAUGE, frozenset({"operation"})),
    "torchtrace_anomalies_total": (COUNTER, frozenset({"operation", "kind"})),
    "torchtrace_skipped_steps_total": (COUNTER, frozenset({"operation"})),
    "torchtrace_memory_bytes": (GAUGE, frozenset({"device", "kind"})),
    "torchtrace_memory_growth_bytes_per_step": (GAUGE, frozenset({"device"})),
    "torchtrace_last_step_timestamp_seconds": (GAUGE, frozenset({"operation"})),
    "torchtrace_spans_dropped_total": (COUNTER, frozenset({"reason"})),
    "torchtrace_internal_errors_total": (COUNTER, frozenset({"component"})),
    "torchtrace_rank_step_skew": (GAUGE, frozenset()),
    "torchtrace_overhead_seconds_total": (COUNTER, frozenset()),
    "torchtrace_build_info": (GAUGE, frozenset({"version", "level"})),
    # throughput and goodput (DESIGN.md, "Throughput and goodput")
    "torchtrace_samples_total": (COUNTER, frozenset({"operation"})),
    "torchtrace_tokens_total": (COUNTER, frozenset({"operation"})),
    "torchtrace_flops_total": (COUNTER, frozenset({"operation"})),
    "torchtrace_mfu_ratio": (GAUGE, frozenset({"operation"})),
    "torchtrace_learning_rate": (GAUGE, frozenset({"operation", "group"})),
    "torchtrace_data_wait_seconds": (HISTOGRAM, frozenset({"operation"})),
    "torchtrace_step_phase_seconds": (HISTOGRAM, frozenset({"operation", "phase"})),
    "torchtrace_goodput_ratio": (GAUGE, frozenset()),
    "torchtrace_badput_seconds_total": (COUNTER, frozenset({"kind"})),
    # hangs (DESIGN.md, "Hangs, deaths and restarts"); the timeout gauge is what TrainingHung compares with
    "torchtrace_stalled_seconds": (GAUGE, frozenset()),
    "torchtrace_hang_timeout_seconds": (GAUGE, frozenset()),
    "torchtrace_hangs_total": (COUNTER, frozenset()),
    "torchtrace_phase": (GAUGE, frozenset({"phase"})),
    "torchtrace_collectives_total": (COUNTER, frozenset()),
    # the whole job (DESIGN.md, "Hangs, deaths and restarts")
    "torchtrace_job_attempt": (GAUGE, frozenset()),
    "torchtrace_job_goodput_ratio": (GAUGE, frozenset()),
    "torchtrace_checkpoint_seconds": (HISTOGRAM, frozenset({"kind"})),
}

#: Closed sets of label values, where the contract fixes them.
ANOMALY_KINDS = frozenset({
    "nonfinite_loss", "nonfinite_grad", "nonfinite_param", "grad_explosion",
    "grad_vanishing", "loss_spike", "memory_leak", "nonfinite_input",
    "nonfinite_output", "uniform_output", "oom", "step_time_regression",
    "throughput_drop", "data_stall", "hang",
})
MEMORY_KINDS = frozenset({"rss", "allocated", "reserved", "peak_allocated"})
DROP_REASONS = frozenset({"queue_full", "export_failed", "shutdown"})
PHASES = frozenset({"forward", "backward", "optimizer"})
TRAINING_PHASES = frozenset({"data_wait", "forward", "backward", "optimizer", "collective", "checkpoint",
                             "evaluation", "idle"})
BADPUT_KINDS = frozenset({"startup", "data_wait", "skipped_step", "forensics", "checkpoint", "evaluation", "other"})
CHECKPOINT_KINDS = frozenset({"save", "load"})
LR_GROUPS = frozenset({*map(str, range(8)), "8+"})  # the group index, capped

#: (series name, label) -> the values that label may take on that series.
CLOSED_LABEL_VALUES: dict[tuple[str, str], frozenset[str]] = {
    ("torchtrace_anomalies_total", "kind"): ANOMALY_KINDS,
    ("torchtrace_memory_bytes", "kind"): MEMORY_KINDS,
    ("torchtrace_spans_dropped_total", "reason"): DROP_REASONS,
    ("torchtrace_step_phase_seconds", "phase"): PHASES,
    ("torchtrace_badput_seconds_total", "kind"): BADPUT_KINDS,
    ("torchtrace_learning_rate", "group"): LR_GROUPS,
    ("torchtrace_phase", "phase"): TRAINING_PHASES,
}


def series_names() -> dict[str, str]:
    """Every series name a scrape can return, mapped to its contract metric.

    A histogram is scraped as ``_bucket``, ``_sum`` and ``_count``; a counter name
    already ends in ``_total``.
    """
    names: dict[str, str] = {}
    for name, (kind, _) in METRICS.items():
        if kind == HISTOGRAM:
            for suffix in ("_bucket", "_sum", "_count"):
                names[name + suffix] = name
        else:
            names[name] = name
    return names


def labels_of(series: str) -> frozenset[str]:
    """All labels a series of the contract may carry, target labels included."""
    metric = series_names()[series]
    kind, extra = METRICS[metric]
    labels = COMMON_LABELS | TARGET_LABELS | extra
    if series.endswith("_bucket") and kind == HISTOGRAM:
        labels |= {"le"}
    return labels


def all_labels() -> frozenset[str]:
    """Every label any contract series may carry."""
    out: set[str] = set()
    for series in series_names():
        out |= labels_of(series)
    return frozenset(out)
