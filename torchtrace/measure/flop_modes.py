"""The dispatch mode under which a step's FLOPs are counted (:mod:`torchtrace.measure.flops`):
PyTorch's FlopCounterMode, counting the global total only, letting ops it must not count run
(nested tensors, meta tensors), and the ways in and out of it while a step runs (a compiled
model run eagerly, a count dropped, left early, or not begun while a profiler records)."""

from __future__ import annotations

import contextlib
import sys
import time
from typing import TYPE_CHECKING, Any

import torch
from torch.utils import _python_dispatch, flop_counter
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from torchtrace.measure.flop_rules import RULES

if TYPE_CHECKING:
    from torch._ops import OpOverload, OpOverloadPacket

_profiler_enabled = getattr(getattr(torch._C, "_autograd", None), "_profiler_enabled", None)


def profiler_running() -> bool:
    """True while a ``torch.profiler`` session records in this process (not during its
    schedule's wait and warm-up steps); a call costs about 0.1 us."""
    try:
        return bool(_profiler_enabled()) if _profiler_enabled is not None else False
    except Exception:
        return False


_INNER = getattr(flop_counter, "_FlopCounterMode", None)  # the dispatch mode FlopCounterMode pushes
_current_mode = getattr(_python_dispatch, "_get_current_dispatch_mode", None)  # the innermost one
_OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


_NESTED, _META = 1, 2


def _uncounted(args: tuple, kwargs: dict | None) -> int:
    """:data:`_NESTED` when a nested tensor is among an op's arguments, :data:`_META` when a
    tensor on the meta device is (and none is nested), else 0."""
    found = 0
    for leaf in tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor):
            if leaf.is_nested:
                return _NESTED
            if leaf.is_meta:
                found = _META
    return found


# The class a pushed FlopCounterMode's dispatch mode becomes; None on a torch without that
# mode, where nested tensors made inside a step fail the count.
_DECLINING: type | None = None
if _INNER is not None:
    class _Declining(_INNER):  # type: ignore[misc, valid-type]
        """FlopCounterMode's dispatch mode, except that an op on a nested tensor runs uncounted
        (torch's own mode fails those ops, and the user's step with them) and marks the
        count incomplete, and an op on meta tensors runs uncounted: it computes nothing (a
        FLOP measurement of the user's on a meta-device copy of the model, Lightning's
        ``measure_flops``, doubled the step's count). A mode of the user's below this one
        still sees the op and counts it."""

        def __torch_dispatch__(self, func: OpOverload, types: tuple, args: tuple = (),
                               kwargs: dict | None = None) -> Any:
            uncounted = _uncounted(args, kwargs)
            if uncounted:
                if uncounted == _NESTED:
                    self.counter.incomplete = True
                return func(*args, **(kwargs or {}))
            began = time.perf_counter()
            try:
                result = super().__torch_dispatch__(func, types, args, kwargs)
            except _OUT_OF_MEMORY:
                raise  # the step's own size, not the counter
            except Exception:
                self.counter.failed = True  # the op itself, or the counter's code around it
                raise
            self.counter.note_time(func, args, time.perf_counter() - began)
            return result

    _DECLINING = _Declining


class _GlobalOnly:
    """Stands for FlopCounterMode's ``ModuleTracker``: every FLOP goes to the ``Global`` total,
    the only one torchtrace reads. The tracker's per-module attribution puts hooks on every
    module and a multi-grad hook on their tensors, which fail a model that calls
    ``torch.autograd.grad`` in its own forward (a physics-informed loss, a gradient penalty):
    "A leaf node was passed to _will_engine_execute_node", raised out of the user's step."""

    parents = frozenset({"Global"})

    def __enter__(self) -> "_GlobalOnly":
        return self

    def __exit__(self, *args: object) -> None:
        return None


