"""PROMETHEUS_MULTIPROC_DIR, set for the application's own multiprocess metrics, leaves
torchtrace's private registry private: nothing of torchtrace's is written into that directory
(where the application's ``MultiProcessCollector`` would serve it), and a directory that does
not exist does not fail ``configure()``.

prometheus_client picks its value class when it is imported, so each case runs in a fresh
interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent("""
    import json, os, sys, urllib.request
    import torch
    import torchtrace as tt
    res = tt.configure(prometheus_port=0, run_dir=sys.argv[1], debug_api=False, register_atexit=False)
    model = torch.nn.Linear(4, 1)
    for i in range(5):
        with tt.debug_context("train_step", model=model) as step:
            loss = model(torch.randn(2, 4)).pow(2).mean()
            loss.backward()
            step.record_loss(loss)
    tt.flush()
    body = urllib.request.urlopen(res.metrics_url, timeout=10).read().decode()
    tt.shutdown()
    print(json.dumps({"steps": [l for l in body.splitlines() if l.startswith("torchtrace_steps_total{")],
                      "build_info": [l for l in body.splitlines() if l.startswith("torchtrace_build_info{")]}))
""")


def _run(tmp_path: Path, multiproc_dir: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHTRACE_", "OTEL_"))}
    env["PROMETHEUS_MULTIPROC_DIR"] = str(multiproc_dir)
    return subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "runs")], env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("exists", [True, False], ids=["existing_dir", "missing_dir"])
def test_multiproc_dir_is_not_used(tmp_path, exists):
    multiproc_dir = tmp_path / "prom-multiproc"
    if exists:
        multiproc_dir.mkdir()
    proc = _run(tmp_path, multiproc_dir)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(out["steps"]) == 1 and out["steps"][0].endswith(" 5.0")
    assert len(out["build_info"]) == 1 and out["build_info"][0].endswith(" 1.0")
    if exists:
        assert sorted(p.name for p in multiproc_dir.iterdir()) == []
    else:
        assert not multiproc_dir.exists()
