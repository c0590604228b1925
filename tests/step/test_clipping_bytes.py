"""Gradient bytes read in a step: torchtrace's statistics read each gradient byte once, and a
``clip_grad_norm_`` inside the step reuses torchtrace's per-tensor norms instead of reading the
gradients again.

A dispatch mode sees every aten operation from the end of ``backward()`` to the step's exit. It
counts the bytes of gradient tensors read by operations that mutate nothing (the measuring
reads: norms). Operations that write in place are the user's own work and are not counted:
the clip's scaling (``grad.mul_``) and the optimizer's update (``param.add_(grad)``).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import torchtrace as tt


class GradientReads(TorchDispatchMode):
    """Counts bytes of the watched tensors read by operations that mutate none of their inputs."""

    def __init__(self, watched: list[torch.Tensor]) -> None:
        super().__init__()
        self.storages = {t.untyped_storage().data_ptr() for t in watched}
        self.read = 0
        self.scaled = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        mutates = func._schema.is_mutable
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self.storages:
                size = t.numel() * t.element_size()
                if not mutates:
                    self.read += size
                elif func.overloadpacket in (torch.ops.aten._foreach_mul_, torch.ops.aten.mul_):
                    self.scaled += size
        return func(*args, **kwargs)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                               torch.nn.ReLU(), torch.nn.Linear(64, 4))


def _bytes_read(clip: bool, steps: int = 3) -> tuple[float, float]:
    """(bytes read by non-mutating ops / gradient bytes, bytes scaled / gradient bytes) in the last step."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(16, 32)
    ratio = scaled = 0.0
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        with tt.debug_context("train_step", model=model, optimizer=opt):
            model(x).pow(2).sum().backward()
            grads = [p.grad for p in model.parameters()]
            total = sum(g.numel() * g.element_size() for g in grads)
            counter = GradientReads(grads)
            with counter:
                if clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
                opt.step()
        ratio, scaled = counter.read / total, counter.scaled / total
    return ratio, scaled


def test_statistics_read_each_gradient_byte_once(tt_runtime):
    read, scaled = _bytes_read(clip=False)
    assert read <= 1.0
    assert read > 0.0  # torchtrace measured: the counter sees its reads
    assert scaled == 0.0


def test_a_clip_inside_the_step_reads_no_gradient_byte_again(tt_runtime):
    read, scaled = _bytes_read(clip=True)
    assert read == 1.0  # torchtrace's one pass; the clip reuses its norms
    assert scaled == 1.0  # the clip still scales every gradient, once


def test_the_counter_sees_a_plain_clip_read_the_gradients():
    """The counter itself, without torchtrace: torch's clip reads every gradient byte once."""
    model = _model()
    model(torch.randn(16, 32)).pow(2).sum().backward()
    grads = [p.grad for p in model.parameters()]
    counter = GradientReads(grads)
    with counter:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
    assert counter.read == sum(g.numel() * g.element_size() for g in grads)
