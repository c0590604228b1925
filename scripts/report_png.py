#!/usr/bin/env python3
"""Make docs/report.png: the README's demo run, its HTML report, drawn by headless Chromium.

    .venv/bin/python scripts/report_png.py [--out docs/report.png] [--chromium /usr/bin/chromium]

Nothing is staged: the demo trains for real (``--inject nan@120``), ``torchtrace report
--html`` writes the report, and Chromium renders it with a fresh profile and no network.
The run directory and the HTML file are kept in a temporary directory that is removed after.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--hide-scrollbars"]


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, **kw)
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}")
    return proc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "report.png"))
    parser.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    parser.add_argument("--size", default="1280,1430", help="window width,height in CSS pixels")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="torchtrace-report-png-") as tmp:
        work = Path(tmp)
        # the demo's own default run directory, so the report names it as a user's would
        run([sys.executable, "-m", "torchtrace.cli", "demo", "--inject", "nan@120", "--port", "0",
             "--hold", "0", "--no-progress"], cwd=work, timeout=300)
        (run_dir,) = [p for p in (work / "torchtrace-runs").iterdir() if p.is_dir()]
        html = work / "report.html"
        run([sys.executable, "-m", "torchtrace.cli", "report", str(run_dir.relative_to(work)), "--html", str(html)],
            cwd=work, timeout=120)
        shot = work / "report.png"
        run([args.chromium, *CHROMIUM_FLAGS, f"--user-data-dir={work / 'profile'}", f"--screenshot={shot}",
             f"--window-size={args.size}", "--virtual-time-budget=5000", html.as_uri()], timeout=120)
        if not shot.exists() or shot.stat().st_size < 10_000:
            sys.exit("Chromium wrote no screenshot")
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, out)
    print(f"wrote {out} from run {run_dir.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
