"""torchtrace BASIC against the monitors users write by hand, in one process, one run.

Every variant trains the same model in interleaved rounds (a fresh order each round, one
untimed step before each timed block), so drift in the machine hits them all alike. For each
workload the table shows the median ms/step, and the paired cost over the bare step and over
the floor: the median over rounds of (variant - bare) and (variant - floor), in µs per step,
with a 95 % bootstrap interval, and as a share of the bare step.

    python benchmarks/peers.py --budget 20          # all four workloads, 20 s of rounds each
    python benchmarks/peers.py --quick              # CI smoke: tiny sizes, asserts nothing about time

Variants (the peers' patterns are written here; no dependency beyond torchtrace's own):
  bare        the plain step: zero_grad, forward, backward, optimizer.step
  floor       the plain step plus one fused norm over the gradients and one host read
  otel        a hand-written OpenTelemetry span around the step with two gauges (loss and step
              seconds; the loss read with .item()); a batch span processor to an exporter that
              drops what it gets, as a job with a collector would pay on its training thread
  otel-norm   as otel, with a third gauge: the total gradient norm (``get_total_norm``, one fused
              pass) read with .item() before the update: the least a health monitor reads, which
              is what the floor pays; the otel peer reads no gradient
  lightning   Lightning-style ``grad_norm``: every parameter's gradient norm, and their total,
              each read with .item() (the per-parameter dict a LightningModule logs)
  trainer     Trainer-style: ``clip_grad_norm_(parameters, 1.0)`` and the returned norm read
              with .item() for logging
  basic       the step decorated with ``@debug_operation``, torchtrace at BASIC (defaults)
  basic-clip  as basic, with the Trainer's ``clip_grad_norm_`` inside the step (no .item():
              torchtrace records the norm); its peer is ``trainer``
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torchtrace as tt  # noqa: E402
from overhead import MLP, Encoder, ManyTensors, Workload, median_interval, time_steps  # noqa: E402

VARIANTS = ("bare", "floor", "otel", "otel-norm", "lightning", "trainer", "basic", "basic-clip")
PEERS = ("otel", "otel-norm", "lightning", "trainer")


def mse_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def lm_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    tokens, target = batch
    logits = model(tokens)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def mean_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).mean()


def workloads(quick: bool, device: torch.device) -> list[Workload]:
    """The toy (34 tensors, negligible compute), the 2M MLP, 2,000 tensors and a transformer."""
    torch.manual_seed(0)
    w, batch = (64, 32) if quick else (340, 256)  # 17 * (340*340 + 340) = 1.97M parameters
    n_tensors = 100 if quick else 2000
    d_model, layers, seq, bsz = (32, 1, 16, 4) if quick else (128, 2, 64, 16)
    return [
        Workload("toy-mlp-8x17", MLP(8), lambda d: (torch.randn(4, 8, device=d), torch.randn(4, 8, device=d)),
                 mse_loss, device),
        Workload(f"mlp-{w}x17", MLP(w), lambda d: (torch.randn(batch, w, device=d), torch.randn(batch, w, device=d)),
                 mse_loss, device),
        Workload(f"tensors-{n_tensors}", ManyTensors(n_tensors), lambda d: torch.tensor(1.0, device=d), mean_loss,
                 device),
        Workload(f"encoder-d{d_model}x{layers}", Encoder(d_model, layers),
                 lambda d: (torch.randint(0, 1000, (bsz, seq), device=d), torch.randint(0, 1000, (bsz, seq), device=d)),
                 lm_loss, device),
    ]


# ---------------------------------------------------------------- the peers' patterns
class DroppingExporter:
    """An OpenTelemetry span exporter that drops what it gets (a collector costs the job the same
    on its training thread: the batch processor's queue; the export runs on its own thread)."""

    def export(self, spans: object) -> object:
        from opentelemetry.sdk.trace.export import SpanExportResult

        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def otel_runner(wl: Workload, gradient_norm: bool = False) -> Callable[[], torch.Tensor]:
    """A hand-written OpenTelemetry span around the step, and two gauges (loss and step seconds);
    ``gradient_norm``: a third, the total gradient norm, read before the update."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(DroppingExporter()))  # type: ignore[arg-type]
    tracer = provider.get_tracer("peer")
    meter = MeterProvider().get_meter("peer")
    loss_gauge = meter.create_gauge("train_loss")
    time_gauge = meter.create_gauge("train_step_seconds")
    norm_gauge = meter.create_gauge("train_grad_norm")
    step_number = 0

    def with_norm() -> torch.Tensor:
        wl.optimizer.zero_grad(set_to_none=True)
        loss = wl.loss_fn(wl.model, wl.batch)
        loss.backward()
        grads = [p.grad for p in wl.model.parameters() if p.grad is not None]
        norm_gauge.set(torch.nn.utils.get_total_norm(grads).item())
        wl.optimizer.step()
        return loss

    def step() -> torch.Tensor:
        nonlocal step_number
        step_number += 1
        t0 = time.perf_counter()
        with tracer.start_as_current_span("train_step") as span:
            span.set_attribute("step", step_number)
            loss = with_norm() if gradient_norm else wl.step(wl.model, wl.batch)
            value = loss.item()
            span.set_attribute("loss", value)
        loss_gauge.set(value)
        time_gauge.set(time.perf_counter() - t0)
        return loss
    return step


def lightning_grad_norms(model: torch.nn.Module) -> dict[str, float]:
    """Lightning-style ``grad_norm``: each parameter's gradient 2-norm and their total, read."""
    norms = {f"grad_2.0_norm/{name}": torch.linalg.vector_norm(p.grad, 2.0)
             for name, p in model.named_parameters() if p.grad is not None}
    total = torch.linalg.vector_norm(torch.stack(list(norms.values())), 2.0)
    out = {name: norm.item() for name, norm in norms.items()}
    out["grad_2.0_norm_total"] = total.item()
    return out


def lightning_runner(wl: Workload) -> Callable[[], torch.Tensor]:
    def step() -> torch.Tensor:
        wl.optimizer.zero_grad(set_to_none=True)
        loss = wl.loss_fn(wl.model, wl.batch)
        loss.backward()
        lightning_grad_norms(wl.model)  # on_before_optimizer_step, as Lightning's docs show
        wl.optimizer.step()
        return loss
    return step


def clipped_step(wl: Workload, read: bool) -> torch.Tensor:
    """The Trainer's step: clip to 1.0 before the update; ``read``: the norm read for the log."""
    wl.optimizer.zero_grad(set_to_none=True)
    loss = wl.loss_fn(wl.model, wl.batch)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(wl.model.parameters(), 1.0)
    if read:
        norm.item()
    wl.optimizer.step()
    return loss


def make_runner(variant: str, wl: Workload) -> Callable[[], torch.Tensor]:
    """A zero-argument callable running one step of ``variant``."""
    if variant == "bare":
        return lambda: wl.step(wl.model, wl.batch)
    if variant == "floor":
        return lambda: wl.floor_step(wl.model, wl.batch)
    if variant == "otel":
        return otel_runner(wl)
    if variant == "otel-norm":
        return otel_runner(wl, gradient_norm=True)
    if variant == "lightning":
        return lightning_runner(wl)
    if variant == "trainer":
        return lambda: clipped_step(wl, read=True)
    if variant == "basic":
        decorated = tt.debug_operation(name="train_step", model=wl.model, optimizer=wl.optimizer)(wl.step)
        return lambda: decorated(wl.model, wl.batch)
    if variant == "basic-clip":
        clipping = tt.debug_operation(name="train_step_clip", model=wl.model, optimizer=wl.optimizer)(clipped_step)
        return lambda: clipping(wl, False)
    raise ValueError(f"variant {variant!r}: expected one of {', '.join(VARIANTS)}")


# ---------------------------------------------------------------- timing and the table
def run_workload(wl: Workload, variants: list[str], steps: int, warmup: int, budget_s: float,
                 device: torch.device) -> dict[str, list[float]]:
    """Wall seconds per step of each variant, one value per round, until the budget is spent."""
    runners = {v: make_runner(v, wl) for v in variants}
    for v in variants:
        for _ in range(warmup):
            runners[v]()
    wall: dict[str, list[float]] = {v: [] for v in variants}
    shuffled = random.Random(1)
    order = list(variants)
    start = time.perf_counter()
    rounds = 0
    while rounds < 3 or time.perf_counter() - start < budget_s:
        shuffled.shuffle(order)
        for v in order:
            runners[v]()  # untimed: pays for the switch from the variant before
            wall[v].append(time_steps(runners[v], steps, device)[0])
        rounds += 1
    return wall


def fmt_table(wl: Workload, wall: dict[str, list[float]]) -> str:
    lines = [f"\n{wl.name}: {wl.n_params / 1e6:.2f}M parameters in {wl.n_tensors} tensors ({len(wall['bare'])} rounds)",
             f"{'variant':<11} {'ms/step':>9} {'+bare us':>9} {'95% interval':>19} {'+bare %':>8} "
             f"{'>floor us':>10} {'>floor %':>9}"]
    for v, values in wall.items():
        added = [a - b for a, b in zip(values, wall["bare"])]
        low, high = median_interval(added)
        share = statistics.median(d / b for d, b in zip(added, wall["bare"]))
        beyond = [a - f for a, f in zip(values, wall["floor"])]
        beyond_share = statistics.median(d / b for d, b in zip(beyond, wall["bare"]))
        lines.append(f"{v:<11} {statistics.median(values) * 1e3:9.3f} {statistics.median(added) * 1e6:+9.1f} "
                     f"[{low * 1e6:+8.1f},{high * 1e6:+8.1f}] {share * 100:+7.2f}% "
                     f"{statistics.median(beyond) * 1e6:+10.1f} {beyond_share * 100:+8.2f}%")
    basic = statistics.median(a - b for a, b in zip(wall["basic"], wall["bare"]))
    leanest = min(PEERS, key=lambda p: statistics.median(a - b for a, b in zip(wall[p], wall["bare"])))
    lean = statistics.median(a - b for a, b in zip(wall[leanest], wall["bare"]))
    lines.append(f"basic adds {basic * 1e6:+.1f} us; the leanest peer ({leanest}) {lean * 1e6:+.1f} us")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, a few rounds: a CI smoke test")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--budget", type=float, default=20.0, help="seconds of timed rounds per workload")
    p.add_argument("--steps", type=int, default=None, help="steps per variant per round (default 10 on the toy, 2 else)")
    p.add_argument("--workloads", default=None, help="comma-separated name prefixes (toy, mlp, tensors, encoder)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads (1 on a machine shared with other work: no spinning thread pool)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.getLogger("torchtrace").setLevel(logging.ERROR)  # anomaly warnings are not what we time
    tt.configure(service_name="peers-bench", level="basic", prometheus_port=0,
                 run_dir=tempfile.mkdtemp(prefix="torchtrace-peers-"), register_atexit=False)
    print(f"# torchtrace against hand-written peers: torch {torch.__version__}, python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, device {device}")
    budget = 1.0 if args.quick else args.budget
    print(f"# {budget:g} s of interleaved rounds per workload; paired medians over rounds")
    wls = workloads(args.quick, device)
    if args.workloads:
        prefixes = tuple(w.strip() for w in args.workloads.split(",") if w.strip())
        wls = [wl for wl in wls if wl.name.startswith(prefixes)]
    for wl in wls:
        steps = args.steps or (10 if wl.name.startswith("toy") else 2)
        wall = run_workload(wl, list(VARIANTS), steps, 1 if args.quick else 5, budget, device)
        print(fmt_table(wl, wall), flush=True)
    tt.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
