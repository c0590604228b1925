"""/metrics scraped over real HTTP: names, types, labels, values and exemplars of the contract."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

import torchtrace as tt
from tests.helpers import read_spans, scrape, value
from torchtrace import semconv


def run_steps(model, n, nan_at=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    records = []
    for i in range(n):
        with tt.debug_context("train_step", model=model, optimizer=opt) as step:
            loss = model(torch.randn(4, 8)).pow(2).mean()
            if i == nan_at:
                loss = loss * float("nan")
            opt.zero_grad()
            loss.backward()
            step.record_loss(loss)
            opt.step()
        records.append(step.record)
    return records


def test_metrics_equal_the_runs_values(tt_runtime, tiny_model):
    records = run_steps(tiny_model, 4)
    tt.flush()
    s = scrape(tt_runtime.metrics_url)
    rid = tt_runtime.run_id
    lab = dict(run_id=rid, rank="0", operation="train_step")
    assert value(s, "torchtrace_steps_total", **lab) == 4
    assert value(s, "torchtrace_loss", **lab) == pytest.approx(records[-1].loss)
    assert value(s, "torchtrace_grad_norm", **lab) == pytest.approx(records[-1].grad_norm)
    assert value(s, "torchtrace_grad_nonfinite_tensors", **lab) == 0
    assert value(s, "torchtrace_step_duration_seconds_count", **lab) == 4
    assert value(s, "torchtrace_step_duration_seconds_sum", **lab) == pytest.approx(
        sum(r.duration_s for r in records), rel=1e-9)
    assert value(s, "torchtrace_last_step_timestamp_seconds", **lab) == pytest.approx(records[-1].end_unix_ns / 1e9)
    assert value(s, "torchtrace_memory_bytes", run_id=rid, rank="0", device="cpu", kind="rss") > 0
    assert value(s, "torchtrace_build_info", run_id=rid, rank="0", version=tt.__version__, level="basic") == 1
    assert value(s, "torchtrace_overhead_seconds_total", run_id=rid, rank="0") > 0
    for reason in semconv.DROP_REASONS:
        assert value(s, "torchtrace_spans_dropped_total", run_id=rid, rank="0", reason=reason) == 0


def test_nan_step_counts_anomalies_and_loss_gauge_is_nan(tt_runtime, tiny_model):
    run_steps(tiny_model, 3, nan_at=2)
    tt.flush()
    s = scrape(tt_runtime.metrics_url)
    lab = dict(run_id=tt_runtime.run_id, rank="0", operation="train_step")
    assert value(s, "torchtrace_anomalies_total", kind="nonfinite_loss", **lab) == 1
    assert value(s, "torchtrace_anomalies_total", kind="nonfinite_grad", **lab) == 1
    assert math.isnan(value(s, "torchtrace_loss", **lab))
    assert value(s, "torchtrace_grad_nonfinite_tensors", **lab) == 4


def test_every_series_carries_run_id_and_rank_and_types_match_contract(tt_runtime, tiny_model):
    run_steps(tiny_model, 2)
    tt.flush()
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    body = urllib.request.urlopen(tt_runtime.metrics_url, timeout=5).read().decode()
    types = {}
    for fam in text_string_to_metric_families(body):
        types[fam.name] = fam.type
        for sample in fam.samples:
            assert {"run_id", "rank"} <= set(sample.labels), sample
    expected = {"torchtrace_steps": "counter", "torchtrace_step_duration_seconds": "histogram",
                "torchtrace_loss": "gauge", "torchtrace_grad_norm": "gauge",
                "torchtrace_grad_nonfinite_tensors": "gauge", "torchtrace_memory_bytes": "gauge",
                "torchtrace_last_step_timestamp_seconds": "gauge", "torchtrace_spans_dropped": "counter",
                "torchtrace_overhead_seconds": "counter", "torchtrace_build_info": "gauge"}
    for name, kind in expected.items():
        assert types.get(name) == kind, (name, types.get(name))


def test_exemplar_trace_id_is_a_span_of_the_run(tt_runtime, tiny_model):
    run_steps(tiny_model, 3)
    spans = read_spans(tt_runtime.spans_path)
    s = scrape(tt_runtime.metrics_url, openmetrics=True)
    exemplars = [e for e in s["exemplars"] if e[0] == "torchtrace_step_duration_seconds_bucket"]
    assert exemplars
    trace_ids = {sp["trace_id"] for sp in spans}
    for _name, _labels, ex in exemplars:
        assert ex.labels["trace_id"] in trace_ids


def test_unsampled_steps_give_no_exemplar_and_no_trace_id(tmp_path, monkeypatch, tiny_model):
    """With a sampler (here OTEL_TRACES_SAMPLER), a step whose span was not sampled names no
    trace: an exemplar or a report row must lead to a trace the backend has."""
    for name in list(os.environ):
        if name.startswith(("TORCHTRACE_", "OTEL_")):
            monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.5")
    result = tt.configure(prometheus_port=0, run_dir=str(tmp_path), debug_api=False, register_atexit=False)
    try:
        records = run_steps(tiny_model, 60)
        trace_ids = {sp["trace_id"] for sp in read_spans(result.spans_path)}
        s = scrape(result.metrics_url, openmetrics=True)
    finally:
        tt.shutdown()
    assert 0 < len(trace_ids) < 60  # some steps were sampled, some not
    assert {r.trace_id for r in records if r.trace_id is not None} == trace_ids
    exemplars = [e for e in s["exemplars"] if e[0] == "torchtrace_step_duration_seconds_bucket"]
    assert exemplars
    assert all(ex.labels["trace_id"] in trace_ids for _name, _labels, ex in exemplars)


def test_port_zero_picks_a_free_port_and_result_reports_it(tt_runtime):
    assert tt_runtime.prometheus_port and tt_runtime.prometheus_port != 9464
    assert tt_runtime.metrics_url.endswith(f":{tt_runtime.prometheus_port}/metrics")


def test_port_in_use_moves_to_next_port(tmp_path):
    import socket

    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    taken = blocker.getsockname()[1]
    try:
        r = tt.configure(prometheus_port=taken, run_dir=str(tmp_path), register_atexit=False)
        assert r.prometheus_port not in (None, taken)
    finally:
        tt.shutdown()
        blocker.close()
    r = tt.configure(prometheus_port=taken, port_policy="off", run_dir=str(tmp_path), register_atexit=False)
    tt.shutdown()


def test_report_is_strict_json_with_totals(tt_runtime, tiny_model):
    run_steps(tiny_model, 3, nan_at=1)
    path = tt_runtime.report_path
    tt.shutdown()
    text = path.read_text()
    report = json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} in report"))
    assert report["totals"]["steps"] == 3
    assert report["anomalies_by_kind"]["nonfinite_loss"] >= 1
    assert report["run_id"] == tt_runtime.run_id
    assert len(report["steps"]) == 3 and report["steps"][1]["loss"] == "NaN"
    assert (path.stat().st_mode & 0o777) == 0o600
    assert (tt_runtime.spans_path.stat().st_mode & 0o777) == 0o600


def test_same_port_again_after_a_scrape_and_shutdown_and_never_shared(tmp_path):
    import socket
    import urllib.request

    r = tt.configure(prometheus_port=0, run_dir=str(tmp_path), register_atexit=False)
    port = r.prometheus_port
    urllib.request.urlopen(r.metrics_url, timeout=5).read()  # leaves a connection in TIME_WAIT
    tt.shutdown()
    r2 = tt.configure(prometheus_port=port, port_policy="off", run_dir=str(tmp_path), register_atexit=False)
    assert r2.prometheus_port == port
    # A second live listener on the same port is still refused.
    other = socket.socket()
    other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        with pytest.raises(OSError):
            other.bind(("127.0.0.1", port))
            other.listen()
    finally:
        other.close()
        tt.shutdown()


def test_shutdown_ends_keep_alive_connections(tmp_path):
    """A scraper holding a keep-alive connection must not keep reading a stopped run."""
    import http.client

    r = tt.configure(run_id="first", prometheus_port=0, run_dir=str(tmp_path), register_atexit=False)
    conn = http.client.HTTPConnection("127.0.0.1", r.prometheus_port, timeout=5)
    conn.request("GET", "/metrics")
    assert 'run_id="first"' in conn.getresponse().read().decode()
    port = r.prometheus_port
    tt.shutdown()
    tt.configure(run_id="second", prometheus_port=port, port_policy="off", run_dir=str(tmp_path),
                 register_atexit=False)
    try:
        conn.request("GET", "/metrics")
        body = conn.getresponse().read().decode()
    except (OSError, http.client.HTTPException):
        conn.close()  # the old connection was ended: a scraper reconnects
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/metrics")
        body = conn.getresponse().read().decode()
    conn.close()
    assert 'run_id="second"' in body and 'run_id="first"' not in body
