"""The runtime's side of the whole job: the black box kept current, how the process ends
(shutdown, an exception, a signal), checkpoint timing, and the job section of the report.

Built at ``configure()`` by :func:`torchtrace.step.setup.black_box` and :func:`watch`; every
function here is guarded (the black box must never break the job). The training thread only
stores into the black box's fields (:func:`note_step`); the writer thread rewrites the file.
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import Future
from types import TracebackType
from typing import TYPE_CHECKING, Any, Callable

from torchtrace import current, files, semconv
from torchtrace.errors import get_logger
from torchtrace.job import checkpoints, ending, progress
from torchtrace.job.metrics import JobMetrics
from torchtrace.job.signals import SignalGuard, start_thread
from torchtrace.job.story import job_story, story_of

if TYPE_CHECKING:
    from torchtrace.record.step import StepRecord
    from torchtrace.step.runtime import Runtime

logger = get_logger("torchtrace")

SIGNAL_DEADLINE_S = 1.5
"""The most a SIGTERM's flush and report may take before the process ends as it would have
(the promise is to end within 2 s)."""

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def init(rt: Runtime) -> None:
    """The runtime's job attributes, before ``configure()`` fills them (setup.run_files, black_box)."""
    rt.job_id = rt.settings.run_id
    rt.attempt = 0
    rt.run_root = None  # the run id's directory, holding every attempt
    rt.state_path = None
    rt.rank_state = None  # torchtrace.job.state.RankState
    rt.job_metrics = None  # torchtrace.job.metrics.JobMetrics
    rt.signals = None  # torchtrace.job.signals.SignalGuard
    rt.job_goodput_cache = None  # (monotonic time, the job's goodput) of the last scrape
    rt.checkpoints_booked_by_framework = False  # see framework_books_checkpoints
    rt.exit_in_step = None  # see exit_in_step


def watch(rt: Runtime) -> None:
    """Signals, the exception hook, checkpoint timing and the job metrics, for this runtime."""
    rt.job_metrics = JobMetrics(rt.settings.run_id, rt.identity.rank, rt.attempt, lambda: job_goodput(rt))
    try:
        rt.metrics.registry.register(rt.job_metrics)
    except Exception as exc:
        rt.errors.report("metrics", exc)
    rt.report_sections["job"] = lambda: job_section(rt)
    checkpoints.install(lambda kind, start, end, call: on_checkpoint(rt, kind, start, end, call.upload, call.part))
    rt.signals = SignalGuard(lambda signum, terminal: on_signal(rt, signum, terminal))
    rt.signals.install()
    sys.excepthook = _ExceptHook(rt, sys.excepthook)
    if rt.attempt > 0 and rt.run_root is not None:
        tell_previous(rt)


def tell_previous(rt: Runtime) -> None:
    """The next attempt tells how the one before ended: logged, and an event in the report."""
    root = rt.run_root
    if root is None:
        return
    attempts = [a for a in job_story(root)["attempts"] if a["attempt"] < rt.attempt]
    if not attempts:
        return
    last = attempts[-1]
    cause = last.get("cause") or {}
    text = f"attempt {last['attempt']} of job {rt.job_id} ended {last['ended']} at step {last['last_step']}"
    if (last.get("world_size") or 1) > 1 and cause:
        text += f" (rank {cause.get('rank')} first)"
    if last.get("detail"):
        text += f": {last['detail']}"
    abnormal = last["ended"] in ("killed", "exception", "hang", "unknown")
    (logger.warning if abnormal else logger.info)("torchtrace: this is attempt %d; %s", rt.attempt, text)
    rt.history.add_event("previous_attempt", text, {k: last.get(k) for k in ("attempt", "ended", "detail",
                                                                             "last_step", "end")})


def note_step(rt: Runtime, record: "StepRecord") -> None:
    """A finished training step into the black box (plain stores; no I/O)."""
    box = rt.rank_state
    if box is None or record.kind != "train":
        return
    f = box.fields
    end = record.end_unix_ns / 1e9 if record.end_unix_ns else time.time()
    _note_reached(f, record, end)
    if record.exception_type is None:
        f["finished_time"] = end  # (a step that raised did not finish: see ending.hung_to_the_end)
    memory = record.memory
    if memory:
        if memory.get("rss_bytes") is not None:
            f["rss_bytes"] = memory["rss_bytes"]
        if memory.get("cuda_allocated_bytes") is not None:
            f["cuda_allocated_bytes"] = memory["cuda_allocated_bytes"]
    if record.anomalies:
        f["last_anomaly"] = {"step": record.step, "kinds": [a.kind for a in record.anomalies]}
        if record.exception_type is None:  # (a step that raised did not come out of its hang)
            _note_recovered_hang(f, record, end)


