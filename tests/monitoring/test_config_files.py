"""The monitoring stack's files agree with each other and with the telemetry contract.

No server is started: these tests read deploy/ and grafana/ and cross-check ports,
paths, datasource uids, alert annotations, the runbook, and every metric name and
label in every PromQL expression.
"""

from __future__ import annotations

import fnmatch
import json
import posixpath
import re
from pathlib import Path, PurePosixPath
from typing import Any, Iterator

import contract
import pytest
import yaml
from promql_refs import PromQLSyntaxError, references, variable_query_references
from stack_files import (
    ALERTMANAGER_CONFIG,
    COMPOSE_FILE,
    DASHBOARD_DIR,
    DEPLOY,
    GRAFANA,
    K8S_MONITORS,
    OTEL_CONFIG,
    PROMETHEUS_CONFIG,
    RULES_FILE,
    RULES_TEST_FILE,
    RUNBOOK,
    load_yaml,
)

TRAINING_JOB_PORT = 9464  # TORCHTRACE_PROMETHEUS_PORT's default (DESIGN.md)
OTLP_GRPC_PORT = 4317
OTLP_HTTP_PORT = 4318

REQUIRED_ALERTS = {
    "TrainingNonFiniteLoss", "TrainingNonFiniteGradients", "GradientExplosion",
    "GradientVanishing", "LossSpike", "TrainingStalled", "StepTimeRegression",
    "MemoryLeak", "StepsSkipped", "RankStraggler", "TelemetryDroppingSpans",
    "ThroughputDrop", "DataLoaderStall", "LowGoodput",
}
SEVERITIES = {"critical", "warning", "info"}

#: Series that Prometheus itself produces, and the labels they may be queried by.
PROMETHEUS_SERIES = {
    "up": {"job", "instance"},
    "ALERTS": contract.all_labels() | {"alertname", "alertstate", "severity"},
}


# ----------------------------------------------------------------------------- helpers


def host_port(address: str) -> tuple[str, int]:
    """'http://prometheus:9090/x' or 'prometheus:9090' -> ('prometheus', 9090)."""
    address = re.sub(r"^[a-z]+://", "", address).split("/", 1)[0]
    host, _, port = address.rpartition(":")
    return host, int(port)


def service_ports(service: dict) -> set[int]:
    """Container-side ports a Compose service listens on (published or exposed)."""
    ports: set[int] = set()
    for entry in service.get("ports", []):
        if isinstance(entry, dict):
            ports.add(int(entry["target"]))
        else:
            ports.add(int(str(entry).split("/")[0].rsplit(":", 1)[-1]))
    ports.update(int(str(p).split("/")[0]) for p in service.get("expose", []))
    return ports


def published_ports(service: dict) -> dict[int, int]:
    """Container port -> host port, for the ports a service publishes."""
    out: dict[int, int] = {}
    for entry in service.get("ports", []):
        if isinstance(entry, dict):
            out[int(entry["target"])] = int(entry["published"])
        else:
            parts = str(entry).split("/")[0].split(":")
            out[int(parts[-1])] = int(parts[-2]) if len(parts) > 1 else int(parts[-1])
    return out


def bind_mounts(service: dict) -> list[tuple[Path, str]]:
    """(host path resolved against deploy/, container path) for each bind mount."""
    mounts = []
    for entry in service.get("volumes", []):
        if isinstance(entry, dict):
            if entry.get("type") == "bind":
                mounts.append(((DEPLOY / entry["source"]).resolve(), entry["target"]))
            continue
        source, target = str(entry).split(":")[:2]
        if source.startswith((".", "/")):
            mounts.append(((DEPLOY / source).resolve(), target))
    return mounts


def container_path(service: dict, host_path: Path) -> str:
    """Where ``host_path`` appears inside the service's container."""
    host_path = host_path.resolve()
    for source, target in bind_mounts(service):
        if host_path == source:
            return target
        if source in host_path.parents:
            return posixpath.join(target, host_path.relative_to(source).as_posix())
    raise AssertionError(f"{host_path} is not mounted into the container")


