"""A root step span draws its ids when they are first read, not at step entry: each step still
has ids of its own, the same for every reader (a child span, the record, spans.jsonl, threads
reading at once), and a span around the step still makes it a child."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import DEFAULT_ON

import torchtrace as tt
from tests.helpers import read_spans
from torchtrace import api
from torchtrace.export import spans


def _ids(span: dict) -> tuple[str, str]:
    return span["trace_id"], span["span_id"]


def test_each_steps_ids_are_one_for_its_child_its_record_and_its_line(tt_runtime):
    user_tracer = TracerProvider().get_tracer("user")
    records, children = [], []
    for i in range(3):
        with tt.debug_context("train_step") as step:
            if i != 1:  # the middle step's ids are first read at its end
                child = user_tracer.start_span("inner")
                child.end()
                children.append(child)
        records.append(step.record)
    lines = [s for s in read_spans(tt_runtime.spans_path) if s["name"] == "train_step"]
    assert [_ids(s) for s in lines] == [(r.trace_id, r.span_id) for r in records]
    assert len({s["span_id"] for s in lines}) == 3 and len({s["trace_id"] for s in lines}) == 3
    for line, child in zip([lines[0], lines[2]], children):
        parent = child.parent
        assert (format(parent.trace_id, "032x"), format(parent.span_id, "016x")) == _ids(line)
        assert child.get_span_context().trace_id == parent.trace_id
        assert line["parent_span_id"] is None


class _SlowIds(RandomIdGenerator):
    """Draws ids as the SDK's generator does, letting other threads run in between: a reader
    that drew them on its own would draw other ids than a reader running meanwhile."""

    def generate_span_id(self) -> int:
        time.sleep(1e-4)
        return super().generate_span_id()


def test_threads_reading_a_new_spans_ids_at_once_read_the_same():
    provider = TracerProvider(id_generator=_SlowIds())
    for _ in range(50):
        span = spans.open_span(provider, "train_step", {}, 1, lambda s: None, 0, otel_context.Context())
        start = threading.Barrier(4)
        read: list[trace.SpanContext] = []

        def reader(span: spans.StepSpan = span, start: threading.Barrier = start) -> None:
            start.wait()
            read.append(span.get_span_context())

        threads = [threading.Thread(target=reader) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len({(c.trace_id, c.span_id) for c in read}) == 1
        assert all(c is read[0] for c in read) and read[0].is_valid and read[0].trace_flags.sampled


def test_a_forced_trace_id_is_the_root_spans_trace():
    span = spans.open_span(TracerProvider(), "train_step", {}, 1, lambda s: None, 0xABC, otel_context.Context())
    assert span.get_span_context().trace_id == 0xABC


def test_a_span_around_the_step_makes_it_a_child_decided_at_entry(tt_runtime):
    outer = TracerProvider().get_tracer("user").start_span("epoch")
    with trace.use_span(outer, end_on_exit=True):
        with tt.debug_context("train_step") as step:
            pass
    line = read_spans(tt_runtime.spans_path)[-1]
    assert line["parent_span_id"] == format(outer.get_span_context().span_id, "016x")
    assert line["trace_id"] == step.record.trace_id == format(outer.get_span_context().trace_id, "032x")


def test_an_unsampled_parent_leaves_the_step_unrecorded(tt_runtime):
    parent = trace.NonRecordingSpan(trace.SpanContext(5, 6, is_remote=True, trace_flags=trace.TraceFlags(0)))
    assert api.get_runtime().tracer_provider.sampler is DEFAULT_ON
    with trace.use_span(parent):
        with tt.debug_context("train_step") as step:
            assert not step.span.is_recording()
    assert step.record.span_id is None
    tt.flush()
    assert not Path(tt_runtime.spans_path).exists()  # no span was sampled, so none was written


class _ReadingIds(RandomIdGenerator):
    """Reads the span's ids while drawing them, as a signal handler that runs on the drawing
    thread between two of its bytecodes would."""

    span: spans.StepSpan | None = None
    seen: trace.SpanContext | None = None

    def generate_span_id(self) -> int:
        span, self.span = self.span, None  # (once: the read inside draws ids too)
        if span is not None:
            self.seen = span.get_span_context()
        return super().generate_span_id()


def test_a_read_on_the_thread_drawing_the_ids_neither_waits_nor_reads_other_ids():
    ids = _ReadingIds()
    span = spans.open_span(TracerProvider(id_generator=ids), "train_step", {}, 1, lambda s: None, 0,
                           otel_context.Context())
    ids.span = span
    read: list[trace.SpanContext] = []
    reader = threading.Thread(target=lambda: read.append(span.get_span_context()), daemon=True)
    reader.start()
    reader.join(5)
    assert not reader.is_alive(), "the read waited for the drawing thread's own lock"
    assert read[0] is ids.seen is span.get_span_context()


def test_a_child_forked_while_another_thread_draws_ids_draws_its_own():
    """A fork while another thread holds the lock the ids are drawn under: the child, where
    that thread does not exist, still draws its spans' ids (a Pool forked from a thread)."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with spans._FIRST_READ:
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert held.wait(5)
    pid = os.fork()
    if pid == 0:  # the child: draw, then leave at once
        span = spans.open_span(TracerProvider(), "train_step", {}, 1, lambda s: None, 0, otel_context.Context())
        os._exit(0 if span.get_span_context().is_valid else 1)
    release.set()
    holder.join()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    raise AssertionError("the forked child waited for its parent's lock")


def test_steps_leave_pythons_global_random_where_it_was(tmp_path):
    """A span's ids are drawn from a generator of torchtrace's own: a loop that shuffles its data
    with ``random`` sees the same order with torchtrace as without it (the SDK's default draws
    from the global ``random``: 192 bits a step)."""
    import random

    import torch

    random.seed(0)
    expected = [random.random() for _ in range(3)]
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), register_atexit=False, strict=True)
    try:
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        @tt.debug_operation(name="decorated_step", model=model, optimizer=opt)
        def step(x):
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            return loss

        random.seed(0)
        for _ in range(3):
            with tt.debug_context("train_step", model=model) as scope:
                scope.record_loss(model(torch.ones(2, 3)).sum())
            assert scope.record.span_id  # (its ids drawn)
            step(torch.ones(2, 3))
    finally:
        tt.shutdown()
    assert [random.random() for _ in range(3)] == expected


def test_a_forked_child_draws_ids_other_than_its_parents():
    """The generator is re-seeded in a forked child (a DataLoader worker's spans), as Python's
    own ``random`` is: parent and child do not draw the same ids."""
    from opentelemetry.sdk.resources import Resource

    from torchtrace.export.tracing import tracer_provider

    ids = tracer_provider(Resource.create({})).id_generator
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(write, ids.generate_span_id().to_bytes(8, "big"))
        os._exit(0)
    os.close(write)
    child = int.from_bytes(os.read(read, 8), "big")
    os.close(read)
    os.waitpid(pid, 0)
    assert child != ids.generate_span_id()
