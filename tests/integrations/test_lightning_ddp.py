"""Lightning's own launcher (``devices=2, strategy="ddp"``): torchtrace is configured at the top
of the script, before the launcher starts the second process and both start the process group.
The first process read a world of one from its environment at configure, the second a world of
two: before, the second alone issued the guard's agreement and the rank-skew collective, and the
job hung for good (at its first step under ``guard="skip"``, at step 50 under the defaults).
torchtrace now reads its identity again when ``init_process_group`` returns. The second process
takes the first one's run id (before, each wrote a run of its own, and the second's files
were named for rank 0)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import require_module
from torchtrace.job.state import read_states

require_module("lightning.pytorch")

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_lightning_ddp_worker.py")


@pytest.mark.timeout(200)
def test_a_lightning_ddp_job_from_its_own_launcher_skips_alike_and_ends(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHTRACE_", "OTEL_"))}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, str(WORKER), str(tmp_path)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r, res in enumerate(ranks):
        assert (res["rank"], res["world"]) == (r, 2)  # the second process read rank 0 from its environment
        assert res["steps"] == 10 and res["skipped"] == [2]  # rank 1's NaN batch, skipped on both
        assert res["skews"] == 3  # every 3 steps, on both
        assert res["finite"]
    assert ranks[0]["weights"] == ranks[1]["weights"]
    # One run: rank 1 took the run id of the script that started it; each black box says its
    # rank in the world the process group made.
    assert ranks[0]["run_id"] == ranks[1]["run_id"]
    (run,) = (tmp_path / "runs").iterdir()
    assert run.name == ranks[0]["run_id"]
    assert [(s["rank"], s["world_size"], s["ended"]) for s in read_states(run)] == [(0, 2, "completed"),
                                                                                 (1, 2, "completed")]


SPAWN_SCRIPT = r"""
import os, sys, torch, lightning.pytorch as pl
from torchtrace.integrations.lightning import TorchtraceCallback


class Regressor(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


if __name__ == "__main__":
    x = torch.randn(64, 8)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=2, strategy=sys.argv[1], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[TorchtraceCallback()])
    trainer.fit(Regressor(), data)
"""


@pytest.mark.timeout(200)
@pytest.mark.parametrize("strategy", ["ddp_spawn", "ddp"])
def test_lightning_ranks_configured_by_the_callback_alone_share_one_run(tmp_path, strategy):
    """No ``configure()`` call and no run id: the script only passes ``TorchtraceCallback()`` to the
    Trainer. ``strategy="ddp_spawn"`` starts its ranks through ``multiprocessing``; each sets
    torchtrace up from the environment at its first step. ``strategy="ddp"`` runs the script
    again for rank 1 after the first process built its callback, which offered the run id that
    process takes at its first step; rank 1 takes it too. Either way both ranks write one run directory,
    as ranks 0 and 1 of a world of 2 (before, a run directory each, where neither rank's watchdog
    saw the other)."""
    script = tmp_path / "train.py"
    script.write_text(SPAWN_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHTRACE_", "OTEL_"))}
    env.update(PYTHONPATH=str(ROOT), TORCHTRACE_RUN_DIR=str(tmp_path / "runs"), TORCHTRACE_PROMETHEUS_PORT="off")
    proc = subprocess.run([sys.executable, str(script), strategy], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (run,) = (tmp_path / "runs").iterdir()
    reports = [json.loads((run / f"report.rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["rank"], r["world_size"]) for r in reports] == [(0, 2), (1, 2)]
    assert [r["totals"]["steps"] for r in reports] == [4, 4]  # 64 samples, batches of 8, split over 2 ranks
