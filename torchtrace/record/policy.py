"""Guard policies: what a non-finite step leads to, decided on the host record.

``warn`` records and logs it; ``skip`` drops the optimizer update before any parameter
changes; ``raise`` raises :class:`torchtrace.NonFiniteError`. Under ``torchrun`` every rank
takes the same decision in the same step (:func:`agree_any`).
"""

from __future__ import annotations

import torch

from torchtrace.config import GUARD_POLICIES
from torchtrace.distributed import collectives
from torchtrace.errors import NonFiniteError
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


def decide_after_record(record, guard: GuardPolicy, consecutive_bad: int, limit: int | None,
                        report: dict | None) -> NonFiniteError | None:
    """The error a finished non-finite record leads to, or None.

    ``consecutive_bad`` counts this step. ``max_consecutive_bad_steps`` (``limit``) stops any
    run, whatever the policy; ``raise`` raises for a step whose gradients were not decided
    before the update (no optimizer, or a non-finite loss or parameter).
    """
    if not record.nonfinite:
        return None
    if limit is not None and consecutive_bad >= limit:
        return NonFiniteError(f"{consecutive_bad} consecutive non-finite steps (limit {limit}) at step "
                              f"{record.step} of {record.operation}", step=record.step, kinds=record.anomaly_kinds,
                              report=report)
    if guard is GuardPolicy.RAISE:
        return NonFiniteError(f"non-finite step {record.step} of {record.operation}: "
                              f"{', '.join(record.anomaly_kinds)}", step=record.step, kinds=record.anomaly_kinds,
                              report=report)
    return None