class _Counter(FlopCounterMode):
    """A FlopCounterMode that counts the global total only (:class:`_GlobalOnly`), lets ops on
    nested tensors run (``incomplete`` says it saw some) and notes an op that raised under it
    (``failed``); a ``void`` count records nothing (:func:`release_counter`)."""

    incomplete = False
    failed = False
    void = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("custom_mapping", RULES)  # recurrent layers, attention on a CPU (flop_rules)
        super().__init__(*args, **kwargs)
        if hasattr(self, "mod_tracker"):
            # A stand-in with the interface FlopCounterMode uses; torch types the slot as its class.
            self.mod_tracker = _GlobalOnly()  # type: ignore[assignment]
        self.by_dtype: dict[torch.dtype, int] = {}  # FLOPs counted per dtype of the op's first tensor
        # Host seconds of the ops run under the count, all and those with no FLOP rule; only on
        # a CPU are they the ops' run time (a GPU op's launch returns before it ran): `on_device`.
        self.op_s = 0.0
        self.unruled_s = 0.0
        self.on_device = False

    def note_time(self, func: OpOverload, args: tuple, seconds: float) -> None:
        """One op's host time, booked as with or without a FLOP rule (see :meth:`unruled_share`)."""
        self.op_s += seconds
        if func._overloadpacket not in self.flop_registry:
            self.unruled_s += seconds
        if not self.on_device:
            for arg in args:
                if isinstance(arg, torch.Tensor):
                    self.on_device = arg.device.type != "cpu"
                    break

    def unruled_share(self) -> float | None:
        """The share of the counted ops' time spent in ops with no FLOP rule (element-wise work,
        normalisation, the optimizer's update, kernels the counter does not know); None when an
        op ran on an accelerator, whose time the host cannot see without a synchronisation."""
        if self.on_device or self.op_s <= 0.0:
            return None
        return self.unruled_s / self.op_s

    def _count_flops(self, func_packet: OpOverloadPacket, out: object, args: tuple, kwargs: dict) -> Any:
        """FlopCounterMode's per-op count (torch 2.1 and later), and the op's FLOPs by the dtype
        it computed in: the precision the step's matrix products really ran at, autocast
        inside the step included, which the step's end can no longer see."""
        before = self._global_count(func_packet)
        result = super()._count_flops(func_packet, out, args, kwargs)
        after = self._global_count(func_packet)
        if before is not None and after is not None and after > before:
            for arg in args:
                if isinstance(arg, torch.Tensor):
                    self.by_dtype[arg.dtype] = self.by_dtype.get(arg.dtype, 0) + after - before
                    break
        return result

    def _global_count(self, func_packet: OpOverloadPacket) -> int | None:
        """The op's FLOPs counted so far; None when this torch keeps its counts otherwise (the
        dtype is then not learnt, and the step's count goes on)."""
        try:
            return int(self.flop_counts.get("Global", {}).get(func_packet, 0))
        except Exception:
            return None

    def compute_dtype(self) -> torch.dtype | None:
        """The dtype most of the counted FLOPs ran in; None when none was seen."""
        return max(self.by_dtype, key=self.by_dtype.__getitem__) if self.by_dtype else None

    def __enter__(self) -> "_Counter":
        super().__enter__()
        if _DECLINING is not None and type(getattr(self, "mode", None)) is _INNER:
            self.mode.__class__ = _DECLINING  # the pushed mode itself: no torch internals re-done
        return self


def eager_for_now() -> contextlib.AbstractContextManager[object]:
    """``torch.compile``d code runs eagerly inside (no compilation, nothing cached): first called
    under the FLOP counter's dispatch mode, torch would never compile it after."""
    dynamo = sys.modules.get("torch._dynamo")
    stance = getattr(dynamo, "set_stance", None) if dynamo is not None else None
    if stance is None:
        return contextlib.nullcontext()
    return stance("force_eager")


def drop_counter(counter: contextlib.ExitStack) -> None:
    """Leave a step's FLOP counter without recording its count (the step was abandoned: what
    it counted so far is part of a step)."""
    abandoned = RuntimeError("torchtrace: step abandoned")
    counter.__exit__(RuntimeError, abandoned, None)


def leave_counter(counter: contextlib.ExitStack) -> bool:
    """Drop a step's FLOP counter while the step goes on, when its dispatch mode is the
    innermost one; else leave it open (False). Leaving a mode pops whatever mode is on top of
    torch's stack: with the user's own mode entered inside the step (their FlopCounterMode),
    it was theirs, and their count came out wrong."""
    mode = _current_mode() if _current_mode is not None else None
    if mode is None or not (type(mode) is _DECLINING or isinstance(mode, _Counter)):
        return False
    drop_counter(counter)
    return True


def release_counter(counter: contextlib.ExitStack) -> bool:
    """Take a count off a step that turned out to hold steps (an epoch): left at once when its
    dispatch mode is the innermost one (True, :func:`leave_counter`); else, below a mode of
    the user's, it stays open to be closed in its turn and records nothing (False). Left open
    and recorded, it counted the whole epoch, work its steps count too."""
    if leave_counter(counter):
        return True
    mode = getattr(counter, "mode", None)
    if isinstance(mode, _Counter):
        mode.void = True
    return False


__all__ = ["drop_counter", "eager_for_now", "leave_counter", "profiler_running", "release_counter"]
