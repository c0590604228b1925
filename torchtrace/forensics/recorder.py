"""The forensic replay's recorder: forward hooks on every module, and tensor hooks on their
inputs' and outputs' gradients, leaving device flags and statistics (never an activation),
read once when the replay is analysed (:mod:`torchtrace.forensics.analysis`)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from torchtrace.forensics import blame
from torchtrace.measure import tensors as tensor_measure
from torchtrace.measure.names import user_name, wrapper_prefix


def _all_finite(ts: list[torch.Tensor]) -> torch.Tensor:
    if not ts:
        return torch.ones((), dtype=torch.bool)
    flags = [torch.isfinite(t.detach()).all().to("cpu", non_blocking=False) if t.device.type != "cpu"
             else torch.isfinite(t.detach()).all() for t in ts]
    return torch.stack(flags).all()


_NAN6 = torch.full((6,), float("nan"), dtype=torch.float64)


def _stats(ts: list[torch.Tensor]) -> torch.Tensor:
    return tensor_measure.tensor_stats(ts[0]).cpu() if ts else _NAN6


class Recorder:
    """Forward and backward hooks on every module; device flags collected, read once at the end."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        prefix = wrapper_prefix(model)
        self.names = {m: user_name(n, prefix) for n, m in model.named_modules()}
        self.calls: list[dict[str, Any]] = []  # in completion order
        self._stack: list[dict[str, Any]] = []
        self.grad_flags: list[tuple[str, str, torch.Tensor]] = []  # (module, "in"/"out", finite flag)
        self.handles: list[Any] = []
        self.order = 0

    def install(self) -> None:
        for module in self.names:
            self.handles.append(module.register_forward_pre_hook(self._pre, with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._post, with_kwargs=True))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def _grad_hook(self, name: str, side: str) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor | None) -> None:
            if grad is not None:  # (an output no loss depends on gets none)
                self.grad_flags.append((name, side, _all_finite([grad])))
        return hook

    def _pre(self, module, args, kwargs):
        name = self.names.get(module, "?")
        ins = list(blame.floating_tensors(args)) + list(blame.floating_tensors(kwargs))
        self.order += 1
        self._stack.append({"module": name, "type": type(module).__name__, "call": self.order,
                            "in_finite": blame.inputs_ok(ins), "in_stats": _stats(ins), "has_in": bool(ins)})
        if torch.is_grad_enabled():
            for t in ins:
                if t.requires_grad:
                    t.register_hook(self._grad_hook(name, "in"))
        return None

    def _post(self, module, args, kwargs, output):
        entry = self._stack.pop() if self._stack else {"module": self.names.get(module, "?"),
                                                        "type": type(module).__name__,
                                                        "call": 0, "in_finite": torch.ones((), dtype=torch.bool),
                                                        "in_stats": _NAN6, "has_in": False}
        outs = list(blame.floating_tensors(output))
        entry["out_finite"] = _all_finite(outs)
        entry["out_stats"] = _stats(outs)
        entry["out_dtype"] = str(outs[0].dtype).replace("torch.", "") if outs else None
        self.calls.append(entry)
        if torch.is_grad_enabled():
            for t in outs:
                if t.requires_grad:
                    t.register_hook(self._grad_hook(str(entry["module"]), "out"))
        return None


__all__ = ["Recorder"]
