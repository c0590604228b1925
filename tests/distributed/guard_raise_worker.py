"""A DDP job under ``guard="raise"`` with a NaN in rank 1's batch at step 3: every rank raises
``NonFiniteError`` at that step, by the guard's agreed decision, and the job ends.
``argv[1]``: the run directory."""

import sys

import torch
import torch.distributed as dist

import torchtrace as tt

dist.init_process_group("gloo")
rank = dist.get_rank()
tt.configure(service_name="guard-raise", run_dir=sys.argv[1], prometheus_port="off", guard="raise")
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
torch.manual_seed(1 + rank)
for step in range(6):
    x = torch.randn(4, 8)
    if step == 3 and rank == 1:
        x[0, 0] = float("nan")
    with tt.debug_context("train_step", model=model, optimizer=opt) as scope:
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        scope.record_loss(loss)
        opt.step()
