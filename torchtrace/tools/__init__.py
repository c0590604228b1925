"""Debugging helpers built on the public API: forward and backward inspection, memory and
profiling helpers, pipeline checks. They use torchtrace as a user would."""
