"""How fast a step ran: its batch (samples, tokens), FLOPs, learning rate and phases, and the
run's goodput accounting.

On the training thread a step pays for: reading the batch's shapes (no host read: a mask's
token count rides in the step's one read), a dictionary lookup of the FLOPs of its input
shapes (counted once per shape under ``FlopCounterMode``; that step is left out of
throughput), the optimizer's learning rates, and four clock reads at the phase boundaries
(forward, backward, optimizer; CUDA events on a GPU, read with the step's deferred read).
:class:`RunThroughput` then books each finished record in the goodput ledger
(:mod:`torchtrace.record.goodput`), which gives the data wait, MFU and the throughput rules.
"""

from __future__ import annotations

import contextlib
import sys
import time
import warnings
import weakref
from typing import Any, Hashable

import torch

from torchtrace import current
from torchtrace.measure import peaks
from torchtrace.measure.batch import BatchSize, infer_batch
from torchtrace.measure.flops import StepFlops, shape_key
from torchtrace.record.goodput import GoodputLedger
from torchtrace.record.step import Anomaly, StepRecord


class StepClock:
    """The phase boundaries of one step: host times, or CUDA events when the model is on a GPU."""

    __slots__ = ("forward_start", "forward_end", "optimizer_start", "optimizer_end", "cuda")

    def __init__(self, cuda: bool) -> None:
        self.forward_start: Any = None
        self.forward_end: Any = None
        self.optimizer_start: Any = None
        self.optimizer_end: Any = None
        self.cuda = cuda

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def phases(self, step_end: Any) -> dict[str, float] | None:
        """Seconds per phase; None when the forward was not seen. Backward runs from the end of
        the forward to the optimizer's step (or to the end of the step without one)."""
        if self.forward_start is None or self.forward_end is None:
            return None
        if not self.cuda:  # host times: plain differences (the common case, kept short)
            f0, f1, o0, o1 = self.forward_start, self.forward_end, self.optimizer_start, self.optimizer_end
            if o0 is not None and o1 is not None:
                return {"forward": max(0.0, f1 - f0), "backward": max(0.0, o0 - f1), "optimizer": max(0.0, o1 - o0)}
            if step_end is None:
                return {"forward": max(0.0, f1 - f0)}
            return {"forward": max(0.0, f1 - f0), "backward": max(0.0, step_end - f1)}
        out = {"forward": self._between(self.forward_start, self.forward_end)}
        if self.optimizer_start is not None and self.optimizer_end is not None:
            out["backward"] = self._between(self.forward_end, self.optimizer_start)
            out["optimizer"] = self._between(self.optimizer_start, self.optimizer_end)
        elif step_end is not None:
            out["backward"] = self._between(self.forward_end, step_end)
        if any(v is None for v in out.values()):
            return None
        return out

    def _between(self, a: Any, b: Any) -> float | None:
        if self.cuda:
            # Only events that completed (the record's read landed after them): no wait.
            if not (a.query() and b.query()):
                return None
            return a.elapsed_time(b) / 1000.0
        return max(0.0, b - a)


