"""An install without NumPy: ``import torchtrace`` and the ``torchtrace`` command print no
"Failed to initialize NumPy" warning (issue 50, item 7). torchtrace does not need NumPy.

Fast, not a fresh virtual environment: each check runs in a subprocess whose
``sitecustomize`` puts a meta-path finder in front that makes ``import numpy`` fail, as it
fails where NumPy is not installed (torch's own import then warns: the first test shows the
blocker works). A fresh venv with ``pip install torch --no-deps`` would need a download of
torch in every run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCKER = textwrap.dedent("""
    import sys

    class _NoNumpy:
        # As if NumPy were not installed: every import of it fails.
        def find_spec(self, name, path=None, target=None):
            if name == "numpy" or name.startswith("numpy."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, _NoNumpy())
""")


@pytest.fixture
def without_numpy(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT)])
    env.pop("PYTHONWARNINGS", None)
    return env


def _run(code: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-W", "default", "-c", code], env=env, cwd=str(cwd),
                          capture_output=True, text=True, timeout=120)


def test_blocker_makes_torch_warn_as_without_numpy(without_numpy: dict[str, str], tmp_path: Path) -> None:
    done = _run("import torch", without_numpy, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "Failed to initialize NumPy" in done.stderr


def test_import_torchtrace_prints_no_numpy_warning(without_numpy: dict[str, str], tmp_path: Path) -> None:
    done = _run("import sys, torchtrace; assert 'numpy' not in sys.modules; print('ok')", without_numpy, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
    assert "NumPy" not in done.stderr and "numpy" not in done.stderr, done.stderr


def test_cli_prints_no_numpy_warning(without_numpy: dict[str, str], tmp_path: Path) -> None:
    done = _run("import sys; from torchtrace.cli import main; sys.exit(main(['--help']))", without_numpy, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "demo" in done.stdout
    assert "NumPy" not in done.stderr, done.stderr


def test_numpy_warning_still_shows_for_the_users_own_numpy_use(without_numpy: dict[str, str],
                                                                 tmp_path: Path) -> None:
    # Only the import-time notice is silenced: torch still says why a NumPy conversion fails.
    done = _run("import torchtrace, torch\ntry:\n    torch.zeros(2).numpy()\nexcept RuntimeError as e:\n"
                "    print('raised', e)", without_numpy, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "raised" in done.stdout and "Numpy is not available" in done.stdout
