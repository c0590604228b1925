"""Gradient statistics with fused multi-tensor kernels, computed on the device.

The non-finite check comes from the norms: a tensor's L2 norm is NaN exactly when the tensor
holds a NaN. An infinite norm means an Inf element *or* a sum of squares that overflowed
(large finite values); :func:`classify_infinite` tells the two apart on the rare path.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch

from torchtrace.distributed import collectives
from torchtrace.measure.names import user_name, wrapper_prefix

_LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclass
class ParamRef:
    """A parameter that may carry a gradient, with its name in the model."""

    name: str
    param: torch.Tensor


@dataclass
class GradStats:
    """Per-tensor gradient norms on the device, in the order of ``names``.

    ``norms`` is a float32 (or float64 when any gradient is float64) 1-D tensor that stays on
    the device until the record's single host read; the global norm is computed from the
    host copy (:func:`global_norm`), or on the device by :attr:`total` when a caller wants it
    there.
    """

    names: list[str]
    norms: torch.Tensor
    grads: list[torch.Tensor]  # dense views used; kept only until the record is read
    scope: str = "global"  # "local" when some DTensor shard norms could not be combined across ranks
    # The norms as measured, where ``norms`` were divided by a loss scale the gradients still
    # carry (:func:`unscaled`): those of the tensors as they are, which a clip's total is made of.
    measured: torch.Tensor | None = None

    @property
    def as_measured(self) -> torch.Tensor:
        """The norms of the gradient tensors as they are (scaled, where they carry a loss scale)."""
        return self.norms if self.measured is None else self.measured

    @property
    def count(self) -> int:
        return len(self.names)

    @property
    def total(self) -> torch.Tensor:
        """The global L2 norm as a 0-d float64 device tensor (one more kernel; no host read)."""
        return torch.linalg.vector_norm(self.norms, dtype=torch.float64)


def global_norm(norms: Sequence[float]) -> float:
    """The global L2 norm from the per-tensor norms, in float64 on the host.

    NaN when any norm is NaN, else infinite when any is infinite.

    >>> global_norm([3.0, 4.0])
    5.0
    """
    total = math.hypot(*norms)
    if not math.isfinite(total) and any(math.isnan(v) for v in norms):
        return math.nan
    return total


def named_params(model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None) -> list[ParamRef]:
    """The parameters to watch, deduplicated (shared parameters appear once).

    With an optimizer, exactly the tensors it updates, named after the model when one is
    given; otherwise the model's parameters. Names are the user's model's, without a wrapper's
    prefix (:mod:`torchtrace.measure.names`: DDP's ``module.``, torch.compile's ``_orig_mod.``).
    """
    names: dict[int, str] = {}
    if model is not None:
        prefix = wrapper_prefix(model)
        for name, p in model.named_parameters(remove_duplicate=True):
            names.setdefault(id(p), user_name(name, prefix))
    refs: list[ParamRef] = ParamList()
    seen: set[int] = set()
    if optimizer is not None:
        for gi, group in enumerate(optimizer.param_groups):
            for pi, p in enumerate(group["params"]):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                refs.append(ParamRef(names.get(id(p), f"group{gi}.param{pi}"), p))
        return refs
    if model is not None:
        for p in model.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                refs.append(ParamRef(names[id(p)], p))
    return refs


def dense(grad: torch.Tensor) -> torch.Tensor:
    """The values whose norm is the gradient's norm, for every layout torch uses."""
    if type(grad) is torch.Tensor and grad.layout is torch.strided:  # the common case, cheaply
        return grad
    if grad.is_sparse:
        return grad.coalesce().values()
    if grad.layout in (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc):
        return grad.values()
    if hasattr(grad, "to_local") and type(grad).__name__ == "DTensor":
        return grad.to_local()
    return grad


def _uniform_dense(params: Sequence[ParamRef]) -> GradStats | None:
    """The common step, cheaply: every parameter has a plain strided floating-point gradient of
    one dtype on one device. None sends the caller to the general path (missing gradients,
    sparse, DTensor, mixed dtypes or devices, low precision)."""
    grads = [ref.param.grad for ref in params]
    if not grads:
        return None
    first = grads[0]
    if type(first) is not torch.Tensor:
        return None
    dtype, device, strided = first.dtype, first.device, torch.strided
    if dtype is not torch.float32 and dtype is not torch.float64:
        return None
    for g in grads:
        # A dense gradient has its parameter's dtype and device (autograd checks it on
        # assignment): the device compare, the costly one, runs only past a dtype change.
        if type(g) is not torch.Tensor or g.layout is not strided or g.dtype is not dtype:
            return None
    if _mixed_devices(params, device):
        return None
    # (every gradient is a dense tensor here: the loop above returned on anything else)
    try:
        norms = torch.stack(torch._foreach_norm(grads, 2))  # type: ignore[arg-type]
    except RuntimeError:  # moved since the device check: the general path sorts it out
        return None
    return GradStats(names=[ref.name for ref in params], norms=norms, grads=grads)  # type: ignore[arg-type]


