"""The debug HTTP API: the request matrix, changes applied at the next step, the read routes."""

from __future__ import annotations

import json
import logging

import pytest
import torch

import torchtrace as tt
from torchtrace.export import debug_api
from torchtrace.export.debug_api import MAX_BODY_BYTES, history_training_summary

from .debug_helpers import Trainer, call, get_json, runtime


def _state(rt) -> tuple:
    return (rt.level.value, rt.mode.value, len(rt._changes), dict(rt.history.totals), len(rt.history.steps()),
            [e.seq for e in rt.history.events()])


@pytest.fixture
def api(tt_runtime, tiny_model):
    rt = runtime()
    trainer = Trainer(tiny_model, nan_at=(3,))
    trainer.run(5)
    return rt, rt.server.port, rt.debug_api.token, trainer


def test_request_matrix_refusals_change_nothing(api):
    rt, port, token, trainer = api
    good = {"Authorization": f"Bearer {token}"}
    cases = [
        # (method, path, headers, body, host, expected status)
        ("POST", "/debug/level/advanced", {}, None, None, 401),
        ("POST", "/debug/level/advanced", {"Authorization": "Bearer " + "x" * 43}, None, None, 403),
        ("POST", "/debug/level/advanced", {"Authorization": token}, None, None, 403),  # no scheme
        ("POST", "/debug/level/advanced", {"Authorization": f"Basic {token}"}, None, None, 403),
        ("POST", "/debug/clear", {}, None, None, 401),
        ("POST", "/debug/clear", {"Authorization": "Bearer wrong"}, None, None, 403),
        ("POST", "/debug/level/advanced", good, None, "evil.example:80", 403),
        ("POST", "/debug/level/advanced", good, None, "127.0.0.1.evil.example", 403),
        ("POST", "/debug/level/advanced", good, None, "", 403),
        ("GET", "/debug/summary", {}, None, "attacker.example", 403),
        ("GET", "/", {}, None, "attacker.example:8080", 403),
        ("POST", "/debug/level/advanced", {**good, "Origin": "http://evil.example"}, None, None, 403),
        ("POST", "/debug/clear", {**good, "Origin": f"http://127.0.0.1:{port}"}, None, None, 403),
        ("GET", "/debug/summary", {"Origin": "http://evil.example"}, None, None, 403),
        ("GET", "/debug/events", {"Sec-Fetch-Site": "cross-site"}, None, None, 403),
        ("POST", "/debug/level/advanced", good, b"x" * (MAX_BODY_BYTES + 1), None, 413),
        ("POST", "/debug/clear", {**good, "Content-Length": str(10 ** 9)}, None, None, 413),
        ("POST", "/debug/clear", {**good, "Transfer-Encoding": "chunked"}, b"0\r\n\r\n", None, 411),
        ("POST", "/debug/level/loud", good, None, None, 400),
        ("POST", "/debug/level/", good, None, None, 400),
        ("POST", "/debug/level/%00basic", good, None, None, 400),
        ("DELETE", "/debug/level/basic", good, None, None, 405),
        ("DELETE", "/debug/clear", good, None, None, 405),
        ("PUT", "/debug/clear", good, None, None, 405),
        ("PATCH", "/debug/summary", good, None, None, 405),
        ("GET", "/debug/clear", good, None, None, 405),
        ("POST", "/debug/summary", good, None, None, 405),
        ("GET", "/debug/events?since=abc", {}, None, None, 400),
        ("GET", "/debug/events?since=-1", {}, None, None, 400),
        ("GET", "/debug/steps?limit=0", {}, None, None, 400),
        ("GET", "/debug/nothing", {}, None, None, 404),
        ("POST", "/nothing", good, None, None, 404),
    ]
    before = _state(rt)
    for method, path, headers, body, host, expected in cases:
        status, resp_headers, data = call(port, method, path, headers, body, host)
        assert status == expected, (method, path, headers.keys(), host, status, data)
        assert _state(rt) == before, (method, path)
        if expected == 401:
            assert resp_headers.get("WWW-Authenticate", "").startswith("Bearer")
        if expected == 405:
            assert "Allow" in resp_headers
        assert token.encode() not in data
    # the training thread finds nothing queued either
    trainer.step()
    assert rt.level.value == "basic"
    assert not any(e.event_type in ("level_changed", "history_cleared") for e in rt.history.events())


