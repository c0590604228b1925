"""End to end on loopback: a training run -> real Prometheus -> shipped rules -> real Alertmanager -> webhook.

Also: every dashboard query returns data from that Prometheus, and the exemplars Prometheus
stored carry trace ids of the run's spans.
"""

from __future__ import annotations

import importlib
import json
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
import yaml
from conftest import require_binary
from stack_files import ALERTMANAGER_CONFIG, DASHBOARD_DIR, RULES_FILE, load_yaml

import torchtrace as tt
from torchtrace import semconv

pytestmark = [pytest.mark.realserver, pytest.mark.timeout(240)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Webhook:
    """An HTTP receiver for Alertmanager's webhook notifications."""

    def __init__(self) -> None:
        self.alerts: list[dict] = []
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                hook.alerts.extend(json.loads(body).get("alerts", []))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/alerts"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def firing(self, name: str) -> list[dict]:
        return [a for a in self.alerts if a["labels"].get("alertname") == name and a["status"] == "firing"]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def wait_http(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=1).read()
            return
        except Exception:
            time.sleep(0.2)
    raise TimeoutError(url)


def api(base: str, path: str, **params) -> dict:
    url = f"{base}{path}?{urllib.parse.urlencode(params)}"
    data = json.loads(urllib.request.urlopen(url, timeout=5).read())
    assert data["status"] == "success", data
    return data["data"]


@pytest.fixture
def stack(tmp_path):
    """Alertmanager (the shipped routes, webhook receivers, short waits) and Prometheus
    (the shipped rules, 1 s scrape and evaluation, exemplar storage) on loopback."""
    am_bin = require_binary("prometheus-alertmanager")
    prom_bin = require_binary("prometheus")
    hook = Webhook()
    am_cfg = load_yaml(ALERTMANAGER_CONFIG)
    am_cfg["route"].update(group_wait="1s", group_interval="1s", repeat_interval="1h")
    for route in am_cfg["route"].get("routes", []):
        route.pop("group_wait", None)
        route.pop("group_interval", None)
    for receiver in am_cfg["receivers"]:
        receiver["webhook_configs"] = [{"url": hook.url, "send_resolved": False}]
    (tmp_path / "am.yml").write_text(yaml.safe_dump(am_cfg))
    am_port, prom_port, metrics_port = free_port(), free_port(), free_port()
    procs = []
    logs = []
    try:
        log = open(tmp_path / "alertmanager.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen(
            [am_bin, f"--config.file={tmp_path / 'am.yml'}", f"--storage.path={tmp_path / 'am-data'}",
             f"--web.listen-address=127.0.0.1:{am_port}", "--cluster.listen-address="],
            stdout=log, stderr=subprocess.STDOUT))
        prom_cfg = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES_FILE)],
            "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]},
            "scrape_configs": [{"job_name": "torchtrace", "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"]}]}],
        }
        (tmp_path / "prom.yml").write_text(yaml.safe_dump(prom_cfg))
        log = open(tmp_path / "prometheus.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen(
            [prom_bin, f"--config.file={tmp_path / 'prom.yml'}", f"--storage.tsdb.path={tmp_path / 'prom-data'}",
             f"--web.listen-address=127.0.0.1:{prom_port}", "--enable-feature=exemplar-storage"],
            stdout=log, stderr=subprocess.STDOUT))
        wait_http(f"http://127.0.0.1:{am_port}/-/ready")
        wait_http(f"http://127.0.0.1:{prom_port}/-/ready")
        yield {"prom": f"http://127.0.0.1:{prom_port}", "am": f"http://127.0.0.1:{am_port}",
               "metrics_port": metrics_port, "hook": hook, "dir": tmp_path}
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        for log in logs:
            log.close()
        hook.close()