def host_path(service: dict, path_in_container: str) -> Path:
    """The host path behind a container path, through the service's bind mounts."""
    for source, target in bind_mounts(service):
        target_path = PurePosixPath(target)
        inner = PurePosixPath(path_in_container)
        if inner == target_path or target_path in inner.parents:
            return source / inner.relative_to(target_path)
    raise AssertionError(f"{path_in_container} is not on a bind mount")


def flag_value(command: list[str], flag: str) -> str:
    values = [arg.split("=", 1)[1] for arg in command if arg.startswith(flag + "=")]
    assert values, f"{flag} missing from {command}"
    return values[-1]


def walk(node: Any) -> Iterator[Any]:
    yield node
    if isinstance(node, dict):
        for value in node.values():
            yield from walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from walk(value)


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    slug = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return slug.replace(" ", "-")


def runbook_headings() -> list[tuple[int, str]]:
    text = RUNBOOK.read_text(encoding="utf-8")
    return [(len(m.group(1)), m.group(2)) for m in re.finditer(r"^(#{1,6})\s+(.+?)\s*$", text, re.M)]


def dashboard_panels(dashboard: dict) -> Iterator[dict]:
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])  # collapsed rows


def variable_query(variable: dict) -> str:
    query = variable.get("query", "")
    return query.get("query", "") if isinstance(query, dict) else query


# ------------------------------------------------------------- the PromQL inventory


def _rules_data() -> dict:
    return load_yaml(RULES_FILE)


def recording_rule_names() -> set[str]:
    return {r["record"] for g in _rules_data()["groups"] for r in g["rules"] if "record" in r}


def promql_expressions() -> list[tuple[str, str, str]]:
    """(where, kind, expression) for every PromQL expression the stack ships.

    kind is "promql" or "grafana-variable".
    """
    found = []
    for group in _rules_data()["groups"]:
        for rule in group["rules"]:
            name = rule.get("alert") or rule.get("record")
            found.append((f"rules:{name}", "promql", rule["expr"]))
    for path in sorted(DASHBOARD_DIR.glob("*.json")):
        dashboard = json.loads(path.read_text(encoding="utf-8"))
        for panel in dashboard_panels(dashboard):
            for target in panel.get("targets", []):
                if target.get("expr"):
                    where = f"{path.name}:{panel.get('title')}:{target.get('refId')}"
                    found.append((where, "promql", target["expr"]))
        for variable in dashboard.get("templating", {}).get("list", []):
            if variable.get("type") == "query":
                where = f"{path.name}:${variable['name']}"
                found.append((where, "grafana-variable", variable_query(variable)))
    return found


def contract_errors(expr: str, kind: str = "promql", recorded: set[str] | None = None) -> list[str]:
    """Everything in ``expr`` that the telemetry contract does not allow."""
    recorded = recording_rule_names() if recorded is None else recorded
    series = contract.series_names()
    every_label = contract.all_labels()
    errors = []
    try:
        if kind == "grafana-variable":
            refs, listed_label = variable_query_references(expr)
            if listed_label and listed_label not in every_label:
                errors.append(f"variable lists unknown label {listed_label!r}")
        else:
            refs = references(expr)
    except PromQLSyntaxError as exc:
        return [str(exc)]
    for selector in refs.selectors:
        name = selector.name
        if name is None:
            errors.append("a selector without a metric name")
            continue
        if name in series:
            allowed = contract.labels_of(name)
        elif name in recorded:
            allowed = every_label
        elif name in PROMETHEUS_SERIES:
            allowed = PROMETHEUS_SERIES[name]
        else:
            errors.append(f"metric {name!r} is not in the telemetry contract")
            continue
        for label, op, value in selector.matchers:
            if label not in allowed:
                errors.append(f"{name} has no label {label!r}")
                continue
            closed = contract.CLOSED_LABEL_VALUES.get((series.get(name, ""), label))
            if closed is None or "$" in value:
                continue
            values = value.split("|") if op in ("=~", "!~") else [value]
            for v in values:
                if v not in closed and not (op in ("=~", "!~") and not re.fullmatch(r"\w+", v)):
                    errors.append(f"{name}{{{label}}} has no value {v!r}")
    for label in refs.grouping_labels - every_label - {"alertname", "alertstate", "severity"}:
        errors.append(f"grouping by unknown label {label!r}")
    return errors


