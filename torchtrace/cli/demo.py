"""``torchtrace demo``: a small model trained on synthetic data, with the telemetry shown.

The fault injector plants a problem at a chosen step so the detection can be seen:
``nan@120`` multiplies that step's loss by NaN; ``explode@80`` scales it by 1e6.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass

import torch

import torchtrace as tt
from torchtrace import current

FAULTS = ("nan", "explode")


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int


def parse_fault(text: str) -> Fault:
    """``nan@120`` -> Fault("nan", 120); raises ValueError naming the accepted forms."""
    kind, _, step = text.partition("@")
    if kind not in FAULTS or not step.isdigit():
        raise ValueError(f"--inject={text!r} is not valid; accepted values: nan@STEP, explode@STEP")
    return Fault(kind, int(step))


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(32, 128), torch.nn.GELU(),
        torch.nn.Linear(128, 128), torch.nn.GELU(),
        torch.nn.Linear(128, 10),
    )


def _bar(done: int, total: int, width: int = 30) -> str:
    filled = int(width * done / max(total, 1))
    return "[" + "#" * filled + "." * (width - filled) + f"] {done}/{total}"


def run(steps: int = 300, level: str = "basic", inject: list[Fault] | None = None, guard: str | None = None,
        prometheus_port: int | str | None = None, run_dir: str | None = None, seed: int = 0,
        out=sys.stdout, progress: bool = True, hold_s: float = 0.0) -> dict:
    """Train for ``steps`` steps under torchtrace and return the run summary."""
    inject = inject or []
    result = tt.configure(service_name="torchtrace-demo", level=level, guard=guard,
                          prometheus_port=prometheus_port, run_dir=run_dir)
    print(f"torchtrace demo: {steps} steps at level {level}", file=out)
    if result.metrics_url:
        print(f"  metrics:  {result.metrics_url}", file=out)
    if result.spans_path:
        print(f"  spans:    {result.spans_path}", file=out)
        print(f"  report:   {result.report_path}", file=out)
    torch.manual_seed(seed)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    teacher = torch.nn.Linear(32, 10)
    faults = {f.step: f.kind for f in inject}
    losses = []
    started = time.perf_counter()
    for i in range(steps):
        x = torch.randn(64, 32)
        y = teacher(x).argmax(dim=1)
        with tt.debug_context("train_step", model=model, optimizer=opt, step=i) as step:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            kind = faults.get(i)
            if kind == "nan":
                loss = loss * float("nan")
            elif kind == "explode":
                loss = loss * 1e6
            opt.zero_grad(set_to_none=True)
            loss.backward()
            step.record_loss(loss)
            opt.step()
        if step.record is not None and step.record.loss is not None:
            losses.append(step.record.loss)
        if progress and (i % 10 == 0 or i == steps - 1):
            last = losses[-1] if losses else float("nan")
            print(f"\r  {_bar(i + 1, steps)} loss {last:8.4f}", end="", file=out, flush=True)
    if progress:
        print(file=out)
    elapsed = time.perf_counter() - started
    tt.flush()
    rt = current.runtime(create=False)
    summary = rt.summary() if rt is not None else {}
    if hold_s > 0:
        print(f"  holding the metrics server for {hold_s:.0f} s", file=out)
        time.sleep(hold_s)
    tt.shutdown()
    _print_table(summary, elapsed, steps, losses, out)
    return summary


def _print_table(summary: dict, elapsed: float, steps: int, losses: list[float], out) -> None:
    totals = summary.get("totals", {})
    finite = [v for v in losses if math.isfinite(v)]
    rows = [
        ("steps", str(totals.get("steps", 0))),
        ("time", f"{elapsed:.2f} s ({1000 * elapsed / max(steps, 1):.2f} ms/step)"),
        ("first loss", f"{finite[0]:.4f}" if finite else "-"),
        ("last finite loss", f"{finite[-1]:.4f}" if finite else "-"),
        ("steps with anomalies", str(totals.get("anomaly_steps", 0))),
        ("non-finite steps", str(totals.get("nonfinite_steps", 0))),
        ("skipped updates", str(totals.get("skipped_steps", 0))),
    ]
    for kind, n in sorted(summary.get("anomalies_by_kind", {}).items()):
        rows.append((f"  {kind}", str(n)))
    telemetry = summary.get("telemetry", {})
    dropped = sum(telemetry.get("spans_dropped", {}).values())
    rows.append(("spans dropped", str(dropped)))
    width = max(len(r[0]) for r in rows)
    print("summary", file=out)
    print("-" * (width + 30), file=out)
    for key, value in rows:
        print(f"{key.ljust(width)}  {value}", file=out)


def add_subcommand(subparsers) -> None:
    p = subparsers.add_parser("demo", help="train a small model with torchtrace and show the telemetry")
    p.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    p.add_argument("--level", default="basic", help="off, basic, advanced or extreme (default basic)")
    p.add_argument("--inject", action="append", default=[], metavar="KIND@STEP",
                   help="plant a fault: nan@STEP or explode@STEP (repeatable)")
    p.add_argument("--guard", default="skip", help="guard policy for non-finite steps: warn, skip, raise (default skip)")
    p.add_argument("--port", default=None, help="metrics port (default 9464; 0 = any free; off)")
    p.add_argument("--run-dir", default=None, help="run directory (default ./torchtrace-runs)")
    p.add_argument("--hold", type=float, default=0.0, help="keep /metrics up this many seconds after training")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    try:
        faults = [parse_fault(f) for f in args.inject]
    except ValueError as exc:
        print(f"torchtrace demo: {exc}", file=sys.stderr)
        return 2
    if args.steps <= 0:
        print("torchtrace demo: --steps must be a positive integer", file=sys.stderr)
        return 2
    run(steps=args.steps, level=args.level, inject=faults, guard=args.guard, prometheus_port=args.port,
        run_dir=args.run_dir, progress=not args.no_progress, hold_s=args.hold)
    return 0
