"""The watchdog's pieces without a subprocess: the timeout rule, a tick, the culprit rule,
faulthandler's format, the phase marks, the hang series, the settings."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from prometheus_client import CollectorRegistry

import torchtrace as tt
from torchtrace import semconv
from torchtrace.config import Settings
from torchtrace.export.hang_metrics import HangMetrics
from torchtrace.job import culprit, progress, stacks
from torchtrace.job.watchdog import FLOOR_S, SLOW_S, Watchdog, hang_timeout
from torchtrace.step import job


# ---------------------------------------------------------------- the timeout rule
def test_adaptive_timeout_is_ten_times_the_longest_recent_period_at_least_the_floor():
    assert hang_timeout(None, "forward", 10, [0.01, 0.02]) == FLOOR_S == 30.0
    assert hang_timeout(None, "forward", 10, [0.5, 5.0, 1.0]) == 50.0
    assert hang_timeout(7.0, "forward", 10, [5.0]) == 7.0  # hang_timeout_s overrides


@pytest.mark.parametrize("phase,steps", [("checkpoint", 10), ("evaluation", 10), ("forward", 0), ("data_wait", 1)])
def test_first_steps_and_marked_phases_keep_their_allowance(phase, steps):
    assert hang_timeout(None, phase, steps, [0.01]) == SLOW_S
    assert hang_timeout(2.0, phase, steps, [0.01]) == SLOW_S


# ---------------------------------------------------------------- ticks
def _fields(**kw):
    f = {"rank": 0, "attempt": 0}
    progress.track(f)
    progress.untrack(f)
    f.update(kw)
    return f


def test_a_tick_flags_a_stall_once_and_learns_periods(tmp_path):
    release = threading.Event()
    trainer = threading.Thread(target=release.wait, args=(10,), name="trainer")
    trainer.start()
    f = _fields(phase="forward", progress=100.0, steps_done=5, step_time=99.0, current_step=5, thread=trainer.ident)
    dog = Watchdog(f, given_timeout_s=None, stack_path=tmp_path / "stacks.txt", hang_path=tmp_path / "hang.json")
    dog._stack_file = open(tmp_path / "stacks.txt", "ab")
    try:
        assert dog.tick(101.0) is None
        f.update(progress=101.5, steps_done=7, step_time=101.5)  # two steps of 1.25 s
        assert dog.tick(102.0) is None
        assert max(dog.recent) == pytest.approx(1.25)
        assert f["hang_timeout_s"] == 30.0
        assert dog.tick(101.5 + 30.0) is None  # not beyond
        finding = dog.tick(101.5 + 31.0)
        assert finding is not None and finding["phase"] == "forward" and finding["step"] == 5
        assert dog.tick(101.5 + 40.0) is None  # once per stall
        assert f["hangs"] == 1 and f["hang"]["since"] == 101.5
        on_disk = json.loads((tmp_path / "hang.json").read_text())
        assert on_disk["stalled_s"] == 31.0 and on_disk["threads"][0]["name"] == "trainer"
        assert on_disk["stack"][0]["function"] == "wait"
        assert "torchtrace: hang at" in (tmp_path / "stacks.txt").read_text()
        # The step ends after all: its record gets the finding once.
        assert dog.take(5) is finding and dog.take(5) is None
    finally:
        release.set()
        trainer.join()
        dog.stop()


def test_time_idle_is_no_step_period(tmp_path, monkeypatch):
    """``tt.idle()`` between epochs, then training resumes: the time from the last step before
    the idle to the first after it is no step period. It was learned as one (the adaptive
    timeout went from 30 s to 76.5 s after 15 s idle, and stayed for 100 observations),
    whether or not a tick saw the idle phase, and whether or not one saw the last step before
    the idle (the tick that first saw the idle once first saw that step too, and measured the
    next period from it: 48.8 s)."""
    now = [100.0]
    monkeypatch.setattr(progress, "_clock", lambda: now[0])
    f = {"rank": 0, "attempt": 0}
    progress.track(f)
    dog = Watchdog(f, given_timeout_s=None, hang_path=tmp_path / "hang.json")
    step = 0
    try:
        for tick_while_idle, tick_after_last in ((True, True), (False, True), (True, False), (False, False)):
            for i in range(5):  # steps of 1 s, a tick after each (but the last, where said)
                progress.step_began(step, "train")
                now[0] += 1.0
                progress.step_ended(step)
                step += 1
                if i < 4 or tick_after_last:
                    dog.tick(now[0])
            progress.idle()
            now[0] += 60.0
            if tick_while_idle:
                dog.tick(now[0])
            for _ in range(2):  # training resumes
                progress.step_began(step, "train")
                now[0] += 1.0
                progress.step_ended(step)
                step += 1
                dog.tick(now[0])
            assert max(dog.recent) <= 1.5 and f["hang_timeout_s"] == 30.0, (tick_while_idle, tick_after_last,
                                                                              list(dog.recent))
    finally:
        progress.untrack(f)
        dog.stop()


def test_a_wall_clock_that_steps_is_neither_a_stall_nor_progress(tmp_path):
    """The marks stamp progress with the wall clock; NTP or a resumed VM can step it. A step of
    an hour forward between two ticks, the training making progress all along, is no hang and
    teaches no hour-long pause (the adaptive timeout stays 30 s); a real stall after it is
    flagged at its length on the monotonic clock. A step backward does not hide a stall."""
    release = threading.Event()
    trainer = threading.Thread(target=release.wait, args=(20,), name="trainer")
    trainer.start()
    f = _fields(phase="forward", progress=100.0, steps_done=5, step_time=100.0, current_step=5, thread=trainer.ident)
    dog = Watchdog(f, given_timeout_s=None, hang_path=tmp_path / "hang.json")
    try:
        assert dog.tick(101.0, 5001.0) is None
        assert dog.tick(3702.0, 5002.0) is None  # the clock stepped an hour inside a step of 2 s so far
        # Steps go on, one a second, stamped by the new clock.
        for i in range(1, 6):
            f.update(progress=3701.0 + i, steps_done=5 + i, step_time=3701.0 + i, current_step=5 + i)
            assert dog.tick(3701.2 + i, 5001.2 + i) is None, i
        assert max(dog.recent) <= 2.5 and f["hang_timeout_s"] == 30.0, (list(dog.recent), f["hang_timeout_s"])
        # Now a real stall: no progress after 3706.0 (monotonic 5006.2 at the last tick).
        assert dog.tick(3706.0 + 29.0, 5006.2 + 29.0) is None
        finding = dog.tick(3706.0 + 31.5, 5006.2 + 31.5)
        assert finding is not None and 31.0 <= finding["stalled_s"] <= 32.0, finding and finding["stalled_s"]
    finally:
        release.set()
        trainer.join()
        dog.stop()
    # Backward: the clock steps an hour back while the thread is stuck.
    f = _fields(phase="forward", progress=100.0, steps_done=5, step_time=99.0, current_step=5, thread=threading.get_ident())
    dog = Watchdog(f, given_timeout_s=5.0, hang_path=tmp_path / "hang2.json")
    try:
        assert dog.tick(101.0, 5001.0) is None
        finding = dog.tick(101.0 - 3600.0 + 6.0, 5007.0)
        assert finding is not None and finding["stalled_s"] == pytest.approx(7.0), finding
    finally:
        dog.stop()


def test_the_stalled_seconds_series_counts_on_the_watchdogs_clock():
    """``torchtrace_stalled_seconds`` with the watchdog's clock: a wall clock stepped since the
    last progress reads as the time the monotonic clock counted."""
    from torchtrace.job.stall import StallClock

    wall, mono = [1000.0], [50.0]
    clock = StallClock(wall=lambda: wall[0], mono=lambda: mono[0])
    f = {"phase": "forward", "progress": 999.0}
    assert clock.look(999.0, wall[0], mono[0]) == 1.0
    wall[0], mono[0] = 1000.0 + 3600.0 + 2.0, 52.0  # two seconds later, the clock an hour ahead
    registry = CollectorRegistry()
    registry.register(HangMetrics("r", "0", lambda: f, clock.now))
    assert registry.get_sample_value("torchtrace_stalled_seconds", {"run_id": "r", "rank": "0"}) == 3.0
    f["progress"] = 4601.5  # progress since the last tick: at most as long ago as that tick
    assert registry.get_sample_value("torchtrace_stalled_seconds", {"run_id": "r", "rank": "0"}) == 0.5


def test_a_stall_between_steps_is_told_after_the_last_step(tmp_path, caplog):
    """A rank stuck in its data source, between steps: the log and the stack file say after
    which step it stalled, not "in step None"."""
    release = threading.Event()
    trainer = threading.Thread(target=release.wait, args=(10,), name="trainer")
    trainer.start()
    f = _fields(phase="data_wait", progress=100.0, steps_done=20, step_time=100.0, current_step=None, step=19,
                thread=trainer.ident, rank=1)
    dog = Watchdog(f, given_timeout_s=5.0, stack_path=tmp_path / "stacks.txt", hang_path=tmp_path / "hang.json")
    dog._stack_file = open(tmp_path / "stacks.txt", "ab")
    try:
        with caplog.at_level("ERROR", logger="torchtrace"):
            assert dog.tick(106.0) is not None
            deadline = time.monotonic() + 10  # (logged from a thread of its own)
            while not caplog.records and time.monotonic() < deadline:
                time.sleep(0.01)
    finally:
        release.set()
        trainer.join()
        dog.stop()
    (message,) = [r.getMessage() for r in caplog.records]
    assert "no progress for 6.0 s after step 19, phase data_wait" in message, message
    assert "after step 19, phase data_wait" in (tmp_path / "stacks.txt").read_text()


def test_a_run_without_a_hang_leaves_no_empty_stack_file_and_one_with_stacks_keeps_it(tmp_path):
    quiet = Watchdog(_fields(phase="idle", progress=0.0), given_timeout_s=None, stack_path=tmp_path / "quiet.txt")
    quiet.start()
    assert (tmp_path / "quiet.txt").exists()  # open while the watchdog runs: faulthandler writes into it
    quiet.stop()
    assert not (tmp_path / "quiet.txt").exists()
    (tmp_path / "kept.txt").write_text("torchtrace: hang at step 3\n")  # an earlier attempt's stacks
    kept = Watchdog(_fields(phase="idle", progress=0.0), given_timeout_s=None, stack_path=tmp_path / "kept.txt")
    kept.start()
    kept.stop()
    assert (tmp_path / "kept.txt").read_text() == "torchtrace: hang at step 3\n"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_stopping_its_copy_leaves_the_parents_stack_file(tmp_path):
    """A child forked from a configured process (a user's os.fork(), exiting through atexit)
    stops its copy of the watchdog: the parent's faulthandler still writes into that file."""
    dog = Watchdog(_fields(phase="idle", progress=0.0), given_timeout_s=None, stack_path=tmp_path / "stacks.txt")
    dog.start()
    pid = os.fork()
    if pid == 0:
        try:
            dog.stop()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert (tmp_path / "stacks.txt").exists()
    dog.stop()
    assert not (tmp_path / "stacks.txt").exists()


def test_idle_is_never_a_hang():
    f = _fields(phase="idle", progress=0.0, steps_done=100)
    dog = Watchdog(f, given_timeout_s=1.0)
    assert dog.tick(10_000.0) is None and "hangs" not in f


def test_a_tick_that_fails_does_not_end_the_thread():
    class Broken(dict):
        broken = False

        def get(self, *a):
            if self.broken:
                raise RuntimeError("boom")
            return super().get(*a)

    fields = Broken()
    dog = Watchdog(fields, period_s=0.01)
    fields.broken = True
    dog.start()
    time.sleep(0.1)
    assert dog._thread is not None and dog._thread.is_alive() and dog.ticks >= 2
    dog.stop()


def test_the_stack_names_the_stuck_thread_and_the_users_frame_first():
    release = threading.Event()

    def users_wait():
        release.wait(10)

    t = threading.Thread(target=users_wait, name="stuck")
    t.start()
    try:
        time.sleep(0.05)
        threads = stacks.capture(t.ident)
        first = threads[0]
        assert first["training"] and first["name"] == "stuck"
        assert first["where"]["function"] == "users_wait" and first["where"]["file"] == __file__
        assert not first["stack"][-1]["user"]  # threading's frames come after
    finally:
        release.set()
        t.join()


def test_faulthandler_dump_is_parsed_and_the_training_thread_found():
    text = ("junk\nTimeout (0:00:05)!\nThread 0x00007f0000000002 (most recent call first):\n"
            '  File "/usr/lib/python3.11/threading.py", line 331 in wait\n\n'
            "Thread 0x00007f0000000001 (most recent call first):\n"
            '  File "/usr/lib/python3.11/re/__init__.py", line 166 in match\n'
            '  File "/home/u/train.py", line 12 in forward\n')
    threads = stacks.parse_faulthandler(text, 0x7F0000000001)
    assert threads[0]["training"] and threads[0]["ident"] == 0x7F0000000001
    assert threads[0]["where"] == {"file": "/home/u/train.py", "line": 12, "function": "forward", "user": True}
    assert [t["training"] for t in stacks.parse_faulthandler(text, None)] == [True, False]


# ---------------------------------------------------------------- the culprit rule
def _box(rank, **kw):
    box = {"rank": rank, "attempt": 0, "world_size": 3, "pid": os.getpid(), "time": 1000.0, "ended": None,
           "progress": 990.0, "phase": "collective", "current_step": 8, "hang_timeout_s": 4.0}
    box.update(kw)
    return box


def test_culprit_is_the_rank_not_inside_the_collective_the_others_wait_in():
    hang = {"since": 990.0}
    boxes = [_box(0, collective_seq=17, hang=hang), _box(1, collective_seq=17, hang=hang),
             _box(2, collective_seq=16, phase="data_wait", hang=hang)]
    verdict = culprit.judge(boxes, now=1000.5)
    assert verdict["verdict"] == "hang" and verdict["culprit_ranks"] == [2]
    assert "#17" in verdict["reason"]


def test_without_collective_counts_the_rank_behind_is_blamed():
    hang = {"since": 990.0}
    boxes = [_box(0, hang=hang, phase="backward"), _box(1, hang=hang, phase="backward"),
             _box(2, hang=hang, phase="data_wait")]
    assert culprit.judge(boxes, now=1000.5)["culprit_ranks"] == [2]


def test_a_gone_rank_named_by_its_peers_is_the_culprit_not_the_ranks_that_then_failed():
    dead = 2 ** 22 + 12345  # (no such pid)
    boxes = [_box(0, ended="exception", peers_gone=[2]), _box(1, ended="exception"), _box(2, pid=dead)]
    verdict = culprit.judge(boxes, now=1000.5)
    assert verdict["verdict"] == "died" and verdict["culprit_ranks"] == [2]
    assert verdict["conditions"] == {0: "ended:exception", 1: "ended:exception", 2: "gone"}


def test_of_ranks_that_all_raised_the_first_to_end_is_the_culprit():
    """torchrun, DDP: rank 1 raises in its step; rank 0 raises 0.7 s later, in the collective
    that rank 1 never joined. The job story names rank 1 first; so does the verdict."""
    boxes = [_box(0, ended="exception", end_detail="RuntimeError", end_time=1000.8, time=1000.8),
             _box(1, ended="exception", end_detail="RuntimeError", end_time=1000.1, time=1000.1)]
    verdict = culprit.judge(boxes, now=1001.0)
    assert (verdict["verdict"], verdict["culprit_ranks"]) == ("died", [1])
    assert verdict["reason"] == ("rank 1 ended with an exception; rank 0 ended with one after it (most likely a "
                                 "collective that failed for want of it)"), verdict["reason"]


def test_a_silent_heartbeat_of_a_live_process_is_a_hang():
    boxes = [_box(0, phase="forward", time=900.0), _box(1, phase="forward")]
    verdict = culprit.judge(boxes, now=1000.5)
    assert verdict["verdict"] == "hang" and verdict["culprit_ranks"] == [0]


def test_healthy_completed_and_running():
    assert culprit.judge([_box(0, progress=999.9, phase="forward")], now=1000.0)["verdict"] == "running"  # 1 of 3
    one = [{**_box(0, progress=999.9, phase="forward"), "world_size": 1}]
    assert culprit.judge(one, now=1000.0)["verdict"] == "healthy"
    assert culprit.judge([{**one[0], "progress": 990.0}], now=1000.0)["verdict"] == "running"  # past half its timeout
    assert culprit.judge([{**one[0], "ended": "completed"}], now=1000.0)["verdict"] == "completed"


# ---------------------------------------------------------------- marks and series
def test_phase_marks_of_a_real_step(tt_runtime, tiny_model):
    rt = tt.current.runtime()
    f = rt.rank_state.fields
    opt = __import__("torch").optim.SGD(tiny_model.parameters(), lr=0.1)
    seen = []
    orig = progress.mark

    with tt.debug_context("train_step", model=tiny_model, optimizer=opt):
        seen.append(f["phase"])
        loss = tiny_model(__import__("torch").ones(2, 8)).sum()
        seen.append(f["phase"])
        loss.backward()
        opt.step()
        seen.append(f["phase"])
        assert f["current_step"] == 0
    seen.append(f["phase"])
    with tt.debug_context("save", kind="checkpoint"):
        seen.append(f["phase"])
        tiny_model(__import__("torch").ones(2, 8))
        seen.append(f["phase"])
    assert seen == ["data_wait", "backward", "optimizer", "data_wait", "checkpoint", "checkpoint"]
    assert f["step"] == 0 and f["steps_done"] == 2 and orig is progress.mark
    tt.shutdown()
    assert f["phase"] == "idle" and f["ended"] == "completed"


class _OwnCall(__import__("torch").nn.Linear):
    def __call__(self, *args, **kwargs):  # a class that routes its own calls: its marks are hooks
        return super().__call__(*args, **kwargs)


@pytest.mark.parametrize("model_class", ["plain", "own call"])
def test_a_call_of_the_model_between_steps_is_progress_on_the_training_thread_only(tt_runtime, model_class):
    """An evaluation loop the script does not mark calls the model between steps: each call
    (its start and its end) is progress, the phase stays ``data_wait``. A call from another
    thread (a server answering with the same model) is not the training's progress."""
    import torch

    model = torch.nn.Linear(8, 2) if model_class == "plain" else _OwnCall(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    f = tt.current.runtime().rank_state.fields
    with tt.debug_context("train_step", model=model, optimizer=opt):
        model(torch.ones(2, 8)).sum().backward()
        opt.step()
    ended = f["progress"]
    time.sleep(0.02)
    with torch.no_grad():
        model(torch.ones(2, 8))
    evaluated = f["progress"]
    assert evaluated > ended and f["phase"] == "data_wait" and f["current_step"] is None
    time.sleep(0.02)
    other = threading.Thread(target=lambda: model(torch.ones(2, 8)))
    other.start()
    other.join()
    assert f["progress"] == evaluated
    tt.shutdown()


def test_hang_series_at_scrape_time():
    f = {"phase": "forward", "progress": time.time() - 42.0, "hangs": 2, "collective_seq": 17, "hang_timeout_s": 30.0}
    registry = CollectorRegistry()
    registry.register(HangMetrics("r", "0", lambda: f))
    base = {"run_id": "r", "rank": "0"}
    assert registry.get_sample_value("torchtrace_stalled_seconds", base) == pytest.approx(42.0, abs=1.0)
    assert registry.get_sample_value("torchtrace_hangs_total", base) == 2.0
    assert registry.get_sample_value("torchtrace_collectives_total", base) == 17.0
    assert registry.get_sample_value("torchtrace_hang_timeout_seconds", base) == 30.0
    phases = {p: registry.get_sample_value("torchtrace_phase", {**base, "phase": p}) for p in semconv.TRAINING_PHASES}
    assert phases == {p: float(p == "forward") for p in semconv.TRAINING_PHASES}
    f.update(phase="idle")
    assert registry.get_sample_value("torchtrace_stalled_seconds", base) == 0.0


def test_settings():
    assert Settings.resolve({}, environ={}).hang_timeout_s is None
    assert Settings.resolve({}, environ={"TORCHTRACE_HANG_TIMEOUT_S": "45"}).hang_timeout_s == 45.0
    assert Settings.resolve({"on_hang": "ABORT"}, environ={}).on_hang == "abort"
    with pytest.raises(ValueError, match="on_hang='exit' is not valid; accepted values: record, abort"):
        Settings.resolve({"on_hang": "exit"}, environ={})
    with pytest.raises(ValueError, match="hang_timeout_s=0 is not valid"):
        Settings.resolve({"hang_timeout_s": 0}, environ={})


def test_a_framework_marks_the_time_between_steps_as_checkpoint_or_evaluation():
    f = _fields()
    progress.track(f)
    try:
        progress.step_began(4, "train")
        progress.step_ended(4)
        progress.between("checkpoint")  # a Trainer about to save
        progress.mark("forward")  # (an evaluation batch inside it: progress only)
        assert f["phase"] == "checkpoint"
        assert hang_timeout(2.0, f["phase"], 10, [0.01]) == SLOW_S
        progress.step_began(5, "train")
        progress.mark("forward")
        assert f["phase"] == "forward"
    finally:
        progress.untrack(f)


def test_a_peer_whose_process_is_gone_is_named_and_the_box_written_at_once():
    dead = 2 ** 22 + 54321  # (no such pid)
    boxes = [_box(0), _box(1, pid=dead), _box(2, pid=dead, ended="completed")]
    f = _fields(rank=0, attempt=0)
    written = []
    dog = Watchdog(f, peers=lambda: boxes, persist=lambda: written.append(dict(f)))
    assert dog.check_peers() == [1]  # rank 2 said how it ended: not gone
    assert f["peers_gone"] == [1] and written and written[-1]["peers_gone"] == [1]
    assert dog.check_peers() == [1] and len(written) == 1  # named once


_DYING = r'''
import socket, sys, time
ballast = b"x" * (64 << 20)  # memory the kernel frees as the process exits
peer = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
peer.sendall(b"r")
time.sleep(60)
'''


def test_a_peer_killed_is_gone_as_soon_as_its_socket_closes():
    # What a rank of a torchrun job sees: its collective fails when the SIGKILLed peer's
    # socket closes, and it may end at once. The peer is then exiting, not yet a zombie, for a
    # few milliseconds (measured here: most of the time); it must already count as gone.
    for _ in range(5):
        with socket.socket() as server:
            server.bind(("127.0.0.1", 0))
            server.listen(1)
            child = subprocess.Popen([sys.executable, "-c", _DYING, str(server.getsockname()[1])])
            try:
                conn, _ = server.accept()
                with conn:
                    assert conn.recv(1) == b"r"
                    os.kill(child.pid, signal.SIGKILL)
                    assert conn.recv(1) == b""  # the socket closed: the peer's collective fails now
                    f = _fields(rank=0, attempt=0)
                    dog = Watchdog(f, peers=lambda: [_box(0), _box(1, pid=child.pid)])
                    assert dog.check_peers() == [1]
                    assert f["peers_gone"] == [1]
            finally:
                child.kill()
                child.wait()


@pytest.mark.parametrize("end", ["exception", "sigterm", "shutdown"])
def test_every_path_that_ends_a_rank_takes_a_last_look_at_the_peers(tmp_path, end, monkeypatch):
    # Rank 0 of a job of two (a job of one process has no peers to look at).
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_WORLD_SIZE", "2")):
        monkeypatch.setenv(name, value)
    tt.configure(run_dir=tmp_path, run_id="look", prometheus_port="off", register_atexit=False)
    rt = tt.current.runtime()
    try:
        # The rank ends before its watchdog's next tick (torchrun's teardown is that fast).
        rt.watchdog.stop()
        box = rt.rank_state.path
        peer = box.with_name("state.rank1.json")
        peer.write_text(json.dumps(_box(1, attempt=rt.attempt, pid=2 ** 22 + 54321)))  # (no such pid)
        if end == "exception":
            try:
                raise RuntimeError("Connection closed by peer")
            except RuntimeError as exc:
                sys.excepthook(type(exc), exc, exc.__traceback__)
        elif end == "sigterm":
            # (Not the real signal: its default action would end pytest. The handler's work.)
            job.on_signal(rt, signal.SIGTERM, terminal=False)
        else:
            tt.shutdown()
        state = json.loads(box.read_text())
        assert state["peers_gone"] == [1]
        assert state["ended"] == {"exception": "exception", "sigterm": "preempted", "shutdown": "completed"}[end]
    finally:
        tt.shutdown()


@pytest.mark.parametrize("end", ["exception", "sigterm", "shutdown"])
def test_every_path_that_ends_a_rank_reads_its_last_collective_again(tmp_path, end, monkeypatch):
    """The last tick saw the rank inside a collective (waiting for a peer late to start); it
    completed, and the rank ended before the next tick. The final black box says it completed:
    a box that still said "in progress" read as a rank ending stuck in it (a hang, CI stop 75)."""
    for name, value in (("RANK", "1"), ("LOCAL_RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_WORLD_SIZE", "2")):
        monkeypatch.setenv(name, value)
    tt.configure(run_dir=tmp_path, run_id="collective", prometheus_port="off", register_atexit=False)
    rt = tt.current.runtime()
    try:
        rt.watchdog.stop()
        recorder = {"seq": 1, "op": "gloo:all_gather", "group": "default_pg", "active": True}
        rt.watchdog.collectives = lambda: dict(recorder)
        rt.watchdog.tick(time.time())
        assert rt.rank_state.fields["collective_active"] is True  # what the last tick saw
        recorder["active"] = False  # the collective completed; no tick since
        if end == "exception":
            try:
                raise ValueError("a bad batch")
            except ValueError as exc:
                sys.excepthook(type(exc), exc, exc.__traceback__)
        elif end == "sigterm":
            job.on_signal(rt, signal.SIGTERM, terminal=False)
        else:
            tt.shutdown()
        state = json.loads(rt.rank_state.path.read_text())
        assert (state["collective_seq"], state["collective_active"]) == (1, False), state
    finally:
        tt.shutdown()


def test_a_hang_the_step_recovers_from_is_hang_badput_not_productive_time(tmp_path):
    """A training step stuck for 2.5 s (hang timeout 1 s, ``on_hang="record"``) that then ends:
    its span carries the ``hang`` anomaly, and the job's story books the stall as ``hang``
    badput, not as the productive time of the step it was in."""
    import torch

    from torchtrace.job.story import job_story

    run_dir = tmp_path / "runs"
    tt.configure(service_name="test", prometheus_port=None, run_dir=str(run_dir), hang_timeout_s=1.0,
                 on_hang="record", register_atexit=False, strict=True)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    stuck = []
    for i in range(6):
        with tt.debug_context("train_step", model=model, optimizer=opt) as step:
            loss = model(torch.ones(2, 4)).sum()
            if i == 3:
                t0 = time.time()
                time.sleep(2.5)  # stuck in the forward; the watchdog flags it after 1 s
                stuck.append(time.time() - t0)
            loss.backward()
            step.record_loss(loss)
            opt.step()
    rt = tt.current.runtime()
    kinds = [e.data.get("kind") for e in rt.history.events() if e.event_type == "anomaly"]
    tt.shutdown()
    assert semconv.HANG in kinds, kinds
    story = job_story(run_dir)
    (attempt,) = story["attempts"]
    hang = story["badput"]["hang"]
    # The stall: from the last progress (the forward began) to the step's end, about the sleep.
    assert stuck[0] <= hang < stuck[0] + 0.5, (hang, stuck)
    # Productive time is the other five steps' (milliseconds) and the stuck step's own work.
    assert attempt["productive_s"] < 0.5, attempt
