"""Probes: optional families of checks around every step (activations, memory samples, leaks,
the profiler, forensics, stragglers), behind one interface (:mod:`torchtrace.probes.base`).

The probe set asks each probe which step ``Features`` it acts on (``Probe.wanted``), so a level
or mode change at runtime switches it on or off at the next step; a probe whose feature is off
is not called at all. The runtime installs them from one list
(:func:`torchtrace.step.setup.probes`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchtrace.probes.base import P, Probe, ProbeSet

if TYPE_CHECKING:
    from torchtrace.step.runtime import Runtime


def find_probe(runtime: Runtime, kind: type[P]) -> P | None:
    """The runtime's probe of class ``kind``, or None."""
    return runtime.probes.find(kind) if runtime is not None else None


__all__ = ["Probe", "ProbeSet", "find_probe"]
