"""Acceptance: a diverged large model does not swamp torchtrace's own telemetry.

5,000 parameter tensors whose gradients are all NaN, 200 steps at BASIC: the report stays
under 5 MB, ``/debug/steps?limit=500`` under 2 MB, shutdown under 2 s, and a client polling
the live page's endpoints costs the training under 10 % of its time.

That cost is measured as the CPU time the process spends outside the training thread,
as a share of the polled blocks' time, less the same share in the quiet blocks: the
serving threads' work under the GIL, which is what the training thread waits for.
Wall-clock step times swing by a third between blocks of the same kind on a shared 2-core
machine (by 2.7 times in a CI run with other jobs on it), so the step times are compared only
for a gross slowdown (the original bug tripled the step): each polled block's median against
the quiet blocks beside it, and the median of those ratios under 2; the ratios are printed.
"""

from __future__ import annotations

import http.client
import json
import os
import statistics
import subprocess
import sys
import time

import pytest
import torch

import torchtrace as tt
from torchtrace.api import get_runtime
from torchtrace.reporting.page import POLL_MS

TENSORS = 5000
STEPS = 200
BLOCKS = 10  # alternating blocks without and with the poller
POLLER = r"""
import http.client, json, sys, time
port, interval = int(sys.argv[1]), float(sys.argv[2])
conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
since = 0
print("ready", flush=True)
while True:
    try:
        for path in ("/debug/summary", "/debug/training/summary", "/debug/steps?limit=500",
                     f"/debug/events?since={since}"):
            conn.request("GET", path, headers={"Host": f"127.0.0.1:{port}"})
            body = conn.getresponse().read()
            if path.startswith("/debug/events"):
                since = json.loads(body)["last_seq"]
        print("poll", time.time(), flush=True)  # when each poll's four answers were in
    except (OSError, http.client.HTTPException) as exc:  # a browser's page retries on its next poll
        print("failed", time.time(), type(exc).__name__, flush=True)
        conn.close()
    time.sleep(interval)
"""


