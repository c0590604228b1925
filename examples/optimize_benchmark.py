"""What does each optimization mode buy on this model? Measure it.

    python examples/optimize_benchmark.py                     # CPU: bfloat16 AMP, inductor if a C++ compiler exists
    python examples/optimize_benchmark.py --backend aot_eager # compile fast, for a quick look
    python examples/optimize_benchmark.py --device cuda       # GPU: float16 AMP with a GradScaler

Prints one row per mode: median step time and its spread, the speedup over NONE, memory
(CUDA peak allocated, or on CPU the activations saved for backward) and its saving, and the
largest loss difference against NONE over the same batches from the same start.
"""
import argparse
import json

import torch
from torch import nn

import torchtrace as tt


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        return x + self.ff(self.norm(x))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    tt.configure(service_name="optimize-benchmark", prometheus_port=None)
    torch.manual_seed(0)
    d = args.width
    model = nn.Sequential(nn.Linear(d, d), *[Block(d) for _ in range(args.depth)], nn.Linear(d, 10)).to(args.device)
    batches = [(torch.randn(args.batch, d), torch.randint(0, 10, (args.batch,))) for _ in range(4)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    results = tt.benchmark_optimizations(model, batches, opt, nn.functional.cross_entropy,
                                         warmup=args.warmup, steps=args.steps, compile_backend=args.backend)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results.as_dict(), fh, indent=2)
    tt.shutdown()


if __name__ == "__main__":
    main()