class Trainer:
    """A small model trained step by step in the test's thread."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)

    def steps(self, n: int, nan: bool = False, pause: float = 0.0) -> None:
        for _ in range(n):
            x = torch.randn(8, 16)
            with tt.debug_context("train_step", model=self.model, optimizer=self.opt, inputs=x) as step:
                loss = self.model(x).pow(2).mean()
                if nan:
                    loss = loss * float("nan")
                self.opt.zero_grad()
                loss.backward()
                step.record_loss(loss)
                step.record_batch(tokens=8 * 16)  # each sample a sequence of 16 values
                self.opt.step()
                if pause:
                    time.sleep(pause)  # the step's compute, not a loader stall


def wait_scraped(prom: str, run_id: str, trainer: "Trainer", min_steps: float = 1, timeout: float = 30) -> None:
    """Train on until Prometheus has scraped the run (a loop that paused to wait would be a
    real data stall, and the DataLoaderStall rule would rightly see it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        res = api(prom, "/api/v1/query", query=f'torchtrace_steps_total{{run_id="{run_id}"}}')["result"]
        if res and float(res[0]["value"][1]) >= min_steps:
            return
        trainer.steps(5, pause=0.05)
    targets = api(prom, "/api/v1/targets")["activeTargets"]
    health = [(t["scrapeUrl"], t["health"], t.get("lastError")) for t in targets]
    seen = api(prom, "/api/v1/query", query="torchtrace_steps_total")["result"]
    built = api(prom, "/api/v1/query", query="torchtrace_build_info")["result"]
    raise TimeoutError(f"Prometheus never scraped run {run_id}: targets {health} steps {seen} build {built}")


def train_for(trainer: Trainer, seconds: float, **kwargs) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        trainer.steps(5, pause=0.05, **kwargs)


def dashboard_queries(run_id: str) -> list[tuple[str, str]]:
    out = []
    for path in sorted(Path(DASHBOARD_DIR).glob("*.json")):
        dash = json.loads(path.read_text())
        for panel in dash["panels"]:
            for target in panel.get("targets", []):
                expr = target.get("expr")
                if not expr:
                    continue
                expr = (expr.replace("$__rate_interval", "30s").replace("$job", ".*").replace("$run_id", run_id)
                        .replace("$rank", ".*").replace("$operation", ".*"))
                out.append((panel.get("title", "?"), expr))
    return out


def test_nan_alert_reaches_webhook_healthy_run_silent_dashboards_have_data(stack, monkeypatch):
    prom, hook = stack["prom"], stack["hook"]
    # The leak detector's growth slope needs two windows of heap samples. After hundreds of
    # tests this process's heap is fragmented enough that the detector would sample it only
    # every few dozen steps (its cost policy, tested in tests/forensics/test_leaks.py), too
    # rarely for an 8-second run: here it samples every step.
    monkeypatch.setattr(importlib.import_module("torchtrace.probes.leaks"), "HEAP_FREE_S", 10.0)
    # Phase 1: a healthy run, scraped for a while: no alert may fire or even be pending.
    healthy = tt.configure(service_name="e2e", run_id="healthy-run", level="advanced",
                           prometheus_port=stack["metrics_port"], port_policy="off",
                           run_dir=str(stack["dir"] / "runs"), register_atexit=False, peak_flops=1e12)
    assert healthy.prometheus_port == stack["metrics_port"]
    trainer = Trainer()
    trainer.steps(3)
    wait_scraped(prom, "healthy-run", trainer)
    train_for(trainer, 8)
    alerts = api(prom, "/api/v1/alerts")["alerts"]
    assert [a for a in alerts if a["labels"].get("run_id") == "healthy-run"] == []
    # Every dashboard query answers with data from this healthy run.
    empty = []
    for title, expr in dashboard_queries("healthy-run"):
        if "ALERTS" in expr:
            continue  # the firing-alerts panel is checked after the faulty run below
        if not api(prom, "/api/v1/query", query=expr)["result"]:
            empty.append(title)
    assert empty == [], f"dashboard panels without data: {empty}"
    check_throughput_series(prom, "healthy-run")
    # Exemplars stored by Prometheus carry trace ids of this run's spans.
    tt.flush()
    spans = [json.loads(l) for l in healthy.spans_path.read_text().splitlines()]
    now = time.time()
    ex = api(prom, "/api/v1/query_exemplars", query='torchtrace_step_duration_seconds_bucket{run_id="healthy-run"}',
             start=now - 300, end=now)
    trace_ids = {e["labels"]["trace_id"] for series in ex for e in series["exemplars"]}
    assert trace_ids and trace_ids <= {s["trace_id"] for s in spans}
    tt.shutdown()
    assert hook.alerts == []

    # Phase 2: a run that hits a NaN after Prometheus has seen it healthy.
    tt.configure(service_name="e2e", run_id="nan-run", guard="skip", prometheus_port=stack["metrics_port"],
                 port_policy="off", run_dir=str(stack["dir"] / "runs"), register_atexit=False)
    trainer = Trainer()
    trainer.steps(3)
    wait_scraped(prom, "nan-run", trainer)
    started = time.monotonic()
    trainer.steps(1, nan=True)
    deadline = started + 60
    while time.monotonic() < deadline and not hook.firing("TrainingNonFiniteLoss"):
        train_for(trainer, 1)
    elapsed = time.monotonic() - started
    fired = hook.firing("TrainingNonFiniteLoss")
    assert fired, f"no TrainingNonFiniteLoss notification within 60 s; got {[a['labels'] for a in hook.alerts]}"
    assert fired[0]["labels"]["run_id"] == "nan-run" and fired[0]["labels"]["severity"] == "critical"
    assert "runbook_url" in fired[0]["annotations"]
    print(f"TrainingNonFiniteLoss reached the webhook {elapsed:.1f} s after the NaN step")
    alerts_panel = [e for t, e in dashboard_queries("nan-run") if "ALERTS" in e]
    for expr in alerts_panel:
        assert api(prom, "/api/v1/query", query=expr)["result"], expr
    assert not [a for a in hook.alerts if a["labels"].get("run_id") == "healthy-run"]
    skipped = api(prom, "/api/v1/query", query='torchtrace_badput_seconds_total{run_id="nan-run",kind="skipped_step"}')
    assert skipped["result"] and float(skipped["result"][0]["value"][1]) > 0
    tt.shutdown()


def value_of(prom: str, expr: str) -> list[float]:
    return [float(r["value"][1]) for r in api(prom, "/api/v1/query", query=expr)["result"]]


def check_throughput_series(prom: str, run: str) -> None:
    """The throughput and goodput series as Prometheus scraped them, against what the trainer
    did: 8 samples a step, a Linear(16, 32) -> Linear(32, 4) model (22,528 FLOPs a step,
    forward + backward, the first layer's input needing no gradient), learning rate 0.01."""
    sel = f'{{run_id="{run}"}}'
    assert value_of(prom, f"torchtrace_samples_total{sel} - 8 * torchtrace_steps_total{sel}") == [0.0]
    assert value_of(prom, f"torchtrace_tokens_total{sel} - 128 * torchtrace_steps_total{sel}") == [0.0]
    assert value_of(prom, f"torchtrace_flops_total{sel} - 22528 * torchtrace_steps_total{sel}") == [0.0]
    mfu = value_of(prom, f"torchtrace_mfu_ratio{sel}")
    assert len(mfu) == 1 and 0 < mfu[0] < 1
    assert value_of(prom, f'torchtrace_learning_rate{{run_id="{run}",group="0"}}') == [0.01]
    assert value_of(prom, f"torchtrace_data_wait_seconds_count{sel} - (torchtrace_steps_total{sel} - 1)") == [0.0]
    for phase in semconv.PHASES:
        query = (f'torchtrace_step_phase_seconds_count{{run_id="{run}",phase="{phase}"}} - ignoring(phase) '
                 f"torchtrace_steps_total{sel}")
        assert value_of(prom, query) == [0.0], phase
    goodput = value_of(prom, f"torchtrace_goodput_ratio{sel}")
    assert len(goodput) == 1 and 0 < goodput[0] < 1
    assert value_of(prom, f'torchtrace_badput_seconds_total{{run_id="{run}",kind="startup"}}')[0] > 0


def test_an_anomaly_counted_in_a_series_first_sample_fires_its_alert(stack):
    """An operation's anomaly series begin when it first counts one: a run whose first step is
    NaN (a bad first batch; the guard skips it and training goes on) is scraped with its
    ``nonfinite_loss`` series already at 1, and the loss gauge finite again. ``increase()``
    reads nothing in a series' first sample: before, no alert fired at all."""
    prom, hook = stack["prom"], stack["hook"]
    tt.configure(service_name="e2e", run_id="first-nan", guard="skip", forensics=False,
                 prometheus_port=stack["metrics_port"], port_policy="off", run_dir=str(stack["dir"] / "runs"),
                 register_atexit=False)
    trainer = Trainer()
    trainer.steps(1, nan=True)
    trainer.steps(3)
    wait_scraped(prom, "first-nan", trainer, min_steps=4)
    counted = value_of(prom, 'torchtrace_anomalies_total{run_id="first-nan",kind="nonfinite_loss"}')
    assert counted == [1.0], counted
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not hook.firing("TrainingNonFiniteLoss"):
        train_for(trainer, 1)
    fired = hook.firing("TrainingNonFiniteLoss")
    assert fired and fired[0]["labels"]["run_id"] == "first-nan", [a["labels"] for a in hook.alerts]
    tt.shutdown()
