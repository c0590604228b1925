"""Every telemetry name torchtrace emits, written once.

Dashboards, alert rules and tests depend on these names: add to them, never rename.
Prometheus names are given as scraped (counters carry their ``_total`` suffix here; the
metric objects are created without it, as prometheus_client expects).
"""

from __future__ import annotations

# ---------------------------------------------------------------- span attributes
ATTR_PREFIX = "torchtrace."
STEP = "torchtrace.step"
OPERATION = "torchtrace.operation"
OPERATION_KIND = "torchtrace.operation.kind"  # evaluation, checkpoint or other; absent on a training step
LEVEL = "torchtrace.level"
RANK = "torchtrace.rank"
LOSS = "torchtrace.loss"
GRAD_NORM = "torchtrace.grad.norm"  # global L2 norm, before clipping
GRAD_NORM_SCOPE = "torchtrace.grad.norm_scope"  # "local" or "global" (sharded runs)
GRAD_NONFINITE_COUNT = "torchtrace.grad.nonfinite_count"
GRAD_NONFINITE_PARAMS = "torchtrace.grad.nonfinite_params"  # names, capped
GRAD_EXPLODED_PARAMS = "torchtrace.grad.exploded_params"  # names, capped
GRAD_VANISHED_PARAMS = "torchtrace.grad.vanished_params"  # names, capped
GRAD_PARAM_COUNT = "torchtrace.grad.param_count"  # tensors with a gradient
PARAM_CHECKED = "torchtrace.param.checked"  # ADVANCED: parameters checked this step (every N steps, bad steps)
PARAM_NONFINITE_PARAMS = "torchtrace.param.nonfinite_params"
UPDATE_RATIO = "torchtrace.update.ratio"  # ||all updates|| / ||all parameters after the update||
UPDATE_RATIO_MAX = "torchtrace.update.ratio_max"  # the largest per-tensor ||update|| / ||parameter||
UPDATE_RATIO_MAX_PARAM = "torchtrace.update.ratio_max_param"  # the tensor it belongs to
ANOMALY_KINDS = "torchtrace.anomaly.kinds"
MEMORY_RSS_BYTES = "torchtrace.memory.rss_bytes"
MEMORY_CUDA_ALLOCATED_BYTES = "torchtrace.memory.cuda_allocated_bytes"
MEMORY_CUDA_RESERVED_BYTES = "torchtrace.memory.cuda_reserved_bytes"
MEMORY_CUDA_PEAK_BYTES = "torchtrace.memory.cuda_peak_allocated_bytes"
STEP_SKIPPED = "torchtrace.step.skipped"  # the guard skipped the optimizer update
STEP_SCALER_OVERFLOW = "torchtrace.step.scaler_overflow"  # the loss scaler found Inf/NaN grads, skipped the update
OVERHEAD_SECONDS = "torchtrace.overhead_seconds"
RANK_STEP_SKEW = "torchtrace.rank.step_skew"  # slowest rank's mean own step time over the median's (every N steps)
RANK_SLOWEST = "torchtrace.rank.slowest"  # the rank with the slowest mean own step time in that window
GUARD_PEER_NONFINITE = "torchtrace.guard.peer_nonfinite"  # the guard acted because another rank was non-finite

# ---------------------------------------------------------------- span events
EVENT_ANOMALY = "torchtrace.anomaly"
EVENT_FORENSICS = "torchtrace.forensics"
EVENT_ANOMALY_KIND = "torchtrace.anomaly.kind"
EVENT_ANOMALY_DETAIL = "torchtrace.anomaly.detail"

# ---------------------------------------------------------------- resource attributes
RESOURCE_RUN_ID = "torchtrace.run_id"
RESOURCE_RANK = "torchtrace.rank"
RESOURCE_LOCAL_RANK = "torchtrace.local_rank"
RESOURCE_WORLD_SIZE = "torchtrace.world_size"
RESOURCE_INSTANCE_ID = "service.instance.id"

