"""Python bytecodes per training step, by variant and by function: a count, not a timing.

The overhead benchmark (``overhead.py``) times variants against each other; on a step of half a
millisecond a few microseconds are at the edge of what it can tell from the machine's noise.
This script counts instead: it runs each variant's step with an event on every bytecode
(``sys.settrace``'s opcode events up to Python 3.11, ``sys.monitoring``'s instruction events
from 3.12) and counts the bytecodes every Python function executes, per step. The count is
the same on every run (up to work done every N steps, averaged over ``--steps``), so a change
that adds or removes Python work on the training thread shows here exactly, whatever the
machine is doing. It does not see time spent in C (PyTorch's kernels, dict and list
operations) or on other threads (span export), and a bytecode of a cold function costs more
than one run in a loop: read it next to the timings, not instead of them.

    python benchmarks/opcodes.py                              # basic against basic-nothr, toy model
    python benchmarks/opcodes.py --variants ideal,floor       # the leanest possible features
    python benchmarks/opcodes.py --variants basic,floor --top 40

Variants are ``overhead.py``'s (its docstring says what each one runs). The first variant is
compared with the second: the bytecodes per step of each, and the functions whose counts
differ by at least ``--min`` per step.
"""

from __future__ import annotations

import argparse
import collections
import logging
import sys
import tempfile
import threading
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import overhead  # noqa: E402
import torchtrace as tt  # noqa: E402


def _where(code) -> str:
    """``folder/file.py:function`` of a code object (``<string>:function`` for generated code)."""
    parts = code.co_filename.replace("\\", "/").split("/")
    return "/".join(parts[-2:]) + ":" + code.co_name


def count_bytecodes(step: Callable[[], object], steps: int) -> collections.Counter:
    """Bytecodes executed per function over ``steps`` calls of ``step`` (this thread only)."""
    counts: collections.Counter = collections.Counter()

    def run() -> None:  # a frame of its own: the counters see frames entered after they start
        for _ in range(steps):
            step()

    if hasattr(sys, "monitoring"):
        _count_with_monitoring(run, counts)
    else:
        _count_with_settrace(run, counts)
    counts.pop(_where(run.__code__), None)
    return counts


def _count_with_settrace(run: Callable[[], None], counts: collections.Counter) -> None:
    """Python 3.11 and before: opcode events of the thread's trace function."""
    def trace(frame, event, arg):
        frame.f_trace_opcodes = True
        if event == "opcode":
            counts[_where(frame.f_code)] += 1
        return trace

    sys.settrace(trace)
    try:
        run()
    finally:
        sys.settrace(None)


def _count_with_monitoring(run: Callable[[], None], counts: collections.Counter) -> None:
    """Python 3.12 and later (a trace function gets no opcode events on 3.12.1):
    ``sys.monitoring``'s instruction events, switched on for each code object when it first
    starts or resumes. They reach every thread; only this one's are counted."""
    mon = sys.monitoring
    tool = next((t for t in (mon.PROFILER_ID, *range(6)) if mon.get_tool(t) is None), None)
    if tool is None:
        raise RuntimeError("every sys.monitoring tool id is in use; run without other profilers or debuggers")
    me, watched = threading.get_ident(), set()

    def started(code, offset):
        if code not in watched:
            watched.add(code)
            mon.set_local_events(tool, code, mon.events.INSTRUCTION)

    def instruction(code, offset):
        if threading.get_ident() == me:
            counts[_where(code)] += 1

    mon.use_tool_id(tool, "torchtrace-opcodes")
    try:
        mon.register_callback(tool, mon.events.PY_START, started)
        mon.register_callback(tool, mon.events.PY_RESUME, started)
        mon.register_callback(tool, mon.events.INSTRUCTION, instruction)
        mon.set_events(tool, mon.events.PY_START | mon.events.PY_RESUME)
        run()
    finally:
        mon.set_events(tool, 0)
        for code in watched:
            mon.set_local_events(tool, code, 0)
        mon.free_tool_id(tool)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default="basic,basic-nothr", help="two of overhead.py's variants: A,B")
    p.add_argument("--workload", default="toy", help="a workload name prefix of overhead.py (toy, mlp, ...)")
    p.add_argument("--steps", type=int, default=640, help="counted steps per variant (after --warmup)")
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--min", type=float, default=3.0, help="show functions differing by at least this per step")
    p.add_argument("--top", type=int, default=60, help="at most this many functions")
    args = p.parse_args(argv)
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    if len(names) != 2 or any(v not in overhead.VARIANTS for v in names):
        p.error(f"--variants={args.variants!r} is not valid; accepted values: two of {', '.join(overhead.VARIANTS)}")
    logging.getLogger("torchtrace").setLevel(logging.ERROR)
    tt.configure(service_name="opcodes-bench", level="basic", prometheus_port=0,
                 run_dir=tempfile.mkdtemp(prefix="torchtrace-opcodes-"), register_atexit=False)
    wl_args = argparse.Namespace(quick=False, device="cpu", gpu_model=False, only_mlp=False, workloads=None)
    wls = [w for w in overhead.workloads(wl_args, torch.device("cpu")) if w.name.startswith(args.workload)]
    if not wls:
        p.error(f"--workload={args.workload!r} matches no workload")
    wl = wls[0]
    per_step = {}
    for name in names:
        step = overhead.make_runner(name, wl)
        for _ in range(args.warmup):
            step()
        per_step[name] = count_bytecodes(step, args.steps)
    a, b = (per_step[n] for n in names)
    total_a, total_b = sum(a.values()) / args.steps, sum(b.values()) / args.steps
    print(f"# Python bytecodes per step, {wl.name}, {args.steps} steps each, torch {torch.__version__}, "
          f"python {sys.version.split()[0]}")
    print(f"{names[0]}: {total_a:.1f}   {names[1]}: {total_b:.1f}   {names[0]} - {names[1]}: {total_a - total_b:+.1f}")
    diff = sorted(((a[k] - b[k]) / args.steps, k) for k in set(a) | set(b))
    shown = [(d, k) for d, k in diff if abs(d) >= args.min]
    shown = sorted(shown, key=lambda item: -abs(item[0]))[:args.top]
    for d, k in sorted(shown, reverse=True):
        print(f"{d:+9.1f}  {k}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
