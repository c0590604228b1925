"""The ``report`` subcommand, for ``torchtrace.cli`` to add to its parser."""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchtrace.reporting.runfiles import RunListing


def add_report_subcommand(subparsers) -> argparse.ArgumentParser:
    """Add ``report RUN_DIR [--html OUT] [--rank N]`` to an ``argparse`` subparsers object.

    The parser's ``func`` default runs it: ``sys.exit(args.func(args))``.
    """
    parser = subparsers.add_parser("report", help="summarise a finished run directory",
                                   description="Print a summary of a torchtrace run directory and, with --html, "
                                               "write a self-contained HTML report.")
    parser.add_argument("run_dir", help="the run's directory (<run_dir>/<run_id>, holding report.json/spans.jsonl)")
    parser.add_argument("--html", metavar="OUT", help="also write a self-contained HTML report to OUT")
    parser.add_argument("--rank", type=int, default=None, help="which rank's files to read (default: rank 0)")
    parser.set_defaults(func=run_report)
    return parser


def run_report(args: argparse.Namespace) -> int:
    """Run the subcommand; returns the process exit status.

    A path that is not one run: a folder of runs (``torchtrace-runs``) gets the list of its
    runs, each with the command that reports it; a path that does not exist says so.
    """
    from torchtrace.reporting.htmlreport import write_html_report
    from torchtrace.reporting.runfiles import find_runs, is_run_dir
    from torchtrace.reporting.terminal import terminal_report

    path = Path(args.run_dir)
    if not path.exists():
        sys.stderr.write(f"torchtrace report: {args.run_dir}: no such file or directory\n")
        return 2
    if path.is_dir() and not is_run_dir(path):
        runs = find_runs(path)
        if runs:
            sys.stdout.write(run_list(args.run_dir, runs))
            if args.html:
                sys.stderr.write("torchtrace report: --html needs one run's directory: pick one of the runs above\n")
                return 2
            return 0
    try:
        sys.stdout.write(terminal_report(args.run_dir, args.rank))
    except FileNotFoundError as exc:
        either = "; no run directory in it either" if path.is_dir() else ""
        sys.stderr.write(f"torchtrace report: {exc}{either}\n")
        return 2
    if args.html:
        try:
            written = write_html_report(args.run_dir, args.html, args.rank)
        except OSError as exc:  # a folder, a path with no parent, one not ours to write
            sys.stderr.write(f"torchtrace report: --html {args.html}: cannot write the page there "
                             f"({exc.strerror or type(exc).__name__})\n")
            return 2
        sys.stdout.write(f"HTML report: {written}\n")
    return 0


def run_list(shown: str, runs: list[RunListing]) -> str:
    """The runs of a folder, oldest first, each as the command that reports it and its numbers.

    >>> from torchtrace.reporting.runfiles import RunListing
    >>> print(run_list("runs", [RunListing(Path("runs/a"), 1.7e9, 300, 1, True)]), end="")
    runs holds 1 run (oldest first); report one with:
      torchtrace report runs/a   # 300 steps, 1 anomalous, started 2023-11-14 22:13 UTC
    """
    lines = [f"{shown} holds {len(runs)} run{'s' if len(runs) != 1 else ''} (oldest first); report one with:"]
    # (find_runs builds each run's path on the folder's path as given, so these paths are as typed)
    commands = [f"  torchtrace report {shlex.quote(str(run.path))}" for run in runs]
    width = max(len(c) for c in commands)
    for command, run in zip(commands, runs):
        started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(run.started_unix))
        if run.steps is None:
            about = f"no report.json yet: still running, or ended without shutdown(); last written {started}"
        else:
            about = f"{run.steps} steps, {run.anomaly_steps or 0} anomalous, started {started}"
            if run.cleared:
                about += " (counted since a POST /debug/clear: the run's report counts every step)"
            if not run.finished:
                about += " (not finished)"
        lines.append(f"{command.ljust(width)}   # {about}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (``python -m torchtrace.reporting.cli report RUN_DIR``) until cli.py wires it."""
    parser = argparse.ArgumentParser(prog="torchtrace")
    add_report_subcommand(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
