"""The shipped rules and configs pass Prometheus' and Alertmanager's own checkers.

Needs promtool (Debian package `prometheus`) and amtool (`prometheus-alertmanager`);
skipped without them unless TORCHTRACE_REQUIRE_SERVERS=1.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import contract
import pytest
import yaml
from promql_refs import references
from stack_files import (
    ALERTMANAGER_CONFIG,
    PROMETHEUS_CONFIG,
    RULES_FILE,
    RULES_TEST_FILE,
    load_yaml,
)

TIMEOUT_S = 60


def run(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=TIMEOUT_S)


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"{result.args}\n{result.stdout}\n{result.stderr}"


# ------------------------------------------------------------------- require_binary


REQUIRE_SERVERS_ENV = "TORCHTRACE_REQUIRE_SERVERS"


def test_require_binary_returns_the_path(binary_finder, tmp_path, monkeypatch):
    binary = tmp_path / "fake-promtool"
    binary.write_text("#!/bin/sh\n", encoding="utf-8")
    binary.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv(REQUIRE_SERVERS_ENV, "1")
    assert binary_finder("fake-promtool") == str(binary)


def test_require_binary_skips_when_missing(binary_finder, monkeypatch):
    monkeypatch.delenv(REQUIRE_SERVERS_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception):
        binary_finder("no-such-binary-torchtrace")


def test_require_binary_fails_when_servers_are_required(binary_finder, monkeypatch):
    monkeypatch.setenv(REQUIRE_SERVERS_ENV, "1")
    with pytest.raises(pytest.fail.Exception):
        binary_finder("no-such-binary-torchtrace")


# -------------------------------------------------------------- the rules test file


def test_every_alert_has_a_firing_and_a_silent_case(alerts, rules_tests):
    """A firing case shows the alert can fire; a silent case that it is not always on."""
    fires, silent = set(), set()
    for group in rules_tests["tests"]:
        by_alert: dict[str, list[bool]] = {}
        for case in group.get("alert_rule_test", []):
            by_alert.setdefault(case["alertname"], []).append(bool(case.get("exp_alerts")))
        for name, expectations in by_alert.items():
            (fires if any(expectations) else silent).add(name)
    names = {a["alert"] for a in alerts}
    assert names - fires == set(), "alerts never shown to fire"
    assert names - silent == set(), "alerts never shown to stay silent"
    assert (fires | silent) - names == set(), "tests for alerts that do not exist"


def test_rules_test_series_are_contract_series(rules_tests):
    """Test input under a misspelled name would make every silent case pass vacuously."""
    allowed = set(contract.series_names()) | {"up"}
    for group in rules_tests["tests"]:
        for series in group.get("input_series", []):
            (selector,) = references(series["series"]).selectors
            assert selector.name in allowed, f"{group['name']}: {selector.name}"
            labels = {label for label, _, _ in selector.matchers}
            if selector.name in contract.series_names():
                assert contract.COMMON_LABELS <= labels <= contract.labels_of(selector.name), series["series"]


def test_rules_test_file_loads_the_shipped_rules(rules_tests):
    loaded = {(RULES_TEST_FILE.parent / f).resolve() for f in rules_tests["rule_files"]}
    assert loaded == {RULES_FILE.resolve()}


# ------------------------------------------------------------------------- promtool


@pytest.mark.realserver
def test_promtool_check_rules(promtool):
    assert_ok(run(promtool, "check", "rules", RULES_FILE))


@pytest.mark.realserver
def test_promtool_test_rules(promtool):
    result = run(promtool, "test", "rules", RULES_TEST_FILE)
    assert_ok(result)
    assert "SUCCESS" in result.stdout


@pytest.mark.realserver
def test_promtool_test_rules_notices_a_broken_rule(promtool, tmp_path):
    """The unit tests are not vacuous: a loosened threshold makes them fail."""
    rules = RULES_FILE.read_text(encoding="utf-8")
    broken = rules.replace("rate(torchtrace_steps_total[15m]) > 0.01", "rate(torchtrace_steps_total[15m]) > 0.0001")
    assert broken != rules, "the StepsSkipped expression changed; update this test"
    (tmp_path / RULES_FILE.name).write_text(broken, encoding="utf-8")
    # only the StepsSkipped groups, to keep this quick
    tests = load_yaml(RULES_TEST_FILE)
    tests["tests"] = [g for g in tests["tests"] if g["name"].startswith("StepsSkipped")]
    assert len(tests["tests"]) == 2
    test_file = tmp_path / RULES_TEST_FILE.name
    test_file.write_text(yaml.safe_dump(tests, sort_keys=False), encoding="utf-8")
    result = run(promtool, "test", "rules", test_file)
    assert result.returncode != 0
    assert "StepsSkipped silent" in result.stdout + result.stderr


@pytest.mark.realserver
def test_promtool_check_config(promtool):
    """Checks prometheus.yml and, through rule_files, the rules next to it."""
    result = run(promtool, "check", "config", PROMETHEUS_CONFIG)
    assert_ok(result)
    assert RULES_FILE.name in result.stdout


# -------------------------------------------------------------------------- amtool


@pytest.mark.realserver
def test_amtool_check_config(amtool):
    assert_ok(run(amtool, "check-config", ALERTMANAGER_CONFIG))


@pytest.mark.realserver
@pytest.mark.parametrize("labels,receiver", [
    (["alertname=TrainingNonFiniteLoss", "severity=critical", "run_id=r1"], "training-oncall"),
    (["alertname=LossSpike", "severity=warning", "run_id=r1"], "training-team"),
])
def test_amtool_routes(amtool, labels, receiver):
    result = run(amtool, "config", "routes", "test", f"--config.file={ALERTMANAGER_CONFIG}", *labels)
    assert_ok(result)
    assert result.stdout.strip() == receiver
