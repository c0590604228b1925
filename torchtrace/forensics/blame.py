"""Which module made a NaN/Inf: the one rule forensic replay and ``debug_forward_pass`` follow.

The rule: walk the module calls in completion order (a child finishes before its parent, so
the innermost module comes first); the module blamed is the first whose output holds a NaN
or an Inf while its inputs hold none. Every module is watched, containers included, so a
module with children that computes in its own ``forward`` (``nn.MultiheadAttention``, whose
attention is not done by any child) is seen and can be blamed.

An input tensor whose only non-finite values are ``-inf`` does not make the inputs
non-finite: additive attention masks use ``-inf`` on purpose (``nn.TransformerEncoderLayer``
turns a boolean ``src_key_padding_mask`` into such a mask before calling its
``self_attn``). A NaN or a ``+inf`` in any input does. Outputs count every NaN and Inf.

:class:`ModuleCalls` records the calls with device-side flags and statistics only (never an
activation); :func:`localise` applies the rule to the host values.

>>> import torch
>>> m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
>>> with torch.no_grad():
...     _ = m[0].bias.fill_(float("inf"))
>>> calls = ModuleCalls(m)
>>> with calls:
...     _ = m(torch.ones(1, 2))
>>> localise(calls.host_rows(calls.values_read()))["module"]
'0'
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch

from torchtrace.measure.activations import first_tensor
from torchtrace.measure.names import user_name, wrapper_prefix
from torchtrace.measure.tensors import STAT_NAMES, tensor_stats
from torchtrace.record import readout

_FLAG_WIDTH = 2  # inputs ok, outputs ok
_ROW = _FLAG_WIDTH + len(STAT_NAMES)


def floating_tensors(obj: object, depth: int = 0) -> Iterator[torch.Tensor]:
    """Floating-point (and complex) tensors inside arguments or outputs: tuples, lists, dicts."""
    if depth > 4:
        return
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() or obj.is_complex():
            yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from floating_tensors(item, depth + 1)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from floating_tensors(item, depth + 1)


def inputs_ok(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """A 0-d bool device tensor: no input holds a NaN or a ``+inf`` (``-inf`` alone is a mask)."""
    flag = None
    for t in tensors:
        x = t.detach()
        if x.is_complex():
            ok = torch.isfinite(x).all()
        else:
            ok = ~(torch.isnan(x).any() | torch.isposinf(x).any())
        flag = ok if flag is None else flag & ok.to(flag.device)
    return torch.ones((), dtype=torch.bool) if flag is None else flag


def outputs_ok(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """A 0-d bool device tensor: every output element is finite."""
    flag = None
    for t in tensors:
        ok = torch.isfinite(t.detach()).all()
        flag = ok if flag is None else flag & ok.to(flag.device)
    return torch.ones((), dtype=torch.bool) if flag is None else flag


@dataclass
class Call:
    """One module call: names, order, output metadata; device flags until read."""

    module: str
    type: str
    order: int  # when it was called (pre-hook order)
    has_inputs: bool
    in_flag: torch.Tensor
    is_leaf: bool
    own_compute: bool = False  # its output is not one of its direct children's outputs
    out_flag: torch.Tensor | None = None
    stats: torch.Tensor | None = None  # tensor_stats of the first floating output
    shape: list[int] | None = None
    input_shapes: list[list[int]] = field(default_factory=list)  # of its floating-point tensor inputs
    dtype: str | None = None
    device: str | None = None
    time_s: float = float("nan")
    _children: list[Any] = field(default_factory=list)  # weak references to direct children's outputs
    _t0: float = 0.0


class ModuleCalls:
    """Forward hooks on every module of ``model``; each call leaves device flags and statistics.

    Use as a context manager around the forward; hooks are removed on exit, also on error.
    ``calls`` is in completion order. :meth:`values_read` is the one host read.
    """

    def __init__(self, model: torch.nn.Module, timing: bool = True) -> None:
        self.model = model
        self.timing = timing
        prefix = wrapper_prefix(model)
        self.names = {m: user_name(n, prefix) for n, m in model.named_modules()}
        self.calls: list[Call] = []
        self._stack: list[Call] = []
        self._handles: list[Any] = []
        self._order = 0

    def __enter__(self) -> "ModuleCalls":
        try:
            for module in self.names:
                self._handles.append(module.register_forward_pre_hook(self._pre, with_kwargs=True))
                self._handles.append(module.register_forward_hook(self._post, with_kwargs=True))
        except Exception:
            self.remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._stack.clear()

    def _pre(self, module, args, kwargs):
        ins = list(floating_tensors(args)) + list(floating_tensors(kwargs))
        self._order += 1
        call = Call(module=self.names.get(module, "?"), type=type(module).__name__, order=self._order,
                    has_inputs=bool(ins), in_flag=inputs_ok(ins),
                    is_leaf=next(iter(module.children()), None) is None)
        call.input_shapes = [list(t.shape) for t in ins]
        call._t0 = time.perf_counter() if self.timing else 0.0
        self._stack.append(call)
        return None

    def _post(self, module, args, kwargs, output):
        if not self._stack:
            return None
        call = self._stack.pop()
        if self.timing:
            call.time_s = time.perf_counter() - call._t0
        outs = list(floating_tensors(output))
        first = first_tensor(output)
        call.out_flag = outputs_ok(outs)
        if first is not None:
            call.stats = tensor_stats(first)
            call.shape = list(first.shape)
            call.dtype = str(first.dtype).replace("torch.", "")
            call.device = str(first.device)
        call.own_compute = first is not None and not any(r() is first for r in call._children)
        call._children = []
        if self._stack and first is not None:
            self._stack[-1]._children.append(weakref.ref(first))
        self.calls.append(call)
        return None

    def stacked(self) -> torch.Tensor | None:
        """Every call's (inputs ok, outputs ok, six statistics) as one float64 tensor."""
        if not self.calls:
            return None
        dev = self.calls[0].in_flag.device
        nan6 = torch.full((len(STAT_NAMES),), float("nan"), dtype=torch.float64, device=dev)
        rows = []
        for c in self.calls:
            out_flag = c.out_flag if c.out_flag is not None else torch.ones((), dtype=torch.bool)
            stats = c.stats if c.stats is not None else nan6
            rows.append(torch.cat([torch.stack([c.in_flag.to(dev, torch.float64), out_flag.to(dev, torch.float64)]),
                                   stats.to(dev)]))
        return torch.stack(rows).reshape(-1)

    def values_read(self) -> list[float]:
        """The one host read of :meth:`stacked` (empty when no module ran)."""
        flat = self.stacked()
        return readout.read(flat.cpu() if flat is not None and flat.device.type != "cpu" else flat) \
            if flat is not None else []

    def host_rows(self, values: list[float]) -> list[dict[str, Any]]:
        """Per call, in completion order: names, flags as bools, statistics, output metadata."""
        out = []
        for i, c in enumerate(self.calls):
            row = values[i * _ROW:(i + 1) * _ROW]
            stats = dict(zip(STAT_NAMES, row[_FLAG_WIDTH:]))
            stats["nan_count"] = int(stats["nan_count"]) if stats["nan_count"] == stats["nan_count"] else 0
            stats["inf_count"] = int(stats["inf_count"]) if stats["inf_count"] == stats["inf_count"] else 0
            out.append({"module": c.module, "type": c.type, "order": c.order, "is_leaf": c.is_leaf,
                        "own_compute": c.own_compute, "has_inputs": c.has_inputs, "in_ok": bool(row[0]),
                        "out_ok": bool(row[1]), "shape": c.shape, "input_shapes": c.input_shapes, "dtype": c.dtype,
                        "device": c.device,
                        "time_s": c.time_s, **stats})
        return out


def localise(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Apply the rule to host rows in completion order (``in_ok``/``out_ok``/``has_inputs``/``order``).

    Returns ``{"cause": "forward", "module", "module_type", "index"}`` for the module where the
    NaN/Inf was born (``index`` into ``rows``); ``{"cause": "input", ...}`` naming the first
    module (in call order) that received a non-finite input when no module produced one from
    finite inputs; ``{"cause": None, ...}`` when every output is finite.
    """
    born = next((i for i, r in enumerate(rows) if r["in_ok"] and not r["out_ok"]), None)
    if born is not None:
        return {"cause": "forward", "module": rows[born]["module"], "module_type": rows[born]["type"], "index": born}
    bad_in = sorted((i for i, r in enumerate(rows) if r["has_inputs"] and not r["in_ok"]),
                    key=lambda i: rows[i]["order"])
    if bad_in:
        i = bad_in[0]
        return {"cause": "input", "module": rows[i]["module"], "module_type": rows[i]["type"], "index": i}
    return {"cause": None, "module": None, "module_type": None, "index": None}


__all__ = ["Call", "ModuleCalls", "floating_tensors", "inputs_ok", "localise", "outputs_ok"]
