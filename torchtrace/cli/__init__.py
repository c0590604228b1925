"""The ``torchtrace`` command: ``demo``, ``report`` and ``why``."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from torchtrace._version import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torchtrace", description="Production telemetry for PyTorch training.")
    parser.add_argument("--version", action="version", version=f"torchtrace {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    from torchtrace.cli import demo

    demo.add_subcommand(sub)
    from torchtrace.reporting.cli import add_report_subcommand

    add_report_subcommand(sub)
    from torchtrace.cli import why

    why.add_subcommand(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as exc:
        print(f"torchtrace: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (``torchtrace why DIR | head``): what is left to write goes
        # nowhere, so that the exit's flush of stdout does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE  # as a process that SIGPIPE ended reports it


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
