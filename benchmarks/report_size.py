"""The report's size for a diverged model, against its number of tensors and the length of
their names (issue 53, item 1: the size must grow with the retained steps, not the model).

Run from the repository root: ``python benchmarks/report_size.py 5000 131 1000`` (tensors,
name length, steps; a few minutes on 2 CPU cores for 5,000 tensors and 1,000 steps). The model
has ``tensors`` parameter tensors of 4 elements named ``p<i>_`` padded with x to the name
length (0: ``p<i>``); its loss is NaN, so every gradient is. BASIC level, forensics off,
the default ``history_size`` (1,000). It prints the report's size, the shutdown time and the
largest sections of the report.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

import torchtrace as tt


class Named(torch.nn.Module):
    """``tensors`` parameter tensors of 4 elements with names of ``name_len`` characters."""

    def __init__(self, tensors: int, name_len: int) -> None:
        super().__init__()
        for i in range(tensors):
            name = f"p{i}_".ljust(name_len, "x") if name_len else f"p{i}"
            self.register_parameter(name, torch.nn.Parameter(torch.randn(4)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(list(self.parameters())) * x


def measure(tensors: int, name_len: int, steps: int, run_dir: str) -> dict:
    """Train ``steps`` diverged steps and return the report's size and what fills it."""
    torch.set_num_threads(1)
    model = Named(tensors, name_len)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tt.configure(prometheus_port=None, run_dir=run_dir, register_atexit=False, forensics=False)
    x = torch.ones(4 * tensors)
    for _ in range(steps):
        with tt.debug_context("train_step", model=model, optimizer=opt) as step:
            loss = (model(x) * float("nan")).sum()
            opt.zero_grad(set_to_none=False)
            loss.backward()
            step.record_loss(loss)
            opt.step()
    t0 = time.monotonic()
    tt.shutdown()
    shutdown_s = time.monotonic() - t0
    [path] = list(Path(run_dir).glob("*/report*.json"))
    data = json.loads(path.read_text())
    sections = sorted(((k, len(json.dumps(v))) for k, v in data.items()), key=lambda kv: -kv[1])[:4]
    return {"bytes": path.stat().st_size, "shutdown_s": round(shutdown_s, 3), "largest_sections": sections}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tensors", type=int)
    parser.add_argument("name_len", type=int)
    parser.add_argument("steps", type=int)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = measure(args.tensors, args.name_len, args.steps, tmp)
    print(f"{args.tensors} tensors, names of {args.name_len or 'p<i>'} characters, {args.steps} steps: "
          f"report {result['bytes'] / 1e6:.2f} MB, shutdown {result['shutdown_s']} s, "
          f"largest sections {result['largest_sections']}")


if __name__ == "__main__":
    main()