EXPRESSIONS = promql_expressions()


# ----------------------------------------------------------------------------- parsing


def config_files() -> list[Path]:
    files = []
    for root in (DEPLOY, GRAFANA):
        for pattern in ("*.yml", "*.yaml", "*.json"):
            files.extend(root.rglob(pattern))
    return sorted(files)


@pytest.mark.parametrize("path", config_files(), ids=lambda p: str(p.relative_to(DEPLOY.parent)))
def test_config_file_parses(path: Path):
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        documents = [json.loads(text)]
    else:
        documents = list(yaml.safe_load_all(text))
    assert documents and all(documents), f"{path} is empty"


def test_expected_files_exist():
    for path in (COMPOSE_FILE, OTEL_CONFIG, PROMETHEUS_CONFIG, RULES_FILE, RULES_TEST_FILE,
                 ALERTMANAGER_CONFIG, K8S_MONITORS, RUNBOOK, DEPLOY / "README.md",
                 DASHBOARD_DIR / "torchtrace-training.json"):
        assert path.is_file(), path


# ----------------------------------------------------------------------------- compose


def test_compose_has_the_stack(compose):
    assert {"otel-collector", "jaeger", "prometheus", "alertmanager", "grafana"} <= set(compose["services"])


def test_compose_images_are_pinned(compose):
    for name, service in compose["services"].items():
        image = service["image"]
        assert ":" in image.rsplit("/", 1)[-1] and not image.endswith(":latest"), f"{name}: pin {image}"


def test_compose_bind_mount_sources_exist(compose):
    for name, service in compose["services"].items():
        for source, target in bind_mounts(service):
            assert source.exists(), f"{name} mounts missing {source} at {target}"


def test_compose_named_volumes_are_declared(compose):
    declared = set(compose.get("volumes") or {})
    for name, service in compose["services"].items():
        for entry in service.get("volumes", []):
            source = entry.get("source") if isinstance(entry, dict) else str(entry).split(":")[0]
            if not source.startswith((".", "/")):
                assert source in declared, f"{name} uses undeclared volume {source}"


def test_compose_dependencies_exist(compose):
    for name, service in compose["services"].items():
        for dependency in service.get("depends_on", []):
            assert dependency in compose["services"], f"{name} depends on unknown {dependency}"


# ---------------------------------------------------------------- OpenTelemetry Collector


def test_collector_reads_the_mounted_config(compose):
    service = compose["services"]["otel-collector"]
    assert flag_value(service["command"], "--config") == container_path(service, OTEL_CONFIG)


def test_collector_otlp_ports_are_published(compose, otel_config):
    protocols = otel_config["receivers"]["otlp"]["protocols"]
    published = published_ports(compose["services"]["otel-collector"])
    for protocol, port in (("grpc", OTLP_GRPC_PORT), ("http", OTLP_HTTP_PORT)):
        _, listen = host_port(protocols[protocol]["endpoint"])
        assert listen == port, f"OTLP {protocol} should listen on {port}"
        assert published.get(listen) == port, f"compose must publish {port}:{listen}"


def test_collector_pipelines_use_defined_components(otel_config):
    service = otel_config["service"]
    for extension in service.get("extensions", []):
        assert extension in otel_config["extensions"]
    for name, pipeline in service["pipelines"].items():
        for section in ("receivers", "processors", "exporters"):
            for component in pipeline.get(section, []):
                assert component in otel_config[section], f"pipeline {name}: {component} undefined"


def test_collector_sends_traces_to_jaeger_over_otlp(compose, otel_config):
    exporters = otel_config["service"]["pipelines"]["traces"]["exporters"]
    otlp = [e for e in exporters if e.split("/")[0] in ("otlp", "otlphttp")]
    assert otlp, "traces must go out over OTLP"
    for name in otlp:
        host, port = host_port(otel_config["exporters"][name]["endpoint"])
        assert host == "jaeger"
        assert port in service_ports(compose["services"]["jaeger"])
    jaeger_env = compose["services"]["jaeger"].get("environment", {})
    assert str(jaeger_env.get("COLLECTOR_OTLP_ENABLED")).lower() == "true"


