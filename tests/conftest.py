"""Shared fixtures: a fresh torchtrace per test, a tiny model, real-server requirements, and
the checkout guard: every test runs in a temporary working directory, and the session fails
when it leaves a new file in the checkout (tests/checkout.py)."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest
import torch

import torchtrace as tt

from .checkout import CheckoutGuard

ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config: pytest.Config) -> None:
    # Under xdist only the controller watches the checkout: it sees the whole session.
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(CheckoutGuard(ROOT), "torchtrace-checkout-guard")


@pytest.fixture(autouse=True)
def _temporary_working_directory(tmp_path_factory, monkeypatch):
    """Run each test in a fresh temporary directory, so anything written relative to the
    working directory (the default run directory ./torchtrace-runs, a subprocess started
    without cwd=) lands there and not in the checkout. It is not the test's tmp_path, so a
    test that lists its tmp_path sees only what it wrote. A torchtrace set up from the
    environment serves metrics on any free port, not on 9464, which a user's own training
    job or another test worker may hold."""
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))
    monkeypatch.setenv("TORCHTRACE_PROMETHEUS_PORT", "0")

def servers_required() -> bool:
    """TORCHTRACE_REQUIRE_SERVERS=1 (set by .ci/run): a missing server or framework fails the test."""
    return os.environ.get("TORCHTRACE_REQUIRE_SERVERS", "").strip().lower() in ("1", "true", "yes")


def require_binary(*names: str) -> str:
    """The path of the first binary found; skip the test without one, or fail when
    TORCHTRACE_REQUIRE_SERVERS=1 (as in CI), so a missing server never passes silently."""
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    message = f"needs one of {', '.join(names)} on PATH"
    if servers_required():
        pytest.fail(message + " (TORCHTRACE_REQUIRE_SERVERS=1)")
    pytest.skip(message)


def require_module(name: str):
    """Import ``name``; skip without it, or fail when TORCHTRACE_REQUIRE_SERVERS=1 (CI installs
    every optional framework through the dev extra, so a missing one there is a broken install)."""
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError as exc:
        if servers_required():
            pytest.fail(f"needs {name} ({exc}) and TORCHTRACE_REQUIRE_SERVERS=1", pytrace=False)
        pytest.skip(f"needs {name}", allow_module_level=True)


class TinyNet(torch.nn.Module):
    """Two linear layers with named submodules; small enough for hundreds of steps per second."""

    def __init__(self, d_in: int = 8, d_hidden: int = 16, d_out: int = 4) -> None:
        super().__init__()
        self.encoder = torch.nn.Linear(d_in, d_hidden)
        self.act = torch.nn.Tanh()
        self.head = torch.nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.head(self.act(self.encoder(x)))


@pytest.fixture
def tiny_model():
    torch.manual_seed(0)
    return TinyNet()


@pytest.fixture
def tt_runtime(tmp_path, monkeypatch):
    """torchtrace configured for one test: any free port, files under tmp_path, strict mode
    (internal errors raise), and shut down afterwards."""
    for name in list(os.environ):
        if name.startswith(("TORCHTRACE_", "OTEL_")):
            monkeypatch.delenv(name, raising=False)
    result = tt.configure(service_name="test", prometheus_port=0, run_dir=str(tmp_path / "runs"), strict=True,
                          register_atexit=False)
    yield result
    tt.shutdown()


@pytest.fixture(autouse=True)
def _no_leaks(monkeypatch):
    """Fail a test that leaves torchtrace configured or leaves its threads running."""
    before = {t.ident for t in threading.enumerate()}
    yield
    tt.shutdown()
    leaked = [t for t in threading.enumerate()
              if t.ident not in before and t.is_alive() and t.name.startswith("torchtrace")]
    for t in leaked:
        t.join(2.0)
    leaked = [t.name for t in leaked if t.is_alive()]
    assert not leaked, f"torchtrace threads left running: {leaked}"