# ---------------------------------------------------------------- metrics (as scraped)
M_STEPS = "torchtrace_steps_total"  # counter {operation}
M_STEP_DURATION = "torchtrace_step_duration_seconds"  # histogram {operation}, exemplar trace_id
M_LOSS = "torchtrace_loss"  # gauge {operation}
M_GRAD_NORM = "torchtrace_grad_norm"  # gauge {operation}
M_GRAD_NONFINITE = "torchtrace_grad_nonfinite_tensors"  # gauge {operation}
M_ANOMALIES = "torchtrace_anomalies_total"  # counter {operation, kind}
M_SKIPPED = "torchtrace_skipped_steps_total"  # counter {operation}
M_MEMORY = "torchtrace_memory_bytes"  # gauge {device, kind}
M_MEMORY_GROWTH = "torchtrace_memory_growth_bytes_per_step"  # gauge {device}
M_LAST_STEP_TS = "torchtrace_last_step_timestamp_seconds"  # gauge {operation}
M_SPANS_DROPPED = "torchtrace_spans_dropped_total"  # counter {reason}
M_INTERNAL_ERRORS = "torchtrace_internal_errors_total"  # counter {component}
M_RANK_SKEW = "torchtrace_rank_step_skew"  # gauge
M_OVERHEAD = "torchtrace_overhead_seconds_total"  # counter
M_BUILD_INFO = "torchtrace_build_info"  # gauge {version, level}
M_RANK_STEP_SECONDS = "torchtrace_rank_step_seconds"  # gauge {operation}: rank's mean wall step time, last skew window
# Hangs (docs/hangs.md): read from the black box's fields when /metrics is scraped.
M_STALLED_SECONDS = "torchtrace_stalled_seconds"  # gauge: seconds since the training thread last made progress
M_HANGS = "torchtrace_hangs_total"  # counter: hangs detected (no progress beyond the hang timeout)
M_PHASE = "torchtrace_phase"  # gauge {phase}: 1 for what the training thread is doing now
M_COLLECTIVES = "torchtrace_collectives_total"  # counter: collectives this rank has entered (its sequence number)
M_HANG_TIMEOUT = "torchtrace_hang_timeout_seconds"  # gauge: the watchdog's hang timeout now (for TrainingHung)

ALL_METRICS = (
    M_STEPS, M_STEP_DURATION, M_LOSS, M_GRAD_NORM, M_GRAD_NONFINITE, M_ANOMALIES,
    M_SKIPPED, M_MEMORY, M_MEMORY_GROWTH, M_LAST_STEP_TS, M_SPANS_DROPPED,
    M_INTERNAL_ERRORS, M_RANK_SKEW, M_OVERHEAD, M_BUILD_INFO,
)

# Labels every series carries.
COMMON_LABELS = ("run_id", "rank")

# ---------------------------------------------------------------- closed label sets
# Anomaly kinds: a fixed set. Add to it, never rename.
NONFINITE_LOSS = "nonfinite_loss"
NONFINITE_GRAD = "nonfinite_grad"
NONFINITE_PARAM = "nonfinite_param"
GRAD_EXPLOSION = "grad_explosion"
GRAD_VANISHING = "grad_vanishing"
LOSS_SPIKE = "loss_spike"
MEMORY_LEAK = "memory_leak"
NONFINITE_INPUT = "nonfinite_input"
NONFINITE_OUTPUT = "nonfinite_output"
UNIFORM_OUTPUT = "uniform_output"
OOM = "oom"
STEP_TIME_REGRESSION = "step_time_regression"
HANG = "hang"  # no progress beyond the hang timeout (torchtrace.job.watchdog)

