"""``clip_grad_norm_``'s total norm from norms already measured: the same bits, no second pass.

``torch.nn.utils.clip_grad_norm_`` (torch 2.x) groups the gradients by device and dtype, takes
each group's per-tensor norms in the gradients' own dtype (``torch._foreach_norm`` on the
foreach path, ``torch.linalg.vector_norm`` per tensor otherwise), stacks them in that grouped
order, and takes ``torch.linalg.vector_norm`` of the stack. :func:`total_norm` rebuilds that
same stack from the per-tensor norms torchtrace measured a moment earlier
(:func:`torchtrace.measure.gradients.gradient_norms`), then applies the same last reduction,
so the result has the same bits without reading a gradient again.

Equality rests on each per-tensor norm being the same number both ways. It is shown here, on
the CPU, by tests against torch's own function (``tests/step/test_clipping_equality.py``):

- float32/float64 gradients: the same ``_foreach_norm`` call on the same tensor (on the CPU,
  ``_foreach_norm`` is ``vector_norm`` per tensor, so the non-foreach path matches too);
- float16/bfloat16 gradients: torchtrace reduces in float32; rounding that to the gradient's
  dtype gives torch's norm, which accumulates in float32 and rounds once at the end.

Where it cannot be shown, :func:`total_norm` returns ``None`` and the caller runs torch's own
function: ``norm_type`` other than 2; gradients on more than one device; ``foreach=False`` off
the CPU (torch's per-tensor kernel is not the foreach kernel there); a gradient torchtrace did
not measure as that very tensor (a parameter outside the watched set, sparse gradients,
DTensor/FSDP2 gradients, whose norms torchtrace combines across ranks in its own order);
complex or integer gradients; a device without foreach kernels.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Sequence

import torch
from torch.utils._foreach_utils import (
    _device_has_foreach_support,
    _group_tensors_by_device_and_dtype,
    _has_foreach_support,
)

if TYPE_CHECKING:
    from torchtrace.measure.gradients import GradStats

_REAL = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def total_norm(stats: GradStats, grads: Sequence[torch.Tensor], norm_type: float,
               foreach: bool | None) -> torch.Tensor | None:
    """The total norm ``clip_grad_norm_(…, norm_type, foreach=foreach)`` would compute for
    ``grads``, from ``stats`` measured on the same, unchanged tensors; ``None`` where the bits
    cannot be shown equal (see the module docstring). No host read. Call it under
    ``torch.no_grad()`` where the gradients may carry a graph (a ``create_graph`` backward).

    >>> g = [torch.tensor([3.0]), torch.tensor([4.0])]
    >>> from torchtrace.measure.gradients import GradStats
    >>> total_norm(GradStats(["a", "b"], torch.tensor([3.0, 4.0]), g), g, 2.0, None)
    tensor(5.)
    """
    if float(norm_type) != 2.0 or not grads:
        return None
    position = {id(g): i for i, g in enumerate(stats.grads)}
    first_device = grads[0].device
    pieces: list[torch.Tensor] = []
    for (device, dtype), ([group], _) in _group_tensors_by_device_and_dtype([list(grads)]).items():
        if device != first_device or dtype not in _REAL:
            return None
        # (torch types the groups' items Optional: they are the gradients given, all tensors)
        if not _uses_the_measured_kernel(group, device, foreach):  # type: ignore[arg-type]
            return None
        rows = [position.get(id(g)) for g in group]
        if None in rows:
            return None
        pieces.append(_norms_at(stats.as_measured, rows).to(dtype))  # type: ignore[arg-type]
    if len(pieces) == 1:
        stacked = pieces[0]
    else:
        # torch.stack of the groups' norms promotes them to one dtype: the same here.
        common = functools.reduce(torch.promote_types, [p.dtype for p in pieces])
        stacked = torch.cat([p.to(common) for p in pieces])
    return torch.linalg.vector_norm(stacked, 2.0)


def _uses_the_measured_kernel(group: list[torch.Tensor], device: torch.device, foreach: bool | None) -> bool:
    """Whether torch's clip takes this group's norms with a kernel whose result is torchtrace's."""
    if foreach is None and _has_foreach_support(group, device):
        return True
    if foreach is True:
        # Without foreach kernels on the device torch raises: let it, from its own function.
        return _device_has_foreach_support(device)
    # The per-tensor vector_norm path equals _foreach_norm only on the CPU (its foreach kernel
    # is vector_norm per tensor there).
    return device.type == "cpu"


def _norms_at(norms: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``norms[rows]`` without a host-to-device copy of an index (a slice when rows run in order)."""
    start = rows[0]
    if rows == list(range(start, start + len(rows))):
        return norms[start:start + len(rows)]
    picked = norms.unbind(0)
    return torch.stack([picked[i] for i in rows])
