"""The debug API paginates and bounds every response in bytes, whatever the model."""

from __future__ import annotations

import json

import pytest

import torchtrace as tt
from torchtrace.export import debug_api
from torchtrace.record.step import Anomaly, StepRecord

from .debug_helpers import call, get_json, runtime

NAMES = [f"blocks.{i}.mlp.weight" for i in range(5000)]


def _record(step: int, names: list[str]) -> StepRecord:
    rec = StepRecord("train_step", step, "basic", start_unix_ns=step, duration_s=0.01, loss=float("nan"),
                     grad_nonfinite_params=list(names))
    rec.anomalies.append(Anomaly("nonfinite_grad", f"{len(names)} tensors", step, "train_step",
                                 {"params": list(names)}))
    return rec


def _pages(port: int, path: str, limit: int) -> list[dict]:
    out, before = [], 0
    while True:
        page = get_json(port, f"{path}?limit={limit}&before={before}")
        out.append(page)
        if page["next_before"] is None:
            return out
        assert page["next_before"] < (before or 10 ** 9)
        before = page["next_before"]


def test_steps_paginate_newest_first_and_every_step_is_seen_once(tt_runtime):
    rt = runtime()
    for i in range(37):
        rt.history.add_step(_record(i, []))
    port = rt.server.port
    pages = _pages(port, "/debug/steps", 10)
    assert [len(p["steps"]) for p in pages] == [10, 10, 10, 7]
    assert [s["step"] for p in reversed(pages) for s in p["steps"]] == list(range(37))
    assert all(p["total"] == 37 and p["omitted_by_size"] == 0 for p in pages)
    # without ?before the newest page, in order, as the live page reads it
    assert [s["step"] for s in get_json(port, "/debug/steps?limit=3")["steps"]] == [34, 35, 36]
    assert call(port, "GET", "/debug/steps?before=-1")[0] == 400


def test_steps_pagination_follows_the_retained_window(tmp_path, monkeypatch):
    for name in [n for n in __import__("os").environ if n.startswith(("TORCHTRACE_", "OTEL_"))]:
        monkeypatch.delenv(name)
    tt.configure(prometheus_port=0, write_files=False, register_atexit=False, history_size=8)
    rt = runtime()
    for i in range(20):
        rt.history.add_step(_record(i, []))
    pages = _pages(rt.server.port, "/debug/steps", 5)
    assert [s["step"] for p in reversed(pages) for s in p["steps"]] == list(range(12, 20))
    assert pages[-1]["next_before"] is None and pages[0]["total"] == 20


def test_events_paginate_oldest_first(tt_runtime):
    rt = runtime()
    port = rt.server.port
    first = get_json(port, "/debug/events?since=0")["last_seq"]
    for i in range(45):
        rt.history.add_event("note", f"n{i}", {"i": i})
    seen, since = [], first
    while True:
        page = get_json(port, f"/debug/events?since={since}&limit=20")
        seen += [e["data"]["i"] for e in page["events"]]
        since = page["last_seq"]
        if not page["more"]:
            break
    assert seen == list(range(45))
    assert call(port, "GET", "/debug/events?limit=0")[0] == 400


def test_a_diverged_step_is_served_with_its_names_capped_and_counted(tt_runtime):
    rt = runtime()
    rt.history.add_step(_record(0, NAMES))
    rt.history.add_event("anomaly", "x" * 100_000, {"params": NAMES})
    port = rt.server.port
    [step] = get_json(port, "/debug/steps")["steps"]
    assert step["grad_nonfinite_params"] == NAMES[:debug_api.MAX_LIST_ITEMS]
    assert step["grad_nonfinite_params_omitted"] == 5000 - debug_api.MAX_LIST_ITEMS
    event = get_json(port, "/debug/events?since=0")["events"][-1]
    assert event["data"]["params_omitted"] == 5000 - debug_api.MAX_LIST_ITEMS
    # The history keeps 512 characters of a message (torchtrace.record.history.NAME_CHARS),
    # under the API's own cap of MAX_STRING_CHARS, and says how much it cut.
    assert len(event["message"]) <= debug_api.MAX_STRING_CHARS
    assert event["message"].endswith("(99488 characters left out)")
    summary = get_json(port, "/debug/summary")
    assert summary["last_step"]["grad_nonfinite_params_omitted"] == 5000 - debug_api.MAX_LIST_ITEMS


def test_a_page_stops_at_the_byte_limit_and_says_what_it_left(tt_runtime, monkeypatch):
    rt = runtime()
    # Names of 200 characters, 2 kept per step by the history (512 characters of names a list):
    # about 0.9 KB a step, 1,000 steps kept = 0.9 MB, over a limit lowered to 256 KB.
    monkeypatch.setattr(debug_api, "MAX_RESPONSE_BYTES", 256 * 1024)
    long_names = [n.ljust(200, "x") for n in NAMES[:40]]
    for i in range(2000):
        rt.history.add_step(_record(i, long_names))
    port = rt.server.port
    status, headers, body = call(port, "GET", "/debug/steps?limit=2000")
    page = json.loads(body)
    assert status == 200 and len(body) <= debug_api.MAX_RESPONSE_BYTES
    kept = len(page["steps"])
    assert 0 < kept < 1000 and page["omitted_by_size"] == 1000 - kept  # history keeps 1,000 steps
    assert page["steps"][-1]["step"] == 1999 and page["next_before"] == 2000 - kept + 1
    rest = get_json(port, f"/debug/steps?limit=2000&before={page['next_before']}")
    assert rest["steps"][-1]["step"] == 1999 - kept


@pytest.mark.parametrize("value, limit", [({"a": "b" * 50}, 40), ({"n": list(range(10))}, 10),
                                          ({"step": 3, "names": NAMES}, 200), ({"ok": 1}, 100)])
def test_bounded_json_is_always_json_within_its_limit(value, limit):
    data = debug_api.bounded_json(value, limit)
    assert len(data) <= limit
    doc = json.loads(data)
    assert doc == value if value == {"ok": 1} else doc.get("truncated", True)
