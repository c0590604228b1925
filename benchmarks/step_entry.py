"""Step entry: the time from entering a step to the user's first operation, against the bare
step and a hand-written OpenTelemetry span, in one process, one run.

Issue 52 asks for at most 20 µs of step entry. A dispatch mode timestamps the first aten
operation on a marker tensor, the first line of the step's body; the clock starts just before
the step is entered. Variants, interleaved in rounds (a fresh order each round):

  bare        ``contextlib.nullcontext()``: the timer's own cost, subtracted from the others
  otel        ``tracer.start_as_current_span("train_step")`` of the OpenTelemetry SDK, with a
              batch span processor (the leanest hand-written peer of ``benchmarks/peers.py``)
  context     ``torchtrace.debug_context("train_step", model=..., optimizer=...)`` at BASIC
  operation   the same step as a function decorated with ``torchtrace.debug_operation``

Each round gives each variant's median entry over its steps; the table gives the median over
rounds of (variant - bare) and (variant - otel), paired within rounds, with a 95 % bootstrap
interval.

    python benchmarks/step_entry.py --seconds 30               # the unit test's one-layer step
    python benchmarks/step_entry.py --seconds 30 --layers 17   # a step that touches more memory
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from overhead import median_interval  # noqa: E402
from peers import DroppingExporter  # noqa: E402

import torchtrace as tt  # noqa: E402

VARIANTS = ("bare", "otel", "context", "operation")


class FirstOp(TorchDispatchMode):
    """The ``perf_counter`` time of the first aten operation on ``marker`` since the mode was entered."""

    def __init__(self, marker: torch.Tensor) -> None:
        super().__init__()
        self.marker = marker
        self.at: float | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.at is None and args and args[0] is self.marker:
            self.at = time.perf_counter()
        return func(*args, **(kwargs or {}))


class Toy:
    """A model of ``layers`` linear layers (the last 16-to-4, the others 16-to-16 with a ReLU after
    each), its optimizer, a batch, and the marker the step's body touches first. One layer is the
    step of ``tests/step/test_step_entry_time.py``; more layers touch more memory in a step, so the
    next step's entry finds less of what it reads in the CPU's caches."""

    def __init__(self, layers: int = 1) -> None:
        torch.manual_seed(0)
        hidden = [m for _ in range(layers - 1) for m in (torch.nn.Linear(16, 16), torch.nn.ReLU())]
        self.model = torch.nn.Sequential(*hidden, torch.nn.Linear(16, 4))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-4)
        self.x = torch.randn(8, 16)
        self.marker = torch.zeros(1)

    def body(self) -> torch.Tensor:
        self.marker.add_(1.0)
        self.optimizer.zero_grad()
        loss = self.model(self.x).pow(2).mean()  # a small, finite loss: no anomaly, no replay
        loss.backward()
        self.optimizer.step()
        return loss


def timed(toy: Toy, step: Callable[[], object]) -> Callable[[], float]:
    """A callable that runs ``step`` once (a step whose body is ``toy.body``) and returns the
    seconds from its call to the body's first operation."""
    def once() -> float:
        watch = FirstOp(toy.marker)
        with watch:
            t0 = time.perf_counter()
            step()
        assert watch.at is not None
        return watch.at - t0
    return once


def in_block(toy: Toy, enter: Callable[[], contextlib.AbstractContextManager]) -> Callable[[], None]:
    """A step that runs ``toy.body`` inside the context manager ``enter()`` returns."""
    def step() -> None:
        with enter():
            toy.body()
    return step


def entry_runner(variant: str, toy: Toy) -> Callable[[], float]:
    """A callable that runs one step of ``variant`` and returns its entry time in seconds."""
    if variant == "operation":
        return timed(toy, tt.debug_operation(name="train_step", model=toy.model, optimizer=toy.optimizer)(toy.body))
    if variant == "bare":
        return timed(toy, in_block(toy, contextlib.nullcontext))
    if variant == "otel":
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(DroppingExporter()))  # type: ignore[arg-type]
        tracer = provider.get_tracer("peer")
        return timed(toy, in_block(toy, lambda: tracer.start_as_current_span("train_step")))
    if variant == "context":
        return timed(toy, in_block(toy, lambda: tt.debug_context("train_step", model=toy.model,
                                                                 optimizer=toy.optimizer)))
    raise ValueError(f"variant {variant!r}: expected one of {', '.join(VARIANTS)}")


def run(seconds: float, steps: int, layers: int = 1) -> dict[str, list[float]]:
    """Each variant's median entry (s) per round, rounds interleaved until ``seconds`` have passed."""
    toy = Toy(layers)
    runners = {v: entry_runner(v, toy) for v in VARIANTS}
    for runner in runners.values():
        for _ in range(50):  # warm: first-step work (hooks, caches, FLOP counts) is not entry
            runner()
    medians: dict[str, list[float]] = {v: [] for v in VARIANTS}
    order = list(VARIANTS)
    shuffle = random.Random(1)
    start = time.perf_counter()
    while len(medians["bare"]) < 5 or time.perf_counter() - start < seconds:
        shuffle.shuffle(order)
        for v in order:
            medians[v].append(statistics.median(runners[v]() for _ in range(steps)))
    if not all(bool(torch.isfinite(p).all()) for p in toy.model.parameters()):
        raise SystemExit("the model diverged: the steps timed included forensic replays")
    return medians


def table(medians: dict[str, list[float]]) -> str:
    rounds = len(medians["bare"])
    lines = [f"{rounds} rounds; per variant: median entry, and paired medians over rounds (us, 95% interval)",
             f"{'variant':10} {'entry us':>9} {'+bare us':>9} {'interval':>20} {'-otel us':>9} {'interval':>20}"]
    for v in VARIANTS:
        row = [f"{v:10} {statistics.median(medians[v]) * 1e6:9.1f}"]
        for base in ("bare", "otel"):
            diffs = [(a - b) * 1e6 for a, b in zip(medians[v], medians[base])]
            lo, hi = median_interval(diffs)
            row.append(f"{statistics.median(diffs):+9.1f} {f'[{lo:+.1f}, {hi:+.1f}]':>20}")
        lines.append(" ".join(row))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=30.0, help="time to spend on rounds")
    p.add_argument("--steps", type=int, default=50, help="steps per variant per round")
    p.add_argument("--layers", type=int, default=1, help="linear layers in the model (1: the unit test's step)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    logging.getLogger("torchtrace").setLevel(logging.ERROR)  # an anomaly's warning is not what is timed
    with tempfile.TemporaryDirectory() as run_dir:
        tt.configure(service_name="step-entry", prometheus_port="off", run_dir=run_dir, register_atexit=False)
        try:
            medians = run(args.seconds, args.steps, args.layers)
        finally:
            tt.shutdown()
    print(f"# step entry: torch {torch.__version__}, python {platform.python_version()}, "
          f"{torch.get_num_threads()} torch thread(s), BASIC defaults, {args.layers} linear layer(s)")
    print(table(medians))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