def _note_reached(f: dict[str, Any], record: "StepRecord", end: float) -> None:
    """The box's last step (a failed one too), and the steps' usual time."""
    n = f.get("steps_finished", 0)
    if n == 0:
        f["first_step"] = record.step
        f["first_step_seconds"] = record.duration_s
        f["first_step_start"] = record.start_unix_ns / 1e9
    else:
        # The mean of the steps after the first: the usual step time (compile shows as the first's excess).
        mean = f.get("step_seconds") or 0.0
        f["step_seconds"] = mean + (record.duration_s - mean) / n
    f["steps_finished"] = n + 1
    f["step"] = record.step
    f["step_time"] = end
    f["loss"] = record.loss


def _note_recovered_hang(f: dict[str, Any], record: "StepRecord", end: float) -> None:
    """A hang the step came out of (``on_hang="record"``): goodput counted the step productive,
    stall included; the black box keeps the stall (from the last progress to the step's end, so
    the work after the stall ended counts with it) for the job's story to book as ``hang``."""
    hang = next((a for a in record.anomalies if a.kind == semconv.HANG), None)
    if hang is None or not record.progressed:
        return  # (a step that made no progress was not productive time to begin with)
    since = hang.data.get("since")
    if isinstance(since, (int, float)):
        stalled = min(max(0.0, end - since), record.duration_s or 0.0)
        f["hang_recovered_s"] = f.get("hang_recovered_s", 0.0) + stalled


