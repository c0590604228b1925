"""The live page's numbers mean what the same numbers mean elsewhere: its data wait is the
Prometheus counter's and the steps' own, however long the page stays open after the last step."""

from __future__ import annotations

import re
import time

import pytest

from ..export.debug_helpers import Trainer, call, get_json, runtime


def badput_counter(port: int, kind: str) -> float:
    status, _, body = call(port, "GET", "/metrics")
    assert status == 200
    pattern = rf'^torchtrace_badput_seconds_total\{{[^}}]*kind="{kind}"[^}}]*\}} (\S+)$'
    (value,) = re.findall(pattern, body.decode(), re.M)
    return float(value)


def test_data_wait_on_the_live_page_is_the_counters_and_stops_at_the_last_step(tt_runtime, tiny_model):
    trainer = Trainer(tiny_model)
    for pause in (0.0, 0.05, 0.05, 0.05):
        time.sleep(pause)  # the loader, between two steps
        trainer.step()
    runtime().finish_deferred(block=True)
    time.sleep(0.6)  # no step follows: the job is done and its page stays open (the demo's hold)
    port = tt_runtime.prometheus_port
    page = get_json(port, "/debug/summary")["throughput"]["badput_s"]["data_wait"]
    counter = badput_counter(port, "data_wait")
    # the steps' own data waits, summed: the reference (three planted 50 ms waits, and the loop)
    steps = get_json(port, "/debug/steps?limit=10")["steps"]
    own = sum(s.get("data_wait_s") or 0.0 for s in steps)
    assert len(steps) == 4 and own >= 0.15
    assert counter == pytest.approx(own, abs=0.02)
    assert page == pytest.approx(counter, abs=1e-6), (page, counter)