def test_collector_metrics_ports_are_scraped(compose, otel_config, prometheus_config):
    ports = {host_port(otel_config["exporters"]["prometheus"]["endpoint"])[1],
             host_port(otel_config["service"]["telemetry"]["metrics"]["address"])[1]}
    assert ports <= service_ports(compose["services"]["otel-collector"])
    scraped = {host_port(t)[1] for job in prometheus_config["scrape_configs"]
               for sc in job.get("static_configs", []) for t in sc["targets"]
               if host_port(t)[0] == "otel-collector"}
    assert ports == scraped


# -------------------------------------------------------------------------- Prometheus


def test_prometheus_flags(compose):
    service = compose["services"]["prometheus"]
    command = service["command"]
    assert flag_value(command, "--config.file") == container_path(service, PROMETHEUS_CONFIG)
    features = {f for arg in command if arg.startswith("--enable-feature=")
                for f in arg.split("=", 1)[1].split(",")}
    assert "exemplar-storage" in features


def test_prometheus_rule_files_resolve_in_the_container(compose, prometheus_config):
    service = compose["services"]["prometheus"]
    config_dir = posixpath.dirname(flag_value(service["command"], "--config.file"))
    matched = set()
    for pattern in prometheus_config["rule_files"]:
        in_container = posixpath.join(config_dir, pattern)
        directory = host_path(service, posixpath.dirname(in_container))
        matched |= {p for p in directory.iterdir() if fnmatch.fnmatch(p.name, posixpath.basename(pattern))}
    assert RULES_FILE.resolve() in matched
    assert RULES_TEST_FILE.resolve() not in matched, "the promtool test file must not load as rules"


def test_prometheus_scrape_targets_exist(compose, prometheus_config):
    services = compose["services"]
    for job in prometheus_config["scrape_configs"]:
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                host, port = host_port(target)
                if host in services:
                    assert port in service_ports(services[host]), f"{job['job_name']}: {target}"
                elif host == "localhost":
                    assert port in service_ports(services["prometheus"]), target
                elif host == "host.docker.internal":
                    assert port == TRAINING_JOB_PORT, target
                    assert "host.docker.internal:host-gateway" in services["prometheus"].get("extra_hosts", [])
                else:
                    pytest.fail(f"{job['job_name']} scrapes unknown host {host}")


def test_prometheus_scrapes_the_training_job(prometheus_config):
    targets = {t for job in prometheus_config["scrape_configs"]
               for sc in job.get("static_configs", []) for t in sc["targets"]}
    assert f"host.docker.internal:{TRAINING_JOB_PORT}" in targets


def test_prometheus_sends_alerts_to_alertmanager(compose, prometheus_config):
    targets = [t for am in prometheus_config["alerting"]["alertmanagers"]
               for sc in am["static_configs"] for t in sc["targets"]]
    assert targets
    for target in targets:
        host, port = host_port(target)
        assert host == "alertmanager"
        assert port in service_ports(compose["services"]["alertmanager"])


# ------------------------------------------------------------------------ Alertmanager


def test_alertmanager_reads_the_mounted_config(compose):
    service = compose["services"]["alertmanager"]
    assert flag_value(service["command"], "--config.file") == container_path(service, ALERTMANAGER_CONFIG)


def test_alertmanager_routes_and_inhibitions_name_real_alerts_and_labels(alertmanager_config, alerts):
    names = {a["alert"] for a in alerts}
    labels = contract.all_labels() | {"alertname", "severity"}

    def routes(route):
        yield route
        for child in route.get("routes", []):
            yield from routes(child)

    receivers = {r["name"] for r in alertmanager_config["receivers"]}
    for route in routes(alertmanager_config["route"]):
        assert set(route.get("group_by", [])) <= labels
        if "receiver" in route:
            assert route["receiver"] in receivers
    for rule in alertmanager_config.get("inhibit_rules", []):
        assert set(rule["equal"]) <= labels
        for matcher in rule["source_matchers"] + rule["target_matchers"]:
            m = re.fullmatch(r'alertname(=~|=)"(.*)"', matcher)
            if m:
                for name in m.group(2).split("|"):
                    assert name in names, f"inhibit rule names unknown alert {name}"


