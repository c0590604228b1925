"""The checkout guard: the test suite must leave no new file in the user's checkout.

Every test writes under a temporary directory. ``CheckoutGuard`` lists the checkout's files
when the session starts and again when it ends; a file that appeared in between fails the
run and is named in the summary. It walks the directory itself rather than asking git,
because what tests used to leave behind (``torchtrace-runs/``, ``artifacts/``) is ignored by
``.gitignore`` and would never show as untracked.

Example, in a conftest.py::

    def pytest_configure(config):
        if not hasattr(config, "workerinput"):  # the xdist controller, or a plain run
            config.pluginmanager.register(CheckoutGuard(ROOT), "checkout-guard")
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# What running Python and pytest leaves by design, and the set-up's own folders.
SKIPPED_DIRS = frozenset({".git", ".venv", "__pycache__", ".pytest_cache"})
SKIPPED_SUFFIXES = (".egg-info",)


def checkout_files(root: Path) -> set[str]:
    """Every file and directory under ``root``, as paths relative to it, leaving out
    SKIPPED_DIRS and ``*.egg-info`` (their contents change whenever Python runs)."""
    found: set[str] = set()
    for top, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS and not d.endswith(SKIPPED_SUFFIXES)]
        rel = Path(top).relative_to(root)
        for name in dirs + files:
            found.add(str(rel / name))
    return found


class CheckoutGuard:
    """A pytest plugin that fails the session when the checkout gained files during it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.before: set[str] = set()
        self.added: list[str] = []

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        self.before = checkout_files(self.root)
        # An empty listing would make the comparison pass whatever the tests write.
        if not self.before:
            raise pytest.UsageError(f"checkout guard: found no file under {self.root}")

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        self.added = sorted(checkout_files(self.root) - self.before)
        if self.added and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.added:
            return
        shown = self.added[:20]
        more = f"\n  ... and {len(self.added) - len(shown)} more" if len(self.added) > len(shown) else ""
        terminalreporter.write_sep("=", "tests left files in the checkout", red=True)
        terminalreporter.write_line(
            f"{len(self.added)} new under {self.root} (every test must write under a temporary directory):\n  "
            + "\n  ".join(shown) + more)
