"""Fixtures for the monitoring stack tests: paths, parsed config files, binaries."""

from __future__ import annotations

import json

import pytest
from stack_files import (
    ALERTMANAGER_CONFIG,
    COMPOSE_FILE,
    DASHBOARD_DIR,
    DASHBOARD_PROVIDERS,
    DATASOURCES,
    OTEL_CONFIG,
    PROMETHEUS_CONFIG,
    RULES_FILE,
    RULES_TEST_FILE,
    load_yaml,
)

from tests.conftest import require_binary  # noqa: E402,F401  (one definition, shared)


@pytest.fixture(scope="session")
def compose() -> dict:
    return load_yaml(COMPOSE_FILE)


@pytest.fixture(scope="session")
def otel_config() -> dict:
    return load_yaml(OTEL_CONFIG)


@pytest.fixture(scope="session")
def prometheus_config() -> dict:
    return load_yaml(PROMETHEUS_CONFIG)


@pytest.fixture(scope="session")
def rules() -> dict:
    return load_yaml(RULES_FILE)


@pytest.fixture(scope="session")
def rules_tests() -> dict:
    return load_yaml(RULES_TEST_FILE)


@pytest.fixture(scope="session")
def alertmanager_config() -> dict:
    return load_yaml(ALERTMANAGER_CONFIG)


@pytest.fixture(scope="session")
def datasources() -> list[dict]:
    return load_yaml(DATASOURCES)["datasources"]


@pytest.fixture(scope="session")
def dashboard_providers() -> list[dict]:
    return load_yaml(DASHBOARD_PROVIDERS)["providers"]


@pytest.fixture(scope="session")
def dashboards() -> dict[str, dict]:
    """Every dashboard JSON file, by file name."""
    return {
        p.name: json.loads(p.read_text(encoding="utf-8"))
        for p in sorted(DASHBOARD_DIR.glob("*.json"))
    }


@pytest.fixture(scope="session")
def alerts(rules) -> list[dict]:
    return [r for g in rules["groups"] for r in g["rules"] if "alert" in r]


@pytest.fixture(scope="session")
def recording_rules(rules) -> list[dict]:
    return [r for g in rules["groups"] for r in g["rules"] if "record" in r]


@pytest.fixture
def promtool() -> str:
    return require_binary("promtool")


@pytest.fixture
def amtool() -> str:
    return require_binary("amtool")


@pytest.fixture
def binary_finder():
    """require_binary itself, for the tests of its skip/fail behaviour."""
    return require_binary

