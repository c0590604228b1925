"""Guard policies: what a non-finite step leads to, decided on the host record.

``warn`` records and logs it; ``skip`` drops the optimizer update before any parameter
changes; ``raise`` raises :class:`torchtrace.NonFiniteError`. Under ``torchrun`` every rank
takes the same decision in the same step (:func:`agree_any`).
"""

from __future__ import annotations

import torch

from torchtrace.config import GUARD_POLICIES
from torchtrace.distributed import collectives
from torchtrace.levels import _ParseEnum
from torchtrace.record import readout


class GuardPolicy(_ParseEnum):
    """The ``guard`` setting.

    >>> GuardPolicy.parse("skip", "guard")
    <GuardPolicy.SKIP: 'skip'>
    """

    WARN = "warn"
    SKIP = "skip"
    RAISE = "raise"


assert tuple(p.value for p in GuardPolicy) == GUARD_POLICIES


def agree_any(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on any rank: one ``all_reduce(MAX)``.

    Without a usable process group, the local flag.
    """
    if not collectives.collectives_available():
        return flag
    import torch.distributed as dist

    t = torch.tensor([1.0 if flag else 0.0], dtype=torch.float32, device=collectives.device())
    collectives.run("guard", lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX))
    return readout.read(t)[0] > 0
