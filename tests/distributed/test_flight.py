"""Which collectives a rank's hang report can name, with the torch it runs on.

torch builds with ``_dump_fr_trace_json`` record gloo's collectives and NCCL's in one flight
recorder. An older torch (2.6) has NCCL's recorder only: gloo's collectives are then counted
from Python. Each test runs a fresh process (the recorder reads its buffer size from the
environment when a process group starts) with a real gloo process group.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(code: str, tmp_path: Path, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHTRACE_", "OTEL_", "TORCH_FR", "RANK",
                                                                      "WORLD_SIZE", "LOCAL_"))}
    code = code.replace("PORT", str(_free_port())).replace("RUNDIR", str(tmp_path / "runs"))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path, env={**clean, "PYTHONPATH": str(ROOT), **env})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_recorder_names_a_gloo_all_reduce_where_torch_records_gloo(tmp_path):
    out = _run("""
import json, torch, torch.distributed as dist
from torchtrace.distributed import flight
flight.enable()
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:PORT", rank=0, world_size=1)
for _ in range(3):
    dist.all_reduce(torch.ones(2))
# The recorder marks a collective completed from the work's own completion, which can come a
# moment after all_reduce returns (a full suite run beside this one saw it still active).
import time
deadline = time.monotonic() + 10
while (flight.last_collective() or {}).get("active") and time.monotonic() < deadline:
    time.sleep(0.01)
print(json.dumps({"every": flight.records_every_backend(), "last": flight.last_collective()}))
dist.destroy_process_group()
""", tmp_path)
    if out["every"]:
        last = out["last"]
        assert last["op"] == "gloo:all_reduce" and not last["active"]
        assert last["seq"] >= 3  # (three all-reduces, and whatever the group's start ran)
    else:  # an older torch: its recorder is NCCL's, and holds nothing of gloo's
        assert out["last"] is None


def test_a_torch_whose_recorder_is_nccls_only_counts_gloo_collectives_from_python(tmp_path):
    """The older torch is made here by taking ``_dump_fr_trace_json`` out of torch's module
    before torchtrace is configured (as a rank of a job of two: ``WORLD_SIZE=2`` in the
    environment; the process group itself is a world of one, so that it starts alone). Its
    all-reduces are then counted: the hang report's collective is the third."""
    out = _run("""
import json, torch, torch.distributed as dist
from torch._C import _distributed_c10d as c10d
if hasattr(c10d, "_dump_fr_trace_json"):
    del c10d._dump_fr_trace_json
import torchtrace as tt
from torchtrace.distributed import flight
from torchtrace.job import progress
tt.configure(service_name="fr", prometheus_port="off", run_dir="RUNDIR", register_atexit=False)
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:PORT", rank=0, world_size=1)
for _ in range(3):
    dist.all_reduce(torch.ones(2))
fields = progress.tracked()
print(json.dumps({"every": flight.records_every_backend(), "seq": fields.get("collective_seq"),
                  "op": fields.get("collective_op"), "phase": fields.get("phase")}))
tt.shutdown()
dist.destroy_process_group()
""", tmp_path, WORLD_SIZE="2", RANK="0")
    assert out == {"every": False, "seq": 3, "op": "all_reduce", "phase": "idle"}
