"""A stop signal's handler runs, whatever the main thread waits for.

Python runs a signal's handler on the main thread, at its next bytecode. A fork
``multiprocessing.Pool`` worker asks for its next task by waiting for the task queue's lock in
C, with no timeout; a SIGTERM from the pool's ``terminate()`` noted just before that wait
interrupted nothing, the handler never ran, and the pool's ``with`` block waited for the worker
for good (1 run in 80 of the fork pool test, two at a time on the 2-core machine; none in 140
since; ``benchmarks/RESULTS.md``, session 33). torchtrace's threads leave the stop signals to
the application's threads, and a signal whose handler has not run is sent to the main thread
again (``torchtrace.job.signals.StuckSignalWatch``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir() or not hasattr(signal, "pthread_sigmask"),
                                reason="reads each thread's signal mask from /proc (Linux)")

def _run(script: str, run_dir: Path, timeout: float) -> subprocess.CompletedProcess:
    """``script`` in a fresh interpreter, given ``run_dir``, with no torchtrace or OpenTelemetry settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHTRACE_", "OTEL_"))}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-c", script, str(run_dir)], env=env, capture_output=True, text=True,
                          timeout=timeout)


THREADS = r"""
import json, sys, threading, urllib.request, torch, torchtrace as tt
from pathlib import Path

result = tt.configure(service_name="masks", prometheus_port=0, run_dir=sys.argv[1], otlp_endpoint="http://127.0.0.1:9",
                      metrics_exporter="both", hang_timeout_s=60)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    with tt.debug_context("train_step", model=model, optimizer=opt) as step:
        loss = model(torch.ones(2, 4)).pow(2).mean()
        loss.backward()
        opt.step()
        step.record_loss(loss)
urllib.request.urlopen(result.metrics_url, timeout=10).read()


def blocked(native_id):
    try:
        status = Path(f"/proc/self/task/{native_id}/status").read_text()
    except OSError:  # a thread that ended meanwhile (a request's)
        return None
    mask = int(next(line for line in status.splitlines() if line.startswith("SigBlk:")).split()[1], 16)
    return [n for n in (2, 15) if mask >> (n - 1) & 1]


masks = {t.name: blocked(t.native_id) for t in threading.enumerate()}
print(json.dumps({name: mask for name, mask in masks.items() if mask is not None}))
tt.shutdown()
"""


def test_torchtraces_threads_block_the_stop_signals_and_the_main_thread_does_not(tmp_path):
    proc = _run(THREADS, tmp_path / "runs", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    masks = json.loads(proc.stdout.strip().splitlines()[-1])
    ours = {name: mask for name, mask in masks.items() if name.startswith("torchtrace-")}
    # The metrics server, the span and metric exporters, the black box's writer, the watchdog.
    assert {"torchtrace-http", "torchtrace-span-export", "torchtrace-metrics-push", "torchtrace-blackbox",
            "torchtrace-watchdog"} <= set(ours), sorted(masks)
    assert all(mask == [signal.SIGINT, signal.SIGTERM] for mask in ours.values()), ours
    assert masks["MainThread"] == [], masks


STUCK = r"""
import multiprocessing, signal, sys, threading, time, torchtrace as tt

tt.configure(service_name="stuck", prometheus_port="off", run_dir=sys.argv[1])
lock = multiprocessing.Lock()
lock.acquire()


def noted_elsewhere():
    time.sleep(0.3)
    signal.raise_signal(signal.SIGTERM)  # Python notes it on this thread; the main thread waits in C


threading.Thread(target=noted_elsewhere, daemon=True).start()
lock.acquire()  # for good: a Pool worker waiting for the task queue's lock
"""


def test_a_sigterm_noted_while_the_main_thread_waits_in_c_still_ends_the_process(tmp_path):
    """The signal is noted on another thread (as it is on the main thread just before a wait in
    C), so nothing interrupts the main thread's wait: the watch sends it to the main thread,
    whose handler then records ``preempted`` and ends the process by the signal."""
    proc = _run(STUCK, tmp_path / "runs", timeout=60)
    assert proc.returncode == -signal.SIGTERM, proc.stderr[-3000:]
    (state,) = (tmp_path / "runs").glob("*/state.json")
    box = json.loads(state.read_text())
    assert (box["ended"], box["end_detail"]) == ("preempted", "SIGTERM")


FORKS = r"""
import asyncio, json, os, signal, sys, torchtrace as tt

tt.configure(service_name="forks", prometheus_port="off", run_dir=sys.argv[1])
ours = signal.set_wakeup_fd(-1)
signal.set_wakeup_fd(ours)
read, write = os.pipe()
pid = os.fork()
if pid == 0:  # the child: no wakeup fd of its parent's, whose pipe its signals would write into
    os.write(write, str(signal.set_wakeup_fd(-1)).encode())
    os._exit(0)
os.waitpid(pid, 0)
child = int(os.read(read, 16))
after_fork = signal.set_wakeup_fd(ours)
loop = asyncio.new_event_loop()
loop.add_signal_handler(signal.SIGUSR1, lambda: None)  # the loop takes the wakeup fd
theirs = signal.set_wakeup_fd(-1)
signal.set_wakeup_fd(theirs)
tt.shutdown()
left = signal.set_wakeup_fd(-1)
print(json.dumps({"ours": ours, "child": child, "after_fork": after_fork, "theirs": theirs, "left": left}))
"""


def test_the_wakeup_fd_is_neither_inherited_by_a_forked_child_nor_taken_from_an_asyncio_loop(tmp_path):
    proc = _run(FORKS, tmp_path / "runs", timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fds = json.loads(proc.stdout.strip().splitlines()[-1])
    assert fds["ours"] != -1 and fds["child"] == -1 and fds["after_fork"] == fds["ours"]
    assert fds["theirs"] not in (-1, fds["ours"]) and fds["left"] == fds["theirs"]  # shutdown left the loop's
