"""No secrets leave the process: a canary in the environment, argv, an exception message and
an auth header appears in no OTLP payload, /metrics page, report, span file or log line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.fixtures import GrpcOtlpReceiver

ROOT = Path(__file__).resolve().parents[1]
CANARY = "canary-7f3a9c1e-secret"
HEADER_CANARY = "hdr-canary-5b2d8e40"

CHILD = r"""
import sys, urllib.request, torch, torchtrace as tt
run_dir, endpoint, header, metrics_out = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
r = tt.configure(service_name="canary-job", prometheus_port=0, run_dir=run_dir, otlp_endpoint=endpoint,
                 otlp_protocol="grpc", metrics_exporter="both", otlp_headers={"authorization": "Bearer " + header})
model = torch.nn.Linear(4, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)
for i in range(5):
    try:
        with tt.debug_context("train_step", model=model, optimizer=opt) as step:
            loss = model(torch.ones(2, 4)).sum(); loss.backward(); step.record_loss(loss); opt.step()
            if i == 3:
                raise ValueError("bad batch from " + sys.argv[-1])
    except ValueError:
        pass
with urllib.request.urlopen(r.metrics_url, timeout=5) as resp:
    open(metrics_out, "wb").write(resp.read())
tt.shutdown()
"""


def test_secret_canary_appears_nowhere(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    run_dir = tmp_path / "runs"
    metrics_out = tmp_path / "metrics.txt"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHTRACE_", "OTEL_"))}
    env.update({"PYTHONPATH": str(ROOT), "MY_API_TOKEN": CANARY, "TORCHTRACE_LEVEL": "advanced"})
    with GrpcOtlpReceiver() as rx:
        out = subprocess.run([sys.executable, str(script), str(run_dir), rx.endpoint, HEADER_CANARY,
                              str(metrics_out), f"--token={CANARY}"],
                             env=env, cwd=tmp_path, capture_output=True, timeout=120)
        assert out.returncode == 0, out.stderr.decode()
        payloads = [r.SerializeToString() for r in rx.trace_requests() + rx.metric_requests()]
        headers = rx.headers()
        spans = rx.spans()
    assert spans and any(r for r in payloads)
    assert any(s.status_code.endswith("ERROR") for s in spans)  # the exception was recorded, by type only
    # The header was sent (that is its purpose) ...
    assert any(HEADER_CANARY in str(h.get("authorization", "")) for h in headers)
    blobs = {"stdout": out.stdout, "stderr": out.stderr, "/metrics": metrics_out.read_bytes()}
    blobs.update({f"payload {i}": p for i, p in enumerate(payloads)})
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert any(p.name.startswith("report") for p in files) and any(p.name.startswith("spans") for p in files)
    blobs.update({str(p): p.read_bytes() for p in files})
    # ... and nothing else carries either canary.
    for name, blob in blobs.items():
        assert CANARY.encode() not in blob, name
        assert HEADER_CANARY.encode() not in blob, name
    assert b"bad batch" not in b"".join(blobs.values())
