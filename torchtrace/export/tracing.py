"""Spans: a private TracerProvider, a bounded batch processor, and the exporters.

The processor follows four rules: a bounded queue that drops and counts when full (never
blocks the training thread); one daemon worker thread, started lazily; rebuilt state in a
forked child, which exports nothing it inherited; and shutdown that respects a deadline
whatever the exporter does.

The spans.jsonl line format and its exporter are in :mod:`torchtrace.export.span_file`,
re-exported here.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import weakref
from typing import Any, Callable

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from torchtrace.errors import get_logger
from torchtrace.export import sdk_log
from torchtrace.export.http_session import HttpSpanExporter
from torchtrace.export.otlp_spans import otlp_span_exporter
from torchtrace.export.span_file import JsonLinesSpanExporter, span_line, span_to_dict
from torchtrace.export.span_ids import own_ids
from torchtrace.export.spans import StepSpan, readable
from torchtrace.job.signals import start_thread

__all__ = ["BoundedBatchSpanProcessor", "DropCallback", "JsonLinesSpanExporter", "otlp_span_exporter", "span_line",
           "span_to_dict", "tracer_provider"]

logger = get_logger(__name__)

DropCallback = Callable[[str, int], None]


class BoundedBatchSpanProcessor(SpanProcessor):
    """Batches finished spans to one exporter from a background thread, and accounts for each.

    Every span handed to :meth:`on_end` is, at any moment, in exactly one of: exported
    (the exporter acknowledged it), dropped (by reason), queued, or in flight (inside an
    export call): ``emitted == exported + sum(dropped.values()) + queued + in_flight``.
    :meth:`accounting` returns the five numbers as one consistent snapshot. After
    :meth:`shutdown` nothing is queued or in flight: a call still unanswered at the deadline
    is cancelled (or abandoned) and its spans are counted dropped, and a late answer changes
    nothing.

    Args:
        exporter: where batches go.
        max_queue: spans held at most; more are dropped and reported as ``queue_full``.
        on_drop: ``on_drop(reason, count)`` for every lost span (queue_full, export_failed,
            shutdown).
        schedule_delay_s: the longest a span waits before its batch is sent.
        max_batch: spans per export call.

    >>> from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    >>> proc = BoundedBatchSpanProcessor(InMemorySpanExporter())
    >>> proc.accounting()["emitted"], proc.accounting()["queued"]
    (0, 0)
    """

    def __init__(self, exporter: SpanExporter, max_queue: int = 4096, on_drop: DropCallback | None = None,
                 schedule_delay_s: float = 1.0, max_batch: int = 512) -> None:
        self.exporter = exporter
        self.max_queue = max_queue
        self.max_batch = max_batch
        self.schedule_delay_s = schedule_delay_s
        self._on_drop = on_drop or (lambda reason, n: None)
        self.on_error: Callable[[BaseException], None] | None = None
        self.emitted = 0
        self.exported = 0
        self.dropped: collections.Counter[str] = collections.Counter()
        self.answered_after_abandon = 0  # spans of abandoned calls that the exporter later acknowledged
        # Drops the callback has not taken yet (it raised), and the failure kinds already logged.
        self._undelivered: collections.Counter[str] = collections.Counter()
        self._callback_failures: set[str] = set()
        self._sdk_warned = False  # the SDK exporter's first failure was turned into a torchtrace warning
        sdk_log.install()
        self._init_state()
        self._pid = os.getpid()
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: (p := ref()) and p._after_fork())  # type: ignore[func-returns-value]

    def _init_state(self) -> None:
        self._queue: collections.deque[ReadableSpan | StepSpan] = collections.deque()
        self._cond = threading.Condition(threading.Lock())
        self._worker: threading.Thread | None = None
        self._shutdown = False
        self._flush_requests = 0
        self._in_flight = 0
        self._abandoned = False  # the in-flight call was given up at shutdown and counted dropped
        self._exiting = False
        self._failing = False  # the last export failed: a flush at shutdown would only wait
        self._export_started: float | None = None
        self._last_answer_s = 0.0  # how long the last successful export took

    def _after_fork(self) -> None:
        # A forked child (a DataLoader worker) must not export its parent's spans, nor any
        # of its own: the parent owns the run's telemetry.
        self._init_state()
        self._shutdown = True
        self._pid = os.getpid()

    @property
    def exporter_kind(self) -> str:
        """``file``, ``otlp_grpc``, ``otlp_http`` or the exporter's class name."""
        if isinstance(self.exporter, JsonLinesSpanExporter):
            return "file"
        module = type(self.exporter).__module__
        if module.startswith("opentelemetry.exporter.otlp") or isinstance(self.exporter, HttpSpanExporter):
            return "otlp_grpc" if ".grpc" in module else "otlp_http"
        return type(self.exporter).__name__

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def accounting(self) -> dict[str, Any]:
        """One consistent snapshot: emitted, exported, dropped by reason, queued, in flight.

        ``emitted == exported + sum(dropped.values()) + queued + in_flight`` always holds.
        """
        with self._cond:
            return {"exporter": self.exporter_kind, "emitted": self.emitted, "exported": self.exported,
                    "dropped": {k: v for k, v in self.dropped.items() if v}, "queued": len(self._queue),
                    "in_flight": self._in_flight}

    def _notify_drop(self, reason: str, count: int) -> None:
        """Tell the drop callback (the metric); called without the lock held.

        A callback that raises is torchtrace's own failure: it goes to :attr:`on_error` (the
        internal-error counter, logged once per kind), or is logged as a warning once per
        exception type without one. The drops it missed are kept and handed to it with the
        next drop it takes, so ``torchtrace_spans_dropped_total`` catches up when it recovers.
        """
        if count <= 0 and not self._undelivered:
            return
        with self._cond:
            self._undelivered[reason] += max(0, count)
            pending = {k: v for k, v in self._undelivered.items() if v > 0}
            self._undelivered.clear()
        delivered: collections.Counter[str] = collections.Counter()
        try:
            for name, n in pending.items():
                self._on_drop(name, n)
                delivered[name] = n
        except Exception as exc:  # the drop counter must never raise into on_end
            with self._cond:
                for name, n in pending.items():
                    self._undelivered[name] += n - delivered[name]
            self._report_callback_failure(exc)

    def _report_callback_failure(self, exc: Exception) -> None:
        if self.on_error is not None:
            try:
                self.on_error(exc)
                return
            except Exception:
                pass
        kind = type(exc).__name__
        if kind not in self._callback_failures:
            self._callback_failures.add(kind)
            logger.warning("torchtrace: counting dropped spans failed (%s); the drops are kept in the report's "
                           "span_exporters and retried on the counter", kind, exc_info=exc)

    # ------------------------------------------------------------ SpanProcessor
    def on_start(self, span, parent_context=None) -> None:  # noqa: D401 - SDK signature
        return None

    def on_end(self, span: ReadableSpan | StepSpan) -> None:
        reason = None
        inline = False
        with self._cond:
            self.emitted += 1
            if self._shutdown:
                reason = "shutdown"
            elif self._worker is None and self._exiting:  # at interpreter exit no thread is started
                if isinstance(self.exporter, JsonLinesSpanExporter):
                    inline = True
                    self._in_flight += 1
                else:
                    reason = "shutdown"
            elif len(self._queue) >= self.max_queue:
                reason = "queue_full"
            else:
                self._queue.append(span)
                if self._worker is None:
                    self._start_worker()
                if len(self._queue) >= self.max_batch:
                    self._cond.notify()
            if reason is not None:
                self.dropped[reason] += 1
        if reason is not None:
            self._notify_drop(reason, 1)
        elif inline:
            self._export([span])

    def _start_worker(self) -> None:
        self._worker = start_thread(self._run, "torchtrace-span-export")

    def _run(self) -> None:
        sdk_log.route_thread(self._sdk_record)
        try:
            self._loop()
        finally:
            sdk_log.unroute_thread()

    def _sdk_record(self, record: logging.LogRecord) -> None:
        """A log record of the SDK's exporter, written on this processor's thread: the first
        warning becomes one torchtrace warning, everything else a DEBUG line."""
        if record.levelno >= logging.WARNING and not self._sdk_warned:
            self._sdk_warned = True
            logger.warning("torchtrace: span export to the OTLP collector is failing (%s); lost spans are counted "
                           "in torchtrace_spans_dropped_total and the report, and the exporter's messages go to "
                           "torchtrace's log at DEBUG", self.exporter_kind)
        logger.debug("OpenTelemetry %s exporter: %s", self.exporter_kind, record.getMessage())

    def _loop(self) -> None:
        while True:
            with self._cond:
                if not self._queue and not self._shutdown and not self._flush_requests:
                    self._cond.wait(self.schedule_delay_s)
                if self._shutdown and not self._queue:
                    return
                batch = [self._queue.popleft() for _ in range(min(self.max_batch, len(self._queue)))]
                self._in_flight += len(batch)
                if not self._queue:
                    self._flush_requests = 0
                    self._cond.notify_all()
            if batch:
                self._export(batch)

    def _export(self, batch: list[ReadableSpan | StepSpan]) -> None:
        """Export one batch (already counted in flight) and move it to exported or dropped."""
        self._export_started = time.monotonic()
        try:
            if not isinstance(self.exporter, JsonLinesSpanExporter):
                # Step spans become the SDK's ReadableSpan here, on the exporter thread
                # (spans.jsonl is written from them directly).
                batch = [readable(s) for s in batch]
            # (spans.jsonl's exporter takes step spans as they are: they read like a ReadableSpan)
            if self.exporter.export(batch) == SpanExportResult.SUCCESS:  # type: ignore[arg-type]
                written = len(batch)
            else:  # a file exporter says how many of a failed batch did reach the file
                written = min(len(batch), max(0, int(getattr(self.exporter, "last_written", 0))))
        except Exception as exc:  # an exporter bug must not kill the worker
            (logger.debug if self.on_error else logger.warning)(
                "span exporter %s raised %s; %d span(s) lost", type(self.exporter).__name__,
                type(exc).__name__, len(batch))
            written = 0
            if self.on_error is not None:
                try:
                    self.on_error(exc)
                except Exception:
                    pass
        if written == len(batch):
            self._last_answer_s = time.monotonic() - self._export_started
        self._export_started = None
        lost = len(batch) - written
        with self._cond:
            if self._abandoned:
                # Counted dropped (shutdown) when it was given up; a late answer changes nothing.
                self._abandoned = False
                self.answered_after_abandon += written
                lost = 0
            else:
                self._in_flight -= len(batch)
                self.exported += written
                self.dropped["export_failed"] += lost
                self._failing = lost > 0
            self._cond.notify_all()
        self._notify_drop("export_failed", lost)

    def collector_unhealthy(self, stuck_after_s: float = 0.5) -> bool:
        """The last export failed, or the current one has hung for ``stuck_after_s`` and for
        twice as long as the last successful one took (a collector slow to answer is not stuck)."""
        started = self._export_started
        patience = max(stuck_after_s, 2 * self._last_answer_s)
        return self._failing or (started is not None and time.monotonic() - started > patience)

    def prepare_exit(self) -> None:
        """Interpreter exit: from now on no thread is started; a processor without a worker
        writes local (file) exports inline and drops network ones as ``shutdown``."""
        self._exiting = True

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Export what is queued now; True only when every export it waited for succeeded (with
        nothing to wait for: when the last export did)."""
        deadline = time.monotonic() + timeout_millis / 1000.0
        with self._cond:
            failed_before = self.dropped["export_failed"]
            if self._worker is None or self._shutdown or not (self._queue or self._in_flight):
                return not self._queue and not self._failing
            self._flush_requests += 1
            self._cond.notify_all()
            while self._queue or self._in_flight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return self.dropped["export_failed"] == failed_before

    def shutdown(self, timeout_s: float = 3.0) -> None:
        """Flush what fits in ``timeout_s``, count the rest as dropped, stop the exporter.

        On return nothing is queued or in flight: a call the exporter's shutdown did not end
        in time is abandoned (its daemon thread may linger) and its spans counted ``shutdown``.
        """
        if self._shutdown:
            return
        deadline = time.monotonic() + timeout_s
        self._flush_until(deadline, timeout_s)
        with self._cond:
            self._shutdown = True
            left = len(self._queue)
            self._queue.clear()
            self.dropped["shutdown"] += left
            self._cond.notify_all()
        self._notify_drop("shutdown", left)
        worker = self._worker
        if worker is not None:
            # An idle worker exits at once; a healthy call in flight may finish, keeping time
            # to cancel it if it does not; a stuck one is cancelled now.
            reserve = min(0.25, timeout_s * 0.25)
            join_s = deadline - time.monotonic() - reserve
            if self.collector_unhealthy(stuck_after_s=0.3):
                join_s = min(join_s, 0.05)
            worker.join(max(0.0, join_s))
        if self._exiting:
            # No new thread at exit: stop the exporter inline. The SDK's exporters only set a
            # flag and close their channel or session here, which also cancels a stuck call.
            self._stop_exporter()
        else:
            stopper = start_thread(self._stop_exporter, "torchtrace-exporter-stop")
            stopper.join(max(0.05, deadline - time.monotonic()))
        if worker is not None and worker.is_alive():
            # A cancelled call returns within milliseconds: let it be counted as what it was.
            worker.join(max(0.0, deadline - time.monotonic()))
        self._abandon_in_flight()

    def _flush_until(self, deadline: float, timeout_s: float) -> None:
        """Flush in short slices; give up early once the collector looks dead or stuck."""
        flush_s = min(0.05, timeout_s * 0.7) if self.collector_unhealthy() else timeout_s * 0.7
        flush_deadline = min(deadline, time.monotonic() + max(0.0, flush_s))
        while True:
            left = flush_deadline - time.monotonic()
            if self.force_flush(int(max(0.0, min(0.05, left)) * 1000)) or left <= 0:
                return
            if self.collector_unhealthy(stuck_after_s=0.3):
                return

    def _abandon_in_flight(self) -> None:
        with self._cond:
            n = self._in_flight
            if n:
                self._in_flight = 0
                self._abandoned = True
                self.dropped["shutdown"] += n
        if n:
            logger.debug("span export still in flight at the shutdown deadline: %d span(s) counted dropped", n)
            self._notify_drop("shutdown", n)

    def _stop_exporter(self) -> None:
        sdk_log.route_thread(self._sdk_record)
        try:
            self.exporter.shutdown()
        except Exception:
            logger.debug("exporter shutdown failed", exc_info=True)
        finally:
            sdk_log.unroute_thread()


def tracer_provider(resource: Resource) -> TracerProvider:
    """A private provider: torchtrace never replaces the application's global one.

    Attribute values (user-given ones included) are cut to ``MAX_ATTRIBUTE_LENGTH`` characters.
    Ids come from :func:`~torchtrace.export.span_ids.own_ids`.
    """
    from opentelemetry.sdk.trace import SpanLimits

    from torchtrace import semconv

    limits = SpanLimits(max_attribute_length=semconv.MAX_ATTRIBUTE_LENGTH,
                        max_span_attribute_length=semconv.MAX_ATTRIBUTE_LENGTH)
    return TracerProvider(resource=resource, shutdown_on_exit=False, span_limits=limits, id_generator=own_ids())
