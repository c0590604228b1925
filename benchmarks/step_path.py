"""How much code one BASIC step runs through: the files and functions it enters.

A toy model (4 linear layers) trains a few steps under ``debug_operation`` and a few under
``debug_context`` at level BASIC; once warm (FLOPs counted, hooks in place), ``sys.setprofile``
counts every Python function call of the steady steps that follow. A newcomer reading one
step reads these files, so fewer is better.

    python benchmarks/step_path.py            # both entry points, torchtrace's files
    python benchmarks/step_path.py --list     # and the functions, by file
    python benchmarks/step_path.py --all      # files outside torchtrace too (torch, OpenTelemetry)

The counts are per step (the steady steps are alike: the union of what they enter is what
one enters). Export runs on its own thread and is not counted: it is not the step's path.
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import sys
import tempfile
import threading
import types

import torch

import torchtrace as tt

PACKAGE_DIR = os.path.dirname(os.path.abspath(tt.__file__))


class PathCounter:
    """A ``sys.setprofile`` hook counting the Python calls made on the thread that set it."""

    def __init__(self, everything: bool) -> None:
        self.everything = everything
        self.calls: collections.Counter[tuple[str, str]] = collections.Counter()
        self.thread = threading.get_ident()

    def __call__(self, frame, event, arg) -> None:
        if event != "call" or threading.get_ident() != self.thread:
            return
        path = frame.f_code.co_filename
        if not self.everything and not path.startswith(PACKAGE_DIR):
            return
        self.calls[(path, function_name(frame.f_code))] += 1

    def files(self) -> set[str]:
        return {path for path, _ in self.calls}


def function_name(code: types.CodeType) -> str:
    """A function's qualified name (``Class.method``, Python 3.11 and later); on Python 3.10,
    which has no ``co_qualname``, its name and first line, which tell methods of one name apart."""
    qualname = getattr(code, "co_qualname", None)
    return qualname if qualname is not None else f"{code.co_name}@{code.co_firstlineno}"


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    loss = model(x).pow(2).mean()
    loss.backward()
    optimizer.step()
    return loss


def count_operation(warm: int, steps: int, everything: bool) -> PathCounter:
    """Steady steps of a ``@debug_operation`` training step (the loss is returned)."""
    model, optimizer = _model_and_optimizer()
    x = torch.randn(4, 8)
    step = tt.debug_operation(name="train_step", model=model, optimizer=optimizer)(_train_step)
    for _ in range(warm):
        step(model, optimizer, x)
    counter = PathCounter(everything)
    sys.setprofile(counter)
    try:
        for _ in range(steps):
            step(model, optimizer, x)
    finally:
        sys.setprofile(None)
    return counter


def count_context(warm: int, steps: int, everything: bool) -> PathCounter:
    """Steady steps of a ``with debug_context(...)`` block that records its loss and batch."""
    model, optimizer = _model_and_optimizer()
    x = torch.randn(4, 8)

    def one() -> None:
        with tt.debug_context("ctx_step", model=model, optimizer=optimizer) as scope:
            loss = _train_step(model, optimizer, x)
            scope.record_loss(loss)
            scope.record_batch(samples=4)

    for _ in range(warm):
        one()
    counter = PathCounter(everything)
    sys.setprofile(counter)
    try:
        for _ in range(steps):
            one()
    finally:
        sys.setprofile(None)
    return counter


def summary(name: str, counter: PathCounter, steps: int, listing: bool) -> dict[str, float]:
    files = counter.files()
    functions = len(counter.calls)
    calls = sum(counter.calls.values()) / steps
    print(f"{name}: {len(files)} files, {functions} functions, {calls:.0f} calls per step")
    if listing:
        by_file: dict[str, list[str]] = collections.defaultdict(list)
        for (path, qualname), n in sorted(counter.calls.items()):
            by_file[path].append(f"{qualname} x{n / steps:g}")
        for path in sorted(by_file):
            shown = os.path.relpath(path, os.path.dirname(PACKAGE_DIR)) if path.startswith(PACKAGE_DIR) else path
            print(f"  {shown}: {', '.join(by_file[path])}")
    return {"files": len(files), "functions": functions, "calls": calls}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--warm", type=int, default=30, help="steps before counting (default 30)")
    p.add_argument("--steps", type=int, default=10, help="steady steps counted (default 10)")
    p.add_argument("--list", action="store_true", help="list the functions entered, by file")
    p.add_argument("--all", action="store_true", help="count files outside torchtrace too")
    args = p.parse_args(argv)
    logging.getLogger("torchtrace").setLevel(logging.ERROR)
    tt.configure(service_name="step-path", level="basic", prometheus_port=None,
                 run_dir=tempfile.mkdtemp(prefix="torchtrace-step-path-"), register_atexit=False)
    try:
        summary("debug_operation", count_operation(args.warm, args.steps, args.all), args.steps, args.list)
        summary("debug_context", count_context(args.warm, args.steps, args.all), args.steps, args.list)
    finally:
        tt.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
