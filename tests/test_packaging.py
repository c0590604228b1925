"""What a built wheel holds, and what a newcomer reads first (issue 50, item 9).

The wheel is built from a copy of the source tree in a temporary directory, with a demo's
run folder (``torchtrace-runs/``) beside the package, as a checkout has after ``torchtrace
demo``: package discovery must not ship it. ``--no-build-isolation`` builds with the
installed setuptools, so no download is needed.
"""

from __future__ import annotations

import os
import pydoc
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import torchtrace

# The module's fixture does its costly work once per process: its tests share one xdist worker.
pytestmark = pytest.mark.xdist_group("packaging")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")  # once a worker: a module fixture ran again when xdist ran tests between
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "torchtrace", src / "torchtrace", ignore=shutil.ignore_patterns("__pycache__"))
    # A demo's run folder, as `torchtrace demo` leaves it in the working directory.
    run = src / "torchtrace-runs" / "demo-20261129-000000"
    run.mkdir(parents=True)
    (run / "report.json").write_text("{}")
    (run / "spans.jsonl").write_text("")
    out = tmp_path_factory.mktemp("wheel")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(src)], check=True, env=env, cwd=str(out), timeout=300, capture_output=True)
    (path,) = out.glob("torchtrace-*.whl")
    with zipfile.ZipFile(path) as archive:
        yield archive


def _dist_file(archive: zipfile.ZipFile, name: str) -> str:
    (path,) = [n for n in archive.namelist() if n.endswith(".dist-info/" + name)]
    return archive.read(path).decode()


@pytest.mark.slow
def test_wheel_holds_the_package_only_not_run_folders(wheel: zipfile.ZipFile) -> None:
    assert _dist_file(wheel, "top_level.txt").split() == ["torchtrace"]
    names = wheel.namelist()
    assert not [n for n in names if "torchtrace-runs" in n or n.endswith("report.json")]
    # The namespace subpackages (no __init__.py) are shipped all the same.
    assert "torchtrace/step/throughput.py" in names
    assert "torchtrace/tools/checks.py" in names


@pytest.mark.slow
def test_wheel_ships_license_and_py_typed(wheel: zipfile.ZipFile) -> None:
    names = wheel.namelist()
    assert "torchtrace/py.typed" in names
    license_text = _dist_file(wheel, "licenses/LICENSE")
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in license_text
    assert "License-Expression: Apache-2.0" in _dist_file(wheel, "METADATA")


def test_license_file_is_the_apache_2_0_text() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License")
    # The standard text's nine sections, in order.
    positions = [text.index(f"\n   {n}. ") for n in range(1, 10)]
    assert positions == sorted(positions)
    assert "END OF TERMS AND CONDITIONS" in text


def test_help_opens_with_a_short_overview_that_points_at_the_docs() -> None:
    doc = torchtrace.__doc__ or ""
    lines = doc.strip().splitlines()
    assert 5 <= len(lines) <= 40, len(lines)
    assert lines[0].startswith("torchtrace:")
    assert "docs/" in doc and "README" in doc
    assert "seed documents" not in doc
    text = pydoc.render_doc(torchtrace, renderer=pydoc.plaintext)
    head = "\n".join(text.splitlines()[:12])
    # help() shows NAME, then the overview itself first, not a compatibility note.
    assert "torchtrace: production telemetry" in head
    assert "PyTorchDebugger" not in head
