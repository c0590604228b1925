"""What torchtrace costs per training step, next to the alternatives users would reach for.

Variants run interleaved in one process (each round in a fresh order, so drift in the machine
and the variant before hit them all alike), each round timing ``--steps`` steps per variant
after one untimed step (the switch from the variant before is not part of any variant's cost).
For each workload the table shows the median ms/step over rounds, the min-max spread, the
paired ratio to the bare loop, and each level's cost beyond the floor (paired: the median over
rounds of variant - floor), in µs per step and as a share of the bare step; then the training
thread's CPU time and the CPU time torchtrace's own background threads (span export, HTTP)
spent per step meanwhile.

    python benchmarks/overhead.py            # full run (a few minutes on 2 CPU cores)
    python benchmarks/overhead.py --quick    # CI smoke: tiny sizes, asserts nothing about time
    python benchmarks/overhead.py --device cuda --gpu-model   # 100M+ parameters, sync-debug check
    python benchmarks/overhead.py --device cuda --gpt         # a 124M GPT-style decoder, bf16, clipping

Variants:
  bare       the plain step
  floor      the plain step plus the least any per-step gradient check costs: one fused norm
             over the gradients (before the update) and one host read of the norms and loss
  devfloor   the device floor: the floor's norm pass, with a copy of the norms and loss to the
             host that nothing waits for (read a step later); on a GPU the floor's host read
             stalls the device, which no check needs to do. basic - devfloor is BASIC beyond it.
  off        decorated with @debug_operation, torchtrace configured with level=off
  basic / advanced / extreme   decorated, at that level; basic-nothr is BASIC with the
             throughput features (batch size, FLOPs, learning rate, phases, goodput) off;
             basic-aa is BASIC again (a step of its own): basic - basic-aa is an A/A pair,
             the machine's own noise, that basic - basic-nothr is judged against.
             basic-nojob is BASIC without the job's per-step work: the hang watch's phase
             marks (torchtrace.job.progress) and the black box's stores at the step's end
             (torchtrace.step.job.note_step) are no-ops during its steps (swapped in and out
             around each step by a context manager, which counts against basic-nojob: on the
             toy model the swap cost more than the work it takes away, 2026-11-29 RESULTS.md).
             basic-nofx is BASIC with NaN forensics off (forensics=False): the step-entry RNG
             capture and, under warn on the CPU, the early gradient look, which forensics
             pays on healthy steps so that it can replay the one that goes wrong.
             extreme trains an identical copy of the model (same weights, own optimizer):
             its activation hooks stay registered on that copy between rounds, as in a job
             that stays at EXTREME, while the other variants' model carries none (a level
             change removes the hooks, and the rounds change the level every few steps)
  marks      the floor plus the least any step-phase timing costs, on an identical copy of the
             model (its own optimizer): a call-through in the model's call seam reads the clock
             around the forward, the optimizer's step pre/post hooks read it around the update,
             and each step keeps its start and end times, its four phase marks and its batch's
             first dimension in a bounded deque; nothing is processed or exported. marks - floor
             is what the throughput features cannot go below with phases timed on the host
  least      marks plus what a FLOP count per input shape and per-step learning rates need on
             every step and nothing more: the step's shape key (torchtrace's own key function),
             one lookup of it in a table, and the optimizer's learning rates, kept with the
             marks. least - floor is what the throughput features cannot go below on the host
  ideal      least plus what any implementation must then do with those values on every step,
             as lean as Python allows: phases and data wait, goodput and counter sums, the
             histograms' values kept, the span's seven throughput attributes; nothing else
  seed       the per-parameter checks a hand-written monitor does: isnan/isinf/norm().item()
             per gradient and mean/std/norm .item() per parameter
  anomaly    the plain step inside torch.autograd.detect_anomaly() always on
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import functools
import json
import logging
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torchtrace as tt  # noqa: E402
from torchtrace import api as tt_api  # noqa: E402
from torchtrace.levels import DebugLevel  # noqa: E402
from torchtrace.measure.flops import shape_key  # noqa: E402
from torchtrace.record import readout  # noqa: E402
from torchtrace.record.step import StepRecord  # noqa: E402

VARIANTS = ("bare", "floor", "devfloor", "off", "basic", "basic-nothr", "basic-aa", "basic-nojob", "basic-nofx",
            "advanced", "extreme", "marks", "least", "ideal", "seed", "anomaly")


# ---------------------------------------------------------------- workloads
class MLP(torch.nn.Module):
    """17 linear layers: 34 parameter tensors."""

    def __init__(self, width: int, layers: int = 17) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i + 1 < len(self.layers):
                x = torch.relu(x)
        return x


class ManyTensors(torch.nn.Module):
    """``n`` small parameter tensors behind one cheap forward (cat + square): cost by tensor count."""

    def __init__(self, n: int, size: int = 16) -> None:
        super().__init__()
        self.params = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(size) * 0.1) for _ in range(n))

    def forward(self, x):
        flat = torch.cat([p.reshape(-1) for p in self.params])
        return (flat * x).pow(2)


class Encoder(torch.nn.Module):
    def __init__(self, d_model: int, layers: int, vocab: int = 1000) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d_model)
        layer = torch.nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=4 * d_model, dropout=0.0,
                                                 batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(d_model, vocab)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)))


class DecoderBlock(torch.nn.Module):
    """Pre-norm causal self-attention and a 4x GELU MLP, each with a residual."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(d_model)
        self.qkv = torch.nn.Linear(d_model, 3 * d_model)
        self.proj = torch.nn.Linear(d_model, d_model)
        self.norm2 = torch.nn.LayerNorm(d_model)
        self.up = torch.nn.Linear(d_model, 4 * d_model)
        self.down = torch.nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, d))
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))