class _ModelHooks:
    """The marks of the open step's forward phase, kept on a model.

    A plain module gets a call-through in ``_compiled_call_impl``: PyTorch's own per-instance
    seam in ``Module.__call__`` (what ``Module.compile()`` fills), which keeps the module on its
    hook-free path. Forward pre/post hooks cost about three times as much per step (every
    hook sends the call down the slow path). Any other module (one with that seam taken, a
    class with its own ``__call__``, a ``torch.compile`` wrapper) gets the hooks.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.handles: list[Any] = []
        self.model = weakref.ref(model)  # weak: this object is the value of a dict keyed by the model
        self.wrapped = _seam_free(model)
        if self.wrapped:
            model._compiled_call_impl = _call_with_marks(model)
        else:
            # The start mark runs before the user's pre-hooks, the end mark after their hooks:
            # the forward phase is the whole call.
            self.handles = [model.register_forward_pre_hook(self._pre, prepend=True),
                            model.register_forward_hook(self._post)]
        # A parameter to ask where the model lives now (a model moved with .to() keeps its parameters).
        self.first = next(model.parameters(), None)

    @property
    def cuda(self) -> bool:
        return self.first is not None and self.first.is_cuda

    @staticmethod
    def _clock() -> StepClock | None:
        if _COMPILING is not None and _COMPILING():  # inside a torch.compile trace: stay out of the graph
            return None
        scope = current.step()
        return scope.clock if scope is not None else None

    def _pre(self, module: Any, args: Any) -> None:
        clock = self._clock()
        if clock is not None and clock.forward_start is None:
            clock.forward_start = clock.mark()

    def _post(self, module: Any, args: Any, output: Any) -> None:
        clock = self._clock()
        if clock is not None and clock.forward_start is not None and clock.optimizer_start is None:
            clock.forward_end = clock.mark()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        model = self.model()
        if self.wrapped and model is not None:
            if getattr(model.__dict__.get("_compiled_call_impl"), _MARKS, False):  # still ours
                del model.__dict__["_compiled_call_impl"]
        self.wrapped = False


_MARKS = "__torchtrace_phase_marks__"


def _seam_free(model: Any) -> bool:
    """True when the module's call goes through ``Module.__call__`` and its seam is free."""
    return (isinstance(model, torch.nn.Module) and "_compiled_call_impl" in vars(torch.nn.Module)
            and type(model).__call__ is torch.nn.Module.__call__
            and model.__dict__.get("_compiled_call_impl") is None)


def _call_with_marks(model: torch.nn.Module) -> Any:
    """``model``'s own call (hooks and all) between the forward phase's two marks.

    Held only by the model itself (a cycle the garbage collector takes with it); pickling and
    ``copy.deepcopy`` leave it out (``Module.__getstate__`` drops the seam).
    """
    call = model._call_impl

    def call_with_marks(*args: Any, **kwargs: Any) -> Any:
        clock = _ModelHooks._clock()
        if clock is None:
            return call(*args, **kwargs)
        if clock.forward_start is None:
            clock.forward_start = clock.mark()
        out = call(*args, **kwargs)
        if clock.optimizer_start is None:
            clock.forward_end = clock.mark()
        return out

    setattr(call_with_marks, _MARKS, True)
    return call_with_marks


class _OptimizerHooks:
    """Step pre/post hooks kept on an optimizer: they mark the open step's optimizer phase."""

    def __init__(self, optimizer: Any) -> None:
        self.handles = [optimizer.register_step_pre_hook(self._pre), optimizer.register_step_post_hook(self._post)]
        # The start mark first, before pre-hooks the user registered earlier (a pre-hook's time is
        # the optimizer's, not the backward's). The hooks live in an ordered dict keyed by handle id.
        pre = getattr(optimizer, "_optimizer_step_pre_hooks", None)
        if hasattr(pre, "move_to_end") and self.handles[0].id in pre:
            pre.move_to_end(self.handles[0].id, last=False)

    @staticmethod
    def _pre(optimizer: Any, args: Any, kwargs: Any) -> None:
        scope = current.step()
        if scope is not None and scope.clock is not None and scope.clock.optimizer_start is None:
            scope.clock.optimizer_start = scope.clock.mark()

    @staticmethod
    def _post(optimizer: Any, args: Any, kwargs: Any) -> None:
        scope = current.step()
        if scope is not None and scope.clock is not None and scope.clock.optimizer_start is not None:
            scope.clock.optimizer_end = scope.clock.mark()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def learning_rates(optimizer: Any) -> list[float] | None:
    """The learning rate of every parameter group (a tensor rate only when it is on the CPU)."""
    if optimizer is None:
        return None
    out = []
    for group in optimizer.param_groups:
        lr = group.get("lr")
        if isinstance(lr, torch.Tensor):
            if lr.device.type != "cpu" or lr.numel() != 1:
                return None  # reading it would wait for the device
            lr = lr.item()
        if not isinstance(lr, (int, float)):
            return None
        out.append(float(lr))
    return out or None


def _eager_for_now() -> Any:
    """``torch.compile``d code runs eagerly inside (no compilation, nothing cached)."""
    dynamo = sys.modules.get("torch._dynamo")
    stance = getattr(dynamo, "set_stance", None) if dynamo is not None else None
    if stance is None:
        return contextlib.nullcontext()
    return stance("force_eager")


