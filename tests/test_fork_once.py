"""A "once only" log line stays once over a process tree: 20 real forked DataLoader workers
(the audit saw one line per worker, 600 over 600 workers)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHILD = r"""
import logging, sys, torch, torchtrace as tt
from torchtrace.errors import InternalErrors
logging.basicConfig(level=logging.WARNING, format="LOG %(name)s %(message)s")
tt.configure(prometheus_port=None, run_dir=sys.argv[1], guard="skip", register_atexit=False)
model = torch.nn.Linear(4, 1)
errors = InternalErrors()

class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        # A step without an optimizer under guard='skip' is named once (a user's mistake) ...
        with tt.debug_context("worker_op", model=model) as step:
            loss = model(torch.ones(1, 4)).sum()
            loss.backward()
            step.record_loss(loss)
        # ... and torchtrace's own failure of one kind is logged once.
        errors.report("files", OSError("disk gone"))
        return torch.ones(4)

# One step here first (it has an optimizer: neither line is logged) does torchtrace's first-step
# work once, before the fork, not once in each of the 20 workers (21 s -> 8 s of wall time here).
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with tt.debug_context("warm_up", model=model, optimizer=opt) as step:
    loss = model(torch.ones(1, 4)).sum()
    loss.backward()
    opt.step()
    step.record_loss(loss)

loader = torch.utils.data.DataLoader(Data(), batch_size=1, num_workers=20, multiprocessing_context="fork")
print("batches", sum(1 for _ in loader), flush=True)
tt.shutdown()
"""


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="fork start method")
def test_once_only_lines_are_once_per_process_tree_over_20_forked_workers(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHTRACE_", "OTEL_"))}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "runs")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    assert "batches 40" in done.stdout, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    guard = [line for line in lines if line.startswith("LOG") and "guard='skip' cannot skip" in line]
    internal = [line for line in lines if line.startswith("LOG") and "internal error in files (OSError)" in line]
    print(f"20 forked workers: guard warning {len(guard)} time(s), internal error {len(internal)} time(s)")
    assert len(guard) == 1, guard
    assert len(internal) == 1, internal