class Decoder(torch.nn.Module):
    """A GPT-style decoder: token and position embeddings, ``layers`` blocks, a final norm and a
    head that shares the token embedding's weight. 12 layers, 12 heads, width 768, 50,304 tokens
    and a context of 1,024 make 124M parameters, GPT-2 small's shape."""

    def __init__(self, layers: int, heads: int, d_model: int, vocab: int, context: int) -> None:
        super().__init__()
        self.tokens = torch.nn.Embedding(vocab, d_model)
        self.positions = torch.nn.Embedding(context, d_model)
        self.blocks = torch.nn.ModuleList(DecoderBlock(d_model, heads) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(d_model)
        self.head = torch.nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.tokens.weight

    def forward(self, idx):
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class Workload:
    """A model, its SGD optimizer (AdamW for the decoder), a batch and a loss. ``clip``: the step
    clips the gradients to this total norm before the update, as LLM recipes do; ``autocast``: the
    forward and loss run under ``torch.autocast`` in that dtype."""

    def __init__(self, name, model, make_batch, loss_fn, device, clip: float | None = None,
                 autocast: torch.dtype | None = None, adamw: bool = False):
        self.name = name
        self.model = model.to(device)
        if adamw:
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=device.type == "cuda")
        else:
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-4)
        self.batch = make_batch(device)
        self.loss_fn = loss_fn
        self.clip = clip
        self.autocast = autocast
        self.device_type = device.type
        self.n_params = sum(p.numel() for p in self.model.parameters())
        self.n_tensors = sum(1 for _ in self.model.parameters())

    def loss(self, model, batch):
        """The forward and loss, under autocast when the workload has it."""
        if self.autocast is None:
            return self.loss_fn(model, batch)
        with torch.autocast(self.device_type, dtype=self.autocast):
            return self.loss_fn(model, batch)

    def step(self, model, batch):
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss(model, batch)
        loss.backward()
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), self.clip)
        self.optimizer.step()
        return loss

    def floor_step(self, model, batch, optimizer=None, read=None):
        """``step`` plus one fused gradient norm pass and one host read (the ``floor`` variant).
        ``read`` takes the loss and norms (one float64 vector) instead of reading them now."""
        optimizer = optimizer or self.optimizer
        optimizer.zero_grad(set_to_none=True)
        loss = self.loss(model, batch)
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norms = torch.stack(torch._foreach_norm(grads)).to(torch.float64)
        values = torch.cat([loss.detach().reshape(1).to(torch.float64), norms])
        if read is None:
            values.tolist()
        else:
            read(values)
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), self.clip)
        optimizer.step()
        return loss


class DeviceFloor:
    """The ``devfloor`` variant: ``step`` plus the one fused gradient norm pass and a copy of the
    loss and norms to the host that nothing waits for: on CUDA a non-blocking copy into pinned
    memory, whose values are taken a step later (by then the device has long finished it). What
    a per-step check that never stalls a GPU must pay; on the CPU it is the ``floor`` without
    its difference (there the copy is the read)."""

    def __init__(self, wl: "Workload") -> None:
        self.wl = wl
        self.pending: tuple[torch.Tensor, torch.cuda.Event] | None = None
        self.values: list[float] = []

    def step(self, model, batch):
        return self.wl.floor_step(model, batch, read=self.read)

    def read(self, values: torch.Tensor) -> None:
        """Start copying ``values`` to the host; take the last step's copy, which has landed."""
        if values.device.type != "cuda":
            self.values = values.tolist()
            return
        if self.pending is not None:  # the last step's copy: landed long ago, so no wait
            host, landed = self.pending
            landed.synchronize()
            self.values = host.tolist()
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        host.copy_(values, non_blocking=True)
        landed = torch.cuda.Event()
        landed.record()
        self.pending = (host, landed)


