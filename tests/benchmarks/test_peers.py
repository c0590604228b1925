"""benchmarks/peers.py: each peer does the work its pattern names (the gradients it reads)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.benchmarks import load


class Ops(TorchDispatchMode):
    """The aten operations run under the mode, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _norm_ops(bench, variant: str) -> list[str]:
    wl = bench.workloads(quick=True, device=torch.device("cpu"))[0]
    step = bench.make_runner(variant, wl)
    step()  # the first step makes the optimizer's state
    with Ops() as ops:
        step()
    return [name for name in ops.names if "norm" in name]


def test_the_otel_peer_reads_no_gradient_and_its_norm_twin_one_fused_pass():
    bench = load("peers")
    assert _norm_ops(bench, "otel") == []
    assert _norm_ops(bench, "otel-norm").count("_foreach_norm") == 1
    assert _norm_ops(bench, "floor") == ["_foreach_norm"]  # the floor's one pass, the same
