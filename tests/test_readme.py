"""The README as a newcomer reads it: its first screen, its example, its links."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from torchtrace import semconv

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
FIRST_SCREEN = 60


def first_python_block() -> str:
    m = re.search(r"```python\n(.*?)```", README, re.S)
    assert m, "the README has no Python example"
    return m.group(1)


def test_first_screen_holds_the_commands_the_example_and_the_picture():
    head = "\n".join(README.splitlines()[:FIRST_SCREEN])
    assert "./scripts/demo.sh --inject nan@120" in head and "./scripts/test.sh" in head
    assert re.search(r"first run ~\d", head) and re.search(r"then ~\d+ s", head)  # expected times, measured
    assert "```python" in head and "![" in head and "(docs/report.png)" in head
    assert ".venv/bin/torchtrace" in head and ". .venv/bin/activate" in head
    assert (ROOT / "docs" / "report.png").stat().st_size > 10_000
    assert len(first_python_block().splitlines()) <= 20


def test_every_anomaly_kind_is_listed():
    missing = [k for k in semconv.ANOMALY_KINDS_ALL if f"`{k}`" not in README]
    assert not missing
    table = (ROOT / "docs" / "telemetry.md").read_text(encoding="utf-8")
    assert not [k for k in semconv.ANOMALY_KINDS_ALL if f"| `{k}` |" not in table]


def test_local_links_point_at_files():
    """Links into the repository resolve."""
    pages = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if "://" in target:
                continue
            path = (page.parent / target).resolve()
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken


def test_every_setting_and_environment_variable_is_documented():
    """docs/configuration.md lists each Settings field and each variable the package reads."""
    import dataclasses
    import re

    from torchtrace.config import Settings

    doc = (ROOT / "docs" / "configuration.md").read_text()
    fields = [f.name for f in dataclasses.fields(Settings)]
    assert len(fields) > 30
    assert [n for n in fields if f"`{n}`" not in doc] == []
    source = "".join(p.read_text() for p in (ROOT / "torchtrace").rglob("*.py"))
    names = set(re.findall(r'"((?:TORCHTRACE|OTEL)_[A-Z_]+)"', source))
    assert {"TORCHTRACE_LEVEL", "TORCHTRACE_THROUGHPUT"} <= names
    assert sorted(n for n in names if n not in doc) == []


def test_every_telemetry_name_is_documented():
    """Each metric and span attribute name of semconv appears in full somewhere under docs/."""
    from torchtrace import semconv

    docs = "".join(p.read_text() for p in (ROOT / "docs").glob("*.md"))
    names = {v for k, v in vars(semconv).items() if k.isupper() and isinstance(v, str)
             and v.startswith(("torchtrace_", "torchtrace.")) and not v.endswith((".", "_"))}
    assert len(names) > 100
    assert sorted(n for n in names if n not in docs) == []


@pytest.mark.timeout(120)
def test_the_first_example_runs_and_replays_a_nan_step(tmp_path):
    """The example as printed, with one NaN planted in the 50th batch: the decorator replays it."""
    plant = ("import torch\n_randn = torch.randn\n_calls = [0]\n"
             "def _planted(*a, **k):\n"
             "    _calls[0] += 1\n"
             "    t = _randn(*a, **k)\n"
             "    if _calls[0] == 50:\n"
             "        t[0, 0] = float('nan')\n"
             "    return t\n"
             "torch.randn = _planted\n")
    script = tmp_path / "example.py"
    script.write_text(plant + first_python_block())
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env = {k: v for k, v in env.items() if not k.startswith(("TORCHTRACE_", "OTEL_"))}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=110,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    (report_file,) = tmp_path.glob("torchtrace-runs/*/report.json")
    report = json.loads(report_file.read_text())
    assert report["totals"]["steps"] == 100 and report["totals"]["skipped_steps"] == 1
    (f,) = report["forensics"]["reports"]
    assert f["cause"] == "input" and f["step"] == 49 and f["inputs"]["nan_count"] == 1
