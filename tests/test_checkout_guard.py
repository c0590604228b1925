"""The suite leaves no file in the checkout: the guard that fails the run, and the temporary
working directory that keeps the default run directory out of the checkout."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

import torchtrace as tt

from .checkout import checkout_files
from .conftest import ROOT

INNER_CONFTEST = textwrap.dedent("""
    from pathlib import Path
    from tests.checkout import CheckoutGuard

    def pytest_configure(config):
        config.pluginmanager.register(CheckoutGuard(Path(__file__).parent), "guard")
""")


def run_inner_session(checkout: Path, test_body: str) -> subprocess.CompletedProcess:
    """A pytest session in ``checkout`` (a stand-in for the user's clone) guarded by CheckoutGuard."""
    checkout.mkdir()
    (checkout / "conftest.py").write_text(INNER_CONFTEST)
    (checkout / "test_inner.py").write_text(textwrap.dedent(test_body))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "test_inner.py"], cwd=checkout, env=env, capture_output=True, text=True, timeout=120)


def test_the_listing_sees_folders_git_ignores(tmp_path):
    (tmp_path / "torchtrace-runs" / "run-1").mkdir(parents=True)
    (tmp_path / "torchtrace-runs" / "run-1" / "report.json").write_text("{}")
    (tmp_path / "artifacts").mkdir()
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "x.pyc").write_text("")
    assert checkout_files(tmp_path) == {"torchtrace-runs", "torchtrace-runs/run-1",
                                        "torchtrace-runs/run-1/report.json", "artifacts"}


def test_a_session_that_writes_into_the_checkout_fails_and_names_the_file(tmp_path):
    proc = run_inner_session(tmp_path / "clone", """
        from pathlib import Path

        def test_writes_a_run_folder():
            run = Path(__file__).parent / "torchtrace-runs" / "run-1"
            run.mkdir(parents=True)
            (run / "spans.jsonl").write_text("")
    """)
    # the test itself passed; the guard failed the session
    assert "1 passed" in proc.stdout, proc.stdout + proc.stderr
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "tests left files in the checkout" in proc.stdout
    assert "torchtrace-runs/run-1/spans.jsonl" in proc.stdout


def test_a_session_that_writes_only_under_tmp_path_passes(tmp_path):
    proc = run_inner_session(tmp_path / "clone", """
        def test_writes_under_tmp_path(tmp_path):
            (tmp_path / "spans.jsonl").write_text("")
    """)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "left files" not in proc.stdout


def test_each_test_runs_outside_the_checkout(tiny_model, monkeypatch):
    for name in list(os.environ):
        if name.startswith(("TORCHTRACE_", "OTEL_")):
            monkeypatch.delenv(name, raising=False)
    cwd = Path.cwd().resolve()
    assert not cwd.is_relative_to(ROOT), cwd
    # configure() with no run_dir: the default ./torchtrace-runs is made in the temporary directory
    tt.configure(service_name="test", prometheus_port="off", strict=True, register_atexit=False)

    @tt.debug_operation(model=tiny_model)
    def train_step(x):
        tiny_model(x).sum().backward()

    train_step(torch.randn(2, 8))
    tt.shutdown()
    assert list((cwd / "torchtrace-runs").iterdir())


def test_every_serial_test_is_still_there():
    """SERIAL_TESTS names functions by name; a rename would run the test in parallel again."""
    from .conftest import SERIAL_TESTS

    for path, names in SERIAL_TESTS.items():
        text = (ROOT / path).read_text()
        for name in names:
            assert f"def {name}(" in text, f"{path} has no {name}"