def _mse(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def _lm(model, batch):
    tokens, target = batch
    logits = model(tokens)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _sum(model, batch):
    return model(batch).mean()


def workloads(args, device) -> list[Workload]:
    torch.manual_seed(0)
    out = []
    if getattr(args, "gpt", False):
        # GPT-2 small's shape on a GPU (8 sequences of 1,024 tokens); a small one otherwise.
        layers, heads, width, vocab, context, batch = ((12, 12, 768, 50304, 1024, 8) if device.type == "cuda"
                                                       else (2, 4, 64, 512, 64, 4))
        dtype = torch.bfloat16
        out.append(Workload(f"gpt-{layers}x{width}-bf16-clip", Decoder(layers, heads, width, vocab, context),
                            lambda d: (torch.randint(0, vocab, (batch, context), device=d),
                                       torch.randint(0, vocab, (batch, context), device=d)),
                            _lm, device, clip=1.0, autocast=dtype, adamw=True))
        return out
    if args.gpu_model:
        # ~101M parameters in 34 tensors: width 2432, 17 layers.
        w = 2432
        out.append(Workload("mlp-101M", MLP(w), lambda d: (torch.randn(512, w, device=d), torch.randn(512, w, device=d)),
                            _mse, device))
        return out
    if args.quick:
        w, batch = 64, 32
    else:
        w, batch = 340, 256  # 17 * (340*340 + 340) = 1.97M parameters, 34 tensors
    out.append(Workload(f"mlp-{w}x17", MLP(w), lambda d: (torch.randn(batch, w, device=d), torch.randn(batch, w, device=d)),
                        _mse, device))
    if not args.only_mlp and not args.quick:
        # The same 34 tensors at width 8: compute is negligible, so "added ms" is torchtrace's
        # fixed per-step cost (Python, small kernels, span, metrics) on this machine.
        out.append(Workload("toy-mlp-8x17", MLP(8), lambda d: (torch.randn(4, 8, device=d), torch.randn(4, 8, device=d)),
                            _mse, device))
    if not args.only_mlp:
        d_model, layers, seq, bsz = (32, 1, 16, 4) if args.quick else (128, 2, 64, 16)
        out.append(Workload(f"encoder-d{d_model}x{layers}", Encoder(d_model, layers),
                            lambda d: (torch.randint(0, 1000, (bsz, seq), device=d),
                                       torch.randint(0, 1000, (bsz, seq), device=d)), _lm, device))
        counts = [100] if args.quick else [1000, 3000, 10000]
        for n in counts:
            out.append(Workload(f"tensors-{n}", ManyTensors(n), lambda d: torch.tensor(1.0, device=d), _sum, device))
    return out


# ---------------------------------------------------------------- variants
def seed_checks(model: torch.nn.Module) -> dict:
    """A typical hand-written monitor: per-parameter checks with a host read each."""
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad
            out[name] = (bool(torch.isnan(g).any()), bool(torch.isinf(g).any()), g.norm().item())
        d = p.detach()
        out[name + ".stats"] = (d.mean().item(), d.std().item(), d.norm().item())
    return out


def marks_runner(wl: Workload, least: bool = False, ideal: bool = False):
    """The ``marks`` variant: the floor step on a copy of the model, with the raw clock reads
    and batch size any phase timing needs kept per step, and nothing else. With ``least``, the
    ``least`` variant: also the step's shape key, its lookup in a table (the first step of a
    shape adds it) and the learning rates, what a per-shape FLOP count and per-step rates need."""
    model = copy.deepcopy(wl.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=wl.optimizer.param_groups[0]["lr"])
    clock, impl, batch = time.perf_counter, type(model)._call_impl, wl.batch
    marks: list[float] = []
    kept: collections.deque = collections.deque(maxlen=1024)

    def seam(*args, **kwargs):
        marks.append(clock())
        out = impl(model, *args, **kwargs)
        marks.append(clock())
        return out

    model.__dict__["_compiled_call_impl"] = seam
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: marks.append(clock()))
    optimizer.register_step_post_hook(lambda opt, args, kwargs: marks.append(clock()))
    floor = wl.floor_step

    def marked():
        marks.clear()
        start = clock()
        loss = floor(model, batch, optimizer)
        kept.append((start, clock(), (batch[0] if type(batch) is tuple else batch).shape[:1], *marks))
        return loss

    if not least and not ideal:
        return marked
    table: dict = {}
    if ideal:
        return _ideal_runner(model, optimizer, batch, floor, marks, clock, table)

    def least_marked():
        marks.clear()
        start = clock()
        key = ("train_step", shape_key((model, batch), {}))
        flops = table.get(key)
        if flops is None:
            table[key] = flops = 0
        rates = [group["lr"] for group in optimizer.param_groups]
        loss = floor(model, batch, optimizer)
        kept.append((start, clock(), (batch[0] if type(batch) is tuple else batch).shape[:1], flops, rates, *marks))
        return loss
    return least_marked


def _ideal_runner(model, optimizer, batch, floor, marks, clock, table):
    """The ``ideal`` variant's step: the least capture, then what any implementation of the
    throughput features must do with it on every step, written as lean as Python allows: the
    phases and the data wait (subtractions), the goodput and counter sums, the histograms'
    values kept for bucketing at scrape, and the span's seven throughput attributes."""
    totals = {"productive": 0.0, "data_wait": 0.0, "samples": 0, "flops": 0}
    kept_values: list = []
    spans: collections.deque = collections.deque(maxlen=1024)
    last_end = [None]
    first = batch[0] if type(batch) is tuple else batch

    def ideal_step():
        marks.clear()
        start = clock()
        key = ("train_step", shape_key((model, batch), {}))
        flops = table.get(key)
        if flops is None:
            table[key] = flops = 0
        rates = [group["lr"] for group in optimizer.param_groups]
        loss = floor(model, batch, optimizer)
        end = clock()
        f0, f1, o0, o1 = marks
        forward, backward, update = f1 - f0, o0 - f1, o1 - o0
        before, last_end[0] = last_end[0], end
        wait = start - before if before is not None else 0.0
        samples = first.shape[0] if first.dim() else 1
        totals["productive"] += end - start
        totals["data_wait"] += wait
        totals["samples"] += samples
        totals["flops"] += flops
        kept_values.append((wait, forward, backward, update))
        if len(kept_values) >= 64:
            kept_values.clear()  # bucketed at scrape
        spans.append({"torchtrace.samples": samples, "torchtrace.flops": flops, "torchtrace.lr": rates[0],
                      "torchtrace.data_wait_s": wait, "torchtrace.phase.forward_s": forward,
                      "torchtrace.phase.backward_s": backward, "torchtrace.phase.optimizer_s": update})
        return loss
    return ideal_step


