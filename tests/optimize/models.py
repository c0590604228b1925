"""Small models for the optimization tests."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    """Residual MLP block: saves its input (Linear a) and tanh's output (kept for b and tanh)."""

    def __init__(self, d: int, expand: int = 4) -> None:
        super().__init__()
        self.a = nn.Linear(d, expand * d)
        self.b = nn.Linear(expand * d, d)

    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x)))


class DeepMLP(nn.Module):
    def __init__(self, d_in: int = 8, d: int = 16, depth: int = 6, d_out: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(depth))
        self.out = nn.Linear(d, d_out)

    def forward(self, x):
        h = self.inp(x)
        for blk in self.blocks:
            h = blk(h)
        return self.out(h)


def batches(n: int = 3, b: int = 32, d_in: int = 8, d_out: int = 4, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(b, d_in, generator=g), torch.randn(b, d_out, generator=g)) for _ in range(n)]
