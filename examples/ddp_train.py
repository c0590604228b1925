"""Data-parallel training observed by torchtrace on every rank.

Run (CPU, gloo):

    torchrun --standalone --nproc_per_node=2 examples/ddp_train.py --steps 20

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--port", default="9464", help="base Prometheus port; local rank r serves on base + r")
    parser.add_argument("--run-dir", default="torchtrace-runs")
    parser.add_argument("--run-id", default=None, help="default: torchrun's run id, shared by all ranks")
    parser.add_argument("--shared-trace", action="store_true", help="one trace id per step across ranks")
    parser.add_argument("--skew-interval", type=int, default=5)
    parser.add_argument("--guard", default="skip", choices=("warn", "skip", "raise"))
    args = parser.parse_args(argv)

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if backend == "nccl" else torch.device("cpu")

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
