"""Process exit stays fast whatever the collector does (the SDK's defaults take 19-30 s).

Each case runs a real training script in a subprocess that exits through the interpreter's
normal exit (torchtrace's atexit shutdown), and measures the wall time from the end of
training to process exit. A baseline with ``TORCHTRACE_DISABLED=1`` (same imports) gives the
interpreter's own teardown time, which on a loaded 2-core machine is itself 1-2 s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc

from tests.fixtures import BlackHole, GrpcOtlpReceiver, dead_port

ROOT = Path(__file__).resolve().parents[1]
CHILD = r"""
import sys, torch, torchtrace as tt
tt.configure(prometheus_port=0, run_dir=sys.argv[1], otlp_endpoint=sys.argv[2], otlp_protocol=sys.argv[3],
             metrics_exporter="both", metrics_export_interval_s=0.2)
torch.manual_seed(0)
model = torch.nn.Linear(8, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)
for i in range(20):
    with tt.debug_context("train_step", model=model, optimizer=opt) as step:
        loss = model(torch.ones(4, 8)).pow(2).mean(); loss.backward(); step.record_loss(loss)
        opt.step(); opt.zero_grad()
print("trained", flush=True)
"""


def _exit_seconds(tmp_path: Path, endpoint: str, protocol: str = "grpc", disabled: bool = False) -> float:
    tmp_path.mkdir(parents=True, exist_ok=True)
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHTRACE_", "OTEL_"))}
    env["PYTHONPATH"] = str(ROOT)
    if disabled:
        env["TORCHTRACE_DISABLED"] = "1"
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "runs"), endpoint, protocol], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    t0 = None
    for line in proc.stdout:
        if line.startswith("trained"):
            t0 = time.monotonic()
            break
    assert t0 is not None, "child did not train"
    rc = proc.wait(timeout=60)
    elapsed = time.monotonic() - t0
    assert rc == 0
    return elapsed


def _report(tmp_path: Path) -> dict:
    [path] = list((tmp_path / "runs").glob("*/report*.json"))
    return json.loads(path.read_text())


def test_exit_within_two_seconds_of_baseline_in_every_collector_state(tmp_path):
    baseline = _exit_seconds(tmp_path / "base", "http://127.0.0.1:9", disabled=True)
    times = {}
    with BlackHole() as hole, GrpcOtlpReceiver() as unavailable:
        unavailable.fail_always(grpc.StatusCode.UNAVAILABLE, retry_after=1.0)
        states = {"dead_port": f"http://127.0.0.1:{dead_port()}", "black_hole": hole.endpoint,
                  "unavailable": unavailable.endpoint}
        for name, endpoint in states.items():
            times[name] = _exit_seconds(tmp_path / name, endpoint)
            report = _report(tmp_path / name)  # the atexit shutdown wrote the final report
            assert report["totals"]["steps"] == 20
            assert sum(report["telemetry"]["spans_dropped"].values()) >= 1
        assert unavailable.requests_seen(), "the UNAVAILABLE collector was reached"
    print(f"exit after training, 2-core CPU container: baseline {baseline:.2f} s, "
          + ", ".join(f"{k} {v:.2f} s" for k, v in times.items()))
    for name, seconds in times.items():
        assert seconds - baseline < 2.0, (name, seconds, baseline)