def test_valid_level_change_applies_at_next_step_not_before(api):
    rt, port, token, trainer = api
    status, _, body = call(port, "POST", "/debug/level/ADVANCED", {"Authorization": f"Bearer {token}"})
    assert status == 202, body
    assert json.loads(body) == {"accepted": True, "level": "advanced", "applies": "at the next step"}
    # not yet: the server thread only queued it
    assert rt.level.value == "basic"
    summary = get_json(port, "/debug/summary")
    assert summary["level"] == "basic" and summary["pending_changes"] == 1
    trainer.step()
    assert rt.level.value == "advanced"
    assert rt.history.steps()[-1]["step"] == 5
    assert rt.features.param_stats  # advanced features are on for the step that applied it
    summary = get_json(port, "/debug/summary")
    assert summary["level"] == "advanced" and summary["pending_changes"] == 0
    events = [e for e in rt.history.events() if e.event_type == "level_changed"]
    assert [e.data["level"] for e in events] == ["advanced"]


@pytest.mark.parametrize("form", ["debug_context", "decorator"])
def test_level_off_then_on_through_the_api_measures_again(api, form):
    """An operator turns torchtrace off through the API for a while, then on again. The way
    back must apply: at level off a step skips torchtrace (the decorator calls the function
    as it is, a context stays inert), and before, the queued change waited for a step
    boundary no step reached, so the run stayed off for good (pending_changes stayed 1)."""
    rt, port, token, trainer = api
    auth = {"Authorization": f"Bearer {token}"}

    @tt.debug_operation(name="train_step", model=trainer.model, optimizer=trainer.opt)
    def decorated(x, y):
        trainer.opt.zero_grad()
        loss = torch.nn.functional.mse_loss(trainer.model(x), y)
        loss.backward()
        trainer.opt.step()
        return loss

    def step():
        if form == "decorator":
            decorated(trainer.x, trainer.y)
        else:
            trainer.step()

    assert call(port, "POST", "/debug/level/off", auth)[0] == 202
    step()
    assert rt.level.value == "off"
    recorded = rt.history.totals["steps"]
    for _ in range(3):
        step()
    assert rt.history.totals["steps"] == recorded  # nothing measured while off
    assert call(port, "POST", "/debug/level/basic", auth)[0] == 202
    step()
    assert rt.level.value == "basic" and get_json(port, "/debug/summary")["pending_changes"] == 0
    step()
    assert rt.history.totals["steps"] == recorded + 2
    assert [e.data["level"] for e in rt.history.events() if e.event_type == "level_changed"] == ["off", "basic"]


def test_valid_clear_applies_at_next_step_not_before(api):
    rt, port, token, trainer = api
    status, _, _ = call(port, "POST", "/debug/clear", {"Authorization": f"Bearer {token}", "Content-Length": "0"})
    assert status == 202
    assert rt.history.totals["steps"] == 5 and len(rt.history.steps()) == 5
    trainer.step()
    # cleared at the boundary before step 5, then step 5 recorded
    assert rt.history.totals["steps"] == 1
    assert [s["step"] for s in rt.history.steps()] == [5]
    assert [e.event_type for e in rt.history.events()] == ["history_cleared"]


def test_post_with_small_body_and_keepalive_connection(api):
    rt, port, token, trainer = api
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("POST", "/debug/level/extreme", body=b"{}", headers={"Authorization": f"Bearer {token}"})
        assert conn.getresponse().read() and True
        conn.request("GET", "/healthz")  # the same connection still parses correctly
        resp = conn.getresponse()
        assert resp.status == 200 and json.loads(resp.read())["status"] == "ok"
    finally:
        conn.close()
    trainer.step()
    assert rt.level.value == "extreme"


