"""Automatic mixed precision: the autocast state of an optimized call and the scaled step.

bfloat16 on CPU; float16 with a ``GradScaler`` on CUDA (bfloat16 there on request, without
a scaler). :func:`current_amp` tells a decorated training step which scaler to use;
:func:`amp_step` uses it.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

import torch

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


@dataclass
class AmpState:
    """The autocast settings of an optimized call; ``scaler`` is set for float16 training."""

    device_type: str
    dtype: torch.dtype
    scaler: torch.amp.GradScaler | None = None

    def autocast(self):
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)


_current_amp: contextvars.ContextVar[AmpState | None] = contextvars.ContextVar("torchtrace_amp", default=None)


def current_amp() -> AmpState | None:
    """The AMP state of the innermost optimized call on this thread/task, or None.

    Inside a function decorated with ``@optimize_model(mode=AMP)`` on CUDA with float16,
    ``current_amp().scaler`` is the GradScaler the training step must use (or call
    :func:`amp_step`, which does).
    """
    return _current_amp.get()


def amp_step(loss: torch.Tensor, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None = None) -> None:
    """Backward and optimizer step, through the GradScaler when AMP needs one.

    ``scaler`` defaults to ``current_amp().scaler``. Without a scaler this is
    ``loss.backward(); optimizer.step()``. Backward runs with autocast disabled, as the
    PyTorch AMP recipe asks. Gradients are not zeroed: call ``optimizer.zero_grad()``.

    >>> model = torch.nn.Linear(2, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> amp_step(model(torch.ones(1, 2)).sum(), opt)
    """
    state = current_amp()
    if scaler is None and state is not None:
        scaler = state.scaler
    device_type = state.device_type if state is not None else loss.device.type
    with torch.autocast(device_type=device_type, enabled=False):
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()



def amp_state(device: torch.device, amp_dtype: str | torch.dtype | None) -> tuple[AmpState | None, str]:
    """The autocast settings for ``device``, or None and the reason AMP cannot apply."""
    dev = device.type
    if amp_dtype is None:
        dtype = torch.float16 if dev == "cuda" else torch.bfloat16
    elif isinstance(amp_dtype, torch.dtype):
        dtype = amp_dtype
    else:
        dtype = _DTYPES[str(amp_dtype).lower()]
    if dev not in ("cpu", "cuda"):
        return None, f"autocast is not supported here for device {dev!r}"
    if dev == "cpu" and dtype is torch.float16:
        return None, "float16 autocast is not offered on CPU; use bfloat16"
    if dev == "cuda" and dtype is torch.bfloat16 and not torch.cuda.is_bf16_supported():
        return None, "this GPU does not support bfloat16"
    scaler = torch.amp.GradScaler("cuda") if (dev == "cuda" and dtype is torch.float16) else None
    return AmpState(dev, dtype, scaler), ""