def make_runner(variant: str, wl: Workload):
    """A zero-argument callable running one step of ``variant``."""
    model, batch = wl.model, wl.batch
    if variant in ("marks", "least", "ideal"):
        return marks_runner(wl, least=variant == "least", ideal=variant == "ideal")
    if variant == "bare":
        return lambda: wl.step(model, batch)
    if variant == "floor":
        return lambda: wl.floor_step(model, batch)
    if variant == "devfloor":
        return functools.partial(DeviceFloor(wl).step, model, batch)
    if variant == "seed":
        def seeded():
            loss = wl.step(model, batch)
            loss.item()
            seed_checks(model)
            return loss
        return seeded
    if variant == "anomaly":
        def anomalous():
            with torch.autograd.detect_anomaly(check_nan=True):
                return wl.step(model, batch)
        return anomalous
    level = variant
    optimizer, step = wl.optimizer, wl.step
    if level == "extreme":
        model = copy.deepcopy(wl.model)
        optimizer = torch.optim.SGD(model.parameters(), lr=wl.optimizer.param_groups[0]["lr"])

        def step(m, b):
            optimizer.zero_grad(set_to_none=True)
            loss = wl.loss(m, b)
            loss.backward()
            if wl.clip is not None:
                torch.nn.utils.clip_grad_norm_(m.parameters(), wl.clip)
            optimizer.step()
            return loss
    if level == "extreme":
        # The operation is pinned at EXTREME (the decorator's level), so the rounds' level
        # changes for the other variants leave its hooks in place.
        pinned = tt.debug_operation(name="train_step", model=model, optimizer=optimizer, level="extreme")(step)
        return lambda: pinned(model, batch)
    decorated = tt.debug_operation(name="train_step", model=model, optimizer=optimizer)(step)
    throughput = not level.endswith("-nothr")  # basic-nothr: BASIC without the throughput features
    without_job = level.endswith("-nojob")
    forensics = not level.endswith("-nofx")  # basic-nofx: BASIC with NaN forensics off
    level = level.split("-")[0]

    def instrumented():
        rt = tt_api.get_runtime()
        if rt.level.value != level or rt.settings.throughput != throughput or rt.settings.forensics != forensics:
            rt.settings = rt.settings.replace(throughput=throughput, forensics=forensics)
            rt.set_level(level)
        if without_job:
            with _job_work_taken_away():
                return decorated(model, batch)
        return decorated(model, batch)
    return instrumented


@contextlib.contextmanager
def _job_work_taken_away():
    """The job's per-step work as no-ops for one step (variant basic-nojob): the hang watch's
    phase marks and the black box's stores at the step's end."""
    from torchtrace.job import progress
    from torchtrace.step import job

    saved = progress.step_began, progress.mark, progress.step_ended, job.note_step
    progress.step_began = progress.mark = progress.step_ended = job.note_step = _nothing
    try:
        yield
    finally:
        progress.step_began, progress.mark, progress.step_ended, job.note_step = saved


def _nothing(*args):
    return None


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _torchtrace_threads_cpu() -> float:
    """CPU seconds used so far by torchtrace's own background threads (span export, HTTP server,
    metrics push), so work moved off the training thread is counted, not hidden."""
    total = 0.0
    for t in threading.enumerate():
        if t.name.startswith("torchtrace") and t.ident is not None:
            try:
                total += time.clock_gettime(time.pthread_getcpuclockid(t.ident))
            except (OSError, ProcessLookupError):  # the thread just ended
                pass
    return total


def time_steps(fn, steps: int, device) -> tuple[float, float, float]:
    """(wall, training-thread CPU, torchtrace background-thread CPU) seconds per step.

    The training thread's CPU time leaves out time the thread was not running (another process
    had the core), so on a shared machine it is the steadier of the two; wall time is the
    figure that counts. The background figure is what torchtrace's own threads spent meanwhile.
    """
    _sync(device)
    b0 = _torchtrace_threads_cpu()
    c0 = time.thread_time()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    _sync(device)
    wall, cpu = (time.perf_counter() - t0) / steps, (time.thread_time() - c0) / steps
    return wall, cpu, (_torchtrace_threads_cpu() - b0) / steps


