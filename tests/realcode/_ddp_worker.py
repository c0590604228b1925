"""The real-code suite's DDP job (``torchrun --nproc_per_node=2``, gloo on CPU): the four planted
faults under ``warn`` and ``skip``, each in a fresh torchtrace run, and a run of gradient
accumulation under ``no_sync()``, all in one launch.

Usage: ``python -m torch.distributed.run ... _ddp_worker.py OUT_DIR``; each rank writes
``OUT_DIR/ddp.rank<r>.json``: per guard and fault, the forensic reports, each step's skip
decision, and a checksum of the final parameters.

``_ddp_worker.py OUT_DIR rank0_only`` runs the job of a script that configures torchtrace
(``guard="skip"``) on rank 0 alone; the key is ``rank0_only/skip``.

``_ddp_worker.py OUT_DIR rank0_ops`` runs an evaluation and checkpoints on rank 0 alone.

``_ddp_worker.py OUT_DIR one_nan GUARD`` runs the issue's job alone: DistributedDataParallel at
its defaults (no ``find_unused_parameters``), an Inf weight planted on rank 1 before step 15,
default torchtrace settings; the key is ``one_nan/GUARD``.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torchtrace as tt  # noqa: E402
from tests.realcode import models  # noqa: E402
from torchtrace.api import get_runtime  # noqa: E402

STEPS = 5
BAD_STEP = 3  # the fault is planted for this step (huge_lr: its update; the next step is the bad one)
MICRO_BATCHES = 4
ONE_NAN_STEPS = 18
ONE_NAN_BAD_STEP = 15


def run_case(out: str, rank: int, guard: str, fault: str, max_replays: int = 3, steps: int = STEPS,
             bad_step: int = BAD_STEP, defaults: bool = False, configured_on: int | None = None) -> dict:
    """One torchtrace run of ``steps`` steps with ``fault`` planted at ``bad_step``. ``defaults``:
    torchtrace's default settings and DistributedDataParallel's (the nan_input fault leaves the
    token embedding unused, which DDP's defaults refuse: use it only with the other faults).
    ``configured_on``: only that rank calls ``configure()``; the others are configured from their
    environment at their first step."""
    run_dir = os.path.join(out, guard, fault)
    if configured_on is not None and rank != configured_on:
        os.environ["TORCHTRACE_PROMETHEUS_PORT"] = "off"
    elif defaults:
        tt.configure(service_name="realcode-ddp", prometheus_port="off", run_dir=run_dir, register_atexit=False,
                     guard=guard)
    else:
        tt.configure(service_name="realcode-ddp", prometheus_port="off", run_dir=run_dir, register_atexit=False,
                     strict=True, guard=guard, throughput=False, forensics_max_replays=max_replays)
    torch.manual_seed(0)
    inner = models.TinyGPT()
    if defaults:
        model = torch.nn.parallel.DistributedDataParallel(inner)
    else:
        model = torch.nn.parallel.DistributedDataParallel(inner, find_unused_parameters=True)
    opt = torch.optim.SGD(models.gpt_param_groups(inner, "lm_head"), lr=0.1)

    @tt.debug_operation
    def train_step(model, idx, targets, opt):
        opt.zero_grad(set_to_none=True)
        _, loss = model(idx, targets)
        loss.backward()
        opt.step()
        return loss

    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data, as a sampler gives
    decisions = []
    for step in range(steps):
        idx, targets = models.gpt_batch(gen)
        saved = None
        if step == bad_step:
            if fault == "inf_weight" and rank == 1:
                saved = inner.h[0].mlp.c_fc.weight.detach().clone()
                models.plant_inf_weight(inner.h[0].mlp.c_fc)
            elif fault == "attention_overflow" and rank == 1:
                saved = models.plant_attention_overflow(inner.h[0].attn.c_attn)
            elif fault == "huge_lr":
                opt.param_groups[0]["lr"] = models.HUGE_LR
            elif fault == "nan_input":
                embeds = models.nan_embeddings(inner, idx) if rank == 1 else inner.wte(idx).detach()
                idx = embeds
        train_step(model, idx, targets, opt)
        record = get_runtime().history.last_record
        decisions.append({"step": step, "skipped": bool(record.skipped), "nonfinite": bool(record.nonfinite)})
        if fault == "huge_lr" and step == bad_step:
            opt.param_groups[0]["lr"] = 0.1
        if saved is not None and record.skipped:  # a transient fault: the skipped step left no trace
            target = inner.h[0].mlp.c_fc.weight if fault == "inf_weight" else inner.h[0].attn.c_attn.weight
            models.put_back(target, saved)
    rt = get_runtime()
    result = {"reports": list(rt.forensics.reports), "decisions": decisions, "identical": _identical_across_ranks(inner),
              "guard": rt.guard.value,
              "internal_errors": rt.errors.total if isinstance(getattr(rt.errors, "total", None), int) else None}
    tt.shutdown()
    return result


def run_accumulation(out: str, rank: int) -> dict:
    """Gradient accumulation under ``guard="skip"``: each step runs ``MICRO_BATCHES`` micro-batches,
    all but the last inside ``no_sync()``, in a ``debug_context`` given the module DDP wraps (as
    ``model=ddp.module``) and a replay of the whole step. A NaN in rank 1's second micro-batch of
    step ``BAD_STEP`` reaches rank 0 only through the last micro-batch's all-reduce."""
    tt.configure(service_name="realcode-ddp", prometheus_port="off", run_dir=os.path.join(out, "accumulate"),
                 register_atexit=False, strict=True, guard="skip", throughput=False)
    torch.manual_seed(0)
    inner = models.TinyGPT()
    model = torch.nn.parallel.DistributedDataParallel(inner, find_unused_parameters=True)
    opt = torch.optim.SGD(inner.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + rank)

    def micro_batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        batches = []
        for i in range(MICRO_BATCHES):
            idx, targets = models.gpt_batch(gen)
            bad = step == BAD_STEP and i == 1 and rank == 1
            embeds = models.nan_embeddings(inner, idx) if bad else inner.wte(idx).detach()
            batches.append((embeds, targets))
        return batches

    def accumulate(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for i, (embeds, targets) in enumerate(batches):
            sync = i == len(batches) - 1  # the all-reduce runs in the last micro-batch's backward
            with contextlib.nullcontext() if sync else model.no_sync():
                _, loss = model(embeds, targets)
                (loss / len(batches)).backward()
            total = total + loss.detach() / len(batches)
        opt.step()
        return total

    decisions = []
    for step in range(STEPS):
        batches = micro_batches(step)
        with tt.debug_context("train_step", model=inner, optimizer=opt,
                              replay=lambda: accumulate(batches)) as scope:
            scope.record_loss(accumulate(batches))
        decisions.append({"step": step, "skipped": bool(scope.record.skipped),
                          "nonfinite": bool(scope.record.nonfinite)})
    result = {"reports": list(get_runtime().forensics.reports), "decisions": decisions,
              "identical": _identical_across_ranks(inner)}
    tt.shutdown()
    return result


def run_fsdp1(out: str, rank: int, instrument: bool) -> dict:
    """FSDP (the first API, flat parameters) under ``guard="warn"``, a decorated step: at step 3
    rank 1's loss is NaN (an empty selection) while every gradient stays finite, so rank 1
    alone finds its step non-finite. ``instrument``: with torchtrace, or the plain loop.
    Returns each step's loss and whether the ranks' parameters agree at the end."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if instrument:
        tt.configure(service_name="realcode-ddp", prometheus_port="off", run_dir=os.path.join(out, "fsdp1"),
                     register_atexit=False, strict=True, guard="warn", throughput=False)
    torch.manual_seed(0)
    inner = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 3))
    model = FullyShardedDataParallel(inner, device_id=torch.device("cpu"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train_step(x, y, keep):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x)[keep], y[keep])
        loss.backward()
        opt.step()
        return loss

    if instrument:
        train_step = tt.debug_operation(name="train_step", model=model, optimizer=opt)(train_step)
    data = torch.Generator().manual_seed(100 + rank)
    losses, scopes = [], []
    for step in range(STEPS + 1):
        x, y = torch.randn(4, 7, generator=data), torch.randn(4, 3, generator=data)
        keep = torch.full((4,), not (step == BAD_STEP and rank == 1))
        losses.append(float(train_step(x, y, keep)))
        if instrument:
            scopes.append(get_runtime().history.last_record.grad_norm_scope)
    with FullyShardedDataParallel.summon_full_params(model):
        identical = _identical_across_ranks(model)
    result = {"losses": losses, "identical": identical, "scopes": scopes}
    if instrument:
        result["reports"] = list(get_runtime().forensics.reports)
        tt.shutdown()
    return result


def run_join(out: str, rank: int, instrument: bool) -> dict:
    """Uneven inputs under ``Join``: rank 0 has 3 batches, rank 1 has 6; a decorated step under
    ``guard="skip"`` with a straggler check every 2 steps, so torchtrace's own collectives (the
    guard's agreement, the skew check) would run while rank 0 has joined. ``instrument``: with
    torchtrace, or the plain loop. Returns the losses and whether the ranks' parameters agree."""
    from torch.distributed.algorithms.join import Join

    if instrument:
        tt.configure(service_name="realcode-ddp", prometheus_port="off", run_dir=os.path.join(out, "join"),
                     register_atexit=False, strict=True, guard="skip", throughput=False, rank_skew_interval=2)
    torch.manual_seed(0)
    inner = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    model = torch.nn.parallel.DistributedDataParallel(inner)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train_step(x, y):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    if instrument:
        train_step = tt.debug_operation(name="train_step", model=model, optimizer=opt)(train_step)
    data = torch.Generator().manual_seed(100 + rank)
    losses = []
    with Join([model]):
        for _ in range(3 if rank == 0 else 6):
            losses.append(float(train_step(torch.randn(4, 4, generator=data), torch.randn(4, 1, generator=data))))
    result = {"losses": losses, "identical": _identical_across_ranks(inner)}
    if instrument:
        tt.shutdown()
    return result


def run_rank0_operations(out: str, rank: int) -> dict:
    """Operations rank 0 runs alone, as DDP scripts do: an evaluation before training followed
    by a barrier, and a checkpoint saved after every step, each marked as the docs show
    (``debug_context(kind=...)``), under a skew check every 2 steps. Returns the losses, whether
    the ranks' parameters agree, and the collectives torchtrace issued."""
    tt.configure(service_name="realcode-ddp", prometheus_port="off", run_dir=os.path.join(out, "rank0_ops"),
                 register_atexit=False, strict=True, guard="skip", rank_skew_interval=2)
    torch.manual_seed(0)
    inner = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    model = torch.nn.parallel.DistributedDataParallel(inner)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @tt.debug_operation(name="train_step", model=model, optimizer=opt)
    def train_step(x, y):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    data = torch.Generator().manual_seed(100 + rank)
    if rank == 0:
        with tt.debug_context("evaluate", kind="evaluation"), torch.no_grad():
            inner(torch.randn(4, 4, generator=data))
    dist.barrier()
    losses = []
    for step in range(6):
        losses.append(float(train_step(torch.randn(4, 4, generator=data), torch.randn(4, 1, generator=data))))
        if rank == 0:
            with tt.debug_context("save", kind="checkpoint"):
                torch.save(inner.state_dict(), os.path.join(out, "rank0_ops.pt"))
    result = {"losses": losses, "identical": _identical_across_ranks(inner),
              "collectives": get_runtime().report()["distributed"]["collectives"]}
    tt.shutdown()
    return result


def _identical_across_ranks(model: torch.nn.Module) -> bool:
    """Every rank holds the same parameters (NaN where the others hold NaN)."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).to(torch.float64)
    gathered = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(torch.nan_to_num(g, 0.0, 1.0, -1.0), torch.nan_to_num(flat, 0.0, 1.0, -1.0))
               and torch.equal(g.isnan(), flat.isnan()) for g in gathered)


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    if sys.argv[2:3] == ["one_nan"]:
        guard = sys.argv[3]
        result = run_case(os.path.join(out, "one_nan"), rank, guard, "inf_weight", steps=ONE_NAN_STEPS,
                          bad_step=ONE_NAN_BAD_STEP, defaults=True)
        with open(os.path.join(out, f"one_nan.rank{rank}.json"), "w") as f:
            json.dump({f"one_nan/{guard}": result}, f, default=str)
        dist.destroy_process_group()
        return
    if sys.argv[2:3] == ["rank0_only"]:
        result = run_case(os.path.join(out, "rank0_only"), rank, "skip", "inf_weight", defaults=True, configured_on=0)
        with open(os.path.join(out, f"rank0_only.rank{rank}.json"), "w") as f:
            json.dump({"rank0_only/skip": result}, f, default=str)
        dist.destroy_process_group()
        return
    if sys.argv[2:3] == ["rank0_ops"]:
        result = run_rank0_operations(out, rank)
        with open(os.path.join(out, f"rank0_ops.rank{rank}.json"), "w") as f:
            json.dump(result, f, default=str)
        dist.destroy_process_group()
        return
    results = {}
    for guard in ("warn", "skip"):
        for fault in models.FAULTS:
            results[f"{guard}/{fault}"] = run_case(out, rank, guard, fault)
            dist.barrier()
    # Only rank 1 replays (rank 0 has no replay budget): a replay that issued DDP's collectives
    # would wait for a rank that never joins it.
    results["lonely/nan_input"] = run_case(os.path.join(out, "lonely"), rank, "warn", "nan_input",
                                           max_replays=0 if rank == 0 else 3)
    results["accumulate/nan_input"] = run_accumulation(out, rank)
    results["fsdp1/plain"] = run_fsdp1(out, rank, instrument=False)
    results["fsdp1/warn"] = run_fsdp1(out, rank, instrument=True)
    results["join/plain"] = run_join(out, rank, instrument=False)
    results["join/skip"] = run_join(out, rank, instrument=True)
    with open(os.path.join(out, f"ddp.rank{rank}.json"), "w") as f:
        json.dump(results, f, default=str)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
