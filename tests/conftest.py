"""Shared fixtures: a fresh torchtrace per test, a tiny model, real-server requirements, and
the checkout guard: every test runs in a temporary working directory, and the session fails
when it leaves a new file in the checkout (tests/checkout.py)."""

from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch

import torchtrace as tt

from .checkout import CheckoutGuard

ROOT = Path(__file__).resolve().parents[1]

# One intra-op thread per test process, and per subprocess a test starts (they inherit the
# variable), unless OMP_NUM_THREADS says otherwise. The tests run tiny models, whose ops gain
# nothing from a second thread, and scripts/test.sh runs one xdist worker per core: torch's
# default of a thread per core gave each core two busy threads, and the idle ones spin-waiting
# for work made the FLOP-counting tests up to ten times slower (tests/measure/test_flop_fit.py:
# 72 s with two threads, 7 s with one, on a loaded 2-core machine).
os.environ.setdefault("OMP_NUM_THREADS", "1")
if os.environ["OMP_NUM_THREADS"].isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Tests that check measured wall time against planted sleeps with bounds of a few tens of
# milliseconds: a second test worker on the same cores stretches what they measure, so
# scripts/test.sh runs them alone, after the parallel part (`-m serial`, no xdist). Listed here
# rather than marked in their files; a name that is no longer collected fails the run.
SERIAL_TESTS = {
    "tests/step/test_throughput.py": {
        "test_data_wait_against_planted_sleeps", "test_torchtraces_own_work_between_steps_is_not_data_wait",
        "test_goodput_against_a_hand_computed_timeline", "test_phases_against_planted_sleeps",
        "test_micro_batches_in_one_step_split_forward_from_backward",
        "test_a_model_under_activation_checkpointing_keeps_its_phases",
        "test_a_forward_called_past_the_model_keeps_the_optimizer_phase"},
    # Two tools' samples per second within 5 %: their windows start one batch apart, so a slow
    # batch there under a busy worker beside it moved them 7 % apart (a CI run, 3 workers).
    "tests/integrations/test_lightning.py": {"test_phases_come_from_lightnings_hooks",
                                             "test_lightnings_own_throughput_monitor_beside_torchtrace_agrees"},
    "tests/integrations/test_transformers.py": {"test_phases_of_a_trainer_step_with_gradient_accumulation",
                                                "test_evaluation_and_checkpoints_between_steps_are_their_own_badput"},
    "tests/export/test_collector_faults.py": {"test_step_time_does_not_depend_on_the_collector"},
    "tests/reporting/test_operations.py": {"test_terminal_report_step_time_and_loss_are_the_training_operation"},
    # Deadlines of a second or two against the wall clock: a busy second worker can push them over.
    "tests/test_exit_deadline.py": {"test_exit_within_two_seconds_of_baseline_in_every_collector_state",
                                    "test_the_exit_handler_keeps_the_shutdown_deadline_when_the_final_metrics_push_hangs"},
    "tests/export/test_second_audit.py": {"test_shutdown_keeps_its_deadline_with_metrics_pushed_to_a_black_hole"},
    "tests/job/test_sigterm.py": {"test_sigterm_with_the_default_action", "test_the_applications_handler_still_runs"},
    # A ratio of median step times within 1.5: a second worker beside it made one 1.83 (1.21 alone).
    "tests/export/test_debug_api_load.py": {"test_fifty_slow_clients_do_not_slow_training"},
    # The slowest step under a header flood below 0.5 s: 4-6 ms alone, but 521 ms in a CI run with
    # three workers and the flood process on 2 cores (its median ratio was 1.12 there).
    "tests/export/test_http_limits.py": {"test_a_header_flood_keeps_memory_and_step_time_bounded"},
}


def pytest_configure(config: pytest.Config) -> None:
    # (pytest-xdist registers it only when loaded: the serial pass runs without it.)
    config.addinivalue_line("markers", "xdist_group(name): tests that share one xdist worker")
    config.addinivalue_line("markers", "serial: measures wall time with tight bounds; scripts/test.sh runs it alone, "
                                       "after the parallel tests (SERIAL_TESTS in tests/conftest.py)")
    # Under xdist only the controller watches the checkout: it sees the whole session.
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(CheckoutGuard(ROOT), "torchtrace-checkout-guard")


@pytest.hookimpl(tryfirst=True)  # before -m and -k deselect: every collected test is seen
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark SERIAL_TESTS ``serial``; a listed test missing from a module that was collected
    whole is an error (a renamed test would otherwise run in parallel again, unnoticed)."""
    found: dict[str, set[str]] = {}
    for item in items:
        path = item.path.relative_to(ROOT).as_posix() if item.path.is_relative_to(ROOT) else ""
        name = getattr(item, "originalname", item.name)
        if name in SERIAL_TESTS.get(path, ()):
            item.add_marker(pytest.mark.serial)
            found.setdefault(path, set()).add(name)
    if any("::" in arg for arg in config.args):
        return  # single tests picked by node id: not every listed test was meant to be collected
    for path, names in SERIAL_TESTS.items():
        collected = any(item.path == ROOT / path for item in items)
        missing = names - found.get(path, set())
        if collected and missing:
            raise pytest.UsageError(f"tests/conftest.py SERIAL_TESTS: {path} has no test {sorted(missing)}")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Under ``--dist loadgroup`` every test of an ``xdist_group`` runs on one worker, which
    pytest-xdist arranges by adding ``@group`` to the test's id. A pytest it does not keep up
    with (9.2 with xdist 3.8) drops that suffix without a word, and each worker then runs the
    group's costly fixture itself: stop the run instead."""
    config = session.config
    if not hasattr(config, "workerinput") or not config.getvalue("loadgroup"):
        return
    lost = [item.nodeid for item in session.items
            if item.get_closest_marker("xdist_group") is not None and "@" not in item.nodeid]
    if lost:
        message = (f"pytest-xdist's loadgroup lost the group of {len(lost)} tests (first: {lost[0]}); "
                   f"pytest {pytest.__version__}: see the pytest range in pyproject.toml")
        os.write(2, f"\nERROR: {message}\n".encode())  # (a worker's error itself reaches the terminal only as a crash)
        pytest.exit(message, returncode=4)


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


@pytest.fixture(autouse=True)
def _process_settings_put_back():
    """What a test sets for its whole process, torchtrace's log level and torch's thread count
    (a benchmark's function run in-process does both), is put back after it: a test that
    silenced torchtrace's warnings left every later test in its worker unable to see them."""
    logger, threads = logging.getLogger("torchtrace"), torch.get_num_threads()
    level = logger.level
    yield
    logger.setLevel(level)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


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