def _mixed_devices(params: Sequence[ParamRef], device: torch.device) -> bool:
    """Whether the parameters live on more than one device (checked once per parameter list
    that :func:`named_params` made; other sequences every time)."""
    key = id(params)
    hit = _DEVICES.get(key)
    if hit is not None and hit[0]() is params:
        return hit[1]
    mixed = any(ref.param.device != device for ref in params)
    try:
        # Weakly: the cache must not keep a dropped model's parameters (its memory) alive.
        entry = (weakref.ref(params), mixed)
    except TypeError:  # a plain list: no weak reference, no caching
        return mixed
    if len(_DEVICES) > 64:
        _DEVICES.clear()
    _DEVICES[key] = entry
    return mixed


_DEVICES: dict[int, tuple[Any, bool]] = {}


class ParamList(list):
    """The list :func:`named_params` returns: a list that can be referenced weakly."""

    __slots__ = ("__weakref__",)


def gradient_norms(params: Sequence[ParamRef]) -> GradStats | None:
    """Per-tensor L2 norms of the gradients, on the device, without a host read.

    For sharded (DTensor / FSDP2) gradients the local shard norms are combined across the
    shard group (:func:`torchtrace.distributed.collectives.reduce_shard_norms`, one
    ``all_reduce``), so every rank gets the norms of the whole tensors; every rank must call
    this at the same point. DDP gradients are already reduced and need nothing.

    Parameters without a gradient are left out. Low-precision gradients are reduced in
    float32 so a large finite fp16 gradient does not overflow its norm. Returns ``None`` when
    no parameter has a gradient.
    """
    fast = _uniform_dense(params)
    if fast is not None:
        return fast
    names: list[str] = []
    grads: list[torch.Tensor] = []
    keys: list[tuple | None] = []
    for ref in params:
        g = ref.param.grad
        if g is None:
            continue
        names.append(ref.name)
        keys.append(collectives.shard_key(g))
        grads.append(dense(g))
    if not grads:
        return None
    norms, order = _grouped_norms(grads)
    if order is not None:
        # Names follow the grouped order so no device-side permutation is needed.
        names = [names[i] for i in order]
        grads = [grads[i] for i in order]
        keys = [keys[i] for i in order]
    scope = "global"
    if any(k is not None for k in keys):
        # DTensor (FSDP2) gradients: the norms so far are of the local shards.
        try:
            norms, scope = collectives.reduce_shard_norms(norms, keys)
        except Exception:  # already logged; collectives are off from now on
            scope = "local"
    return GradStats(names=names, norms=norms, grads=grads, scope=scope)


def unscaled(stats: GradStats, scale: torch.Tensor) -> GradStats:
    """The norms of gradients that still carry a loss scaler's ``scale`` (a device tensor of one
    element), divided by it on the device: those of the gradients the update applies. (The
    scale is a power of two: the division is exact.)"""
    norms = stats.norms / scale.detach().to(stats.norms.device, stats.norms.dtype).reshape(())
    return GradStats(names=stats.names, norms=norms, grads=stats.grads, scope=stats.scope, measured=stats.as_measured)


