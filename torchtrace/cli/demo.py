"""``torchtrace demo``: a small model trained on synthetic data, with the telemetry shown.

The fault injector plants a problem at a chosen step so its detection can be watched:

- ``nan@STEP``: one sample of the batch is all zeros, and the model's first layer normalises
  each sample without an epsilon (``x / rms(x)``), so that sample becomes 0/0 = NaN inside the
  layer ``norm``. The forensic replay names the layer.
- ``nan-input@STEP``: the batch itself carries a NaN (a corrupt record); the replay says the
  NaN came in with the input, before any layer ran.
- ``explode@STEP``: the loss is scaled by 1e6, so the gradients explode (finite, but huge).

Steps are numbered from 0, so ``--steps 300`` accepts faults at steps 0 to 299.
"""

from __future__ import annotations

import argparse
import os
import select
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import IO

import torch

import torchtrace as tt
from torchtrace import current
from torchtrace.cli import narrate
from torchtrace.cli.console import Console, bar_text, is_terminal, logs_through
from torchtrace.errors import NonFiniteError

FAULTS = {
    "nan": "one all-zero sample reaches a layer that normalises without an epsilon: 0/0 = NaN",
    "nan-input": "a NaN in the input batch (a corrupt record)",
    "explode": "the loss is scaled by 1e6: exploding gradients",
}
DEFAULT_HOLD_S = 30.0  # in a terminal: how long the live page stays up after training


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int


def parse_fault(text: str, steps: int | None = None) -> Fault:
    """``nan@120`` -> Fault("nan", 120).

    Raises:
        ValueError: an unknown kind, a step that is not a number, or a step the run never
            reaches (``steps`` given and ``step >= steps``); the message names the accepted values.

    >>> parse_fault("nan@120")
    Fault(kind='nan', step=120)
    """
    kind, _, step = text.partition("@")
    accepted = ", ".join(f"{k}@STEP" for k in FAULTS)
    if kind not in FAULTS or not step.isdigit():
        raise ValueError(f"--inject={text!r} is not valid; accepted values: {accepted}")
    fault = Fault(kind, int(step))
    if steps is not None and fault.step >= steps:
        raise ValueError(f"--inject={text!r}: step {fault.step} is never reached with --steps {steps} "
                         f"(steps are numbered 0 to {steps - 1})")
    return fault


def check_faults(faults: list[Fault]) -> None:
    """Refuse two faults planted at the same step (only one of them would show)."""
    seen: dict[int, str] = {}
    for f in faults:
        if f.step in seen:
            raise ValueError(f"--inject: two faults at step {f.step} ({seen[f.step]}, {f.kind}); use one per step")
        seen[f.step] = f.kind