ANOMALY_KINDS_ALL: tuple[str, ...] = (
    NONFINITE_LOSS, NONFINITE_GRAD, NONFINITE_PARAM, GRAD_EXPLOSION, GRAD_VANISHING,
    LOSS_SPIKE, MEMORY_LEAK, NONFINITE_INPUT, NONFINITE_OUTPUT, UNIFORM_OUTPUT, OOM,
    STEP_TIME_REGRESSION, HANG,
)
# What the training thread is doing (torchtrace_phase{phase}, the black box's ``phase``).
TRAINING_PHASES = ("data_wait", "forward", "backward", "optimizer", "collective", "checkpoint", "evaluation", "idle")
# Kinds that make a step "non-finite": span status ERROR, guard policies apply.
NONFINITE_KINDS = frozenset({NONFINITE_LOSS, NONFINITE_GRAD, NONFINITE_PARAM})

MEMORY_KINDS = ("rss", "allocated", "reserved", "peak_allocated")
DROP_REASONS = ("queue_full", "export_failed", "shutdown")
# torchtrace's own components, for torchtrace_internal_errors_total{component}.
COMPONENTS = (
    "step", "gradients", "memory", "record", "tracing", "metrics", "files", "server",
    "forensics", "profiler", "distributed", "logging", "other",
)

# Histogram buckets for a training step (seconds): 1 ms to 10 min.
STEP_DURATION_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 120.0, 300.0, 600.0,
)

# Caps on what goes into one span.
MAX_NAMES_PER_ATTRIBUTE = 32
MAX_ATTRIBUTE_LENGTH = 1024