_COMPILING = getattr(getattr(torch, "compiler", None), "is_compiling", None)


def _is_compiling() -> bool:
    return bool(_COMPILING()) if _COMPILING is not None else False


def _compiled(model: Any) -> bool:
    return model is not None and hasattr(model, "_orig_mod")


class RunThroughput:
    """The runtime's side: FLOPs per input shape, phase hooks, peak FLOP/s and the goodput ledger."""

    def __init__(self, rt: Any) -> None:
        self.rt = rt
        self.flops = StepFlops()
        self.ledger = GoodputLedger(configured_at=time.perf_counter(), peak_flops=rt.settings.peak_flops)
        self._models: "weakref.WeakKeyDictionary[Any, _ModelHooks]" = weakref.WeakKeyDictionary()
        self._optimizers: "weakref.WeakKeyDictionary[Any, _OptimizerHooks]" = weakref.WeakKeyDictionary()
        self._peaks: dict[str, float | None] = {}
        self._peak_known = False
        self._batches: dict[Hashable, BatchSize] = {}

    # ------------------------------------------------------------ step start and end
    def batch(self, scope: Any, given: tuple | None) -> BatchSize | None:
        """The step's batch (see :func:`batch_of`). Inputs of one shape key have one batch size
        unless a mask is counted, so what was inferred is kept per key."""
        key = scope.flops_key
        if key is None:
            return batch_of(scope.inputs, given)
        batch = self._batches.get(key)
        if batch is None:
            batch = infer_batch(*scope.inputs)
            if not batch.pending and len(self._batches) < 256:
                self._batches[key] = batch
        if given is not None:
            batch = batch.with_overrides(samples=given[0], tokens=given[1])
        return batch

    @staticmethod
    def key_of(name: str, inputs: tuple | None) -> Hashable | None:
        """The FLOP table's key of a step: its operation and its inputs' shapes."""
        return (name, shape_key(inputs[0], inputs[1])) if inputs is not None else None

    def begin(self, scope: Any, outermost: bool) -> tuple[StepClock | None, Any]:
        """At a step's start: the phase clock, and the FLOP counter when this step counts."""
        model, optimizer = scope.model, scope.optimizer
        clock = None
        if model is not None:
            hooks = self._models.get(model)
            if hooks is None:
                hooks = self._models[model] = _ModelHooks(model)
            if optimizer is not None and optimizer not in self._optimizers:
                self._optimizers[optimizer] = _OptimizerHooks(optimizer)
            clock = StepClock(cuda=hooks.cuda)
        counter = None
        key = scope.flops_key
        if outermost and key is not None and self.flops.needs_count(key) and not _compiled(model):
            counter = contextlib.ExitStack()
            # A module compiled with torch.compile runs eagerly for this one step: first called
            # under the FLOP counter's dispatch mode, torch would never compile it after.
            counter.enter_context(_eager_for_now())
            counter.enter_context(warnings.catch_warnings())
            # The counter's module hooks are torchtrace's, not the user's: no warning about them.
            warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there are global hooks")
            counter.enter_context(self.flops.counting(key))
        return clock, counter

    def end(self, scope: Any, counter: Any, exc: BaseException | None) -> tuple[float | None, bool]:
        """At a step's end: (its FLOPs, whether they were counted in this step)."""
        counted = False
        if counter is not None:
            try:
                if exc is None:
                    counter.__exit__(None, None, None)
                    counted = True
                else:
                    counter.__exit__(type(exc), exc, None)
            except Exception as err:
                self.rt.errors.report("other", err)
        key = scope.flops_key
        flops = self.flops.lookup(key) if key is not None else None
        return flops, counted

    # ------------------------------------------------------------ finished records
    def account(self, scope: Any, record: StepRecord) -> None:
        """Book the record in the goodput ledger: its data wait, and the throughput rules'
        anomalies. (MFU, goodput and badput are read from the ledger when metrics are scraped.)"""
        if record.flops is not None and not self._peak_known:
            self._peak_known = True
            if self.ledger.peak_flops is None:
                self.ledger.peak_flops = self._peak(scope)
        start = scope.started_at
        flops = record.flops
        account = self.ledger.add(start, start + record.duration_s,
                                  not record.skipped and record.exception_type is None, record.flops_counted,
                                  record.samples, record.tokens, int(flops) if flops is not None else None,
                                  record.kind, record.operation)
        record.data_wait_s = account.data_wait_s
        for finding in account.findings:
            record.anomalies.append(Anomaly(finding.kind, finding.detail, record.step, record.operation,
                                            dict(finding.data)))

    def replay(self, start: float, end: float) -> None:
        """A forensic replay ran from ``start`` to ``end`` (perf_counter seconds)."""
        self.ledger.add_forensics(start, end)

    def scrape(self) -> tuple[float | None, dict[str, float], dict[str, float | None]]:
        """For ``/metrics``: the goodput ratio now, badput seconds by kind (final counts: they
        only grow), and each operation's MFU over its last window."""
        mfu = {}
        for name in list(self.rt.history.operations):
            tp = self.ledger.throughput(name)
            if tp is not None and tp.mfu is not None:
                mfu[name] = tp.mfu
        return self.ledger.snapshot(time.perf_counter()).ratio, self.ledger.closed().badput, mfu

    def _peak(self, scope: Any) -> float | None:
        model = scope.model
        if model is None:
            return None
        try:
            param = next(model.parameters())
        except StopIteration:
            return None
        dtype = torch.get_autocast_dtype(param.device.type) if torch.is_autocast_enabled(param.device.type) \
            else param.dtype
        key = f"{param.device}/{dtype}"
        if key not in self._peaks:
            self._peaks[key] = peaks.peak_flops(param.device, dtype)
        return self._peaks[key]

    def section(self) -> dict[str, Any]:
        g = self.ledger.snapshot(time.perf_counter())
        ops = {}
        for name in list(self.rt.history.operations):
            tp = self.ledger.throughput(name)
            if tp is not None:
                ops[name] = {"steps": tp.steps, "seconds": tp.seconds, "samples_per_s": tp.samples_per_s,
                             "tokens_per_s": tp.tokens_per_s, "flops_per_s": tp.flops_per_s, "mfu": tp.mfu,
                             "data_wait_share": tp.data_wait_share}
        return {"wall_s": g.wall_s, "productive_s": g.productive_s, "goodput_ratio": g.ratio, "badput_s": g.badput,
                "peak_flops": self.ledger.peak_flops, "flop_counted_shapes": len(self.flops), "operations": ops}

    def release(self) -> None:
        """Remove the phase hooks (throughput went off): a model called at level OFF, or with
        ``throughput=False``, takes PyTorch's hook-free path. The next step that measures
        throughput puts them back."""
        self.close()

    def close(self) -> None:
        for hooks in list(self._models.values()) + list(self._optimizers.values()):
            hooks.remove()
        self._models.clear()
        self._optimizers.clear()


