"""Activation checkpointing of a model's repeated blocks, installed only while it runs.

Nothing is rewritten in the user's model: each chosen block gets a checkpointed
``forward`` set on the instance for the duration of a call (:func:`installed`) and removed
afterwards, so the same model called directly behaves as before, its ``state_dict`` keys
never change, and hooks still run. The patched callables are built once and reused, so a
compiled model sees the same objects on every call.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

_NORM_WITH_STATS = (nn.modules.batchnorm._BatchNorm,)
MIN_FLAT_LAYERS = 4  # a flat Sequential shorter than this is not worth segmenting


@dataclass
class CheckpointPlan:
    """Which modules get a checkpointed forward, and what was left alone and why."""

    patches: list[tuple[nn.Module, Callable]] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    kind: str = ""  # "blocks" or "segments"

    @property
    def empty(self) -> bool:
        return not self.patches


def _has_running_stats(module: nn.Module) -> bool:
    return any(isinstance(m, _NORM_WITH_STATS) and m.track_running_stats for m in module.modules())


def _block_forward(block: nn.Module) -> Callable:
    original = type(block).forward.__get__(block)

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():  # nothing is saved in inference: no recomputation
            return original(*args, **kwargs)
        return checkpoint(original, *args, use_reentrant=False, **kwargs)

    return forward


def _segments_forward(seq: nn.Sequential, n_segments: int) -> Callable:
    layers = list(seq)
    size = math.ceil(len(layers) / n_segments)
    chunks = [layers[i:i + size] for i in range(0, len(layers), size)]

    def run(chunk, x):
        for layer in chunk:
            x = layer(x)
        return x

    def forward(x):
        if not torch.is_grad_enabled():
            return run(layers, x)
        for chunk in chunks[:-1]:
            x = checkpoint(run, chunk, x, use_reentrant=False)
        return run(chunks[-1], x)  # the last segment's activations are needed at once anyway

    return forward


def plan_checkpointing(model: nn.Module) -> CheckpointPlan:
    """Choose the blocks to checkpoint.

    1. Repeated composite blocks: children of an ``nn.ModuleList``/``nn.Sequential`` that
       share a class, occur at least twice and have submodules of their own (transformer
       layers, residual blocks). Blocks holding BatchNorm running statistics are skipped:
       recomputation would update the statistics twice and change results.
    2. Otherwise the longest flat ``nn.Sequential`` of at least ``MIN_FLAT_LAYERS`` layers
       is split into about sqrt(n) checkpointed segments.
    """
    plan = CheckpointPlan()
    for name, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        groups: dict[type, list[tuple[str, nn.Module]]] = {}
        for child_name, child in container.named_children():
            if next(child.children(), None) is not None:
                groups.setdefault(type(child), []).append((child_name, child))
        for cls, members in groups.items():
            if len(members) < 2:
                continue
            for child_name, child in members:
                full = f"{name}.{child_name}" if name else child_name
                if _has_running_stats(child):
                    plan.skipped[full] = "holds BatchNorm running statistics: recomputation would update them twice"
                    continue
                if any(child is m for m, _ in plan.patches) or any(
                        child in set(m.modules()) for m, _ in plan.patches):
                    continue  # already inside a checkpointed block
                plan.patches.append((child, _block_forward(child)))
                plan.names.append(full)
    if plan.patches:
        plan.kind = "blocks"
        return plan
    flats = [(name, m) for name, m in model.named_modules()
             if isinstance(m, nn.Sequential) and len(m) >= MIN_FLAT_LAYERS
             and all(next(c.children(), None) is None for c in m)]
    flats.sort(key=lambda item: -len(item[1]))
    for name, seq in flats:
        if _has_running_stats(seq):
            plan.skipped[name or "<model>"] = "holds BatchNorm running statistics"
            continue
        n_segments = max(2, round(math.sqrt(len(seq))))
        plan.patches.append((seq, _segments_forward(seq, n_segments)))
        plan.names.append(f"{name or '<model>'}[{n_segments} segments]")
        plan.kind = "segments"
        break
    return plan


@contextlib.contextmanager
def installed(plan: CheckpointPlan) -> Iterator[None]:
    """Set the checkpointed forwards on their modules for the duration of the block."""
    done = []
    try:
        for module, forward in plan.patches:
            if module.__dict__.get("forward") is forward:
                continue  # re-entrant call: already installed by an outer call
            module.__dict__["forward"] = forward
            done.append(module)
        yield
    finally:
        for module in done:
            module.__dict__.pop("forward", None)