def run_workload(wl: Workload, variants, rounds: int, steps: int, warmup: int, device, budget_s: float):
    runners = {v: make_runner(v, wl) for v in variants}
    for v in variants:  # warm up every path (allocator, autograd graph caches, span machinery)
        for _ in range(warmup):
            runners[v]()
    times: dict[str, list[tuple[float, float, float]]] = {v: [] for v in variants}
    rt = tt_api.get_runtime()
    rt.flush(5.0)
    bg0 = _torchtrace_threads_cpu()
    t_start = time.perf_counter()
    # Each round runs the variants in a fresh order (seeded: the same run gives the same orders).
    # Alternating a fixed order with its reverse ran the variant at either end twice in a row
    # (the end of one round, the start of the next), with its code and data still in the caches:
    # on the toy model the A/A pair read +24.6 us [+21.3, +28.0] apart with basic-aa at an end.
    shuffled = random.Random(1)
    order = list(variants)
    for r in range(rounds):
        shuffled.shuffle(order)
        for v in order:
            # One step untimed first: it pays for the switch from the variant before (a level or
            # setting change, code and data the other variant pushed out of the caches), which a
            # job running one variant all along never pays. Without it the A/A pair read 11 to
            # 26 us apart on the toy model, by position in the round alone.
            runners[v]()
            times[v].append(time_steps(runners[v], steps, device))
        if time.perf_counter() - t_start > budget_s and r >= 2:
            break
    rt.flush(5.0)
    instrumented = sum(len(times[v]) * steps for v in variants if v.startswith(("basic", "advanced", "extreme")))
    # The exporter works in bursts (once a second) whatever variant is running then: its CPU
    # time over the whole run, per instrumented step, is what the steps cost it.
    background = (_torchtrace_threads_cpu() - bg0) / max(instrumented, 1)
    return times, background


def off_call_cost(n: int = 200_000) -> tuple[float, float]:
    """µs per call of a trivial function: plain, and decorated with torchtrace at level off."""
    def f(x):
        return x

    g = tt.debug_operation(f)
    rt = tt_api.get_runtime()
    rt.set_level("off")
    best_plain = best_dec = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        for i in range(n):
            f(i)
        t1 = time.perf_counter()
        for i in range(n):
            g(i)
        t2 = time.perf_counter()
        best_plain = min(best_plain, (t1 - t0) / n)
        best_dec = min(best_dec, (t2 - t1) / n)
    return best_plain * 1e6, best_dec * 1e6


def export_costs(n: int = 2000) -> dict[str, float]:
    """µs on the training thread for the export part of a step: span open + record applied + end
    (handed to the exporter queues), and the metrics update."""
    from types import SimpleNamespace

    from torchtrace.export.spans import apply_record

    rt = tt_api.get_runtime()
    rt.set_level("basic")
    names = [f"layers.{i}.weight" for i in range(34)]
    record = StepRecord(operation="train_step", step=1, level="basic", start_unix_ns=time.time_ns(),
                        end_unix_ns=time.time_ns(), duration_s=0.01, loss=0.5, grad_norm=1.0,
                        grad_names=names, memory={"rss_bytes": 1 << 30}, trace_id="0" * 32)
    scope = SimpleNamespace(name="train_step", step=1, kind="train")
    t0 = time.perf_counter()
    for i in range(n):
        scope.step = i
        span = rt.open_span(scope, DebugLevel.BASIC, None, time.time_ns())
        apply_record(span, record, None, False)
    t1 = time.perf_counter()
    for _ in range(n):
        rt.metrics.observe_step(record)
    t2 = time.perf_counter()
    rt.flush(5.0)
    return {"span_us": (t1 - t0) / n * 1e6, "metrics_us": (t2 - t1) / n * 1e6}


def overhead_check(wl: Workload, device, rounds: int) -> dict[str, float]:
    """torchtrace's self-measured overhead vs the measured difference to bare, at BASIC
    (two-step blocks of each, interleaved; the difference is the median over rounds)."""
    rt = tt_api.get_runtime()
    rt.set_level("basic")
    bare = make_runner("bare", wl)
    inst = make_runner("basic", wl)
    for _ in range(3):
        bare(); inst()
    rt.finish_deferred(block=True)
    walls, threads, selfs = [], [], []
    for _ in range(rounds):
        tb = time_steps(bare, 2, device)
        before = _overhead_total(rt)
        ti = time_steps(inst, 2, device)
        rt.finish_deferred(block=True)
        selfs.append((_overhead_total(rt) - before) / 2)
        walls.append(ti[0] - tb[0])
        threads.append(ti[1] - tb[1])
    return {"self_us": statistics.median(selfs) * 1e6, "delta_us": statistics.median(walls) * 1e6,
            "thread_delta_us": statistics.median(threads) * 1e6}


def _overhead_total(rt) -> float:
    return rt.metrics.value("torchtrace_overhead_seconds_total") or 0.0


