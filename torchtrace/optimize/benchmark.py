"""``benchmark_optimizations``: what each mode buys on this model, measured, and a runner.

Every mode trains a fresh deep copy of the same starting model, with a fresh optimizer
loaded from the same state, on the same batches, from the same random seed: nothing one
mode does leaks into the next, and the loss difference against NONE is numerical agreement
and not a different experiment. Times are per step (CUDA synchronised at each step
boundary), warm-up steps excluded; a mode slower or hungrier than NONE is reported so.
"""

from __future__ import annotations

import copy
import inspect
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence, TextIO

import torch
from torch import nn

from torchtrace import current, semconv
from torchtrace.levels import OptimizationMode
from torchtrace.measure.saved import SavedTensorMeter
from torchtrace.optimize.modes import OptimizedModel, amp_step, failure_reason, model_device, optimize_model

ALL_MODES = tuple(OptimizationMode)
OptimizerLike = "torch.optim.Optimizer | Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]"


@dataclass
class ModeResult:
    """One mode's measurements. Times in seconds, memory in bytes; None when not measured."""

    mode: OptimizationMode
    ok: bool = True
    error: str | None = None
    step_times_s: list[float] = field(default_factory=list)
    median_s: float | None = None
    iqr_s: float | None = None  # 75th minus 25th percentile of the timed steps
    memory_bytes: int | None = None
    memory_kind: str = ""
    speedup: float | None = None  # NONE's median / this median: < 1 means slower
    memory_saving: float | None = None  # 1 - memory / NONE's memory: < 0 means more memory
    max_abs_loss_diff: float | None = None  # against NONE, step by step
    losses: list[float] = field(default_factory=list)
    applied: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in ("ok", "error", "median_s", "iqr_s", "memory_bytes", "memory_kind",
                                           "speedup", "memory_saving", "max_abs_loss_diff", "applied", "skipped")}
        d["mode"] = self.mode.value
        d["step_times_s"] = list(self.step_times_s)
        d["losses"] = list(self.losses)
        return d

    # The seeds read a mode's result as a dict: result["total_time"], "error" in result.
    def seed_view(self) -> dict[str, Any]:
        """The seeds' keys: ``total_time`` (seconds of the timed steps; ``inf`` for a failed mode,
        so ``min(results.items(), key=...)`` never picks it), ``speedup_factor``,
        ``memory_savings``, ``median_step_time``, ``memory_bytes``, ``max_abs_loss_diff``,
        ``applied``, ``skipped``, ``mode``; ``error`` only for a mode that failed."""
        d: dict[str, Any] = {"mode": self.mode.value,
                             "total_time": math.fsum(self.step_times_s) if self.ok else math.inf,
                             "speedup_factor": self.speedup, "memory_savings": self.memory_saving,
                             "median_step_time": self.median_s, "memory_bytes": self.memory_bytes,
                             "max_abs_loss_diff": self.max_abs_loss_diff, "applied": list(self.applied),
                             "skipped": dict(self.skipped)}
        if not self.ok:
            d["error"] = self.error
        return d

    def __getitem__(self, key: str) -> Any:
        return self.seed_view()[key]

    def __contains__(self, key: object) -> bool:
        return key in self.seed_view()

    def get(self, key: str, default: Any = None) -> Any:
        return self.seed_view().get(key, default)

    def keys(self):
        return self.seed_view().keys()


@dataclass
class BenchmarkResults:
    """All modes' results (``results[mode]``), the device, and the table as text.

    Also a mapping of mode value (``"amp"``) to :class:`ModeResult`: ``items()``, ``keys()``,
    ``values()``, ``len()``, ``in`` (the seeds' ``for mode, result in results.items()``).
    """

    device: str
    warmup: int
    steps: int
    results: dict[OptimizationMode, ModeResult] = field(default_factory=dict)

    def __getitem__(self, mode: OptimizationMode | str) -> ModeResult:
        return self.results[OptimizationMode.parse(mode, "mode")]

    # Mapping of mode value ("amp") -> ModeResult, as the seeds iterate it.
    def items(self):
        return [(m.value, r) for m, r in self.results.items()]

    def keys(self):
        return [m.value for m in self.results]

    def values(self):
        return list(self.results.values())

    def __iter__(self):
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.results)

    def __contains__(self, mode: object) -> bool:
        try:
            return OptimizationMode.parse(mode, "mode") in self.results  # type: ignore[arg-type]
        except ValueError:
            return False

    def as_dict(self) -> dict[str, Any]:
        return {"device": self.device, "warmup": self.warmup, "steps": self.steps,
                "modes": {m.value: r.as_dict() for m, r in self.results.items()}}

    def table(self) -> str:
        """A fixed-width table; speedups are NONE's printed median over each printed median."""
        kinds = {r.memory_kind for r in self.results.values() if r.memory_kind}
        mem_head = "memory MB" + (f" ({kinds.pop()})" if len(kinds) == 1 else "")
        head = ["mode", "status", "median ms", "IQR ms", "speedup", mem_head, "mem saving", "max |dloss|", "notes"]
        rows = [head]
        for r in self.results.values():
            notes = r.error if not r.ok else ", ".join(r.applied) or "-"
            if r.ok and r.skipped:
                notes += "; not applied: " + ", ".join(f"{k} ({v})" for k, v in r.skipped.items())
            rows.append([
                r.mode.value, "ok" if r.ok else "FAILED",
                _fmt(r.median_s, 1e3, "{:.4f}"), _fmt(r.iqr_s, 1e3, "{:.4f}"),
                "-" if r.speedup is None else f"{r.speedup:.3f}x",
                _fmt(r.memory_bytes, 1 / 2**20, "{:.3f}"),
                "-" if r.memory_saving is None else f"{100 * r.memory_saving:+.1f}%",
                _fmt(r.max_abs_loss_diff, 1, "{:.2e}"), (notes or "")[:160],
            ])
        widths = [max(len(row[i]) for row in rows) for i in range(len(head) - 1)]
        lines = []
        for n, row in enumerate(rows):
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1])
            if n == 0:
                lines.append("-" * len(lines[0]))
        return "\n".join(lines) + f"\n({self.device}; {self.warmup} warm-up + {self.steps} timed steps per mode)"