def test_read_routes(api):
    rt, port, token, trainer = api
    assert get_json(port, "/healthz") == {"status": "ok", "run_id": rt.settings.run_id}
    summary = get_json(port, "/debug/summary")
    assert summary["totals"]["steps"] == 5 and summary["anomalies_by_kind"] == {"nonfinite_loss": 1}
    steps = get_json(port, "/debug/steps")["steps"]
    assert [s["step"] for s in steps] == [0, 1, 2, 3, 4]
    assert steps[3]["loss"] == "NaN" and steps[3]["anomalies"] == ["nonfinite_loss"]
    assert [s["step"] for s in get_json(port, "/debug/steps?limit=2")["steps"]] == [3, 4]
    events = get_json(port, "/debug/events?since=0")
    assert [e["data"]["step"] for e in events["events"] if e["type"] == "anomaly"] == [3]
    assert get_json(port, f"/debug/events?since={events['last_seq']}") == {"events": [], "more": False,
                                                                          "last_seq": events["last_seq"]}
    # localhost and [::1] Host headers are loopback too; HEAD answers without a body
    assert call(port, "GET", "/debug/summary", host=f"localhost:{port}")[0] == 200
    assert call(port, "GET", "/debug/summary", host=f"[::1]:{port}")[0] == 200
    status, headers, body = call(port, "HEAD", "/debug/summary")
    assert status == 200 and body == b""
    # same-origin GET (what the live page's fetch may send) is fine
    assert call(port, "GET", "/debug/steps", {"Origin": f"http://127.0.0.1:{port}"})[0] == 200
    page_status, page_headers, page = call(port, "GET", "/")
    assert page_status == 200 and page_headers["Content-Type"].startswith("text/html")
    assert b"<canvas" in page and b"http://" not in page.replace(b"http://127.0.0.1:PORT", b"")
    assert "connect-src 'self'" in page_headers["Content-Security-Policy"]
    # /metrics is untouched by the debug API's Host rules (Prometheus scrapes by address)
    assert call(port, "GET", "/metrics", host="10.1.2.3:9464")[0] == 200


