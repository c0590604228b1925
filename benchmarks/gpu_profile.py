"""Where a step's time goes on a GPU: bare, floor and BASIC steps of overhead.py's workloads under
torch.profiler, timed as overhead.py times them (rounds of a few steps, then a synchronisation).

    python benchmarks/gpu_profile.py --gpu-model          # the 101M MLP
    python benchmarks/gpu_profile.py --gpt                # the 124M decoder in bf16 with clipping
    python benchmarks/gpu_profile.py --gpt --out DIR      # also each variant's chrome trace (gzip)

Per variant and per step: the wall time, the device's busy time (the union of its kernels, copies
and fills), the device's idle time between a round's first and last kernel, the time from a
round's start to its first kernel (host work the device waits for), and the time from its last
kernel to the round's end. Then the kernels whose device time per step differs from the bare
step's by more than a microsecond; unprofiled, the time from calling each variant's step to
its body's first line (host work the device waits for after a synchronisation), and each
thread's CPU time per BASIC step. Needs CUDA.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead  # noqa: E402

import torchtrace as tt  # noqa: E402

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def profile_rounds(runner, rounds: int, steps: int) -> list[dict]:
    """The chrome-trace events of ``rounds`` rounds of ``steps`` calls of ``runner``, each round
    annotated ``round`` and ended by a synchronisation."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(rounds):
            with torch.profiler.record_function("round"):
                for _ in range(steps):
                    runner()
                torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    prof.export_chrome_trace(path)
    with open(path) as f:
        trace = json.load(f)
    os.unlink(path)
    return trace["traceEvents"]


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``intervals`` (start, end)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def summarise(events: list[dict], steps: int) -> dict:
    """Medians over rounds, per step, in µs, and each device operation's total µs per step."""
    rounds = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                    if e.get("name") == "round" and e.get("cat") == "user_annotation")
    device = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in events
                    if e.get("cat") in DEVICE_CATEGORIES)
    per_round = []
    for start, end in rounds:
        inside = [(s, e) for s, e, _ in device if start <= s < end]
        if not inside:
            continue
        busy = busy_time(inside)
        first, last = min(s for s, _ in inside), max(e for _, e in inside)
        per_round.append({"wall": (end - start) / steps, "busy": busy / steps,
                          "idle_inside": (last - first - busy) / steps,
                          "to_first_kernel": first - start, "after_last_kernel": end - last})
    by_name: dict[str, float] = collections.defaultdict(float)
    counted = sum(1 for _ in per_round) * steps
    for s, e, name in device:
        if any(start <= s < end for start, end in rounds):
            by_name[name] += (e - s) / counted
    out = {k: statistics.median(r[k] for r in per_round) for k in per_round[0]}
    out["ops"] = dict(by_name)
    return out


def thread_cpu_per_step(runner, steps: int) -> tuple[float, dict[str, float]]:
    """Wall µs per step over ``steps`` unprofiled calls of ``runner``, and each thread's CPU µs
    per step meanwhile (the training thread and torchtrace's own)."""
    def cpu() -> dict[str, float]:
        out = {}
        for t in threading.enumerate():
            if t.ident is not None:
                try:
                    out[t.name] = time.clock_gettime(time.pthread_getcpuclockid(t.ident))
                except (OSError, ProcessLookupError):  # the thread just ended
                    pass
        return out

    torch.cuda.synchronize()
    before, t0 = cpu(), time.perf_counter()
    for _ in range(steps):
        runner()
    torch.cuda.synchronize()
    wall, after = time.perf_counter() - t0, cpu()
    return wall / steps * 1e6, {name: (after[name] - before.get(name, 0.0)) / steps * 1e6 for name in after}


def entry_latency(wl, variant: str, rounds: int, steps: int, sync) -> tuple[float, float]:
    """Median µs from calling a ``variant`` step to its body's first line (the user's code; on a
    GPU the device idles until then after a synchronisation): for the first step of a round,
    which follows ``sync()``, and for the others. Unprofiled."""
    starts: list[float] = []
    body = wl.step

    def step(model, batch):
        starts.append(time.perf_counter())
        return body(model, batch)

    wl.step = step  # (the instance's attribute: make_runner's variants call it)
    try:
        runner = overhead.make_runner(variant, wl)
        for _ in range(3):
            runner()
        first, later = [], []
        for _ in range(rounds):
            sync()
            for i in range(steps):
                called = time.perf_counter()
                runner()
                (first if i == 0 else later).append((starts[-1] - called) * 1e6)
        sync()
    finally:
        del wl.step
    return statistics.median(first), statistics.median(later) if later else float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu-model", action="store_true")
    p.add_argument("--gpt", action="store_true")
    p.add_argument("--variants", default="bare,floor,basic")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=2, help="steps per round (overhead.py's rounds have 2)")
    p.add_argument("--out", default=None, help="a folder for each variant's chrome trace")
    args = p.parse_args()
    args.quick, args.only_mlp = False, True
    device = torch.device("cuda")
    tt.configure(service_name="gpu-profile", level="basic", prometheus_port=0, run_dir=tempfile.mkdtemp(),
                 register_atexit=False)
    wl = overhead.workloads(args, device)[0]
    print(f"# {wl.name}: {wl.n_params / 1e6:.2f}M parameters in {wl.n_tensors} tensors; torch {torch.__version__}, "
          f"{torch.cuda.get_device_name(0)}; {args.rounds} rounds of {args.steps} steps per variant; µs per step")
    results = {}
    for variant in args.variants.split(","):
        runner = overhead.make_runner(variant, wl)
        for _ in range(5):
            runner()
        torch.cuda.synchronize()
        events = profile_rounds(runner, args.rounds, args.steps)
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            with gzip.open(Path(args.out) / f"{wl.name}-{variant}.json.gz", "wt") as f:
                json.dump(events, f)
        results[variant] = summarise(events, args.steps)
    keys = ("wall", "busy", "idle_inside", "to_first_kernel", "after_last_kernel")
    print(f"{'variant':<8} " + " ".join(f"{k:>17}" for k in keys) + "   (to_first/after_last: µs per round)")
    for variant, r in results.items():
        print(f"{variant:<8} " + " ".join(f"{r[k]:17.1f}" for k in keys))
    bare = results.get("bare", {"ops": {}})["ops"]
    for variant, r in results.items():
        if variant == "bare":
            continue
        diff = {name: r["ops"].get(name, 0.0) - bare.get(name, 0.0) for name in set(r["ops"]) | set(bare)}
        shown = sorted((d, name) for name, d in diff.items() if abs(d) > 1.0)
        print(f"\n{variant} - bare, device µs per step by operation (|difference| > 1 µs), "
              f"in all {sum(diff.values()):+.1f}:")
        for d, name in sorted(shown, reverse=True):
            print(f"  {d:+9.1f}  {name[:110]}")
    print("\nµs from calling the step to its body's first line, median of 50 rounds (unprofiled):")
    for variant in args.variants.split(","):
        first, later = entry_latency(wl, variant, 50, args.steps, torch.cuda.synchronize)
        print(f"  {variant:<8} first step of a round {first:8.1f}   later steps {later:8.1f}")
    if "basic" in args.variants.split(","):
        wall, threads = thread_cpu_per_step(overhead.make_runner("basic", wl), 100)
        print(f"\nbasic, 100 steps unprofiled: {wall:.1f} µs per step; CPU µs per step by thread:")
        for name, used in sorted(threads.items(), key=lambda kv: -kv[1]):
            if used >= 0.5:
                print(f"  {used:9.1f}  {name}")
    tt.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
