"""How many steps the leak detector takes to flag a leak, against the leak's size and the
CPU heap's sampling interval.

Run from the repository root: ``python benchmarks/leak_detection.py`` (a few minutes on 2 CPU
cores). Each case is a real training loop (Linear(16, 4096) -> Tanh -> Linear(4096, 4), SGD)
at ADVANCED with the leak detector's default settings; from its first step (or, in the
second table, from a step after 120 clean ones) every step keeps a copy of its hidden
activation in a list, ``multiple`` times ``leak_threshold_bytes``. The heap-sampling
interval is forced through the probe's three sampling constants, as if a heap sample cost
more than the budget allows. The tables print the steps from the leak's first step to the
step that carries the ``memory_leak`` anomaly (the slow path's ``leak_confirm_steps``
included).

The second table starts the leak after 120 clean steps, and at heap gaps over 1 at two
phases of the heap samples: (a) the leak's first step is the one right after a sample, so
no sample sees it for a whole interval unless the resident size gives it away; (u) the next
sample sees growth just under the threshold over its interval. That table is printed twice:
with every case in one process (its heap holds the memory earlier cases freed, so a leak
reuses free pages and the resident size does not show it, as on a fragmented heap), and with
each case in a new process (the resident size grows with the leak and prompts an early heap
sample). A case stops when flagged, after ``--max-steps`` steps, or when the kept list
passes ``--max-bytes``.

The last table is the detector's own time per step (its ``finalize`` less the heap samples
it took), median over the steps of a clean 300-step loop and over the leaking steps before
the anomaly (the slow path's steps included), the number of heap samples over the whole
case (of them, out of turn), and the median time of one heap sample. It runs first, in a
process whose heap is still young.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import logging
import math
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import torchtrace as tt  # noqa: E402
from torchtrace import semconv  # noqa: E402
from torchtrace.api import get_runtime  # noqa: E402
from torchtrace.measure import memory as mem_measure  # noqa: E402
from torchtrace.probes import find_probe  # noqa: E402

probe_module = importlib.import_module("torchtrace.probes.leaks")
WIDTH = 4096
ORIGINAL = {name: getattr(probe_module, name) for name in ("HEAP_FREE_S", "HEAP_BUDGET", "HEAP_MAX_GAP")}


def force_gap(gap: int) -> None:
    for name, value in ORIGINAL.items():
        setattr(probe_module, name, value)
    if gap == 1:
        probe_module.HEAP_FREE_S = 10.0
    else:
        probe_module.HEAP_FREE_S, probe_module.HEAP_BUDGET, probe_module.HEAP_MAX_GAP = 0.0, 1e-12, gap


class Case:
    """One training loop at ADVANCED; ``run`` returns (steps from onset to flag or None, steps run)."""

    def __init__(self, gap: int, run_dir: str) -> None:
        force_gap(gap)
        self.gap = gap
        self.sampled_at: list[int] = []
        self.heap_s: list[float] = []  # time of each heap sample
        self.i = 0
        real = mem_measure.heap_in_use_bytes

        def counted():
            self.sampled_at.append(self.i)
            t0 = time.perf_counter()
            try:
                return real()
            finally:
                self.heap_s.append(time.perf_counter() - t0)

        mem_measure.heap_in_use_bytes = counted
        self._real = real
        tt.configure(level="advanced", prometheus_port="off", run_dir=run_dir, register_atexit=False)
        self.probe = find_probe(get_runtime(), probe_module.LeakProbe)
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(16, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, 4))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.finalize_s: list[float] = []
        inner = self.probe.finalize

        def timed(scope, record, span):  # the detector's time, its heap sample taken out
            samples = len(self.heap_s)
            t0 = time.perf_counter()
            inner(scope, record, span)
            self.finalize_s.append(time.perf_counter() - t0 - sum(self.heap_s[samples:]))

        self.probe.finalize = timed

    def close(self) -> None:
        tt.shutdown()
        mem_measure.heap_in_use_bytes = self._real
        for name, value in ORIGINAL.items():
            setattr(probe_module, name, value)

    def step(self, x, y, kept: list | None) -> bool:
        with tt.debug_context("train_step", model=self.model, optimizer=self.opt) as step:
            self.opt.zero_grad()
            h = self.model[1](self.model[0](x))
            loss = torch.nn.functional.mse_loss(self.model[2](h), y)
            loss.backward()
            self.opt.step()
            if kept is not None:
                kept.append(h.detach().clone())
        self.i += 1
        return semconv.MEMORY_LEAK in step.record.anomaly_kinds

    def run(self, multiple: float, clean: int, phase: str, max_steps: int, max_bytes: float):
        rows = max(1, round(16 * multiple))
        x, y = torch.randn(rows, 16), torch.randn(rows, 4)
        for _ in range(clean):
            if self.step(x, y, None):
                return None, "false alarm"
        if self.gap > 1 and phase != "none":
            # "after": the leak's first step is the one after a heap sample, so no sample sees
            # it for a whole interval; "under": the next sample sees ceil(gap / multiple) - 1
            # leaked steps, growth just under the threshold over the interval
            lead = self.gap if phase == "after" else max(1, math.ceil(self.gap / multiple) - 1)
            while self.i != self.sampled_at[-1] + self.gap - lead + 1:
                if self.step(x, y, None):
                    return None, "false alarm"
        onset = self.i
        kept: list = []
        while self.i - onset < max_steps:
            if self.step(x, y, kept):
                return self.i - onset, ""
            if len(kept) * rows * WIDTH * 4 > max_bytes:
                return None, f"stopped at {len(kept) * rows * WIDTH * 4 / 2 ** 30:.1f} GiB"
        return None, f"> {max_steps}"


def one_case(gap: int, multiple: float, clean: int, phase: str, args, run_dir: str) -> str:
    """Steps to detection of one case, or why there is none, as a table cell."""
    if args.fresh:  # in a new process: a young heap, nothing freed before the leak
        cmd = [sys.executable, __file__, "--one", f"{gap},{multiple},{clean},{phase}", "--max-steps",
               str(args.max_steps), "--max-bytes", str(args.max_bytes)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        return out.strip().splitlines()[-1]
    case = Case(gap, run_dir)
    try:
        steps, note = case.run(multiple, clean, phase, args.max_steps, args.max_bytes)
    finally:
        case.close()
        gc.collect()
    return str(steps) if steps is not None else note


def detection_table(multiples, gaps, clean: int, args, run_dir: str) -> list[str]:
    """Steps to detection; after clean steps, at gaps over 1, "a / u" for the two phases."""
    lines = ["| leak (x threshold) | MB/step | " + " | ".join(f"gap {g}" for g in gaps) + " |",
             "|---|---|" + "---|" * len(gaps)]
    for m in multiples:
        cells = []
        for g in gaps:
            phases = ("none",) if clean == 0 or g == 1 else ("after", "under")
            cells.append(" / ".join(one_case(g, m, clean, phase, args, run_dir) for phase in phases))
        mb = round(16 * m) * WIDTH * 4 / 1e6
        lines.append(f"| {m:g} | {mb:.2f} | " + " | ".join(cells) + " |")
    return lines


def cost_table(gaps, args, run_dir: str) -> list[str]:
    lines = ["| heap gap | clean loop: detector us/step | leaking 10x until flagged: detector us/step | "
             "heap samples (out of turn) | one heap sample, us |", "|---|---|---|---|---|"]
    for g in gaps:
        case = Case(g, run_dir)
        try:
            x, y = torch.randn(160, 16), torch.randn(160, 4)
            for _ in range(300):
                case.step(x, y, None)
            clean = statistics.median(case.finalize_s[32:]) * 1e6
            case.finalize_s.clear()
            kept: list = []
            for _ in range(args.max_steps):
                if case.step(x, y, kept):
                    break
            leaking = statistics.median(case.finalize_s[:-1]) * 1e6 if len(case.finalize_s) > 1 else float("nan")
            extra = getattr(case.probe, "heap_extra_samples", "n/a")
            heap_us = statistics.median(case.heap_s) * 1e6
        finally:
            case.close()
            gc.collect()
        lines.append(f"| {g} | {clean:.0f} | {leaking:.0f} | {len(case.sampled_at)} ({extra}) | {heap_us:.0f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--multiples", default="1.5,2,4,10,26")
    parser.add_argument("--gaps", default="1,11,64")
    parser.add_argument("--max-steps", type=int, default=400)
    parser.add_argument("--max-bytes", type=float, default=1.5 * 2 ** 30)
    parser.add_argument("--no-fresh", action="store_true", help="skip the table with a new process per case")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # gap,multiple,clean,phase: one case, one cell
    args = parser.parse_args()
    args.fresh = False
    multiples = [float(v) for v in args.multiples.split(",")]
    gaps = [int(v) for v in args.gaps.split(",")]
    logging.getLogger("torchtrace").setLevel(logging.ERROR)  # the anomaly's warning per case
    torch.set_num_threads(1)
    if args.one:
        gap, multiple, clean, phase = args.one.split(",")
        with tempfile.TemporaryDirectory() as run_dir:
            print(one_case(int(gap), float(multiple), int(clean), phase, args, run_dir))
        return
    from torchtrace.record import growth

    print(f"# leak detection benchmark: torch {torch.__version__}, python {platform.python_version()}, "
          f"{platform.machine()}, torch threads {torch.get_num_threads()}")
    print(f"# defaults: threshold {growth.DEFAULT_THRESHOLD} bytes/step, window {growth.DEFAULT_WINDOW}; "
          f"steps from the leak's first step to the memory_leak anomaly")
    mid = ("leak from a step after 120 clean steps; at gaps over 1, a / u: its first step right after a heap "
           "sample / the next sample sees growth just under the threshold")
    with tempfile.TemporaryDirectory() as run_dir:
        print("\nthe detector's own time per step (LeakProbe.finalize less its heap samples, median):")
        print("\n".join(cost_table(gaps, args, run_dir)))
        print("\nleak from the first step (all cases in one process):")
        print("\n".join(detection_table(multiples, gaps, 0, args, run_dir)))
        print(f"\n{mid}; all cases in one process, whose heap holds what earlier cases freed:")
        print("\n".join(detection_table(multiples, gaps, 120, args, run_dir)))
        if not args.no_fresh:
            args.fresh = True
            print(f"\n{mid}; each case in a new process:")
            print("\n".join(detection_table(multiples, gaps, 120, args, run_dir)))


if __name__ == "__main__":
    main()
