"""The real-code suite's straggler job (``torchrun --nproc_per_node=2``, gloo on CPU): DDP, rank 1
50 ms slower per step, in three runs of torchtrace in one launch: ``inside`` (rank 1 sleeps 50 ms
more in its step, between forward and backward, as a slower device would compute), ``outside``
(rank 1 sleeps 50 ms before each step, as a slow data loader would) and ``even``. Each rank's
work in the step is a small model's forward and backward and a 20 ms sleep.

Usage: ``python -m torch.distributed.run ... _skew_worker.py OUT_DIR``; each rank writes
``OUT_DIR/skew.rank<r>.json``: per run, the report's ``rank_skew`` section (the last gather),
the ``torchtrace_rank_step_skew`` gauge, and ``reference_s``: the rank's own time in the step
measured by the script, its mean over the last gather's window (from the step's start through
the forward and the sleep, up to the backward, where DDP makes the ranks wait for each other).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torchtrace as tt  # noqa: E402
from torchtrace.api import get_runtime  # noqa: E402

RUNS = ("inside", "outside", "even")
INTERVAL = 20
STEPS = 2 * INTERVAL
SLOW_S = 0.05
# Every rank's work in its step, beside the small model's: a sleep, so that the scheduler's noise
# on this 2-core machine (a few ms, other jobs running) stays small beside each rank's own time.
WORK_S = 0.02


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(3):
        layers += [torch.nn.Linear(256, 256), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(256, 1))


def run(out: str, rank: int, where: str) -> dict:
    """One torchtrace run of DDP training with rank 1 slowed ``where`` (``inside``, ``outside``
    the step, or ``even``: not at all)."""
    tt.configure(service_name="realcode-skew", prometheus_port="off", run_dir=os.path.join(out, where),
                 register_atexit=False, strict=True, rank_skew_interval=INTERVAL)
    model = torch.nn.parallel.DistributedDataParallel(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.001)
    own: list[float] = []
    slow = rank == 1

    @tt.debug_operation(name="train_step", model=model, optimizer=opt)
    def step(x: torch.Tensor) -> torch.Tensor:
        began = time.perf_counter()
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        time.sleep(WORK_S + (SLOW_S if slow and where == "inside" else 0.0))
        own.append(time.perf_counter() - began)
        loss.backward()
        opt.step()
        return loss

    for _ in range(STEPS):
        x = torch.randn(256, 256)
        if slow and where == "outside":
            time.sleep(SLOW_S)
        step(x)
    rt = get_runtime()
    gauge = rt.metrics.registry.get_sample_value("torchtrace_rank_step_skew",
                                                 {"run_id": rt.settings.run_id, "rank": str(rank)})
    section = rt.report()["distributed"]["rank_skew"]
    tt.shutdown()
    return {"rank_skew": section, "skew_gauge": gauge, "reference_s": sum(own[-INTERVAL:]) / INTERVAL}


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    results = {}
    for where in RUNS:
        results[where] = run(out, rank, where)
        dist.barrier()
    with open(os.path.join(out, f"skew.rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