def _fmt(value, scale, pattern) -> str:
    return "-" if value is None else pattern.format(value * scale)


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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seed(seed: int) -> None:
    torch.manual_seed(seed)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)


def _move(batch, device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_move(b, device) for b in batch)
    return batch


def _train_step(om: OptimizedModel, opt, loss_fn, batch) -> torch.Tensor:
    x, y = batch
    opt.zero_grad(set_to_none=True)
    with om.context():
        loss = loss_fn(om(x), y)
    amp_step(loss, opt, om.amp.scaler if om.amp is not None else None)
    return loss.detach()


def _measure_memory(om: OptimizedModel, loss_fn, batch, device) -> tuple[int, str]:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda_peak_allocated"
    x, y = batch
    with SavedTensorMeter(om.module.parameters()) as meter:
        with om.context():
            loss = loss_fn(om(x), y)
    del loss  # no backward, no optimizer step: the trained state is untouched
    return meter.bytes, "saved_activations"


def _run_mode(snapshot: nn.Module, names: dict[int, str], optimizer, loss_fn, batches, mode, warmup, steps, seed, device,
              measure_memory, opts) -> ModeResult:
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

    A mode that raises is reported with its error; the others still run. Spans:
    ``benchmark_optimizations`` with one ``benchmark_optimizations.mode`` child per mode;
    metrics ``torchtrace_optimization_{step_seconds,speedup,memory_bytes}{mode}``.
    """
    wanted = [OptimizationMode.parse(m, "modes") for m in (modes if modes is not None else ALL_MODES)]
    order = [OptimizationMode.NONE] + [m for m in dict.fromkeys(wanted) if m is not OptimizationMode.NONE]
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
    with outer:
        for mode in order:
            span_cm = (tracer.start_as_current_span("benchmark_optimizations.mode",
                                                    attributes={semconv.OPT_MODE: mode.value},
                                                    record_exception=False, set_status_on_exception=False)
                       if tracer else _null())
            with span_cm as span:
                try:
                    res = _run_mode(snapshot, names, optimizer, loss_fn, batches, mode, warmup, steps, seed, device,
                                    measure_memory, opts)
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
    if print_table:
        (file or sys.stdout).write(out.table() + "\n")
    return out


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _compare(res: ModeResult, base: ModeResult | None) -> None:
    if base is None:  # this is NONE itself
        base = res
    if not (res.ok and base.ok):
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


def optimize_training_loop(model: nn.Module, dataloader: Iterable, optimizer: torch.optim.Optimizer,
                           loss_fn: Callable, epochs: int = 1, mode: OptimizationMode | str = OptimizationMode.NONE,
                           **options: Any) -> dict[str, Any]:
    """Train ``model`` in place under ``mode``; return total time and what was measured.

    The optimizer must hold ``model``'s parameters (the optimized wrapper shares them).
    Losses are read to the host once per epoch. Returns ``total_time_s``, ``steps``,
    ``epoch_mean_loss`` (one per epoch), ``final_loss``, ``optimization`` (what was applied
    and skipped) and ``mode``. Options are those of :func:`optimize_model`.
    """
    mode = OptimizationMode.parse(mode, "mode")
    if epochs < 1:
        raise ValueError(f"epochs={epochs}: need epochs >= 1")
    device = model_device(model)
    om = optimize_model(model, mode, **options)
    om.train()
    rt = current.runtime()
    tracer = rt.tracer if rt is not None and not rt.off else None
    span_cm = tracer.start_as_current_span("optimize_training_loop", attributes={semconv.OPT_MODE: mode.value}) \
        if tracer else _null()
    epoch_means: list[float] = []
    steps = 0
    final = None
    with span_cm as span:
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(epochs):
            losses = [_train_step(om, optimizer, loss_fn, _move(batch, device)) for batch in dataloader]
            steps += len(losses)
            if losses:
                values = torch.stack([l.float() for l in losses]).double().cpu()  # one host read per epoch
                epoch_means.append(float(values.mean()))
                final = float(values[-1])
        _sync(device)
        total = time.perf_counter() - t0
        if span is not None:
            span.set_attributes({**om.report.span_attributes(), semconv.TRAIN_TOTAL_S: total,
                                 semconv.TRAIN_STEPS: steps})
    return {"mode": mode.value, "total_time_s": total, "steps": steps, "epochs": epochs,
            "epoch_mean_loss": epoch_means, "final_loss": final, "optimization": om.report.as_dict()}
