"""Scenarios run by ``torchrun`` for tests/distributed (gloo on CPU): one process per rank.

Usage: ``python -m torch.distributed.run --standalone --nproc_per_node=2 _worker.py OUT_DIR SCENARIO...``.
Each rank writes ``OUT_DIR/<scenario>.rank<r>.json`` with what it observed.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torchtrace as tt  # noqa: E402
from torchtrace.measure import gradients as grad_measure  # noqa: E402


class Net(torch.nn.Module):
    """Odd sizes, so shards are uneven (FSDP2 pads them)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Linear(8, 15)
        self.act = torch.nn.Tanh()
        self.head = torch.nn.Linear(15, 3)

    def forward(self, x):
        return self.head(self.act(self.encoder(x)))


def ref_norm(grads) -> tuple[float, list[float]]:
    """Float64 reference, plain loops."""
    per = []
    for g in grads:
        s = 0.0
        for v in g.detach().double().reshape(-1).tolist():
            s += v * v
        per.append(math.sqrt(s))
    return math.sqrt(sum(p * p for p in per)), per


def configure(out: str, **kw) -> None:
    tt.configure(service_name="dist-test", prometheus_port=0, run_dir=os.path.join(out, "runs"),
                 register_atexit=False, strict=True, **kw)


def scenario_shard(out: str, rank: int, world: int) -> dict:
    """Global grad norm with FSDP2 (fully_shard) and with DTensor directly, vs one process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    result: dict = {}
    torch.manual_seed(0)
    full = Net().double()
    x = torch.randn(12, 8, dtype=torch.float64)
    y = torch.randn(12, 3, dtype=torch.float64)
    torch.nn.functional.mse_loss(full(x), y).backward()
    result["ref_total"], result["ref_per"] = ref_norm([p.grad for p in full.parameters()])
    mesh = init_device_mesh("cpu", (world,))

    # 1. DTensor directly: Shard(0) and Replicate gradients on a plain parameter list.
    params = []
    for i, p in enumerate(full.parameters()):
        q = torch.nn.Parameter(distribute_tensor(p.detach().clone(), mesh, [Shard(0) if i % 2 == 0 else Replicate()]))
        q.grad = distribute_tensor(p.grad.clone(), mesh, [Shard(0) if i % 2 == 0 else Replicate()])
        params.append(grad_measure.ParamRef(f"p{i}", q))
    stats = grad_measure.gradient_norms(params)
    result["dtensor_total"] = float(stats.total)
    result["dtensor_per"] = stats.norms.double().tolist()
    result["dtensor_names"] = stats.names
    result["dtensor_scope"] = stats.scope
    local_only = torch.linalg.vector_norm(torch.stack([p.grad.to_local().norm() for p in
                                                       (r.param for r in params)]).double())
    result["local_only_total"] = float(local_only)

    # 2. FSDP2: each rank gets half the batch; the reduce-scatter averages to the full-batch gradient.
    try:
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        model = Net().double()
        fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        configure(out)
        half = x.shape[0] // world
        xs, ys = x[rank * half:(rank + 1) * half], y[rank * half:(rank + 1) * half]
        # inputs=: this step is also the one whose FLOPs are counted, under FSDP2's collectives
        with tt.debug_context("train_step", model=model, optimizer=opt, inputs=(xs, ys)) as step:
            loss = torch.nn.functional.mse_loss(model(xs), ys)
            loss.backward()
            step.record_loss(loss)
            opt.step()
        tt.flush()
        rec = step.record
        from torch.utils.flop_counter import FlopCounterMode

        with FlopCounterMode(display=False) as counter:  # the reference: an unsharded copy, same batch
            torch.nn.functional.mse_loss(Net().double()(xs), ys).backward()
        result["fsdp_flops"], result["fsdp_flops_ref"] = rec.flops, counter.get_total_flops()
        result["fsdp_samples"] = rec.samples
        result["fsdp_total"] = rec.grad_norm
        result["fsdp_scope"] = rec.grad_norm_scope
        result["fsdp_names"] = rec.grad_names
        result["fsdp_per"] = rec.grad_norms
        result["collectives"] = tt.api.get_runtime().report()["distributed"]["collectives"]
        tt.shutdown()
    except Exception as exc:  # shown in the result; the test decides
        result["fsdp_error"] = f"{type(exc).__name__}: {exc}"
    return result


def _replicas(model: torch.nn.Module) -> tuple[bool, bool]:
    """(whether every rank holds the same parameters, bit for bit; whether this rank's are finite)."""
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.zeros_like(params) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, params)
    return all(torch.equal(gathered[0], t) for t in gathered), bool(torch.isfinite(params).all())


