"""The integrations are optional: importing torchtrace imports no framework; a missing one says what to install."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FRAMEWORKS = ("lightning", "pytorch_lightning", "transformers", "accelerate")


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_importing_torchtrace_imports_no_framework():
    proc = run(f"""
        import sys
        import torchtrace, torchtrace.integrations, torchtrace.integrations._common
        assert torchtrace.__file__.startswith({str(ROOT)!r}), torchtrace.__file__
        print(sorted(m for m in sys.modules if m.split(".")[0] in {FRAMEWORKS!r}))
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.parametrize("extra, blocked", [("lightning", ("lightning", "pytorch_lightning")),
                                            ("transformers", ("transformers",))])
def test_missing_framework_says_what_to_install(extra, blocked):
    proc = run(f"""
        import sys
        for name in {blocked!r}:
            sys.modules[name] = None  # as if not installed
        try:
            import torchtrace.integrations.{extra}
        except ImportError as exc:
            print(exc)
        else:
            raise SystemExit("imported without the framework")
    """)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert f'pip install "torchtrace[{extra}]"' in proc.stdout