class ManyTensors(torch.nn.Module):
    """5,000 small parameter tensors; the loss is NaN, so every gradient is all NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(4)) for _ in range(TENSORS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (the list's own iteration indexes it by a string per item: 4 times slower at 5,000)
        return torch.cat(list(self.blocks.parameters())) * x


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _step(model, opt, x) -> float:
    t0 = time.perf_counter()
    with tt.debug_context("train_step", model=model, optimizer=opt) as step:
        loss = (model(x) * float("nan")).sum()
        opt.zero_grad(set_to_none=False)
        loss.backward()
        step.record_loss(loss)
        opt.step()
    return time.perf_counter() - t0


def _block(model, opt, x, port: int | None) -> tuple[list[float], float, float, int, list[str]]:
    """One block of steps, polled when ``port`` is given.

    Returns the step times, the block's wall time, the CPU time the process spent outside
    this (the training) thread during it, the polls the client completed during it (its
    first poll starts as the block does: it is ready before it connects), and the polls that
    failed (the error's name).
    """
    poller = None
    if port is not None:
        # the live page's four requests at the live page's pace
        poller = subprocess.Popen([sys.executable, "-c", POLLER, str(port), str(POLL_MS / 1000)],
                                  stdout=subprocess.PIPE, text=True)
        assert poller.stdout.readline().strip() == "ready"
    try:
        began, wall0, cpu0, own0 = time.time(), time.perf_counter(), time.process_time(), time.thread_time()
        times = [_step(model, opt, x) for _ in range(STEPS // BLOCKS)]
        wall, others = time.perf_counter() - wall0, (time.process_time() - cpu0) - (time.thread_time() - own0)
        ended = time.time()
    finally:
        if poller is not None:
            assert poller.poll() is None, "the poller died"
            poller.kill()
            poller.wait(5)
    lines = [line.split() for line in poller.stdout.read().splitlines()] if poller is not None else []
    polls = sum(began <= float(when) <= ended for kind, when, *_ in lines if kind == "poll")
    failures = [error for kind, when, *error in lines if kind == "failed" and began <= float(when) <= ended]
    return times, wall, others, polls, [name for error in failures for name in error]


def _neighbour_ratios(blocks: list[tuple[bool, float, int, list[str]]]) -> list[float]:
    """Each polled block's median step over the mean of the quiet blocks' just before and after it.

    >>> _neighbour_ratios([(True, 30.0, 1, []), (False, 10.0, 0, []), (True, 20.0, 1, []), (False, 30.0, 0, [])])
    [3.0, 1.0]
    """
    ratios = []
    for i, (polled, median_ms, _, _) in enumerate(blocks):
        if polled:
            beside = [blocks[j][1] for j in (i - 1, i + 1) if 0 <= j < len(blocks) and not blocks[j][0]]
            if beside:
                ratios.append(median_ms / statistics.fmean(beside))
    return ratios


@pytest.mark.slow
def test_a_diverged_5000_tensor_model_keeps_telemetry_bounded(tmp_path, monkeypatch, one_thread):
    for name in list(os.environ):
        if name.startswith(("TORCHTRACE_", "OTEL_")):
            monkeypatch.delenv(name)
    result = tt.configure(level="basic", prometheus_port=0, run_dir=str(tmp_path), register_atexit=False)
    rt = get_runtime()
    torch.manual_seed(0)
    model = ManyTensors()
    # (foreach: one update for the 5,000 tensors, not 5,000; what torchtrace records is the same)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, foreach=True)
    x = torch.ones(TENSORS * 4)
    # per kind (quiet, polled): step times, wall seconds, other threads' CPU seconds
    steps: dict[bool, list[float]] = {False: [], True: []}
    wall = {False: 0.0, True: 0.0}
    others = {False: 0.0, True: 0.0}
    blocks: list[tuple[bool, float, int, list[str]]] = []
    for block in range(BLOCKS):
        polled = bool(block % 2)
        times, block_wall, block_others, polls, failed_polls = _block(model, opt, x, rt.server.port if polled else None)
        # the first block warms up; every later one is measured
        if block:
            steps[polled].extend(times)
            wall[polled] += block_wall
            others[polled] += block_others
            blocks.append((polled, round(statistics.median(times) * 1e3, 1), polls, failed_polls))
    assert rt.history.totals["steps"] == STEPS
    assert rt.history.last_record.grad_nonfinite_params and len(rt.history.last_record.grad_names) == TENSORS

    conn = http.client.HTTPConnection("127.0.0.1", rt.server.port, timeout=30)
    conn.request("GET", "/debug/steps?limit=500", headers={"Host": f"127.0.0.1:{rt.server.port}"})
    steps_body = conn.getresponse().read()
    conn.close()
    t0 = time.monotonic()
    tt.shutdown()
    shutdown_s = time.monotonic() - t0
    report_bytes = result.report_path.stat().st_size if result.report_path.exists() else None
    q, p = statistics.median(steps[False]), statistics.median(steps[True])
    slowdown = statistics.median(_neighbour_ratios(blocks))
    # the share of the polled blocks' time the serving took, over the quiet blocks' background
    serving = others[True] / wall[True] - others[False] / wall[False]
    print(f"\ndiverged {TENSORS}-tensor model, {STEPS} steps: report {report_bytes} bytes; /debug/steps?limit=500 "
          f"{len(steps_body)} bytes; shutdown {shutdown_s:.2f} s; threads other than the training one: "
          f"{others[False] / wall[False]:.2%} of the time quiet, {others[True] / wall[True]:.2%} polled; "
          f"median step {q * 1e3:.1f} ms quiet, {p * 1e3:.1f} ms polled (ratio {p / q:.3f}; polled block over the quiet ones beside it, median {slowdown:.3f}); "
          f"blocks (polled, median ms, polls, failed polls) {blocks}")
    assert len(json.loads(steps_body)["steps"]) > 0
    # Every acceptance criterion is checked, and all that fail are named together.
    failed = [name for name, ok in [
        (f"/debug/steps?limit=500 is {len(steps_body)} bytes, not under 2 MB", len(steps_body) < 2 * 10 ** 6),
        (f"shutdown took {shutdown_s:.2f} s, not under 2 s", shutdown_s < 2.0),
        (f"report.json is {report_bytes} bytes, not under 5 MB", report_bytes is not None
         and report_bytes < 5 * 10 ** 6),
        (f"a polled block saw no poll: {blocks}", all(n >= 1 for kind, _, n, _ in blocks if kind)),
        (f"serving the poller took {serving:.2%} of the polled time, not under 10 %", serving < 0.10),
        (f"a polled block's steps took {slowdown:.2f} times the quiet blocks' beside it (median), not under 2: "
         f"{blocks}", slowdown < 2.0),
    ] if not ok]
    assert not failed, failed