def _ddp_steps(out: str, rank: int, guard: str, nan_step: int, steps: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    configure(out, guard=guard)
    g = torch.Generator().manual_seed(100 + rank)
    skipped, raised_at, message = [], None, None
    for i in range(steps):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 3, generator=g)
        try:
            with tt.debug_context("train_step", model=model, optimizer=opt) as step:
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()  # DDP all-reduces here
                if rank == 1 and i == nan_step:
                    model.module.head.weight.grad[0, 0] = float("nan")  # after the all-reduce: rank 1 only
                opt.step()
                opt.zero_grad()
        except tt.NonFiniteError as exc:
            raised_at, message = i, str(exc)
            break
        if step.record.skipped:
            skipped.append(i)
    same, finite = _replicas(model)
    tt.shutdown()
    return {"skipped": skipped, "raised_at": raised_at, "message": message, "params_equal": same,
            "params_finite": finite}


def scenario_guard(out: str, rank: int, world: int) -> dict:
    """A NaN on rank 1 only: both ranks skip (guard=skip) or raise (guard=raise) in the same step."""
    return {"skip": _ddp_steps(out, rank, "skip", nan_step=3, steps=6),
            "raise": _ddp_steps(out, rank, "raise", nan_step=2, steps=6)}


def scenario_minibatches(out: str, rank: int, world: int) -> dict:
    """A PPO update's minibatch loop inside one step that names only its DDP model: a NaN on
    rank 1 alone, planted after the all-reduce in the third minibatch of step 1. Every rank
    must skip that update and the step's later ones, agreeing in the same collective."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(Net())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    configure(out, guard="skip")
    g = torch.Generator().manual_seed(100 + rank)
    records = []
    for step in range(2):
        with tt.debug_context("ppo_update", model=model) as scope:
            for minibatch in range(4):
                x, y = torch.randn(4, 8, generator=g), torch.randn(4, 3, generator=g)
                loss = torch.nn.functional.mse_loss(model(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()  # DDP all-reduces here
                if rank == 1 and (step, minibatch) == (1, 2):
                    model.module.head.weight.grad[0, 0] = float("nan")  # after the all-reduce: rank 1 only
                opt.step()
        records.append({"skipped": scope.record.skipped, "peer": scope.record.guard_peer_nonfinite})
    same, finite = _replicas(model)
    tt.shutdown()
    return {"records": records, "params_equal": same, "params_finite": finite}


def scenario_skew(out: str, rank: int, world: int) -> dict:
    """Independent models (no per-step sync); rank 1 is slowed by a sleep inside each step."""
    torch.manual_seed(rank)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    configure(out, rank_skew_interval=4)
    for i in range(8):
        with tt.debug_context("train_step", model=model, optimizer=opt):
            if rank == 1:
                time.sleep(0.05)
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    rt = tt.api.get_runtime()
    report = rt.report()["distributed"]
    import urllib.request

    with urllib.request.urlopen(rt.metrics_url, timeout=10) as resp:  # this rank's own /metrics
        scraped = resp.read().decode()
    steps_lines = [ln for ln in scraped.splitlines() if ln.startswith("torchtrace_steps_total{")]
    skew_value = rt.metrics.registry.get_sample_value("torchtrace_rank_step_skew",
                                                      {"run_id": rt.settings.run_id, "rank": str(rank)})
    tt.shutdown()
    return {"skew_gauge": skew_value, "rank_skew": report["rank_skew"], "collectives": report["collectives"],
            "steps_lines": steps_lines, "metrics_port": rt.server.port}


def scenario_crash(out: str, rank: int, world: int) -> dict:
    """Rank 1 raises at step 2; rank 0 goes on into DDP's all-reduce and must not hang."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    configure(out, guard="skip")
    for i in range(50):
        with tt.debug_context("train_step", model=model, optimizer=opt):
            if rank == 1 and i == 2:
                raise RuntimeError("rank 1 fails on purpose")
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    return {"finished": True}


def main() -> int:
    """Run the named scenarios in order in the same processes (starting torch is the slow part)."""
    out, scenarios = sys.argv[1], sys.argv[2:]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    for scenario in scenarios:
        t0 = time.monotonic()
        result = globals()[f"scenario_{scenario}"](out, rank, world)
        result["rank"] = rank
        result["seconds"] = time.monotonic() - t0
        with open(os.path.join(out, f"{scenario}.rank{rank}.json"), "w") as fh:
            json.dump(result, fh)
        dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
