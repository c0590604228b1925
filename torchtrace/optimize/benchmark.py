"""``benchmark_optimizations``: what each mode buys on this model, measured.

Every mode trains a fresh deep copy of the same starting model, with a fresh optimizer
loaded from the same state, on the same batches, from the same random seed: nothing one
mode does leaks into the next, and the loss difference against NONE is numerical agreement
and not a different experiment. Times are per step (CUDA synchronised at each step
boundary), warm-up steps excluded; a mode slower or hungrier than NONE is reported so.
The results are in :mod:`torchtrace.optimize.results`; the runner, ``optimize_training_loop``,
in :mod:`torchtrace.optimize.training` (both importable from here too).
"""

from __future__ import annotations

import copy
import inspect
import math
import sys
import time
from typing import Callable, Iterable, Sequence, TextIO

import torch
from torch import nn

from torchtrace import current, semconv
from torchtrace.forensics.isolation import rng_kept
from torchtrace.levels import OptimizationMode
from torchtrace.measure.saved import SavedTensorMeter
from torchtrace.optimize.modes import OptimizedModel, failure_reason, model_device, optimize_model
from torchtrace.optimize.results import BenchmarkResults, ModeResult
from torchtrace.optimize.training import _move, _null, _sync, _train_step, optimize_training_loop

__all__ = ["BenchmarkResults", "ModeResult", "benchmark_optimizations", "optimize_training_loop"]

