"""Probes: optional families of checks plugged into every step (activations, memory, leaks,
profiler, forensics, stragglers).

Each probe looks at the step's ``Features`` on every call, so a level or mode change at
runtime switches it on or off at the next step; a probe whose feature is off costs one
attribute check per step.
"""

from __future__ import annotations

from typing import Any


def install_probes(runtime) -> None:
    """Add the profiling, activation, memory and leak probes to a new runtime (called once)."""
    from torchtrace.probes.activations import ActivationProbe
    from torchtrace.probes.leaks import LeakProbe
    from torchtrace.probes.memory import MemoryProbe
    from torchtrace.probes.profiler import ProfilerProbe

    runtime.probes.extend([ProfilerProbe(runtime), ActivationProbe(runtime), MemoryProbe(runtime),
                           LeakProbe(runtime)])


def find_probe(runtime, kind: type) -> Any:
    """The runtime's probe of class ``kind``, or None."""
    if runtime is None:
        return None
    for p in runtime.probes:
        if isinstance(p, kind):
            return p
    return None