def fmt_table(name: str, wl: Workload, times, background: float = 0.0) -> str:
    """Per variant: wall ms/step (median over rounds, min-max), the paired ratio to bare (median
    over rounds of the round's variant/bare ratio: drift that hits a whole round cancels), and
    the cost beyond the floor, paired the same way: the median over rounds of
    (variant - floor), in µs per step and as a share of the bare step. Then the training
    thread's CPU time (paired ratio); below, the CPU time of torchtrace's background threads
    per instrumented step."""
    wall = {v: [t[0] for t in ts] for v, ts in times.items()}
    cpu = {v: [t[1] for t in ts] for v, ts in times.items()}
    rounds = len(wall["bare"])
    has_floor = "floor" in wall
    lines = [f"\n{name}: {wl.n_params / 1e6:.2f}M parameters in {wl.n_tensors} tensors ({rounds} rounds)",
             f"{'variant':<10} {'ms/step':>9} {'min':>9} {'max':>9} {'paired':>7} {'>floor us':>10} {'>floor %':>9} "
             f"{'t.paired':>8}"]
    for v in times:
        med = statistics.median(wall[v])
        paired = statistics.median(a / b for a, b in zip(wall[v], wall["bare"]))
        cpaired = statistics.median(a / b for a, b in zip(cpu[v], cpu["bare"]))
        if has_floor and v not in ("bare", "floor"):
            beyond = statistics.median(a - f for a, f in zip(wall[v], wall["floor"]))
            beyond_pct = statistics.median((a - f) / b for a, f, b in zip(wall[v], wall["floor"], wall["bare"]))
            extra = f"{beyond * 1e6:+10.1f} {beyond_pct * 100:+8.2f}%"
        else:
            extra = f"{'':>10} {'':>9}"
        lines.append(f"{v:<10} {med * 1e3:9.3f} {min(wall[v]) * 1e3:9.3f} {max(wall[v]) * 1e3:9.3f} {paired:7.3f} "
                     f"{extra} {cpaired:8.3f}")
    if "basic" in wall and "basic-nothr" in wall:
        lines.extend(throughput_verdict(wall))
    if "basic" in wall and "basic-nojob" in wall:
        lines.extend(paired_verdict(wall, "basic-nojob", "the job's per-step work"))
    if "basic" in wall and "basic-nofx" in wall:
        lines.extend(paired_verdict(wall, "basic-nofx", "NaN forensics on healthy steps"))
    if "basic" in wall and "devfloor" in wall:
        lines.extend(device_floor_verdict(wall))
    lines.append(f"torchtrace's background threads (span export, HTTP): {background * 1e6:.1f} us CPU per "
                 f"instrumented step")
    return "\n".join(lines)


def throughput_verdict(wall: dict[str, list[float]]) -> list[str]:
    """What the throughput features cost at BASIC (basic - basic-nothr, paired per round), and
    whether that is within noise: its 95 % interval holds 0. An interval that excludes 0 with a
    median no larger than the widest end of the A/A pair's interval (basic - basic-aa, the same
    thing twice, in the same run) is "not told apart": the run was too noisy to say either way,
    and a longer run decides (on a slow day, a real cost of 50-100 us read so on the toy)."""
    def summary(a: str, b: str) -> tuple[float, float, float, float]:
        diffs = [x - y for x, y in zip(wall[a], wall[b])]
        share = statistics.median((x - y) / z for x, y, z in zip(wall[a], wall[b], wall["bare"]))
        return (statistics.median(diffs), share, *median_interval(diffs))

    med, share, lo, hi = summary("basic", "basic-nothr")
    lines = [f"throughput features (basic - basic-nothr, paired per round): {med * 1e6:+.1f} us ({share * 100:+.2f} % "
             f"of bare), 95 % interval of the median [{lo * 1e6:+.1f}, {hi * 1e6:+.1f}] us"]
    noise = None
    if "basic-aa" in wall:
        amed, ashare, alo, ahi = summary("basic", "basic-aa")
        noise = max(abs(alo), abs(ahi))
        lines.append(f"A/A (basic - basic-aa, the same step twice): {amed * 1e6:+.1f} us ({ashare * 100:+.2f} % of bare), "
                     f"95 % interval [{alo * 1e6:+.1f}, {ahi * 1e6:+.1f}] us")
    lines.append(f"throughput features: {noise_verdict(med, lo, hi, noise)}")
    if "marks" in wall and "floor" in wall:
        kmed, kshare, klo, khi = summary("marks", "floor")
        lines.append(f"least phase capture (marks - floor: clock reads and batch size kept, nothing processed): "
                     f"{kmed * 1e6:+.1f} us ({kshare * 100:+.2f} % of bare), 95 % interval [{klo * 1e6:+.1f}, "
                     f"{khi * 1e6:+.1f}] us; the features beyond it: {(med - kmed) * 1e6:+.1f} us")
    if "ideal" in wall and "floor" in wall:
        imed, ishare, ilo, ihi = summary("ideal", "floor")
        within = "holds 0" if ilo <= 0 <= ihi else ("within the A/A difference" if noise is not None and
                                                    abs(imed) <= noise else "above noise")
        lines.append(f"ideal features (ideal - floor: least plus the leanest per-step processing): "
                     f"{imed * 1e6:+.1f} us ({ishare * 100:+.2f} % of bare), 95 % interval [{ilo * 1e6:+.1f}, "
                     f"{ihi * 1e6:+.1f}] us ({within}); the features beyond it: {(med - imed) * 1e6:+.1f} us")
        # Paired per round: what torchtrace's features cost beyond the leanest implementation of them.
        beyond = [(b - n) - (i - f) for b, n, i, f in zip(wall["basic"], wall["basic-nothr"], wall["ideal"],
                                                           wall["floor"])]
        blo, bhi = median_interval(beyond)
        bmed = statistics.median(beyond)
        within = "holds 0" if blo <= 0 <= bhi else ("within the A/A difference" if noise is not None and
                                                    abs(bmed) <= noise else "above noise")
        lines.append(f"the features beyond the ideal ((basic - basic-nothr) - (ideal - floor), paired per round): "
                     f"{bmed * 1e6:+.1f} us, 95 % interval [{blo * 1e6:+.1f}, {bhi * 1e6:+.1f}] us ({within})")
    if "least" in wall and "floor" in wall:
        lmed, lshare, llo, lhi = summary("least", "floor")
        within = "holds 0" if llo <= 0 <= lhi else ("within the A/A difference" if noise is not None and
                                                    abs(lmed) <= noise else "above noise")
        lines.append(f"least capture (least - floor: marks plus the shape key, a table lookup and the learning "
                     f"rates): {lmed * 1e6:+.1f} us ({lshare * 100:+.2f} % of bare), 95 % interval [{llo * 1e6:+.1f}, "
                     f"{lhi * 1e6:+.1f}] us ({within}); the features beyond it: {(med - lmed) * 1e6:+.1f} us")
    return lines


