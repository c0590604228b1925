"""Trace and span ids drawn from a random generator of torchtrace's own, never from Python's
global ``random``, whose sequence belongs to the training script (its data order, its
augmentations)."""

from __future__ import annotations

import os
import random

from opentelemetry import trace
from opentelemetry.sdk.trace.id_generator import IdGenerator

__all__ = ["OwnRandomIds", "own_ids", "own_random"]

_RANDOM = random.Random()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_RANDOM.seed)


def own_random() -> random.Random:
    """torchtrace's random generator, seeded from the system's entropy and again in a forked
    child (as Python's global one is): for span ids and the exporters' retry jitter."""
    return _RANDOM


class OwnRandomIds(IdGenerator):
    """Trace and span ids drawn from :func:`own_random`.

    The SDK's default draws from the global ``random``: every step would move the sequence a
    training script shuffles its data or picks its augmentations with, and torchtrace would
    change what the run trains on.
    """

    def __init__(self) -> None:
        self._random = own_random()

    def generate_span_id(self) -> int:
        span_id = self._random.getrandbits(64)
        while span_id == trace.INVALID_SPAN_ID:
            span_id = self._random.getrandbits(64)
        return span_id

    def generate_trace_id(self) -> int:
        trace_id = self._random.getrandbits(128)
        while trace_id == trace.INVALID_TRACE_ID:
            trace_id = self._random.getrandbits(128)
        return trace_id

    def is_trace_id_random(self) -> bool:
        return True


_IDS: OwnRandomIds | None = None


def own_ids() -> OwnRandomIds:
    """The one generator of every provider torchtrace makes (one fork handler, not one per
    ``configure()``)."""
    global _IDS
    if _IDS is None:
        _IDS = OwnRandomIds()
    return _IDS
