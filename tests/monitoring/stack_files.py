"""Where the monitoring stack's files are, and how the tests read them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
DEPLOY = REPO_ROOT / "deploy"
GRAFANA = REPO_ROOT / "grafana"

COMPOSE_FILE = DEPLOY / "docker-compose.yml"
OTEL_CONFIG = DEPLOY / "otel-collector" / "config.yaml"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
RULES_FILE = DEPLOY / "prometheus" / "rules" / "torchtrace.rules.yml"
RULES_TEST_FILE = DEPLOY / "prometheus" / "rules" / "torchtrace.rules.test.yml"
ALERTMANAGER_CONFIG = DEPLOY / "alertmanager" / "alertmanager.yml"
K8S_MONITORS = DEPLOY / "kubernetes" / "podmonitor.yaml"
RUNBOOK = DEPLOY / "RUNBOOK.md"
DATASOURCES = GRAFANA / "provisioning" / "datasources" / "datasources.yml"
DASHBOARD_PROVIDERS = GRAFANA / "provisioning" / "dashboards" / "dashboards.yml"
DASHBOARD_DIR = GRAFANA / "dashboards"


def load_yaml(path: Path) -> Any:
    with path.open(encoding="utf-8") as f:
        return yaml.safe_load(f)
