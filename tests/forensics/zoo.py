"""A zoo of planted faults, each in a named submodule of a small model."""

from __future__ import annotations

import torch


class SafeLogLoss(torch.nn.Module):
    """Cross-entropy written by hand; log(0) when a probability underflows to 0."""

    def forward(self, probs, target):
        return -(torch.log(probs) * target).sum(-1).mean()


class SqrtFeature(torch.nn.Module):
    def forward(self, x):
        return torch.sqrt(x)  # NaN for negative inputs


class MyNorm(torch.nn.Module):
    """A custom normalisation dividing by the standard deviation (zero for constant rows)."""

    def forward(self, x):
        return (x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True)


class HalfBlock(torch.nn.Module):
    """Computes in float16: overflows to Inf for large activations."""

    def forward(self, x):
        return (x.half() * 1000.0).pow(2).float()


class _BadBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


class BadGrad(torch.nn.Module):
    def forward(self, x):
        return _BadBackward.apply(x)


class Zoo(torch.nn.Module):
    """[pre fault] -> encoder -> act -> [mid fault] -> head; fault slots are identities unless planted."""

    def __init__(self, fault: torch.nn.Module | None = None, fault_name: str = "block", where: str = "mid") -> None:
        super().__init__()
        self.where = where
        self.fault_name = fault_name
        self.add_module(fault_name, fault if fault is not None else torch.nn.Identity())
        self.encoder = torch.nn.Linear(8, 16)
        self.act = torch.nn.Tanh()
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        fault = getattr(self, self.fault_name)
        if self.where == "pre":
            x = fault(x)
        h = self.act(self.encoder(x))
        if self.where == "mid":
            h = fault(h)
        return self.head(h)
