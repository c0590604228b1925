"""``optimize_model``: AMP, compilation and activation checkpointing, applied and reported.

``optimize_model(model, mode)`` returns an :class:`OptimizedModel` sharing the user's
parameters (an optimizer built on either sees the same tensors);
``@optimize_model(mode=...)`` decorates a step or inference function whose arguments hold
the model. Every application opens an ``optimize_model`` span saying what was applied and
what was not, and why: nothing fails the job because an optimization is unavailable.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import shutil
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, TypedDict

import torch
from torch import nn

from torchtrace import current, semconv
from torchtrace.errors import get_logger
from torchtrace.levels import OptimizationMode
from torchtrace.optimize import amp as amp_mod
from torchtrace.optimize import checkpointing
from torchtrace.optimize.amp import _DTYPES, AmpState, _current_amp, amp_step, current_amp  # noqa: F401

logger = get_logger(__name__)

AMP, COMPILE, CHECKPOINT = "amp", "compilation", "activation_checkpointing"
_WANTS = {
    OptimizationMode.NONE: (),
    OptimizationMode.AMP: (AMP,),
    OptimizationMode.COMPILATION: (COMPILE,),
    OptimizationMode.MEMORY_EFFICIENT: (CHECKPOINT,),
    OptimizationMode.FULL_OPTIMIZATION: (AMP, COMPILE, CHECKPOINT),
}


@dataclass
class OptimizationReport:
    """What one application of a mode did: ``applied`` names, ``skipped`` name → reason."""

    mode: OptimizationMode
    device: str
    applied: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    amp_dtype: str | None = None
    grad_scaler: bool = False
    compile_backend: str | None = None
    compile_fallback: str | None = None  # why compilation fell back to eager, if it did
    checkpointed: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"mode": self.mode.value, "device": self.device, "applied": list(self.applied),
                "skipped": dict(self.skipped), "amp_dtype": self.amp_dtype, "grad_scaler": self.grad_scaler,
                "compile_backend": self.compile_backend, "compile_fallback": self.compile_fallback,
                "checkpointed": list(self.checkpointed)}

    def span_attributes(self) -> dict[str, Any]:
        attrs: dict[str, Any] = {
            semconv.OPT_MODE: self.mode.value, semconv.OPT_DEVICE: self.device,
            semconv.OPT_APPLIED: list(self.applied),
            semconv.OPT_SKIPPED: [f"{k}: {v}"[:semconv.MAX_ATTRIBUTE_LENGTH] for k, v in self.skipped.items()],
        }
        if self.amp_dtype:
            attrs[semconv.OPT_AMP_DTYPE] = self.amp_dtype
            attrs[semconv.OPT_GRAD_SCALER] = self.grad_scaler
        if self.compile_backend:
            attrs[semconv.OPT_COMPILE_BACKEND] = self.compile_backend
        if self.compile_fallback:
            attrs[semconv.OPT_COMPILE_FALLBACK] = self.compile_fallback[:semconv.MAX_ATTRIBUTE_LENGTH]
        if self.checkpointed:
            attrs[semconv.OPT_CHECKPOINTED] = self.checkpointed[:semconv.MAX_NAMES_PER_ATTRIBUTE]
        return attrs


def failure_reason(exc: BaseException, limit: int = 300) -> str:
    """One line naming an exception and its root cause (dynamo wraps backend errors)."""
    root, seen = exc, 0
    while seen < 10:
        nxt = getattr(root, "inner_exception", None) or root.__cause__
        if nxt is None:
            break
        root, seen = nxt, seen + 1
    text = f"{type(exc).__name__}: {exc}" if root is exc else f"{type(exc).__name__} ({type(root).__name__}: {root})"
    return " ".join(text.split())[:limit]


def model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    for b in model.buffers():
        return b.device
    return torch.device("cpu")


def _amp_state(device: torch.device, amp_dtype, report: OptimizationReport) -> AmpState | None:
    state, why = amp_mod.amp_state(device, amp_dtype)
    if state is None:
        report.skipped[AMP] = why
        return None
    report.applied.append(AMP)
    report.amp_dtype = str(state.dtype).replace("torch.", "")
    report.grad_scaler = state.scaler is not None
    return state


def compile_unavailable(backend: str, device: torch.device) -> str | None:
    """Why ``torch.compile`` cannot work here, or None when nothing is known against it."""
    if not hasattr(torch, "compile"):
        return "torch.compile is not available in this PyTorch"
    try:
        import torch._dynamo as dynamo
        if not dynamo.is_dynamo_supported():
            return "TorchDynamo does not support this Python version or platform"
    except Exception as exc:  # noqa: BLE001 - any import failure is a reason to fall back
        return f"TorchDynamo cannot be imported: {type(exc).__name__}: {exc}"
    if backend == "inductor" and device.type == "cpu":
        if not (os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")):
            return "no C++ compiler found: inductor needs one for CPU code"
    return None


class OptimizedModel(nn.Module):
    """The user's model with the mode's optimizations around its forward.

    Parameters, buffers and ``state_dict`` are the wrapped model's (keys unchanged); calling
    the original model directly is unaffected (checkpointing is installed only during
    this wrapper's forward). A compiled forward that fails on its first call falls back to
    eager for good, and the reason is kept in ``report.compile_fallback``.
    """

    def __init__(self, module: nn.Module, report: OptimizationReport, amp: AmpState | None,
                 plan: checkpointing.CheckpointPlan | None, compiled: Callable | None) -> None:
        super().__init__()
        self.module = module
        self.report = report
        self.amp = amp
        self._plan = plan
        object.__setattr__(self, "_compiled", compiled)  # not a submodule: same parameters
        self._compiled_ok = False

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None:
                raise
            return getattr(module, name)  # model.encoder, model.config, ... of the wrapped model

    def _call_view(self) -> nn.Module:
        """What a decorated function receives: this wrapper when compiling, else the model."""
        return self if self.report.compile_backend else self.module

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    @contextlib.contextmanager
    def context(self) -> Iterator[AmpState | None]:
        """Autocast and checkpointing as this wrapper applies them (for loss code too)."""
        token = _current_amp.set(self.amp) if self.amp is not None else None
        try:
            with (self.amp.autocast() if self.amp is not None else contextlib.nullcontext()):
                with (checkpointing.installed(self._plan) if self._plan is not None else contextlib.nullcontext()):
                    yield self.amp
        finally:
            if token is not None:
                _current_amp.reset(token)

    def forward(self, *args, **kwargs):
        with self.context():
            return self._run(self.module, args, kwargs)

    def _run(self, module, args, kwargs):
        compiled = self._compiled
        if compiled is None:
            return module(*args, **kwargs)
        if self._compiled_ok:
            return compiled(*args, **kwargs)
        try:
            out = compiled(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - compilation errors take many types
            self._fall_back(failure_reason(exc))
            return module(*args, **kwargs)  # the user's own error raises here, unchanged
        self._compiled_ok = True
        return out

    def _fall_back(self, reason: str) -> None:
        object.__setattr__(self, "_compiled", None)
        report = self.report
        report.compile_fallback = reason
        if COMPILE in report.applied:
            report.applied.remove(COMPILE)
        report.skipped[COMPILE] = f"fell back to eager: {reason}"
        logger.warning("torch.compile failed on the first call (%s); running eager", reason)
        _record_fallback(report)


def _record_fallback(report: OptimizationReport) -> None:
    rt = current.runtime()
    if rt is None or rt.off:
        return
    try:
        with rt.tracer.start_as_current_span("optimize_model.fallback", attributes=report.span_attributes()):
            pass
    except Exception as exc:  # noqa: BLE001
        rt.errors.report("other", exc)


class _Options(TypedDict):
    """optimize_model's options, as _apply takes them."""

    amp_dtype: str | torch.dtype | None
    compile_backend: str | Callable
    compile_options: dict | None


def _apply(model: nn.Module, mode: OptimizationMode, *, amp_dtype: str | torch.dtype | None = None,
           compile_backend: str | Callable = "inductor",
           compile_options: dict | None = None, device: torch.device | None = None) -> OptimizedModel:
    device = device or model_device(model)
    report = OptimizationReport(mode=mode, device=str(device))
    wants = _WANTS[mode]
    full = mode is OptimizationMode.FULL_OPTIMIZATION
    amp = _amp_state(device, amp_dtype, report) if AMP in wants else None
    plan = None
    if CHECKPOINT in wants:
        plan = checkpointing.plan_checkpointing(model)
        for name, reason in plan.skipped.items():
            report.skipped[f"{CHECKPOINT}:{name}"] = reason
        if plan.empty:
            report.skipped[CHECKPOINT] = "no repeated blocks or long nn.Sequential found"
            plan = None
        else:
            report.applied.append(CHECKPOINT)
            report.checkpointed = list(plan.names)
    compiled = None
    if COMPILE in wants:
        backend_name = compile_backend if isinstance(compile_backend, str) else getattr(
            compile_backend, "__name__", type(compile_backend).__name__)
        report.compile_backend = backend_name
        why = compile_unavailable(backend_name, device)
        if why is None:
            try:
                compiled = torch.compile(model, backend=compile_backend, **(compile_options or {}))
                report.applied.append(COMPILE)
            except Exception as exc:  # noqa: BLE001 - unknown backend, bad options, ...
                why = failure_reason(exc)
        if why is not None:
            report.compile_fallback = why
            report.skipped[COMPILE] = f"fell back to eager: {why}"
            if not full:
                logger.warning("torch.compile unavailable (%s); running eager", why)
    return OptimizedModel(model, report, amp, plan, compiled)


def _traced(mode: OptimizationMode, build: Callable[[], OptimizedModel]) -> OptimizedModel:
    rt = current.runtime()
    if rt is None or rt.off:
        return build()
    with rt.tracer.start_as_current_span("optimize_model", attributes={semconv.OPT_MODE: mode.value}) as span:
        result = build()  # the user's errors (none expected) propagate, recorded on the span
        try:
            span.set_attributes(result.report.span_attributes())
        except Exception as exc:  # noqa: BLE001
            rt.errors.report("tracing", exc)
        return result


def optimize_model(model: nn.Module | None = None, mode: OptimizationMode | str | None = None,
                   *, amp_dtype: str | torch.dtype | None = None, compile_backend: str | Callable = "inductor",
                   compile_options: dict | None = None, optimization_mode: OptimizationMode | str | None = None):
    """Apply an optimization mode to a model, or decorate a function taking one.

    Args:
        model: an ``nn.Module``: returns an :class:`OptimizedModel`. Omitted: returns a
            decorator for a function whose first ``nn.Module`` argument is the model.
        mode: NONE, AMP (autocast: bfloat16 on CPU, float16 + GradScaler on CUDA),
            COMPILATION (``torch.compile``, eager fallback with the reason recorded),
            MEMORY_EFFICIENT (activation checkpointing of repeated blocks),
            FULL_OPTIMIZATION (all that apply on this device).
        amp_dtype: "bfloat16" or "float16" to override the device default.
        compile_backend: ``torch.compile`` backend ("inductor", "aot_eager", "eager", or a
            backend callable).
        compile_options: further keyword arguments for ``torch.compile``.
        optimization_mode: the seeds' name for ``mode`` (``@optimize_model(optimization_mode=
            OptimizationMode.AMP)``); give one of the two. Default FULL_OPTIMIZATION.

    Raises:
        ValueError: a mode or amp_dtype that does not exist, or ``mode`` and
            ``optimization_mode`` that disagree (at decoration time).

    >>> net = optimize_model(torch.nn.Linear(4, 2), "amp")
    >>> net(torch.randn(3, 4)).dtype
    torch.bfloat16
    >>> @optimize_model(mode="amp")
    ... def predict(model, x):
    ...     return model(x)
    """
    mode = _one_mode(mode, optimization_mode)
    if amp_dtype is not None and not isinstance(amp_dtype, torch.dtype) and str(amp_dtype).lower() not in _DTYPES:
        raise ValueError(f"amp_dtype={amp_dtype!r} is not valid; accepted values: bfloat16, float16")
    opts = _Options(amp_dtype=amp_dtype, compile_backend=compile_backend, compile_options=compile_options)
    if isinstance(model, nn.Module):
        return _traced(mode, lambda: _apply(model, mode, **opts))
    if model is not None and callable(model):  # @optimize_model without arguments
        return _decorator(mode, opts)(model)
    if model is not None:
        raise TypeError(f"optimize_model expects an nn.Module or a function, got {type(model).__name__}")
    return _decorator(mode, opts)


def _one_mode(mode: OptimizationMode | str | None, optimization_mode: OptimizationMode | str | None
              ) -> OptimizationMode:
    """``mode`` or its seed name ``optimization_mode``; both only when they agree."""
    a = OptimizationMode.parse(mode, "mode") if mode is not None else None
    b = OptimizationMode.parse(optimization_mode, "optimization_mode") if optimization_mode is not None else None
    if a is not None and b is not None and a is not b:
        raise ValueError(f"mode={a.value!r} contradicts optimization_mode={b.value!r}; give one of them")
    return a or b or OptimizationMode.FULL_OPTIMIZATION


def _decorator(mode: OptimizationMode, opts: _Options) -> Callable[[Callable], Callable]:
    def decorate(fn: Callable) -> Callable:
        cache: "weakref.WeakKeyDictionary[nn.Module, OptimizedModel]" = weakref.WeakKeyDictionary()

        def prepare(args, kwargs):
            for i, a in enumerate(args):
                if isinstance(a, nn.Module) and not isinstance(a, OptimizedModel):
                    opt = _get(a)
                    return opt, args[:i] + (opt._call_view(),) + args[i + 1:], kwargs
            for k, a in kwargs.items():
                if isinstance(a, nn.Module) and not isinstance(a, OptimizedModel):
                    opt = _get(a)
                    return opt, args, {**kwargs, k: opt._call_view()}
            return None, args, kwargs

        def _get(module):
            opt = cache.get(module)
            if opt is None:
                opt = _traced(mode, lambda: _apply(module, mode, **opts))
                cache[module] = opt
            return opt

        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def async_wrapper(*args, **kwargs):
                opt, args, kwargs = prepare(args, kwargs)
                if opt is None:
                    return await fn(*args, **kwargs)
                with opt.context():
                    return await fn(*args, **kwargs)
            async_wrapper.optimized = cache  # type: ignore[attr-defined]
            return async_wrapper

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            opt, args, kwargs = prepare(args, kwargs)
            if opt is None:
                return fn(*args, **kwargs)
            with opt.context():
                return fn(*args, **kwargs)
        wrapper.optimized = cache  # type: ignore[attr-defined]
        return wrapper
    return decorate
