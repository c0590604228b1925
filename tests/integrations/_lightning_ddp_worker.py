"""A Lightning job on two processes its own launcher starts (``devices=2, strategy="ddp"`` on
the CPU, gloo), with torchtrace configured at the top of the script, before the launcher starts
the second process and the process group: as a user's script does it.

Usage: ``python _lightning_ddp_worker.py OUT_DIR``; each process writes ``OUT_DIR/rank<r>.json``:
its steps' skip decisions, its identity as torchtrace read it, its run id, a checksum of the final
weights.
A NaN loss on rank 1 at batch 2 of each epoch; the rank-skew collective every 3 steps.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402

import torchtrace as tt  # noqa: E402
from torchtrace.integrations.lightning import TorchtraceCallback  # noqa: E402

STEPS = 10


class Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if batch_idx == 2 and self.global_rank == 1:
            loss = loss * float("nan")
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main() -> int:
    out = sys.argv[1]
    logging.getLogger("lightning").setLevel(logging.ERROR)
    tt.configure(service_name="lightning-ddp", prometheus_port="off", run_dir=os.path.join(out, "runs"),
                 register_atexit=False, strict=True, guard="skip", rank_skew_interval=3)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)
    module = Module()
    trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", devices=2,
                         strategy=DDPStrategy(timeout=datetime.timedelta(seconds=20)), logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[TorchtraceCallback()], limit_val_batches=0)
    trainer.fit(module, data)
    rt = tt.api.get_runtime()
    rt.finish_deferred(block=True)
    steps = [r for r in rt.history.steps() if r["operation"] == "train_step"]
    result = {"skipped": [r["step"] for r in steps if r.get("skipped")], "steps": len(steps),
              "rank": rt.identity.rank, "world": rt.identity.world_size,
              "skews": rt.report()["distributed"]["collectives"].get("skew", 0),
              "weights": float(sum(p.detach().double().sum() for p in module.parameters())),
              "finite": all(bool(torch.isfinite(p).all()) for p in module.parameters()),
              "run_id": rt.settings.run_id}
    tt.shutdown()
    with open(os.path.join(out, f"rank{trainer.global_rank}.json"), "w") as fh:
        json.dump(result, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
