"""One training process for the hang tests; ``HANG_CASE`` picks how it gets stuck.

Cases: ``forward`` (a module's forward sleeps forever), ``loader`` (a DataLoader worker
never returns a batch), ``regex`` (a catastrophic regular expression holds the GIL),
``busy`` (a Python busy loop), ``stuck_evaluation`` (an evaluation loop the script does not
mark, whose forward sleeps forever), ``slow_first`` / ``checkpoint`` / ``evaluation`` /
``unmarked_evaluation`` / ``slow_steps`` (no hang: must not be flagged). ``HANG_TIMEOUT``: hang_timeout_s, unset for the adaptive
timeout. The process prints ``METRICS <url>`` and ``HANGING <unix time>`` (flushed).
"""

import os
import re
import sys
import time

import torch

import torchtrace as tt

CASE = os.environ["HANG_CASE"]
HANG_AT = int(os.environ.get("HANG_AT", "5"))


class Stuck(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 2)
        self.stuck = False

    def forward(self, x):
        if self.stuck:
            print(f"HANGING {time.time()}", flush=True)
            if CASE in ("forward", "stuck_evaluation"):
                while True:
                    time.sleep(0.5)  # waits forever, as a lost peer or a dead device would
            if CASE == "busy":
                n = 0
                while True:
                    n += 1
            if CASE == "regex":
                re.match(r"(a+)+$", "a" * 64 + "b")  # catastrophic backtracking, inside the C matcher
        return self.lin(x)


class Batches(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 1000

    def __getitem__(self, i: int):
        if CASE == "loader" and i == HANG_AT:
            while True:
                time.sleep(0.5)  # the worker never returns this batch
        return torch.randn(8)


def step_seconds(step: int) -> float:
    if CASE == "slow_first":
        return 3.0 if step == 0 else 0.1
    if CASE == "slow_steps":
        return 3.0
    return 0.01


def train() -> None:
    timeout = os.environ.get("HANG_TIMEOUT")
    tt.configure(run_dir=os.environ["HANG_RUN_DIR"], prometheus_port=0,
                 hang_timeout_s=float(timeout) if timeout else None, register_atexit=True)
    print(f"METRICS {tt.current.runtime().metrics_url}", flush=True)
    model = Stuck()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(Batches(), batch_size=None, num_workers=1 if CASE == "loader" else 0)
    steps = int(os.environ.get("HANG_STEPS", "1000000"))
    if CASE == "loader":
        print(f"HANGING {time.time()}", flush=True)
    for step, x in enumerate(loader):
        if step >= steps:
            break
        model.stuck = CASE in ("forward", "busy", "regex") and step == HANG_AT
        with tt.debug_context("train_step", model=model, optimizer=opt) as scope:
            loss = model(x.unsqueeze(0)).pow(2).mean()
            loss.backward()
            time.sleep(step_seconds(step))
            opt.step()
            opt.zero_grad()
            scope.record_loss(loss)
        if CASE == "checkpoint" and step == 3:
            with tt.debug_context("save", kind="checkpoint"):
                time.sleep(8.0)
        if CASE in ("unmarked_evaluation", "stuck_evaluation") and step == 3:
            # nanoGPT's estimate_loss, a validation pass: the model called under no_grad
            # between steps, for longer than the timeout, and not marked
            model.stuck = CASE == "stuck_evaluation"
            with torch.no_grad():
                for _ in range(8):
                    model(torch.randn(1, 8))
                    time.sleep(0.5)
        if CASE == "evaluation" and step == 3:
            with tt.debug_context("evaluate", model=model, kind="evaluation"), torch.no_grad():
                for _ in range(4):
                    model(torch.randn(1, 8))
                    time.sleep(1.0)
    print("DONE", flush=True)
    tt.shutdown()


if __name__ == "__main__":
    train()
    sys.exit(0)
