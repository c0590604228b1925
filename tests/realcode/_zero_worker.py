"""DDP with ``ZeroRedundancyOptimizer`` (each rank keeps a shard of the optimizer's state), as
its tutorial writes a checkpoint: every rank consolidates the shards onto rank 0, which saves
them to a file.

Usage: ``python -m torch.distributed.run ... _zero_worker.py OUT_DIR``; each rank writes
``OUT_DIR/zero.rank<r>.json``: its checkpoint saves and loads as torchtrace counted them, and
its black box's ``checkpoint_step``.
"""

from __future__ import annotations

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torchtrace as tt  # noqa: E402
from torchtrace import semconv  # noqa: E402
from torchtrace.api import get_runtime  # noqa: E402

STEPS = 4
SAVED_AFTER = 1  # the step after which the shards are consolidated and rank 0 saves


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    tt.configure(prometheus_port="off", run_dir=os.path.join(out, "runs"), register_atexit=False)
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                                        torch.nn.Linear(16, 1)))
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
    torch.manual_seed(rank)
    for step in range(STEPS):
        with tt.debug_context("train_step", model=model, optimizer=opt):
            torch.nn.functional.mse_loss(model(torch.randn(8, 8)), torch.randn(8, 1)).backward()
            opt.step()
            opt.zero_grad()
        if step == SAVED_AFTER:
            opt.consolidate_state_dict(to=0)  # shards travel as torch.save'd bytes, rank to rank
            if rank == 0:
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                           os.path.join(out, "checkpoint.pt"))
    rt = get_runtime()
    counted = {kind: rt.metrics.value(semconv.M_CHECKPOINT_SECONDS + "_count", {"kind": kind})
               for kind in ("save", "load")}
    result = {"counted": counted, "checkpoint_step": rt.rank_state.fields.get("checkpoint_step")}
    tt.shutdown()
    with open(os.path.join(out, f"zero.rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
