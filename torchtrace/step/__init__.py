"""The step pipeline: one instrumented step, from its entry to its finished record.

Read :mod:`torchtrace.step.scope` first (what ``debug_context`` yields, and the walk through
one step), then :mod:`torchtrace.step.state` (what a step carries), :mod:`~torchtrace.step.throughput`
(its batch, FLOPs, phases and goodput booking), :mod:`~torchtrace.step.runtime` (the configured
state every step reaches) and :mod:`~torchtrace.step.finish` (host values in, telemetry out).
``docs/architecture.md`` draws the path.
"""