class InputNorm(torch.nn.Module):
    """Scales each sample to unit root-mean-square, deliberately without an epsilon.

    An all-zero sample therefore becomes 0/0 = NaN here: the bug the ``nan`` fault plants.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / x.pow(2).mean(dim=-1, keepdim=True).sqrt()


class DemoNet(torch.nn.Module):
    """``norm`` -> two GELU layers of 256 -> ``head`` (10 classes); about 85 k parameters."""

    def __init__(self, d_in: int = 64, hidden: int = 256, classes: int = 10) -> None:
        super().__init__()
        self.norm = InputNorm()
        self.body = torch.nn.Sequential(torch.nn.Linear(d_in, hidden), torch.nn.GELU(),
                                        torch.nn.Linear(hidden, hidden), torch.nn.GELU())
        self.head = torch.nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.norm(x)))


def make_model() -> DemoNet:
    return DemoNet()


def make_batch(teacher: torch.nn.Linear, fault: str | None, batch: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of synthetic data labelled by ``teacher``, with ``fault`` planted in it."""
    x = torch.randn(batch, teacher.in_features)
    with torch.no_grad():
        y = teacher(x).argmax(dim=1)
    if fault == "nan":
        x[batch // 3] = 0.0
    elif fault == "nan-input":
        x[batch // 3, 5] = float("nan")
    return x, y


@dataclass
class DemoState:
    """What the loop has seen so far, for the narration and the summary."""

    losses: list[float]
    step_times: list[float]
    events: list[str]
    bad_since: int | None = None  # the first step of the current non-finite stretch
    last_good: tuple[int, float] | None = None  # (step, loss) of the last healthy step
    replays: int = 0
    skipped: int = 0
    stopped_at: int | None = None
    ran: int = 0  # steps run to their end (counted by the demo itself: at level off nothing is measured)


def run(steps: int = 300, level: str = "basic", inject: list[Fault] | None = None, guard: str | None = "skip",
        prometheus_port: int | str | None = None, run_dir: str | None = None, seed: int = 0,
        out: IO[str] = sys.stdout, progress: bool = True, hold_s: float | None = 0.0) -> dict:
    """Train for ``steps`` steps under torchtrace, telling what happens, and return the run summary.

    ``hold_s``: keep the live page up this long after training (``None``: 30 s when ``out``
    and stdin are terminals, else 0).
    """
    inject = inject or []
    check_faults(inject)
    result = tt.configure(service_name="torchtrace-demo", level=level, guard=guard,
                          prometheus_port=prometheus_port, run_dir=run_dir)
    console = Console(out, bar=progress and is_terminal(out))
    rt = current.runtime(create=False)
    settings = result.settings
    narrate.header(console, steps, settings, inject, FAULTS, _live_page(rt), result)
    torch.manual_seed(seed)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    teacher = torch.nn.Linear(64, 10)
    faults = {f.step: f.kind for f in inject}
    state = DemoState([], [], [])
    with logs_through(console) as handler:
        # The narration tells each NaN story; torchtrace's own lines about it would say it twice.
        handler.addFilter(narrate.told_by_narration)
        _train(model, opt, teacher, faults, steps, console, state, progress)
        tt.flush()
    summary = rt.summary() if rt is not None else {}
    page = _live_page(rt)
    narrate.summary(console, summary, state, settings, steps)
    narrate.next_steps(console, result.run_dir, report_command(), page)
    tt.idle()  # training is over: the hold below is no hang, nor the job's time
    _hold(console, hold_s, page, out)
    tt.shutdown()
    return summary


def _train(model: DemoNet, opt: torch.optim.Optimizer, teacher: torch.nn.Linear, faults: dict[int, str],
           steps: int, console: Console, state: DemoState, progress: bool) -> None:
    pipe_every = max(1, steps // 6)
    for i in range(steps):
        kind = faults.get(i)
        x, y = make_batch(teacher, kind)

        def forward_and_loss(x=x, y=y, kind=kind):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            return loss * 1e6 if kind == "explode" else loss

        try:
            with tt.debug_context("train_step", model=model, optimizer=opt, step=i,
                                  replay=forward_and_loss, inputs=(x, y)) as step:
                loss = forward_and_loss()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                step.record_loss(loss)
                opt.step()
        except NonFiniteError as exc:  # guard="raise"
            console.end_progress()
            if exc.report:
                state.replays += 1
                kinds = [k for k in exc.kinds if k in narrate.NONFINITE_KINDS]
                for line in narrate.forensic_lines(exc.report, kinds):
                    console.line(line)
            narrate.stopped(console, i, f"training stopped by guard raise: {exc}")
            state.stopped_at = i
            return
        except KeyboardInterrupt:
            console.end_progress()
            narrate.stopped(console, i, "interrupted (Ctrl-C); the run's files are written all the same")
            state.stopped_at = i
            return
        narrate.after_step(console, i, step.record, state)
        _show_progress(console, i, steps, _step_loss(step.record, loss, state), progress, pipe_every)
    console.end_progress()


def _step_loss(record, loss: torch.Tensor, state: DemoState) -> float:
    """This step's loss: torchtrace's reading of it, or (nothing measured: level off) the
    demo's own, kept for the summary too."""
    state.ran += 1
    if record is not None and record.loss is not None:
        return record.loss
    value = float(loss.detach())
    state.losses.append(value)
    return value


def _show_progress(console: Console, i: int, steps: int, loss: float, progress: bool, pipe_every: int) -> None:
    """Step ``i`` (numbered from 0, as the narration and the report number it) and its loss."""
    if console.bar:
        console.progress(f"  {bar_text(i + 1, steps)}  step {i}  loss {loss:8.4f}", force=i == steps - 1)
    elif progress and ((i + 1) % pipe_every == 0 or i == steps - 1):
        console.line(f"  step {i} ({i + 1}/{steps} done)  loss {loss:.4f}")


def _live_page(rt) -> tuple[str, str | None] | None:
    """(address, token) of the live page, or None when it is not served."""
    api = getattr(rt, "debug_api", None) if rt is not None else None
    server = getattr(rt, "server", None) if rt is not None else None
    if api is None or server is None or not server.url:
        return None
    return f"{server.url}/", (None if api.token_from_settings else api.token)


def report_command() -> str:
    """How this very program is started again, for the ``report`` command the demo suggests:
    an absolute path, right from any directory the user copies it into."""
    argv0 = sys.argv[0] if sys.argv else ""
    if os.path.basename(argv0) == "torchtrace" and os.path.isfile(argv0):
        on_path = shutil.which("torchtrace")
        if on_path and os.path.realpath(on_path) == os.path.realpath(argv0):
            return "torchtrace"
        return os.path.abspath(argv0)
    return f"{os.path.abspath(sys.executable)} -m torchtrace.cli"


def usable_run_dir(path: str) -> str:
    """``--run-dir`` as an absolute path (a relative one is taken from the directory the demo
    was started in), once a directory was made and removed where it would be created.

    Raises:
        ValueError: it cannot be created or written; the message names ``--run-dir``.
    """
    absolute = os.path.abspath(os.path.expanduser(path))
    existing = absolute
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        problem = f"{existing} is not a directory"
    else:
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".torchtrace-demo-", dir=existing))
            return absolute
        except OSError as exc:
            problem = f"cannot create a directory in {existing}: {exc.strerror or exc}"
    raise ValueError(f"--run-dir={path!r} is not valid: {problem}; accepted values: a directory you can write")


def _hold(console: Console, hold_s: float | None, page: tuple[str, str | None] | None, out: IO[str]) -> None:
    interactive = is_terminal(out) and is_terminal(sys.stdin)
    if hold_s is None:
        hold_s = DEFAULT_HOLD_S if interactive else 0.0
    if hold_s <= 0 or page is None:
        return
    how = "press Enter to end now" if interactive else "Ctrl-C ends it now"
    console.line(f"\nThe live page stays up for {hold_s:.0f} s at {page[0]} ({how}; --hold 0 skips this).")
    try:
        if interactive:
            select.select([sys.stdin], [], [], hold_s)
        else:
            time.sleep(hold_s)
    except KeyboardInterrupt:
        pass


def add_subcommand(subparsers) -> None:
    p = subparsers.add_parser("demo", help="train a small model with torchtrace and show the telemetry",
                              description="Train a small model on synthetic data under torchtrace. Planted faults: "
                              + "; ".join(f"{k}@STEP: {v}" for k, v in FAULTS.items()) + ".")
    p.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    p.add_argument("--level", default="basic", help="off, basic, advanced or extreme (default basic)")
    p.add_argument("--inject", action="append", default=[], metavar="KIND@STEP",
                   help="plant a fault: " + ", ".join(f"{k}@STEP" for k in FAULTS) + " (repeatable; steps from 0)")
    p.add_argument("--guard", default="skip", help="policy for non-finite steps: warn, skip, raise (default skip)")
    p.add_argument("--port", default=None, help="metrics and live page port (default 9464; 0 = any free; off)")
    p.add_argument("--run-dir", default=None, help="run directory (default ./torchtrace-runs)")
    p.add_argument("--hold", type=float, default=None,
                   help=f"keep the live page up this many seconds after training (default {DEFAULT_HOLD_S:.0f} "
                        "in a terminal, 0 in a pipe)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar or progress lines")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    try:
        if args.steps <= 0:
            raise ValueError(f"--steps={args.steps} is not valid; accepted values: a positive integer")
        if args.hold is not None and not args.hold >= 0:
            raise ValueError(f"--hold={args.hold} is not valid; accepted values: seconds, 0 or more")
        faults = [parse_fault(f, args.steps) for f in args.inject]
        check_faults(faults)
        run_dir = usable_run_dir(args.run_dir) if args.run_dir is not None else None
    except ValueError as exc:
        print(f"torchtrace demo: {exc}", file=sys.stderr)
        return 2
    # One intra-op thread: this model is too small to gain from more, and on a machine whose
    # cores are busy the threads' spin-waits made each step about 10x slower (8 vs 92 ms).
    torch.set_num_threads(1)
    run(steps=args.steps, level=args.level, inject=faults, guard=args.guard, prometheus_port=args.port,
        run_dir=run_dir, progress=not args.no_progress, hold_s=args.hold)
    return 0
