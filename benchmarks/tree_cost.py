"""BASIC's cost in two trees of torchtrace: this checkout against an earlier commit, alternating.

A change to the step's code (a redesign, a new feature on the step's path) should leave BASIC's
cost where it was. Two trees cannot share a process, so each child process imports torchtrace
from one tree and times ``benchmarks/overhead.py``'s own workload, runner and round design
(interleaved rounds of bare, floor and basic) for ``--seconds``; its figure is BASIC's cost
beyond the floor, the median over its rounds of basic - floor. Children run in shuffled triples
(base, base again, new): base again - base is the A/A pair, how far apart two processes of the
same tree read on this machine, which new - base is judged against. Both are paired within
their triple, so a slow minute of the machine hits the three alike.

    python benchmarks/tree_cost.py --base fe2504a                 # every CPU workload
    python benchmarks/tree_cost.py --base fe2504a --workloads toy --triples 6 --seconds 10

The base tree is exported from git (its ``torchtrace/`` only) into a temporary folder; the new
tree is this checkout, uncommitted changes included (the header says whether there are any).
The workloads, the runner and the timing are this checkout's for both trees.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = Path(__file__).resolve().parent
# overhead.py, imported where it is used: a child must import torchtrace from its tree first.
sys.path.insert(0, str(BENCHMARKS))
WORKLOADS = ("mlp", "toy", "encoder", "tensors-1000", "tensors-3000", "tensors-10000")


def child(tree: str, workload: str, seconds: float) -> dict[str, float | int | str]:
    """Time one workload with torchtrace imported from ``tree``: bare, floor and basic in
    overhead.py's interleaved rounds. BASIC's cost beyond the floor and beyond bare (medians over
    rounds of the paired differences, seconds a step) and the bare step."""
    # torchtrace comes from the tree; overhead.py's own path entry for this checkout comes later
    # and finds it already imported.
    sys.path.insert(0, tree)
    import torch

    import torchtrace as tt

    if not tt.__file__.startswith(tree):
        raise SystemExit(f"torchtrace came from {tt.__file__}, not from {tree}")
    import overhead

    torch.set_num_threads(1)
    logging.getLogger("torchtrace").setLevel(logging.ERROR)
    tt.configure(service_name="tree-cost-bench", level="basic", prometheus_port=0,
                 run_dir=tempfile.mkdtemp(prefix="torchtrace-tree-"), register_atexit=False)
    options = argparse.Namespace(gpu_model=False, quick=False, only_mlp=False)
    chosen = [wl for wl in overhead.workloads(options, torch.device("cpu")) if wl.name.startswith(workload)]
    if not chosen:
        raise SystemExit(f"no workload named {workload!r} in overhead.py")
    wl = chosen[0]
    variants, _, steps, _ = overhead.workload_plan(wl, ["bare", "floor", "basic"], 2, 100_000, quick=False)
    times, background = overhead.run_workload(wl, variants, 100_000, steps, 5, torch.device("cpu"), seconds)
    wall = {v: [t[0] for t in times[v]] for v in variants}
    tt.shutdown()
    return {
        "workload": wl.name,
        "rounds": len(wall["bare"]),
        "bare_s": statistics.median(wall["bare"]),
        "beyond_floor_s": statistics.median(b - f for b, f in zip(wall["basic"], wall["floor"])),
        "beyond_bare_s": statistics.median(b - f for b, f in zip(wall["basic"], wall["bare"])),
        "background_s": background,
    }


def export_tree(rev: str, into: str) -> str:
    """``torchtrace/`` of commit ``rev`` under ``into``; the folder to put on ``sys.path``."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev, "torchtrace"],
                             capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", into], input=archive.stdout, check=True)
    return into


def run_child(tree: str, workload: str, seconds: float) -> dict:
    from overhead import run_child as overhead_child

    return overhead_child(__file__, ["--child", tree, "--workloads", workload, "--seconds", str(seconds)])


def compare(workload: str, trees: dict[str, str], triples: int, seconds: float) -> list[str]:
    """Shuffled triples (base, base again, new); new - base and the A/A pair, base again - base,
    each paired within its triple, for BASIC's cost beyond the floor."""
    from overhead import median_interval, noise_verdict

    shuffle = random.Random(1)
    runs: dict[str, list[dict]] = {"base": [], "base2": [], "new": []}
    for _ in range(triples):
        order = list(runs)
        shuffle.shuffle(order)
        for kind in order:
            runs[kind].append(run_child(trees["new" if kind == "new" else "base"], workload, seconds))
    us = 1e6

    def cost(kind: str) -> list[float]:
        return [r["beyond_floor_s"] for r in runs[kind]]

    diff = [n - b for n, b in zip(cost("new"), cost("base"))]
    aa = [b2 - b for b2, b in zip(cost("base2"), cost("base"))]
    lo, hi = median_interval(diff)
    alo, ahi = median_interval(aa)
    med = statistics.median(diff)
    bare = statistics.median(r["bare_s"] for kind in runs for r in runs[kind])
    rounds = statistics.median(r["rounds"] for kind in runs for r in runs[kind])
    return [
        f"\n{runs['new'][0]['workload']}: {triples} triples of {seconds:g} s children ({rounds:g} rounds each, "
        f"median); bare step {bare * 1e3:.3f} ms",
        f"BASIC beyond the floor, median over children: base {statistics.median(cost('base')) * us:.1f} us, "
        f"base again {statistics.median(cost('base2')) * us:.1f} us, new {statistics.median(cost('new')) * us:.1f} us "
        f"({statistics.median(cost('new')) / bare * 100:.2f} % of bare)",
        f"new - base (per triple): {med * us:+.1f} us ({med / bare * 100:+.2f} % of bare), 95 % interval "
        f"[{lo * us:+.1f}, {hi * us:+.1f}] us; A/A (base again - base) {statistics.median(aa) * us:+.1f} us "
        f"[{alo * us:+.1f}, {ahi * us:+.1f}]",
        f"new against base: {noise_verdict(med, lo, hi, max(abs(alo), abs(ahi)))}",
    ]


def _describe_checkout() -> str:
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "torchtrace"],
                           capture_output=True, text=True).stdout.strip()
    return f"{head}{' with uncommitted changes to torchtrace/' if dirty else ''}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=False, help="the earlier commit (any git revision)")
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help=f"comma-separated prefixes of overhead.py's workload names (default {','.join(WORKLOADS)})")
    p.add_argument("--triples", type=int, default=4)
    p.add_argument("--seconds", type=float, default=8.0, help="timed rounds of each child")
    p.add_argument("--child", help=argparse.SUPPRESS)  # (one child process: the tree to import)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.workloads, args.seconds)))
        return 0
    if not args.base:
        p.error("--base is required: the commit to compare this checkout against")
    import torch

    with tempfile.TemporaryDirectory(prefix="torchtrace-base-") as base_dir:
        trees = {"base": export_tree(args.base, base_dir), "new": str(ROOT)}
        print(f"# BASIC's cost, two trees: base {args.base}, new {_describe_checkout()}; torch {torch.__version__}, "
              f"python {platform.python_version()}, {os.cpu_count()} CPUs, torch threads 1; children of "
              f"{args.seconds:g} s in shuffled triples (base, base again, new)", flush=True)
        for workload in (w.strip() for w in args.workloads.split(",") if w.strip()):
            print("\n".join(compare(workload, trees, args.triples, args.seconds)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