def device_floor_verdict(wall: dict[str, list[float]]) -> list[str]:
    """BASIC beyond the device floor (basic - devfloor, paired per round): in µs, as a share of
    the bare step, with the 95 % interval of the median; and the device floor itself against
    the bare step."""
    floor = [f - b for f, b in zip(wall["devfloor"], wall["bare"])]
    beyond = [x - f for x, f in zip(wall["basic"], wall["devfloor"])]
    share = statistics.median((x - f) / b for x, f, b in zip(wall["basic"], wall["devfloor"], wall["bare"]))
    lo, hi = median_interval(beyond)
    return [f"device floor (devfloor - bare: the fused norm pass and a copy nothing waits for): "
            f"{statistics.median(floor) * 1e6:+.1f} us",
            f"BASIC beyond the device floor (basic - devfloor, paired per round): "
            f"{statistics.median(beyond) * 1e6:+.1f} us ({share * 100:+.2f} % of bare), 95 % interval "
            f"[{lo * 1e6:+.1f}, {hi * 1e6:+.1f}] us"]


def paired_verdict(wall: dict[str, list[float]], without: str, what: str) -> list[str]:
    """What ``what`` costs at BASIC: basic - ``without`` (BASIC with it taken away), paired per
    round, judged as :func:`throughput_verdict` judges the throughput features (against the
    A/A pair, basic - basic-aa, when it ran)."""
    def paired(a: str, b: str) -> tuple[float, float, float]:
        diffs = [x - y for x, y in zip(wall[a], wall[b])]
        return (statistics.median(diffs), *median_interval(diffs))

    med, lo, hi = paired("basic", without)
    line = (f"{what} (basic - {without}, paired per round): {med * 1e6:+.1f} us, 95 % interval "
            f"[{lo * 1e6:+.1f}, {hi * 1e6:+.1f}] us")
    noise = None
    if "basic-aa" in wall:
        amed, alo, ahi = paired("basic", "basic-aa")
        line += f"; A/A {amed * 1e6:+.1f} us [{alo * 1e6:+.1f}, {ahi * 1e6:+.1f}]"
        noise = max(abs(alo), abs(ahi))
    return [line, f"{what}: {noise_verdict(med, lo, hi, noise)}"]