# ------------------------------------------------------------------------------ Grafana


def test_grafana_mounts_provisioning_and_dashboards(compose, dashboard_providers):
    service = compose["services"]["grafana"]
    assert container_path(service, GRAFANA / "provisioning") == "/etc/grafana/provisioning"
    dashboards_in_container = container_path(service, DASHBOARD_DIR)
    assert [p["options"]["path"] for p in dashboard_providers] == [dashboards_in_container]


def test_grafana_datasource_urls_point_at_compose_services(compose, datasources):
    for ds in datasources:
        host, port = host_port(ds["url"])
        assert host in compose["services"], f"{ds['name']}: {ds['url']}"
        assert port in service_ports(compose["services"][host]), f"{ds['name']}: {ds['url']}"


def test_grafana_datasource_uids_are_fixed_and_unique(datasources):
    uids = [ds.get("uid") for ds in datasources]
    assert all(uids) and len(set(uids)) == len(uids)
    by_type = {ds["type"]: ds["uid"] for ds in datasources}
    assert by_type["prometheus"] == "prometheus" and by_type["jaeger"] == "jaeger"


def test_exemplars_link_trace_id_to_jaeger(datasources):
    jaeger_uids = {ds["uid"] for ds in datasources if ds["type"] == "jaeger"}
    prometheus = next(ds for ds in datasources if ds["type"] == "prometheus")
    links = prometheus["jsonData"]["exemplarTraceIdDestinations"]
    assert links
    for link in links:
        assert link["name"] == "trace_id"  # the exemplar label of the contract
        assert link["datasourceUid"] in jaeger_uids


def test_dashboard_datasource_uids_exist(dashboards, datasources):
    uids = {ds["uid"] for ds in datasources} | {"-- Grafana --"}
    assert dashboards
    for name, dashboard in dashboards.items():
        for node in walk(dashboard):
            if isinstance(node, dict) and isinstance(node.get("datasource"), dict):
                uid = node["datasource"].get("uid")
                assert uid in uids, f"{name}: unknown datasource uid {uid!r}"


