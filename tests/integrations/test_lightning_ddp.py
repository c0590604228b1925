"""Lightning's own launcher (``devices=2, strategy="ddp"``): torchtrace is configured at the top
of the script, before the launcher starts the second process and both start the process group.
The first process read a world of one from its environment at configure, the second a world of
two: before, the second alone issued the guard's agreement and the rank-skew collective, and the
job hung for good (at its first step under ``guard="skip"``, at step 50 under the defaults).
torchtrace now reads its identity again when ``init_process_group`` returns."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import require_module

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