def remeasured(stats: GradStats | None, again: GradStats) -> GradStats:
    """``stats`` with the tensors measured ``again`` (a later update's, after a backward of its
    own) taking their new norms; tensors new to ``stats`` are added after the others."""
    if stats is None:
        return again
    renamed = set(again.names)
    keep = [i for i, name in enumerate(stats.names) if name not in renamed]
    dtype = torch.promote_types(stats.norms.dtype, again.norms.dtype)
    rows = torch.tensor(keep, dtype=torch.long, device=stats.norms.device)

    def merged(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        return torch.cat([first[rows].to(dtype), second.to(stats.norms.device, dtype)])

    scaled = stats.measured is not None or again.measured is not None
    return GradStats(names=[stats.names[i] for i in keep] + list(again.names), norms=merged(stats.norms, again.norms),
                     grads=[stats.grads[i] for i in keep] + list(again.grads) if stats.grads else list(again.grads),
                     scope="local" if "local" in (stats.scope, again.scope) else stats.scope,
                     measured=merged(stats.as_measured, again.as_measured) if scaled else None)


GradientMark = tuple["weakref.ref[torch.Tensor] | None", int]


def gradient_mark(param: torch.Tensor) -> GradientMark:
    """Where ``param``'s gradient stands: a weak reference to its tensor and the tensor's version
    (a backward sets it, or adds to it in place); ``(None, 0)`` while it has none. No device
    value is read. The reference is weak: it keeps no gradient alive, and a tensor freed since
    cannot be taken for a new one made at its address, as its ``id`` could."""
    grad = param.grad
    return (weakref.ref(grad), grad._version) if grad is not None else (None, 0)


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread now (an optimizer stepped
    from a gradient hook, with the model's other gradients not all computed yet; a model called
    again to recompute an activation checkpoint)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def gradient_moved(before: GradientMark, now: GradientMark) -> bool:
    """Whether a gradient changed between two marks (:func:`gradient_mark`): another tensor than
    before (the one seen then may be gone), or the same one written in place."""
    (ref, version), (ref_now, version_now) = before, now
    seen = ref() if ref is not None else None
    if ref is not None and seen is None:
        return True  # the gradient seen before was freed: set to None, or replaced by a backward
    current_grad = ref_now() if ref_now is not None else None
    return seen is not current_grad or version != version_now


def backward_between(before: GradientMark | None, now: GradientMark | None) -> bool:
    """Whether a backward moved a gradient between two marks (:func:`gradient_mark`; a model's
    at two of its calls); False when either is not known."""
    return before is not None and now is not None and gradient_moved(before, now)


def _grouped_norms(grads: list[torch.Tensor]) -> tuple[torch.Tensor, list[int] | None]:
    """Norms of gradients of several dtypes or devices: one foreach kernel per (device, dtype)
    group (foreach kernels want uniform lists), float64 when any gradient is. Returns the
    norms in grouped order, and that order (None when there was one group)."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, g in enumerate(grads):
        groups.setdefault((g.device, g.dtype), []).append(i)
    any_f64 = any(dtype in (torch.float64, torch.complex128) for _device, dtype in groups)
    out_dtype = torch.float64 if any_f64 else torch.float32
    home = grads[0].device
    pieces: list[torch.Tensor] = []
    order: list[int] = []
    for (device, dtype), idx in groups.items():
        tensors = [grads[i] for i in idx] if len(groups) > 1 else grads
        norms: list[torch.Tensor] | tuple[torch.Tensor, ...]
        if dtype in _LOW_PRECISION:
            norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
        elif dtype.is_floating_point or dtype.is_complex:
            norms = torch._foreach_norm(tensors, 2)  # the output dtype follows the input's (complex -> real)
        else:  # integer gradients do not occur in autograd; be safe anyway
            norms = [torch.linalg.vector_norm(t.double()) for t in tensors]
        # One group's norms share a dtype: stack them, then convert once (not once per tensor).
        stacked = torch.stack(norms)
        if stacked.dtype != out_dtype:
            stacked = stacked.to(out_dtype)
        if device != home:
            stacked = stacked.to(home, non_blocking=True)
        pieces.append(stacked)
        order.extend(idx)
    if len(pieces) == 1:
        return pieces[0], None
    return torch.cat(pieces), order


def classify_infinite(grads: Iterable[torch.Tensor]) -> list[bool]:
    """For gradients whose norm came out infinite: True where an element really is ±Inf/NaN.

    This reads the device; call it only on the anomaly path, never on a healthy step.
    """
    return [bool((~torch.isfinite(g)).any()) for g in grads]


def parameter_norms(params: Sequence[ParamRef]) -> torch.Tensor | None:
    """Per-tensor L2 norms of the parameters themselves (for finiteness and update ratios)."""
    tensors = [dense(ref.param.detach()) for ref in params]
    if not tensors:
        return None
    return _norms_f64(tensors)


def _norms_f64(tensors: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Per-tensor L2 norms as one float64 tensor (low precision reduced in float32)."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)

    def norms_of(ts: list[torch.Tensor] | tuple[torch.Tensor, ...], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        return (torch._foreach_norm(ts, 2, dtype=torch.float32) if dtype in _LOW_PRECISION
                else torch._foreach_norm(ts, 2))

    if len(groups) == 1:  # the common case: one stack, one conversion
        ((_device, dtype),) = groups
        return torch.stack(norms_of(tensors, dtype)).to(torch.float64)
    result: list[torch.Tensor | None] = [None] * len(tensors)
    for (_device, dtype), idx in groups.items():
        norms = norms_of([tensors[i] for i in idx], dtype)
        for i, n in zip(idx, norms):
            result[i] = n
    home = tensors[0].device
    return torch.stack([r.to(device=home, dtype=torch.float64) for r in result])  # type: ignore[union-attr]


def snapshot_parameters(params: Sequence[ParamRef]) -> list[torch.Tensor]:
    """Copies of the parameters (local shards of sharded ones), for :func:`update_norms`.

    Costs one parameter-sized allocation until the update is measured; taken only every
    ``update_ratio_interval`` steps.
    """
    return [dense(ref.param.detach()).clone() for ref in params]


def update_norms(params: Sequence[ParamRef], before: list[torch.Tensor]) -> torch.Tensor | None:
    """Per-tensor norms of ``parameter now - snapshot``, float64, on the device (no host read)."""
    now = [dense(ref.param.detach()) for ref in params]
    if not now or len(now) != len(before):
        return None
    return _norms_f64(torch._foreach_sub(now, before))