ALL_MODES = tuple(OptimizationMode)
OptimizerLike = "torch.optim.Optimizer | Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]"


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    if len(sorted_values) == 1:
        return sorted_values[0]
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def _make_optimizer(optimizer, model: nn.Module, names: dict[int, str]) -> torch.optim.Optimizer:
    """A fresh optimizer of the same class over ``model``'s parameters, groups and state."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return optimizer(model.parameters())
    by_name = dict(model.named_parameters())
    groups = []
    for group in optimizer.param_groups:
        missing = [p for p in group["params"] if id(p) not in names]
        if missing:
            raise ValueError("the optimizer holds parameters that are not the model's")
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": [by_name[names[id(p)]] for p in group["params"]]})
    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    fresh = type(optimizer)(groups, **defaults)
    fresh.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # same hyper-parameters and state
    return fresh


def _seed(seed: int) -> None:
    torch.manual_seed(seed)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)


def _measure_memory(om: OptimizedModel, loss_fn, batch, device) -> tuple[int, str]:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda_peak_allocated"
    x, y = batch
    with SavedTensorMeter(om.module.parameters()) as meter:
        with om.context():
            loss = loss_fn(om(x), y)
    del loss  # no backward, no optimizer step: the trained state is untouched
    return meter.bytes, "saved_activations"


def _run_mode(snapshot: nn.Module, names: dict[int, str], optimizer, loss_fn, batches, mode, warmup, steps, seed,
              device, measure_memory, opts) -> ModeResult:
    result = ModeResult(mode=mode)
    model = copy.deepcopy(snapshot)
    opt = _make_optimizer(optimizer, model, names)
    _seed(seed)
    om = optimize_model(model, mode, **opts)
    om.train()
    result.applied = list(om.report.applied)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses = []
    for i in range(warmup + steps):
        batch = batches[i % len(batches)]
        _sync(device)
        t0 = time.perf_counter()
        losses.append(_train_step(om, opt, loss_fn, batch))
        _sync(device)
        if i >= warmup:
            result.step_times_s.append(time.perf_counter() - t0)
    result.losses = torch.stack([l.float() for l in losses]).double().cpu().tolist()  # one host read
    result.applied = list(om.report.applied)  # a compile fallback on the first call shows here
    result.skipped = dict(om.report.skipped)
    times = sorted(result.step_times_s)
    result.median_s = _percentile(times, 0.5)
    result.iqr_s = _percentile(times, 0.75) - _percentile(times, 0.25)
    if measure_memory:
        result.memory_bytes, result.memory_kind = _measure_memory(om, loss_fn, batches[0], device)
    return result


def benchmark_optimizations(model: nn.Module, batches: Iterable, optimizer, loss_fn: Callable,
                            modes: Iterable[OptimizationMode | str] | None = None, *, warmup: int = 2,
                            steps: int = 10, seed: int = 0, amp_dtype: str | torch.dtype | None = None,
                            compile_backend: str = "inductor", compile_options: dict | None = None,
                            measure_memory: bool = True, print_table: bool = True,
                            file: TextIO | None = None) -> BenchmarkResults:
    """Train a copy of ``model`` under each mode and compare with NONE.

    Args:
        model: left untouched; each mode trains a deep copy of it.
        batches: ``(inputs, targets)`` pairs, moved to the model's device; cycled through.
        optimizer: an optimizer of ``model`` (its class, hyper-parameters and state are
            copied for every mode) or a factory ``params -> optimizer``.
        loss_fn: ``loss_fn(outputs, targets)``.
        modes: default all modes. NONE always runs first: it is the reference.
        warmup, steps: untimed then timed training steps per mode.
        compile_backend: ``torch.compile`` backend; "aot_eager" or "eager" compile fast.
        measure_memory: on CUDA ``max_memory_allocated`` over the mode's steps; on CPU the
            bytes of activations saved for backward in one forward
            (:class:`~torchtrace.measure.saved.SavedTensorMeter`).
        print_table: write :meth:`BenchmarkResults.table` to ``file`` (default stdout).

    The global generators (torch's, Python's, NumPy's) are left as the benchmark found them:
    each mode's training is seeded (``seed``), and the user's training after it draws what it
    would have drawn without it.

    A mode that raises is reported with its error; the others still run. Spans:
    ``benchmark_optimizations`` with one ``benchmark_optimizations.mode`` child per mode;
    metrics ``torchtrace_optimization_{step_seconds,speedup,memory_bytes}{mode}``.
    """
    order = _mode_order(modes)
    if warmup < 0 or steps < 1:
        raise ValueError(f"warmup={warmup}, steps={steps}: need warmup >= 0 and steps >= 1")
    device = model_device(model)
    batches = [_move(b, device) for b in batches]
    if not batches:
        raise ValueError("batches is empty: need at least one (inputs, targets) pair")
    snapshot = copy.deepcopy(model)
    names = {id(p): n for n, p in model.named_parameters()}
    opts = dict(amp_dtype=amp_dtype, compile_backend=compile_backend, compile_options=compile_options)
    out = BenchmarkResults(device=str(device), warmup=warmup, steps=steps)
    rt = current.runtime()
    tracer = rt.tracer if rt is not None and not rt.off else None
    outer = tracer.start_as_current_span("benchmark_optimizations") if tracer else _null()
    with outer, rng_kept():
        for mode in order:
            _benchmark_mode(mode, out, rt, tracer,
                            lambda m: _run_mode(snapshot, names, optimizer, loss_fn, batches, m, warmup, steps, seed,
                                                device, measure_memory, opts))
    if print_table:
        (file or sys.stdout).write(out.table() + "\n")
    return out


def _mode_order(modes: Iterable[OptimizationMode | str] | None) -> list[OptimizationMode]:
    """The modes to run, parsed and without repeats; NONE first, as the reference."""
    wanted = [OptimizationMode.parse(m, "modes") for m in (modes if modes is not None else ALL_MODES)]
    return [OptimizationMode.NONE] + [m for m in dict.fromkeys(wanted) if m is not OptimizationMode.NONE]


def _benchmark_mode(mode: OptimizationMode, out: BenchmarkResults, rt, tracer,
                    run: Callable[[OptimizationMode], ModeResult]) -> None:
    """Run one mode in its span, compare it with NONE, add it to ``out`` and to the metrics."""
    span_cm = (tracer.start_as_current_span("benchmark_optimizations.mode",
                                            attributes={semconv.OPT_MODE: mode.value},
                                            record_exception=False, set_status_on_exception=False)
               if tracer else _null())
    with span_cm as span:
        try:
            res = run(mode)
        except Exception as exc:  # noqa: BLE001 - a failing mode is a result, not a crash
            res = ModeResult(mode=mode, ok=False, error=failure_reason(exc))
            if span is not None:
                span.record_exception(exc)
        _compare(res, out.results.get(OptimizationMode.NONE))
        out.results[mode] = res
        if span is not None:
            _annotate(span, res, rt)
    if rt is not None and not rt.off and res.ok:
        try:
            rt.metrics.set_optimization(mode.value, res.median_s, res.speedup, res.memory_bytes)
        except Exception as exc:  # noqa: BLE001
            rt.errors.report("metrics", exc)


def _compare(res: ModeResult, base: ModeResult | None) -> None:
    if base is None:  # this is NONE itself
        base = res
    if not (res.ok and base.ok) or res.median_s is None or base.median_s is None:
        return
    # Speedup from the medians as printed (0.1 microsecond), so the table is self-consistent.
    m_base, m_res = round(base.median_s * 1e3, 4), round(res.median_s * 1e3, 4)
    res.speedup = m_base / m_res if m_res > 0 else None
    if base.memory_bytes and res.memory_bytes is not None:
        res.memory_saving = 1.0 - res.memory_bytes / base.memory_bytes
    n = min(len(res.losses), len(base.losses))
    res.max_abs_loss_diff = max((abs(a - b) for a, b in zip(res.losses[:n], base.losses[:n])), default=None)


def _annotate(span, res: ModeResult, rt) -> None:
    from opentelemetry.trace import Status, StatusCode
    try:
        attrs = {semconv.OPT_APPLIED: list(res.applied), semconv.BENCH_STEPS: len(res.step_times_s)}
        for key, value in ((semconv.BENCH_MEDIAN_S, res.median_s), (semconv.BENCH_IQR_S, res.iqr_s),
                           (semconv.BENCH_SPEEDUP, res.speedup), (semconv.BENCH_MEMORY_BYTES, res.memory_bytes),
                           (semconv.BENCH_MEMORY_SAVING, res.memory_saving),
                           (semconv.BENCH_LOSS_DIFF, res.max_abs_loss_diff)):
            if value is not None:
                attrs[key] = value
        if res.memory_kind:
            attrs[semconv.BENCH_MEMORY_KIND] = res.memory_kind
        if res.skipped:
            attrs[semconv.OPT_SKIPPED] = [f"{k}: {v}"[:semconv.MAX_ATTRIBUTE_LENGTH] for k, v in res.skipped.items()]
        if res.error:
            attrs[semconv.BENCH_ERROR] = res.error[:semconv.MAX_ATTRIBUTE_LENGTH]
            span.set_status(Status(StatusCode.ERROR, res.error[:200]))
        span.set_attributes(attrs)
    except Exception as exc:  # noqa: BLE001
        rt.errors.report("tracing", exc)
