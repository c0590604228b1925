"""The ``report`` subcommand, for ``torchtrace.cli`` to add to its parser."""

from __future__ import annotations

import argparse
import sys


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
    """Run the subcommand; returns the process exit status."""
    from torchtrace.reporting.htmlreport import write_html_report
    from torchtrace.reporting.terminal import terminal_report

    try:
        sys.stdout.write(terminal_report(args.run_dir, args.rank))
        if args.html:
            path = write_html_report(args.run_dir, args.html, args.rank)
            sys.stdout.write(f"HTML report: {path}\n")
    except FileNotFoundError as exc:
        sys.stderr.write(f"torchtrace report: {exc}\n")
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (``python -m torchtrace.reporting.cli report RUN_DIR``) until cli.py wires it."""
    parser = argparse.ArgumentParser(prog="torchtrace")
    add_report_subcommand(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