def test_training_summary_counts_and_rates(api):
    rt, port, token, trainer = api
    trainer.nan_at.update({6, 7})
    trainer.run(5)  # steps 5..9, NaN at 6 and 7
    served = get_json(port, "/debug/training/summary")
    assert served == json.loads(json.dumps(history_training_summary(rt)))
    assert served["total_steps"] == 10 and served["anomaly_steps"] == 3
    assert served["anomaly_rate"] == 3 / 10
    assert served["rates_by_kind"] == {"nonfinite_loss": 3 / 10}
    assert served["loss_anomaly_rate"] == 3 / 10 and served["explosion_rate"] == 0.0
    losses = [s["loss"] for s in rt.history.steps() if s["step"] not in (3, 6, 7)]
    assert served["recent"]["mean_loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-12)


def test_training_summary_is_swappable(api):
    rt, port, token, trainer = api
    rt.debug_api.training_summary = lambda runtime: {"source": "monitor", "steps": runtime.history.totals["steps"]}
    assert get_json(port, "/debug/training/summary") == {"source": "monitor", "steps": 5}


def test_token_setting_env_and_privacy(tmp_path, monkeypatch, caplog):
    token = "s3cret-token-for-tests-0123456789"
    monkeypatch.setenv("TORCHTRACE_DEBUG_TOKEN", token)
    with caplog.at_level(logging.INFO, logger="torchtrace"):
        result = tt.configure(prometheus_port=0, run_dir=str(tmp_path / "runs"), register_atexit=False)
    rt = runtime()
    assert rt.debug_api.token == token
    assert token not in caplog.text  # a configured token is never logged
    assert call(result.prometheus_port, "POST", "/debug/clear", {"Authorization": f"Bearer {token}"})[0] == 202
    assert token not in json.dumps(rt.report())
    assert token not in repr(rt.settings)
    tt.shutdown()
    assert token not in (tmp_path / "runs" / result.run_id / "report.json").read_text()


def test_random_token_logged_once_locally(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="torchtrace"):
        tt.configure(prometheus_port=0, run_dir=str(tmp_path / "runs"), register_atexit=False)
    rt = runtime()
    assert len(rt.debug_api.token) >= 40
    assert caplog.text.count(rt.debug_api.token) == 1
    other = rt.debug_api.token
    tt.configure(prometheus_port=0, run_dir=str(tmp_path / "runs"), register_atexit=False)
    assert runtime().debug_api.token != other  # per process configuration


def test_settings_validation(tmp_path):
    with pytest.raises(ValueError, match="debug_token"):
        tt.configure(debug_token="short", prometheus_port=0, write_files=False, register_atexit=False)
    with pytest.raises(ValueError, match="debug_api"):
        tt.configure(debug_api="maybe", prometheus_port=0, write_files=False, register_atexit=False)
    tt.configure(debug_api=False, prometheus_port=0, write_files=False, register_atexit=False)
    rt = runtime()
    assert rt.debug_api is None
    assert call(rt.server.port, "GET", "/debug/summary")[0] == 404
    assert call(rt.server.port, "GET", "/metrics")[0] == 200


def test_host_parsing():
    assert debug_api._host_name("127.0.0.1:9464") == "127.0.0.1"
    assert debug_api._host_name("[::1]:80") == "::1"
    assert debug_api._host_name("LOCALHOST.") == "localhost"
    assert debug_api._host_name("localhost.evil.example") == "localhost.evil.example"


def test_bad_token_in_environment_is_logged_and_replaced(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCHTRACE_DEBUG_TOKEN", "short")
    with caplog.at_level(logging.WARNING):
        tt.configure(prometheus_port=0, write_files=False, register_atexit=False)
    assert "ignoring TORCHTRACE_DEBUG_TOKEN" in caplog.text and "short" not in caplog.text
    assert runtime().debug_api.token != "short" and len(runtime().debug_api.token) >= 40


@pytest.mark.parametrize("query", ["/debug/steps?limit=%C2%B2", "/debug/steps?before=%C2%B2",
                                   "/debug/events?since=%E2%91%A0", "/debug/events?limit=%C2%B3",
                                   "/debug/steps?limit=%D9%A3", "/debug/events?since=%EF%BC%93"])
def test_numbers_in_other_scripts_are_bad_arguments(api, query):
    # "²".isdigit() is True but int("²") raises: the route answered 500. Arabic-Indic and
    # full-width digits were taken as numbers. Only ASCII digits are integers here: 400.
    rt, port, token, trainer = api
    status, _, body = call(port, "GET", query)
    assert status == 400, (status, body)
    assert b"integer" in body


def test_an_empty_number_is_a_bad_argument(api):
    """``?since=`` with nothing after it answered 200 (the empty value was dropped as if absent);
    the docs give 400 for an argument that is not an integer."""
    rt, port, token, trainer = api
    for query in ("/debug/events?since=", "/debug/events?limit=", "/debug/steps?limit=", "/debug/steps?before="):
        status, _, body = call(port, "GET", query)
        assert status == 400 and b"integer" in body, (query, status, body)


def test_queued_level_changes_collapse_into_the_last_one(api):
    """500 level POSTs before a step queued 500 changes (pending_changes 500) and each left a
    level_changed event at the next step, pushing the run's other events out of the history.
    Only the last pending level matters: one change waits, the step applies the last level
    asked for, and one event says so. A clear after it is a change of its own, in order."""
    rt, port, token, trainer = api
    auth = {"Authorization": f"Bearer {token}"}
    levels = ["advanced", "basic", "extreme"] * 166 + ["off", "advanced"]
    for level in levels:
        assert call(port, "POST", f"/debug/level/{level}", auth)[0] == 202
    assert get_json(port, "/debug/summary")["pending_changes"] == 1
    assert call(port, "POST", "/debug/clear", auth)[0] == 202
    assert call(port, "POST", "/debug/clear", auth)[0] == 202
    assert get_json(port, "/debug/summary")["pending_changes"] == 2
    trainer.step()
    assert rt.level.value == levels[-1] and get_json(port, "/debug/summary")["pending_changes"] == 0
    assert [e.event_type for e in rt.history.events()] == ["history_cleared"]
    assert call(port, "POST", "/debug/level/basic", auth)[0] == 202
    trainer.step()
    assert [(e.event_type, e.data.get("level")) for e in rt.history.events()] == [
        ("history_cleared", None), ("level_changed", "basic")]
    answers = [call(port, "POST", path, auth)[0] for _ in range(20) for path in ("/debug/clear", "/debug/level/basic")]
    # Alternating kinds cannot collapse: the queue fills, then a clear is refused; a level change
    # still collapses into the level change at the queue's end.
    full = debug_api.MAX_PENDING_CHANGES
    assert answers == [202] * full + [429, 202] * ((40 - full) // 2)
    assert get_json(port, "/debug/summary")["pending_changes"] == debug_api.MAX_PENDING_CHANGES