def refresh(rt: Runtime, fields: dict[str, Any]) -> None:
    """The writer thread's update before each write: memory now, and the attempt's goodput."""
    rss = _rss_bytes()
    if rss is not None:
        fields["rss_bytes"] = rss
    g = rt.throughput.ledger.snapshot(time.perf_counter())
    fields["wall_s"] = g.wall_s
    fields["productive_s"] = g.productive_s
    fields["badput_s"] = dict(g.badput)


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm", "rb") as fh:
            return int(fh.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


def on_checkpoint(rt: Runtime, kind: str, start: float, end: float, upload: Future[Any] | None = None,
                  part: bool = False) -> None:
    """One outermost checkpoint save or load (perf_counter seconds): the histogram, badput
    ``checkpoint`` (inside a step too: taken out of the step's time) and the black box.

    Only a call on the thread that trains counts: one on another thread is part of a save in
    progress (a distributed checkpoint's writer threads, an asynchronous save's upload).
    ``upload``: an asynchronous save's upload (see :func:`checkpoint_saved`). ``part``: one
    part of a checkpoint counted whole later (:func:`checkpoint_counted`): its time is booked
    and added to the black box's, but it is no checkpoint of its own."""
    if not progress.on_training_thread():
        return
    seconds = end - start
    metrics = rt.job_metrics
    if metrics is not None and not part:
        metrics.observe_checkpoint(kind, seconds)
    booked = rt.checkpoints_booked_by_framework
    if rt.features.throughput and not rt.closed and not booked:
        scope = current.step()
        if scope is None:
            rt.throughput.book(start, end, "checkpoint", f"{kind}_checkpoint")
        elif scope.throughput is not None:  # taken out of the step's time as it is booked
            scope.throughput.checkpoint_s += seconds
    box = rt.rank_state
    if box is None:
        return
    f = box.fields
    totals = dict(f.get("checkpoint_seconds") or {})
    totals[kind] = totals.get(kind, 0.0) + seconds
    f["checkpoint_seconds"] = totals
    if kind == "save" and not part:
        checkpoint_saved(rt, f.get("step"), upload)


def checkpoint_counted(rt: Runtime, kind: str, seconds: float) -> None:
    """A checkpoint whose parts were timed one by one (``TimedCall.part``: a Trainer's resume)
    is complete: one save or load of ``seconds`` (the parts' time together) in the histogram,
    and a save is the black box's last checkpoint, holding the last step finished. The parts'
    time was booked as they ran (:func:`on_checkpoint`)."""
    if not progress.on_training_thread():
        return
    metrics = rt.job_metrics
    if metrics is not None:
        metrics.observe_checkpoint(kind, seconds)
    box = rt.rank_state
    if kind == "save" and box is not None:
        checkpoint_saved(rt, box.fields.get("step"))


def framework_books_checkpoints(rt: Runtime, flag: bool) -> None:
    """A framework integration books the time of its checkpoint saves in goodput itself (the
    Hugging Face Trainer's ``on_save``: the time since the step before). A timed save inside
    must then not book its own slice first: the time before that slice would be booked as
    data wait, and the framework's booking could no longer count it as checkpoint."""
    rt.checkpoints_booked_by_framework = flag


def checkpoint_saved(rt: Runtime, step: int | None, upload: Future[Any] | None = None) -> None:
    """A checkpoint saved now, holding ``step``: the black box's last checkpoint (for lost
    progress: the steps after it are the ones a restart repeats).

    ``upload``: the checkpoint was staged now and is stored on another thread: it becomes the
    last checkpoint, as of now, once that future completes without error, unless a later one
    was saved in the meantime."""
    box = rt.rank_state
    if box is None:
        return
    try:
        productive = rt.throughput.ledger.snapshot(time.perf_counter()).productive_s
    except Exception as exc:
        rt.errors.report("record", exc)
        return
    now = time.time()
    saved = {"checkpoint_step": step, "checkpoint_time": now, "checkpoint_productive_s": productive}
    if upload is None:
        box.fields.update(saved)
        return

    def uploaded(done: Future[Any]) -> None:
        try:
            stored = not done.cancelled() and done.exception() is None
            if stored and (box.fields.get("checkpoint_time") or 0.0) <= now:
                box.fields.update(saved)
        except Exception as exc:
            rt.errors.report("record", exc)

    upload.add_done_callback(uploaded)


def on_signal(rt: Runtime, signum: int, terminal: bool) -> None:
    """SIGTERM/SIGINT: record ``preempted``, then flush finished spans and write the report (and,
    when the process ends by this signal, close) within :data:`SIGNAL_DEADLINE_S`.

    The work runs on a helper thread that the main thread waits for: the signal interrupted
    the main thread somewhere, perhaps holding a lock the flush needs; the wait's deadline
    keeps the process ending on time whatever happens.
    """
    import signal

    box = rt.rank_state
    # This signal may end the process now (torchrun's SIGTERM after a peer died, perhaps in the
    # middle of shutdown): the write here may be the black box's last.
    found = last_look(rt)
    if box is not None and box.fields.get("ended") is None:
        box.fields.update(ended="preempted", end_detail=signal.Signals(signum).name, end_time=time.time())
        box.write(refresh=False)
    elif box is not None and found:
        box.write(refresh=False)
    if rt.closed or (rt.signals is not None and rt.signals.holding):
        return  # a shutdown under way: the signal takes effect once it has ended (SignalGuard.hold)

    def work() -> None:
        try:
            if terminal:
                rt.close()
            else:
                rt.flush(SIGNAL_DEADLINE_S * 0.6)
                rt.write_report()
        except Exception as exc:
            logger.debug("torchtrace: flush on signal %s failed: %s", signum, exc)

    helper = start_thread(work, "torchtrace-preempted")
    helper.join(SIGNAL_DEADLINE_S)
    if helper.is_alive():
        logger.warning("torchtrace: flushing on %s took over %.1f s; handing the signal on without waiting for it",
                       signal.Signals(signum).name, SIGNAL_DEADLINE_S)


def last_look(rt: Runtime) -> list[int]:
    """The ranks newly found gone by one last look at the peers and at this rank's last
    collective, taken by every path that ends this process (an exception, a signal, shutdown)
    before its final black-box write, which the caller makes: a rank whose collective failed
    for a SIGKILLed peer may be ended by the launcher before its watchdog's next tick, and must
    still name that peer in ``peers_gone``; a collective the last tick saw in flight may have
    completed since, and the box must not say the rank ended inside it.

    Bounded: one read of the run directory's black boxes and of ``/proc`` for each peer on
    this host (:meth:`torchtrace.job.watchdog.Watchdog.check_peers`), one dump of the flight
    recorder (:meth:`~torchtrace.job.watchdog.Watchdog.read_collectives`), no waiting on
    another thread (it runs in a signal handler too). Nothing without a watchdog (no run
    directory); errors are swallowed.
    """
    dog = rt.watchdog
    box = rt.rank_state
    if dog is None or box is None:
        return []
    dog.read_collectives()
    try:
        known = list(box.fields.get("peers_gone") or [])
        dog.check_peers(persist=False)
        return [r for r in box.fields.get("peers_gone") or [] if r not in known]
    except Exception as exc:
        logger.debug("torchtrace: last look at the peers failed: %r", exc)
        return []


class _ExceptHook:
    """``sys.excepthook`` while configured: an exception that ends the main thread is written to
    the black box (type, and its message with ``record_exception_messages``), then the hook
    that was there before runs."""

    def __init__(self, rt: Runtime,
                 previous: Callable[[type[BaseException], BaseException, TracebackType | None], object]) -> None:
        self.rt = rt
        self.previous = previous

    def __call__(self, exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        try:
            record_exception(self.rt, exc)
        except Exception:
            pass
        self.previous(exc_type, exc, tb)


def record_exception(rt: Runtime, exc: BaseException, step: int | None = None) -> None:
    """An exception that ends the process, into the black box: ``exception``, its type (and its
    message with ``record_exception_messages``; a ``sys.exit`` status always) and the step it
    ended (``step``, else the step running, else the last finished), unless the process already
    said how it ended."""
    box = rt.rank_state
    if box is None or box.fields.get("ended") is not None:
        return
    detail = type(exc).__name__
    if isinstance(exc, SystemExit) and isinstance(exc.code, int):
        detail = f"{detail}: {exc.code}"  # (a status, not a message)
    elif rt.settings.record_exception_messages:
        detail = f"{detail}: {str(exc)[:500]}"
    detail += ending.oom_note(box.fields)
    if step is None:
        running = current.step()
        step = running.step if running is not None else box.fields.get("step")
    last_look(rt)
    box.fields.update(ended="exception", end_detail=detail, end_time=time.time(), end_step=step)
    box.write()


def exit_in_step(rt: Runtime, exc: SystemExit, step: int) -> None:
    """``sys.exit`` with a failure status left step ``step`` (the engines of DeiT, MAE and DETR
    exit so on a loss that is not finite). No exception hook sees a ``SystemExit``, and the exit
    hook no status: kept here, it is the process's end at shutdown (:func:`close`), unless a step
    finished after it (the script caught the exit and trained on). A ``sys.exit`` outside every
    step is not seen: that process reads as completed."""
    rt.exit_in_step = (exc, step)


def preempted_since(rt: Runtime, since: float) -> bool:
    """A SIGTERM or SIGINT reached the process at ``since`` (a ``time.time()``) or later: the
    black box says ``preempted`` from then (:func:`on_signal`)."""
    box = rt.rank_state
    if box is None or box.fields.get("ended") != "preempted":
        return False
    at = box.fields.get("end_time")
    return isinstance(at, (int, float)) and at >= since


def close(rt: Runtime, ended_at: float) -> None:
    """At shutdown, once the run's ledger closed: ``completed`` at ``ended_at`` (shutdown's
    start, unix time) unless the process already said how it ended, the hooks taken off, the
    black box written (the report's job section reads it)."""
    try:
        _close(rt, ended_at)
    except Exception as exc:
        rt.errors.report("files", exc)


def _close(rt: Runtime, ended_at: float) -> None:
    box = rt.rank_state
    if box is not None:
        exit_in_step = rt.exit_in_step
        if exit_in_step is not None and exit_in_step[1] >= (box.fields.get("step") or 0):
            record_exception(rt, *exit_in_step)  # (no step finished after it: the process's end)
        if box.fields.get("ended") is None:
            box.fields.update(ended="completed", end_time=ended_at)
        box.stop()
        # After the writer thread stopped: no earlier copy of the fields can land after this write.
        last_look(rt)
        box.write()
    checkpoints.uninstall()
    hook = sys.excepthook
    if isinstance(hook, _ExceptHook) and hook.rt is rt:
        sys.excepthook = hook.previous


def write_now(rt: Runtime) -> None:
    """Rewrite the black box now (``tt.flush()``), not at the writer's next turn."""
    box = rt.rank_state
    if box is not None:
        box.write()


def release(rt: Runtime) -> None:
    """At the end of shutdown: the black box's file claim, after the last write (``close``
    wrote it; no second write here: this runs after the exporters, at the end of shutdown's
    deadline), then the signal handlers given back. A signal held while shutting down
    (:meth:`~torchtrace.job.signals.SignalGuard.hold`) takes effect then."""
    box = rt.rank_state
    try:
        if box is not None and box.path is not None:
            files.release_file(box.path)
    finally:
        if rt.signals is not None:
            rt.signals.restore()


def job_section(rt: Runtime) -> dict[str, Any]:
    """The report's ``job`` section: the story of every attempt found beside this one."""
    box = rt.rank_state
    if rt.run_root is not None:
        story = job_story(rt.run_root)
    else:
        story = story_of([dict(box.fields)] if box is not None else [])
    story["attempt"] = rt.attempt
    story["job_id"] = rt.job_id
    return story


GOODPUT_CACHE_S = 10.0
"""``/metrics`` reads the black boxes for the job's goodput at most this often."""


def job_goodput(rt: Runtime) -> float | None:
    """The job's goodput for ``/metrics``, read from the black boxes at most every
    :data:`GOODPUT_CACHE_S` seconds (the scrape thread's call)."""
    now = time.monotonic()
    cached = rt.job_goodput_cache
    if cached is not None and now - cached[0] < GOODPUT_CACHE_S:
        return cached[1]
    value = job_section(rt).get("goodput")
    rt.job_goodput_cache = (now, value)
    return value
