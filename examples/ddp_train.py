"""Data-parallel training observed by torchtrace on every rank.

Run:

    torchrun --standalone --nproc_per_node=2 examples/ddp_train.py --steps 20

With a GPU for every local rank the ranks train on them (NCCL); otherwise all of them train on
the CPU (gloo). ``--device cpu`` or ``--device cuda`` decides instead.

Each rank serves its metrics on base port + local rank (9464, 9465, ...; ``--port 0`` for any
free port), writes ``spans.rank<r>.jsonl`` and ``report.rank<r>.json`` into the shared run
directory, and labels every span and series with its rank. With ``--shared-trace`` all ranks'
spans of one step share one trace id, so Jaeger shows a step across ranks together.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torchtrace as tt  # noqa: E402


def pick_device(choice: str, gpus: int, local_rank: int, ranks_per_node: int) -> torch.device:
    """One GPU per local rank (NCCL), or every rank on the CPU (gloo): the ranks of a node decide
    alike, so two ranks on a one-GPU machine both run on the CPU ("auto")."""
    if choice == "cuda" or (choice == "auto" and gpus >= ranks_per_node > 0):
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--port", default="9464", help="base Prometheus port; local rank r serves on base + r")
    parser.add_argument("--run-dir", default="torchtrace-runs")
    parser.add_argument("--run-id", default=None, help="default: torchrun's run id, shared by all ranks")
    parser.add_argument("--shared-trace", action="store_true", help="one trace id per step across ranks")
    parser.add_argument("--skew-interval", type=int, default=5)
    parser.add_argument("--guard", default="skip", choices=("warn", "skip", "raise"))
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="auto: a GPU per local rank when there are enough, else the CPU")
    args = parser.parse_args(argv)

    device = pick_device(args.device, torch.cuda.device_count(), int(os.environ.get("LOCAL_RANK", 0)),
                         int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()

    result = tt.configure(service_name="ddp-example", prometheus_port=args.port, run_dir=args.run_dir, run_id=args.run_id,
                          guard=args.guard, shared_step_trace=args.shared_trace,
                          rank_skew_interval=args.skew_interval)
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).to(device))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank sees its own data shard

    @tt.debug_operation(name="train_step", model=model, optimizer=opt)
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    for _ in range(args.steps):
        x = torch.randn(32, 16, generator=gen).to(device)
        train_step(x, x.sum(dim=1, keepdim=True))

    rt = tt.api.get_runtime()
    last = rt.history.last_record
    print(f"rank {rank}: steps={args.steps} loss={last.loss:.4f} grad_norm={last.grad_norm:.4f} "
          f"metrics={result.metrics_url} spans={result.spans_path}", flush=True)
    tt.shutdown()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
