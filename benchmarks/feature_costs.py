"""What each part of the throughput features costs a step where it runs, by taking it away.

``overhead.py`` times the features as a whole (BASIC against BASIC without them). A part's
own cost cannot be timed apart from the step around it: timed alone (a loop calling one
function), the ledger's booking and the metric update ran 4 and 10 times faster than they
cost inside a training step, where the step's own work has pushed torchtrace's code and
data out of the caches (measured 2026-11-27, benchmarks/RESULTS.md). So each
part is stubbed in turn, in a process of its own, and the features are timed again with it
stubbed: the difference to the run with nothing stubbed is what the part costs where it runs.

Parts (``--stub``):

  none      nothing stubbed
  key       the step's shape key (a constant: every step looks up the same FLOPs)
  clock     the phase clock (no marks in the forward seam or the optimizer hooks, no phases)
  ledger    the goodput ledger's booking (no data wait, no goodput, no throughput rules)
  metrics   the metric sums and the data-wait and phase histograms
  spans     the span's throughput attributes
  seam      the forward seam itself (the model's call is PyTorch's own; no forward marks)
  lr        the learning rates (none recorded)
  all       every part above

A stubbed part changes what a step records; the numbers say what a part costs, nothing more.

    python benchmarks/feature_costs.py                    # every part, 60 s of toy steps each
    python benchmarks/feature_costs.py --stub clock,none  # some parts
    python benchmarks/feature_costs.py --quick            # CI smoke: a few rounds, asserts nothing about time
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PARTS = ("none", "key", "clock", "ledger", "metrics", "spans", "seam", "lr", "all")


def stub(part: str) -> None:
    """Take ``part`` of the throughput features away, in this process."""
    import collections

    from torchtrace.export import spans, step_metrics
    from torchtrace.record import goodput
    from torchtrace.step import gradients, phases, throughput

    if part in ("key", "all"):
        throughput.shape_key = lambda args, kwargs: ()
    if part in ("clock", "all"):
        start = throughput.RunThroughput.start

        def without_clock(self, scope, parent, entered_at):
            state = start(self, scope, parent, entered_at)  # (the step's FLOP key, clock and counter)
            state.clock = None
            return state
        throughput.RunThroughput.start = without_clock
    if part in ("ledger", "all"):
        goodput.GoodputLedger.add_step = lambda self, step: goodput.StepAccount(None, ())
    if part in ("metrics", "all"):  # a step's throughput values go nowhere: nothing is added up or bucketed
        init = step_metrics._Operation.__init__

        def without_sums(self, label, kinds):
            init(self, label, kinds)
            self.unfolded = collections.deque(maxlen=0)  # (its append drops the values, in C)
        step_metrics._Operation.__init__ = without_sums
    if part in ("spans", "all"):
        spans._throughput = lambda attrs, record: None
    if part in ("seam", "all"):
        phases.ModelMarks.attach = lambda self, model: setattr(self, "attached", True)
    if part in ("lr", "all"):
        throughput.learning_rates = gradients.learning_rates = lambda optimizer: None


def measure(part: str, budget_s: float, quick: bool) -> str:
    """The features' cost (basic - basic-nothr) on the toy model with ``part`` stubbed."""
    sys.path.insert(0, str(HERE))
    import torch

    import overhead
    import torchtrace as tt

    logging.getLogger("torchtrace").setLevel(logging.ERROR)
    tt.configure(service_name="feature-costs", level="basic", prometheus_port=0,
                 run_dir=tempfile.mkdtemp(prefix="torchtrace-costs-"), register_atexit=False)
    if part != "none":
        stub(part)
    args = argparse.Namespace(quick=False, device="cpu", gpu_model=False, only_mlp=False, workloads=None)
    wl = next(w for w in overhead.workloads(args, torch.device("cpu")) if w.name.startswith("toy"))
    rounds, steps = (3, 2) if quick else (100_000, 10)  # rounds: until the budget is spent
    times, _ = overhead.run_workload(wl, ["bare", "basic", "basic-nothr", "basic-aa"], rounds, steps,
                                     1 if quick else 5, torch.device("cpu"), budget_s)
    wall = {v: [t[0] for t in ts] for v, ts in times.items()}
    features, aa = overhead.throughput_verdict(wall)[:2]
    return f"{part:8s} {len(wall['basic'])} rounds | {features.split(': ', 1)[1]} | {aa.split(': ', 1)[1]}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stub", default=",".join(PARTS), help=f"comma-separated parts: {', '.join(PARTS)}")
    p.add_argument("--budget", type=float, default=60.0, help="seconds of timed rounds per part")
    p.add_argument("--quick", action="store_true", help="a few rounds per part: a CI smoke test")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: measure one part here
    args = p.parse_args(argv)
    parts = [s.strip() for s in args.stub.split(",") if s.strip()]
    bad = [s for s in parts if s not in PARTS]
    if bad or not parts:
        p.error(f"--stub={args.stub!r} is not valid; accepted values: {', '.join(PARTS)}")
    budget = 1.0 if args.quick else args.budget
    if args.one:
        print(measure(parts[0], budget, args.quick), flush=True)
        return 0
    # (the version from the package's metadata: this process measures nothing, and importing
    # torch would double the start-up of a quick run)
    from importlib.metadata import version

    print(f"# what each part of the throughput features costs a toy step (basic - basic-nothr with the part "
          f"stubbed), torch {version('torch')}, {os.cpu_count()} CPUs, {budget:g} s of rounds per part")
    print("# part, rounds | features: median, share of bare, 95 % interval | the A/A pair")
    started = time.perf_counter()
    for part in parts:  # a process each: a stub cannot be put back, and one run leaves caches warm for the next
        cmd = [sys.executable, __file__, "--one", "--stub", part, "--budget", str(budget)] + (["--quick"] * args.quick)
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            print(out.stdout + out.stderr, file=sys.stderr)
            return out.returncode
        print(out.stdout.strip().splitlines()[-1], flush=True)
    print(f"# {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
