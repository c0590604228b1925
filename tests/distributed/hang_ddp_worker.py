"""A DDP job for the hang tests (run by torchrun, 3 ranks, gloo, CPU).

``HANG_MODE``: ``stop`` (rank 2 sleeps forever in its input code at step 8, before its
forward), ``kill`` (rank 2 SIGKILLs itself there), ``save`` (rank 2, after step 7, saves a
checkpoint to storage that never answers), ``none``. ``HANG_RUN_DIR``: the run
directory. Each rank prints ``RANK <r> STEP <n>`` as it finishes a step.
"""

import os
import signal
import time

import torch
import torch.distributed as dist

import torchtrace as tt

MODE = os.environ.get("HANG_MODE", "none")
STOP_AT = 8


def make_batch(rank: int, step: int) -> torch.Tensor:
    if rank == 2 and step == STOP_AT:
        if MODE == "stop":
            while True:
                time.sleep(0.2)  # the input pipeline never returns
        if MODE == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
    return torch.randn(8, 16)


def train() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tt.configure(run_dir=os.environ["HANG_RUN_DIR"], prometheus_port="off", hang_timeout_s=4,
                 register_atexit=True)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(40):
        with tt.debug_context("train_step", model=model, optimizer=opt) as scope:
            x = make_batch(rank, step)
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            scope.record_loss(loss)
        print(f"RANK {rank} STEP {step}", flush=True)
        if MODE == "save" and rank == 2 and step == STOP_AT - 1:
            with tt.checkpoint("save"):
                while True:
                    time.sleep(0.2)  # the storage never answers
        time.sleep(0.3)
    tt.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    train()
