"""Running tests/job/trainer.py as a real process, and reading its own timestamps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TRAINER = Path(__file__).with_name("trainer.py")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TORCHTRACE_", "OTEL_", "TORCHELASTIC_", "SLURM_"))}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **extra)
    return env


RANK_SCRIPT = r"""
import sys, torch, torch.distributed as dist, torchtrace as tt

dist.init_process_group("gloo")
tt.configure(prometheus_port="off", run_dir=sys.argv[1])
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    with tt.debug_context("train_step", model=model, optimizer=opt):
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
tt.shutdown()
dist.destroy_process_group()
"""
"""A rank of a two-rank gloo job, however it was launched: two steps into ``argv[1]``, its run dir."""


def start(config: dict, env: dict[str, str], cmd: list[str] | None = None) -> subprocess.Popen:
    return subprocess.Popen((cmd or [sys.executable]) + [str(TRAINER), json.dumps(config)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_ready(proc: subprocess.Popen, timeout: float = 120.0) -> int:
    """The step the trainer stopped at (it prints READY <step>); fails if it ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("READY"):
            return int(line.split()[1])
        if not line and proc.poll() is not None:
            raise AssertionError(f"trainer ended with {proc.returncode}: {proc.stderr.read()[-3000:]}")
    raise AssertionError("trainer never got ready")


def events(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