# ---------------------------------------------------------------- forensics (issue 3)
# Attributes of the torchtrace.forensics event: FORENSICS_PREFIX + a report key, e.g.
# torchtrace.forensics.module (the producing module's path), .cause (input, forward, loss,
# backward, parameter, unknown), .kind (the anomaly kind), .op (backward op from the anomaly
# trace), .inputs/.outputs (JSON statistics), .rank, .replay_seconds (seconds).
FORENSICS_PREFIX = "torchtrace.forensics."
FORENSICS_MODULE = "torchtrace.forensics.module"
FORENSICS_CAUSE = "torchtrace.forensics.cause"
FORENSICS_OP = "torchtrace.forensics.op"
EVENT_OOM = "torchtrace.oom"  # out of memory inside a step; attributes under FORENSICS_PREFIX
# Iterative inference loops (monitor_loop_step): one event per iteration on the current span.
EVENT_LOOP_STEP = "torchtrace.loop_step"
LOOP_NAME = "torchtrace.loop.name"
LOOP_STEP = "torchtrace.loop.step"
LOOP_STAT_PREFIX = "torchtrace.loop."  # + mean, std, min, max, nan_count, inf_count
LOOP_NONFINITE = "torchtrace.loop.nonfinite"
# Added anomaly kind (detect_model_anomalies: outputs outside the expected value range).
OUTPUT_OUT_OF_RANGE = "output_out_of_range"
ANOMALY_KINDS_ALL = ANOMALY_KINDS_ALL + (OUTPUT_OUT_OF_RANGE,)
# ---------------------------------------------------------------- profiling, memory, activations
PROFILE_TRACE_PATH = "torchtrace.profile.trace_path"  # Chrome trace file of the window holding this step
PROFILE_WINDOW = "torchtrace.profile.window"  # "first-last" steps of the profiled window
PROFILE_REASON = "torchtrace.profile.reason"  # why the window was opened: schedule, anomaly, regression, manual
PROFILE_TRUNCATED = "torchtrace.profile.truncated"  # trace events dropped to respect the size cap
EVENT_PROFILE_OP = "torchtrace.profile.op"  # one of the window's top ops by self time
PROFILE_OP_NAME = "torchtrace.profile.op.name"
PROFILE_OP_SELF_CPU_US = "torchtrace.profile.op.self_cpu_us"
PROFILE_OP_CPU_US = "torchtrace.profile.op.cpu_us"
PROFILE_OP_SELF_DEVICE_US = "torchtrace.profile.op.self_device_us"
PROFILE_OP_CALLS = "torchtrace.profile.op.calls"
MEMORY_GROWTH_BYTES_PER_STEP = "torchtrace.memory.growth_bytes_per_step"  # leak detector's slope
EVENT_MEMORY_LEAK = "torchtrace.memory_leak"  # the leak report: accumulating tensors and sites
MEMORY_LEAK_TENSORS = "torchtrace.memory_leak.tensors"  # "shape dtype device grad_fn +count (+bytes)", capped
MEMORY_LEAK_SITES = "torchtrace.memory_leak.sites"  # "file:line +bytes", capped
EVENT_ACTIVATIONS = "torchtrace.activations"  # per-layer output statistics of the step
ACTIVATION_LAYERS = "torchtrace.activations.layers"  # layer names, capped
ACTIVATION_MEAN = "torchtrace.activations.mean"
ACTIVATION_STD = "torchtrace.activations.std"
ACTIVATION_MIN = "torchtrace.activations.min"
ACTIVATION_MAX = "torchtrace.activations.max"
ACTIVATION_NONFINITE = "torchtrace.activations.nonfinite"  # per layer: 1 when its output held NaN/Inf
ACTIVATION_NONFINITE_LAYERS = "torchtrace.activations.nonfinite_layers"
# ---------------------------------------------------------------- optimize_model (added)
# Span attributes of the "optimize_model" and "benchmark_optimizations" spans.
OPT_MODE = "torchtrace.optimize.mode"  # an OptimizationMode value
OPT_DEVICE = "torchtrace.optimize.device"
OPT_APPLIED = "torchtrace.optimize.applied"  # names: amp, compilation, activation_checkpointing
OPT_SKIPPED = "torchtrace.optimize.skipped"  # "name: reason" strings
OPT_AMP_DTYPE = "torchtrace.optimize.amp_dtype"
OPT_GRAD_SCALER = "torchtrace.optimize.grad_scaler"
OPT_COMPILE_BACKEND = "torchtrace.optimize.compile_backend"
OPT_COMPILE_FALLBACK = "torchtrace.optimize.compile_fallback"  # why compilation fell back to eager
OPT_CHECKPOINTED = "torchtrace.optimize.checkpointed"  # module names, capped
BENCH_MEDIAN_S = "torchtrace.benchmark.median_step_seconds"
BENCH_IQR_S = "torchtrace.benchmark.iqr_step_seconds"
BENCH_SPEEDUP = "torchtrace.benchmark.speedup"  # NONE's median over this mode's; < 1 is slower
BENCH_MEMORY_BYTES = "torchtrace.benchmark.memory_bytes"
BENCH_MEMORY_KIND = "torchtrace.benchmark.memory_kind"  # saved_activations or cuda_peak_allocated
BENCH_MEMORY_SAVING = "torchtrace.benchmark.memory_saving"  # 1 - mode/NONE; negative uses more
BENCH_LOSS_DIFF = "torchtrace.benchmark.max_abs_loss_diff"  # against NONE, same batches and seed
BENCH_STEPS = "torchtrace.benchmark.timed_steps"
BENCH_ERROR = "torchtrace.benchmark.error"
TRAIN_TOTAL_S = "torchtrace.training.total_seconds"  # optimize_training_loop span
TRAIN_STEPS = "torchtrace.training.steps"