def run_child(script: str, args: list[str], timeout_s: float = 900) -> dict:
    """Run ``python script *args`` as a child benchmark process (one torch thread, no
    ``TORCHTRACE_``/``OTEL_`` settings from this environment) and return the JSON object its
    last line prints; a child that fails ends the benchmark with its error."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHTRACE_", "OTEL_"))}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run([sys.executable, script, *args], env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    if done.returncode != 0:
        raise SystemExit(f"child {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def noise_verdict(median: float, lo: float, hi: float, noise: float | None) -> str:
    """How a paired difference (its median and the 95 % interval of the median) reads against the
    machine's noise: "within noise" when the interval holds 0; "not told apart" when it excludes 0
    but the median is no larger than ``noise``, the widest end of an A/A pair's interval (the same
    thing twice, measured alike), so that a longer run decides; otherwise "above noise", or "below
    noise" for a difference that is a saving.

    >>> noise_verdict(3.0, -1.0, 6.0, None)
    'within noise (the interval holds 0)'
    >>> noise_verdict(3.0, 1.0, 6.0, 4.0)[:20]
    'not told apart from '
    >>> noise_verdict(5.0, 1.0, 6.0, 4.0)
    'above noise'
    >>> noise_verdict(-5.0, -6.0, -1.0, 4.0)
    'below noise (cheaper)'
    """
    if lo <= 0 <= hi:
        return "within noise (the interval holds 0)"
    if noise is not None and abs(median) <= noise:
        return "not told apart from noise (the interval excludes 0, but the A/A pair spreads as wide: a longer run decides)"
    return "above noise" if median > 0 else "below noise (cheaper)"


def median_interval(values: list[float], level: float = 0.95, resamples: int = 2000) -> tuple[float, float]:
    """A bootstrap interval of the median of ``values`` (seeded: the same rounds give the same
    interval). When it holds 0, the rounds cannot tell the difference from the machine's noise.

    >>> median_interval([1.0] * 10)
    (1.0, 1.0)
    """
    rng = random.Random(0)
    n = len(values)
    medians = sorted(statistics.median(rng.choices(values, k=n)) for _ in range(resamples))
    tail = (1 - level) / 2
    return medians[int(tail * resamples)], medians[min(resamples - 1, int((1 - tail) * resamples))]


def workload_plan(wl: Workload, variants, steps: int, rounds: int, quick: bool) -> tuple[list[str], float, int, int]:
    """(variants, time budget in s, steps per variant per round, rounds) for one workload."""
    vs, budget, n, r = list(variants), (12 if quick else 75), steps, rounds
    if quick:
        return vs, budget, n, r
    if wl.name.startswith("encoder"):
        budget = 40
    if wl.name.startswith("toy-"):
        budget, n = 25, 10
    if wl.name.startswith("tensors-"):
        # Per-tensor host reads make the seed-style check minutes long at thousands of
        # tensors; it and detect_anomaly are shown on the 1,000-tensor model only.
        if wl.n_tensors > 1000:
            vs = [v for v in vs if v not in ("seed", "anomaly")]
        budget, n, r = 30, 2, min(rounds, 15)
    return vs, budget, n, r


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, few rounds: a CI smoke test")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--gpu-model", action="store_true", help="one ~100M-parameter MLP (use with --device cuda)")
    p.add_argument("--gpt", action="store_true",
                   help="one GPT-style decoder in bf16 whose step clips its gradients (124M parameters with "
                        "--device cuda; a small one on the CPU)")
    p.add_argument("--only-mlp", action="store_true", help="only the MLP workload")
    p.add_argument("--workloads", default=None,
                   help="comma-separated name prefixes to run (mlp, toy, encoder, tensors); default: all")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="steps per variant per round")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds of timed rounds per workload (default: 25 to 75 by workload); a longer run "
                        "narrows the intervals, the A/A pair's with them")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if "bare" not in variants:
        variants.insert(0, "bare")
    # Short blocks, many rounds: this machine's speed drifts over seconds, and a round of two
    # steps per variant lets the paired ratio cancel that drift (11 rounds of 20 steps could
    # not tell 5 % from noise; 120 rounds of 2 steps put `off` within 0.5 % of bare).
    rounds = args.rounds or (3 if args.quick else 120)
    steps = args.steps or (3 if args.quick else 2)
    warmup = 1 if args.quick else 5

    logging.getLogger("torchtrace").setLevel(logging.ERROR)  # anomaly warnings are not what we time
    warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")
    run_dir = tempfile.mkdtemp(prefix="torchtrace-bench-")
    tt.configure(service_name="overhead-bench", level="basic", prometheus_port=0, run_dir=run_dir,
                 register_atexit=False)
    print(f"# torchtrace overhead benchmark: torch {torch.__version__}, python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, device {device}")
    shown = f"{args.budget:g} s of" if args.budget is not None and not args.rounds else f"up to {rounds}"
    print(f"# {shown} interleaved rounds x {steps} steps per variant (each workload has a time budget);"
          f" medians and min-max over rounds; 'paired' = median over rounds of the round's ratio to bare")
    total0 = time.perf_counter()
    wls = workloads(args, device)
    if args.workloads:
        prefixes = tuple(w.strip() for w in args.workloads.split(",") if w.strip())
        wls = [wl for wl in wls if wl.name.startswith(prefixes)] or wls[:1]
    # The micro measurements first: later workloads can leave the process changed (a leak
    # investigation turns tracemalloc on for a few steps, which slows every allocation).
    plain_us, dec_us = off_call_cost(20_000 if args.quick else 200_000)
    print(f"\nOFF decorated call: {dec_us:.3f} us vs plain {plain_us:.3f} us (+{dec_us - plain_us:.3f} us per call)")
    costs = export_costs(200 if args.quick else 2000)
    print(f"export on the training thread: span start+attributes+end {costs['span_us']:.1f} us/step, "
          f"metrics {costs['metrics_us']:.1f} us/step")
    oc = overhead_check(wls[0], device, 5 if args.quick else 60)
    print(f"torchtrace_overhead_seconds_total ({wls[0].name}, basic, medians): {oc['self_us']:.1f} us/step; "
          f"instrumented - bare: {oc['delta_us']:.1f} us/step wall, {oc['thread_delta_us']:.1f} us/step training-thread CPU")
    from torchtrace.probes.leaks import LeakProbe
    from torchtrace.probes import find_probe

    leak_probe = find_probe(tt_api.get_runtime(), LeakProbe)
    for wl in wls:
        vs, budget, n, r = workload_plan(wl, variants, steps, rounds, args.quick)
        if args.budget is not None:
            budget, r = args.budget, args.rounds or 100_000  # (rounds: until the budget is spent)
        started = leak_probe.investigations if leak_probe is not None else 0
        times, background = run_workload(wl, vs, r, n, warmup, device, budget)
        print(fmt_table(wl.name, wl, times, background), flush=True)
        if leak_probe is not None and leak_probe.investigations > started:
            # Switching variants every two steps moves the heap; the detector's slow path
            # (census + tracemalloc for confirm_steps steps) is then part of what was timed.
            print(f"(leak detector: {leak_probe.investigations - started} investigation(s) started during this "
                  f"workload, {leak_probe.flagged} leak(s) flagged in total)", flush=True)
    if device.type == "cuda":
        wl = wls[0]
        rt = tt_api.get_runtime()
        runner = make_runner("basic", wl)
        runner()
        torch.cuda.synchronize()
        reads0 = readout.reads()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(5):
                # The whole instrumented step runs in error mode: any synchronisation raises.
                runner()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        rt.flush(5.0)
        print(f"\nsync-debug 'error' mode: 5 BASIC steps ran without a synchronisation; "
              f"host reads {readout.reads() - reads0}")
    tt.shutdown()
    print(f"\ntotal benchmark time {time.perf_counter() - total0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
