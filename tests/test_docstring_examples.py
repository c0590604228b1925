"""The examples in torchtrace's docstrings run, and print what they show.

They run in a pytest process of their own, without the suite's worker processes: some configure
torchtrace and shut it down, which must not touch the state of the suite's own process, and an
example must hold however it is run.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_every_docstring_example_runs_and_prints_what_it_shows(tmp_path):
    modules = [p for p in (REPO / "torchtrace").rglob("*.py") if ">>>" in p.read_text(encoding="utf-8")]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "--doctest-modules",
         "--rootdir", str(tmp_path), "-o", "testpaths=", str(REPO / "torchtrace")],
        cwd=tmp_path, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    passed = re.search(r"(\d+) passed", done.stdout)
    # (each module with an example is one doctest item or more; a few examples are marked +SKIP)
    assert passed is not None and int(passed.group(1)) >= len(modules) - 5, done.stdout[-2000:]