def batch_of(inputs: tuple | None, given: tuple | None) -> BatchSize | None:
    """The step's batch: inferred from its inputs, with what ``record_batch`` gave in place."""
    batch = infer_batch(inputs[0], inputs[1]) if inputs is not None else None
    if given is not None:
        batch = (batch or BatchSize()).with_overrides(samples=given[0], tokens=given[1])
    return batch


def fill_throughput(record: Any, batch: Any, given_flops: float | None, counted_flops: float | None,
                    counted: bool, lr: Any, optimizer: Any) -> None:
    """A step's samples, tokens, FLOPs and learning rates on its record.

    ``given_flops`` is what ``record_batch(flops=)`` said (it wins over the counted ones);
    ``lr`` the rates read when the update was about to happen (a scheduler may have stepped
    since), else the optimizer's rates now.
    """
    if batch is not None:
        record.samples = batch.samples
        if batch.tokens is not None and not isinstance(batch.tokens, torch.Tensor):
            record.tokens = int(batch.tokens)
    record.flops = given_flops if given_flops is not None else counted_flops
    record.flops_counted = counted and given_flops is None
    record.lr = lr if lr is not None else learning_rates(optimizer)


__all__ = ["RunThroughput", "StepClock", "batch_of", "fill_throughput", "learning_rates"]
