"""Would handing a step's bookkeeping to a background thread make the training thread faster?

torchtrace books each finished step (goodput, throughput windows, span attributes, metrics)
on the training thread. The obvious alternative is to append the step's raw values to a queue
and let a thread of torchtrace's book them. This script measures that alternative on the toy
model of ``overhead.py`` (a step of a few hundred microseconds, most of it Python and small
kernels), with the real goodput ledger's booking as the work, run ``--posts`` times a step to
stand for all of it:

    python benchmarks/offload.py
    python benchmarks/offload.py --posts 8 --rounds 300

Variants, interleaved round by round like ``overhead.py``'s:
  bare     the plain step
  inline   the step, then the booking on the training thread
  signal   the step, an append to a queue and an ``Event.set()``; a worker wakes and books
  poll     the step and an append; a worker that sleeps ``--poll-ms`` between looks books
Printed: each variant's median over rounds of its paired difference to bare, in µs a step.
The worker threads run all along (each variant's own), as a thread of torchtrace's would.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import overhead  # noqa: E402
from torchtrace.record.goodput import FinishedStep, GoodputLedger  # noqa: E402


class Booker:
    """The work: ``posts`` bookings of the step in a goodput ledger (data wait, totals, window, rules)."""

    def __init__(self, posts: int) -> None:
        self.ledger = GoodputLedger(configured_at=time.perf_counter())
        self.posts = posts

    def book(self, start: float, end: float) -> None:
        for _ in range(self.posts):  # (the step pipeline builds a FinishedStep per step too)
            self.ledger.add_step(FinishedStep(start, end, samples=4, flops=1000))


def runners(wl: overhead.Workload, posts: int, poll_s: float) -> tuple[dict, list]:
    """The variants' one-step callables (each with its ``booker``, but bare), and a stop
    function for each worker thread."""
    model, batch, step = wl.model, wl.batch, wl.step
    clock = time.perf_counter
    inline_booker = Booker(posts)

    def inline():
        start = clock()
        loss = step(model, batch)
        inline_booker.book(start, clock())
        return loss
    inline.booker = inline_booker

    def queued(wake: bool):
        booker, queue, event, stop = Booker(posts), collections.deque(), threading.Event(), threading.Event()

        def worker():
            while not stop.is_set():
                if wake:
                    event.wait()
                    event.clear()
                else:
                    time.sleep(poll_s)
                while queue:
                    booker.book(*queue.popleft())

        thread = threading.Thread(target=worker, daemon=True, name=f"offload-{'signal' if wake else 'poll'}")
        thread.start()

        def run():
            start = clock()
            loss = step(model, batch)
            queue.append((start, clock()))
            if wake:
                event.set()
            return loss

        run.booker = booker

        def halt():
            stop.set()
            event.set()
            thread.join()
        return run, halt

    signal, halt_signal = queued(True)
    poll, halt_poll = queued(False)
    return {"bare": lambda: step(model, batch), "inline": inline, "signal": signal, "poll": poll}, \
        [halt_signal, halt_poll]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--posts", type=int, default=4, help="ledger bookings a step (the work handed over)")
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--steps", type=int, default=10, help="steps per variant per round")
    p.add_argument("--poll-ms", type=float, default=1.0, help="the polling worker's sleep between looks")
    args = p.parse_args(argv)
    if args.posts < 1 or args.rounds < 1 or args.steps < 1 or not args.poll_ms > 0:
        p.error("--posts, --rounds and --steps are integers >= 1; --poll-ms is a positive number")
    wl_args = argparse.Namespace(quick=False, device="cpu", gpu_model=False, only_mlp=False, workloads=None)
    wl = next(w for w in overhead.workloads(wl_args, torch.device("cpu")) if w.name.startswith("toy"))
    variants, halts = runners(wl, args.posts, args.poll_ms / 1e3)
    alone = Booker(args.posts)
    t0 = time.perf_counter()
    for _ in range(2000):
        alone.book(t0, t0)
    work_us = (time.perf_counter() - t0) / 2000 * 1e6
    times: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for _ in range(args.rounds):
            for name, run in variants.items():
                run()  # untimed: the switch from the variant before
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    run()
                times[name].append((time.perf_counter() - t0) / args.steps)
    finally:
        for halt in halts:
            halt()
    print(f"# {wl.name}, torch {torch.__version__}, python {sys.version.split()[0]}, {args.rounds} rounds x "
          f"{args.steps} steps; the work alone: {work_us:.1f} us a step ({args.posts} ledger bookings)")
    bare = times["bare"]
    for name, values in times.items():
        diff = statistics.median(v - b for v, b in zip(values, bare))
        print(f"{name:8s} {statistics.median(values) * 1e3:8.3f} ms/step   vs bare {diff * 1e6:+8.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
