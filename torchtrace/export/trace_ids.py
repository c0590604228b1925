"""One trace per step across ranks: a trace id every rank derives for (run, operation, step).

With ``shared_step_trace``, a step span that is a root span takes this id, so the spans of
step 120 on every rank of a job sit in one trace.
"""

from __future__ import annotations

import hashlib


def step_trace_id(run_id: str, operation: str, step: int) -> int:
    """The 128-bit trace id every rank derives for (run, operation, step).

    >>> step_trace_id("run", "train_step", 1) == step_trace_id("run", "train_step", 1)
    True
    """
    digest = hashlib.sha256(f"{run_id}\x00{operation}\x00{step}".encode()).digest()
    return int.from_bytes(digest[:16], "big") or 1