def test_dashboard_is_well_formed(dashboards):
    dashboard = dashboards["torchtrace-training.json"]
    assert dashboard["uid"] == "torchtrace-training"
    ids = [p["id"] for p in dashboard_panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in dashboard_panels(dashboard):
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"]), panel["title"]
        if panel["type"] != "row":
            assert panel.get("targets"), f"{panel['title']} has no query"
            refs = [t["refId"] for t in panel["targets"]]
            assert len(refs) == len(set(refs)), panel["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert {"job", "run_id", "rank"} <= set(variables)
    for name in ("job", "run_id", "rank"):
        _, label = variable_query_references(variable_query(variables[name]))
        assert label == name


def test_dashboard_shows_what_the_issue_asks_for(dashboards):
    dashboard = dashboards["torchtrace-training.json"]
    exprs = " ".join(t.get("expr", "") for p in dashboard_panels(dashboard) for t in p.get("targets", []))
    for needed in ("torchtrace_steps_total", "torchtrace_loss", "torchtrace_grad_norm",
                   "torchtrace_anomalies_total", "torchtrace_skipped_steps_total",
                   "torchtrace_memory_bytes", "torchtrace_step_duration_seconds_bucket",
                   "ALERTS", "torchtrace_overhead_seconds_total",
                   "torchtrace_spans_dropped_total", "torchtrace_rank_step_skew"):
        assert needed in exprs, f"no panel shows {needed}"
    assert re.search(r"by \(kind\)[^\n]*torchtrace_anomalies_total", exprs), "anomalies by kind"
    for needed in ("torchtrace_tokens_total", "torchtrace_mfu_ratio", "torchtrace_data_wait_seconds_sum",
                   "torchtrace_goodput_ratio"):
        assert needed in exprs, f"no panel shows {needed}"
    assert re.search(r"by \(kind\) \(rate\(torchtrace_badput_seconds_total", exprs), "goodput breakdown by badput kind"
    assert re.search(r"by \(rank\)[^\n]*torchtrace_step_duration_seconds_sum", exprs), "step time by rank"


def test_step_duration_panel_shows_exemplars(dashboards):
    dashboard = dashboards["torchtrace-training.json"]
    panels = [p for p in dashboard_panels(dashboard)
              if any("torchtrace_step_duration_seconds_bucket" in t.get("expr", "") for t in p.get("targets", []))]
    assert panels
    for panel in panels:
        assert any(t.get("exemplar") for t in panel["targets"]), panel["title"]


def test_dashboard_queries_follow_the_run_variable(dashboards):
    """A panel that ignores $run_id mixes runs together."""
    for name, dashboard in dashboards.items():
        for panel in dashboard_panels(dashboard):
            for target in panel.get("targets", []):
                for selector in references(target.get("expr", "")).selectors:
                    matchers = {label: value for label, _, value in selector.matchers}
                    assert matchers.get("run_id") == "$run_id", f"{name}: {panel['title']}: {selector.name}"


# ------------------------------------------------------------------- telemetry contract


def test_contract_agrees_with_the_library_names():
    """The throughput names written out here are the ones torchtrace.semconv emits."""
    from torchtrace import semconv

    assert set(semconv.THROUGHPUT_METRICS) <= set(contract.METRICS)
    assert contract.PHASES == set(semconv.PHASES) and contract.BADPUT_KINDS == set(semconv.BADPUT_KINDS)
    assert contract.LR_GROUPS == {*map(str, range(semconv.MAX_LR_GROUPS)), f"{semconv.MAX_LR_GROUPS}+"}
    assert {semconv.THROUGHPUT_DROP, semconv.DATA_STALL} <= contract.ANOMALY_KINDS


@pytest.mark.parametrize("where,kind,expr", EXPRESSIONS, ids=[e[0] for e in EXPRESSIONS])
def test_promql_uses_only_contract_metrics_and_labels(where, kind, expr):
    assert contract_errors(expr, kind) == []


@pytest.mark.parametrize("expr,kind,expected", [
    ("rate(torchtrace_step_total[5m])", "promql", "not in the telemetry contract"),
    ("torchtrace_step_duration_seconds", "promql", "not in the telemetry contract"),
    ("torchtrace_loss{kind=\"x\"}", "promql", "has no label 'kind'"),
    ("increase(torchtrace_anomalies_total{kind=\"nan_loss\"}[5m])", "promql", "has no value 'nan_loss'"),
    ("torchtrace_memory_bytes{kind=~\"rss|vram\"}", "promql", "has no value 'vram'"),
    ("sum by (rnak) (torchtrace_loss)", "promql", "unknown label 'rnak'"),
    ("rat(torchtrace_steps_total[5m])", "promql", "unknown function"),
    ("{__name__=~\"torchtrace_.*\"}", "promql", "without a metric name"),
    ("label_values(torchtrace_build_inf, run_id)", "grafana-variable", "not in the telemetry contract"),
    ("label_values(torchtrace_build_info, runid)", "grafana-variable", "unknown label 'runid'"),
])
def test_contract_check_catches_mistakes(expr, kind, expected):
    errors = contract_errors(expr, kind)
    assert any(expected in e for e in errors), errors


def test_contract_check_accepts_grafana_variables_and_recorded_series():
    expr = ('histogram_quantile(0.9, sum by (le) (rate(torchtrace_step_duration_seconds_bucket'
            '{job=~"$job", run_id=~"$run_id", operation=~"${operation}"}[$__rate_interval])))'
            ' > on (job) group_left torchtrace:step_duration_seconds:mean5m offset 1h')
    assert contract_errors(expr, recorded={"torchtrace:step_duration_seconds:mean5m"}) == []


def test_recording_rules_are_named_level_metric_operation(recording_rules):
    for rule in recording_rules:
        level, metric, operation = rule["record"].split(":")
        assert level == "torchtrace" and metric and operation, rule["record"]


# ------------------------------------------------------------------------------ alerts


def test_required_alerts_exist(alerts):
    names = [a["alert"] for a in alerts]
    assert len(names) == len(set(names)), "duplicate alert names"
    assert REQUIRED_ALERTS <= set(names), REQUIRED_ALERTS - set(names)


def test_alerts_have_severity_and_annotations(alerts):
    for alert in alerts:
        name = alert["alert"]
        assert alert["labels"]["severity"] in SEVERITIES, name
        annotations = alert["annotations"]
        for key in ("summary", "description", "runbook_url"):
            assert annotations.get(key, "").strip(), f"{name} lacks {key}"


def test_alert_for_durations_are_short(alerts):
    for alert in alerts:
        m = re.fullmatch(r"(\d+)([smh])", alert.get("for", "0m"))
        assert m, alert["alert"]
        seconds = int(m.group(1)) * {"s": 1, "m": 60, "h": 3600}[m.group(2)]
        assert seconds <= 15 * 60, f"{alert['alert']}: for {alert['for']} is too slow to react"


def test_runbook_urls_point_at_runbook_sections(alerts):
    anchors = {github_anchor(text) for _, text in runbook_headings()}
    for alert in alerts:
        url = alert["annotations"]["runbook_url"]
        path, _, anchor = url.partition("#")
        assert path.endswith("deploy/RUNBOOK.md"), url
        assert anchor == alert["alert"].lower(), url
        assert anchor in anchors, f"RUNBOOK.md has no section #{anchor}"


def test_runbook_sections_are_current_alerts(alerts):
    """Each third-level heading is an alert; a removed alert takes its section along."""
    names = {a["alert"] for a in alerts}
    sections = [text for level, text in runbook_headings() if level == 3]
    assert set(sections) == names
    text = RUNBOOK.read_text(encoding="utf-8")
    for name in names:
        section = text.split(f"### {name}\n", 1)[1].split("\n### ", 1)[0]
        for part in ("**Means.**", "**Check first.**", "**Silence.**"):
            assert part in section, f"{name} section lacks {part}"


def deploy_readme_alert_table() -> dict[str, str]:
    """Alert name -> severity, from the `| alert | severity | fires when |` table of
    deploy/README.md."""
    lines = (DEPLOY / "README.md").read_text(encoding="utf-8").splitlines()
    header = lines.index("| alert | severity | fires when |")
    rows: dict[str, str] = {}
    for line in lines[header + 2:]:
        if not line.startswith("|"):
            break
        name, severity, fires_when = (cell.strip() for cell in line.strip("|").split("|"))
        assert name not in rows, f"deploy/README.md lists {name} twice"
        assert fires_when, f"deploy/README.md: {name} has no 'fires when'"
        rows[name] = severity
    return rows


def test_deploy_readme_alert_table_lists_every_alert(alerts):
    """Each alert of the rules file has a row, with its severity; a removed alert loses it."""
    table = deploy_readme_alert_table()
    expected = {a["alert"]: a["labels"]["severity"] for a in alerts}
    assert set(expected) - set(table) == set(), "alerts without a row in deploy/README.md"
    assert set(table) - set(expected) == set(), "deploy/README.md rows for alerts that do not exist"
    assert table == expected, "severities in deploy/README.md differ from the rules"


# ------------------------------------------------------------------------- Kubernetes


def test_kubernetes_monitors(prometheus_config):
    documents = list(yaml.safe_load_all(K8S_MONITORS.read_text(encoding="utf-8")))
    kinds = {d["kind"]: d for d in documents}
    assert set(kinds) == {"PodMonitor", "ServiceMonitor"}
    for document in documents:
        assert document["apiVersion"] == "monitoring.coreos.com/v1"
        assert document["spec"]["selector"]["matchLabels"]
    endpoints = kinds["PodMonitor"]["spec"]["podMetricsEndpoints"]
    assert endpoints and all(e.get("path", "/metrics") == "/metrics" for e in endpoints)
    # the same job name as the Compose scrape config, so rules and dashboards carry over
    training_job = next(j["job_name"] for j in prometheus_config["scrape_configs"]
                        if any(f":{TRAINING_JOB_PORT}" in t for sc in j.get("static_configs", []) for t in sc["targets"]))
    jobs = {r.get("replacement") for e in endpoints for r in e.get("relabelings", []) if r.get("targetLabel") == "job"}
    assert jobs == {training_job}
    assert kinds["ServiceMonitor"]["spec"]["endpoints"]


def test_step_phases_panel_keeps_operations_apart(dashboards):
    """With $operation = All (the default), a training step's forward and an evaluation
    step's forward are different things: pooled, the panel showed neither (a probe read
    2.32 ms for forward, training 2.42 ms, evaluation 1.70 ms). An operation without a
    phase (evaluation has no backward or optimizer) shows no line rather than NaN."""
    dashboard = dashboards["torchtrace-training.json"]
    targets = [t for p in dashboard_panels(dashboard) for t in p.get("targets", [])
               if "torchtrace_step_phase_seconds" in t.get("expr", "")]
    assert targets
    for target in targets:
        expr = target["expr"]
        for grouping in re.findall(r"by \(([^)]*)\)", expr):
            assert {"operation", "phase"} <= {g.strip() for g in grouping.split(",")}, expr
        assert "{{operation}}" in target["legendFormat"] and "{{phase}}" in target["legendFormat"]
        assert re.search(r"_count\{[^}]*\}\[\$__rate_interval\]\)\)\s*>\s*0\)", expr), expr


# ------------------------------------------------------------------ OTLP endpoints documented

OTLP_VARIABLE = re.compile(r"(OTEL_EXPORTER_OTLP_(?:TRACES_|METRICS_)?(?:ENDPOINT|PROTOCOL))"
                           r"""(?:=|:\s*|,\s*value:\s*)["']?([^\s"'}#]+)""")
DEFAULT_OTLP_PROTOCOL = "http/protobuf"  # torchtrace's, as the OTel spec's (docs/configuration.md)


def text_blocks(path: Path) -> list[str]:
    """A markdown file's fenced code blocks (what a reader copies); a YAML file as one block."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".md":
        return re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.M | re.S)
    return [text]


def documented_otlp_endpoints() -> list[tuple[str, str, str]]:
    """(file, endpoint URL, protocol it is used with) for every OTLP endpoint deploy/ tells
    a training job to set: README and runbook code blocks, compose, Kubernetes manifests. A
    block that sets no protocol means torchtrace's default."""
    found = []
    for path in sorted([*DEPLOY.rglob("*.md"), *DEPLOY.rglob("*.yml"), *DEPLOY.rglob("*.yaml")]):
        for block in text_blocks(path):
            pairs = OTLP_VARIABLE.findall(block)
            protocols = {value for name, value in pairs if name.endswith("PROTOCOL")}
            assert len(protocols) <= 1, f"{path}: one block sets several protocols {protocols}"
            protocol = protocols.pop() if protocols else DEFAULT_OTLP_PROTOCOL
            found += [(str(path.relative_to(DEPLOY)), value, protocol)
                      for name, value in pairs if name.endswith("ENDPOINT")]
    return found


def test_documented_otlp_endpoints_match_the_collectors_receiver(otel_config):
    receivers = otel_config["receivers"]["otlp"]["protocols"]
    port_of = {"grpc": host_port(receivers["grpc"]["endpoint"])[1],
               "http/protobuf": host_port(receivers["http"]["endpoint"])[1]}
    assert port_of == {"grpc": OTLP_GRPC_PORT, "http/protobuf": OTLP_HTTP_PORT}
    documented = documented_otlp_endpoints()
    assert any(where == "README.md" for where, _, _ in documented), documented
    for where, url, protocol in documented:
        assert host_port(url)[1] == port_of[protocol], (
            f"{where}: {url} with protocol {protocol}: the collector takes {protocol} on {port_of[protocol]}")


def test_the_endpoint_check_catches_a_grpc_port_with_the_default_protocol(tmp_path, monkeypatch):
    (tmp_path / "README.md").write_text("```sh\nexport OTEL_EXPORTER_OTLP_ENDPOINT=http://localhost:4317\n```\n")
    (tmp_path / "job.yaml").write_text('env:\n  - {name: OTEL_EXPORTER_OTLP_PROTOCOL, value: "grpc"}\n'
                                       '  - {name: OTEL_EXPORTER_OTLP_ENDPOINT, value: "http://collector:4317"}\n')
    monkeypatch.setitem(globals(), "DEPLOY", tmp_path)
    assert documented_otlp_endpoints() == [("README.md", "http://localhost:4317", "http/protobuf"),
                                           ("job.yaml", "http://collector:4317", "grpc")]