# Metrics of benchmark_optimizations, label {mode} from the OptimizationMode values.
M_OPT_STEP_SECONDS = "torchtrace_optimization_step_seconds"  # gauge {mode}: median step time
M_OPT_SPEEDUP = "torchtrace_optimization_speedup"  # gauge {mode}: NONE median / mode median
M_OPT_MEMORY = "torchtrace_optimization_memory_bytes"  # gauge {mode}: measured memory (see kind)
OPT_METRICS = (M_OPT_STEP_SECONDS, M_OPT_SPEEDUP, M_OPT_MEMORY)
OPTIMIZATION_MODES = ("none", "amp", "compilation", "memory_efficient", "full_optimization")
# ---------------------------------------------------------------- throughput and goodput (additive)
# Span attributes.
SAMPLES = "torchtrace.samples"  # batch items in the step
TOKENS = "torchtrace.tokens"  # tokens in the step (non-padding where a mask says so)
FLOPS = "torchtrace.flops"  # model FLOPs of the step, forward + backward
LR = "torchtrace.lr"  # learning rate of parameter group 0 (all groups in the report)
DATA_WAIT_S = "torchtrace.data_wait_s"  # seconds from the end of the previous step to the start of this one
PHASE_FORWARD_S = "torchtrace.phase.forward_s"
PHASE_BACKWARD_S = "torchtrace.phase.backward_s"
PHASE_OPTIMIZER_S = "torchtrace.phase.optimizer_s"
# Metrics (as scraped).
M_SAMPLES = "torchtrace_samples_total"  # counter {operation}
M_TOKENS = "torchtrace_tokens_total"  # counter {operation}
M_FLOPS = "torchtrace_flops_total"  # counter {operation}
# Gauge {operation}: achieved FLOP/s over peak, last window; absent when the peak is unknown.
M_MFU = "torchtrace_mfu_ratio"
M_LEARNING_RATE = "torchtrace_learning_rate"  # gauge {operation, group}: group index, capped at MAX_LR_GROUPS
M_DATA_WAIT = "torchtrace_data_wait_seconds"  # histogram {operation}
M_STEP_PHASE = "torchtrace_step_phase_seconds"  # histogram {operation, phase}
M_GOODPUT = "torchtrace_goodput_ratio"  # gauge: productive step time over wall time since configure
M_BADPUT = "torchtrace_badput_seconds_total"  # counter {kind}
THROUGHPUT_METRICS = (M_SAMPLES, M_TOKENS, M_FLOPS, M_MFU, M_LEARNING_RATE, M_DATA_WAIT, M_STEP_PHASE, M_GOODPUT,
                      M_BADPUT)
PHASES = ("forward", "backward", "optimizer")
BADPUT_KINDS = ("startup", "data_wait", "skipped_step", "forensics", "checkpoint", "evaluation", "other")
MAX_LR_GROUPS = 8  # learning-rate groups past this index share the label value "8+"
# Histogram buckets for waiting on data and for step phases (seconds): 100 µs to 5 min.
DATA_WAIT_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                     10.0, 30.0, 60.0, 300.0)
THROUGHPUT_DROP = "throughput_drop"
DATA_STALL = "data_stall"
ANOMALY_KINDS_ALL = ANOMALY_KINDS_ALL + (THROUGHPUT_DROP, DATA_STALL)

# ---------------------------------------------------------------- the whole job: attempts, deaths, checkpoints
RESOURCE_JOB_ID = "torchtrace.job_id"  # every rank and attempt of one training job
RESOURCE_ATTEMPT = "torchtrace.attempt"  # 0 for the first attempt, +1 per restart
M_JOB_ATTEMPT = "torchtrace_job_attempt"  # gauge: attempt number within the job, 0 for the first
M_JOB_GOODPUT = "torchtrace_job_goodput_ratio"  # gauge: productive step time over the job's wall time, all attempts
M_CHECKPOINT_SECONDS = "torchtrace_checkpoint_seconds"  # histogram {kind}: kind in CHECKPOINT_KINDS
CHECKPOINT_KINDS = ("save", "load")
CHECKPOINT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
JOB_BADPUT_KINDS = ("restart", "lost_progress", "compile", "hang")
"""Badput only the job view has (the job section of report.json), beside each attempt's own kinds."""
JOB_ENDINGS = ("completed", "exception", "preempted", "killed", "hang", "unknown")
"""How an attempt (and each rank of it) ended."""
