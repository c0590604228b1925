"""No file the project tracks holds a merge's conflict markers: a conflict once resolved by
committing both sides left docs/forensics.md saying two contradictory things."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^(<{7}|>{7})( |$)", re.M)


def tracked_text_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    paths = [ROOT / name for name in listed.decode().split("\0") if name]
    return [p for p in paths if p.is_file() and p.suffix not in (".png", ".jpg", ".gz")]


def test_no_tracked_file_holds_conflict_markers():
    found = []
    for path in tracked_text_files():
        text = path.read_text(errors="replace")
        found += [f"{path.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}" for m in MARKER.finditer(text)]
    assert not found, found
