"""What forensics costs: nothing on healthy steps, one replay on the step that went wrong.

Run from the repository root: ``python benchmarks/forensics_cost.py`` (about 30 s on 2 CPU cores).
Prints a table: median step time of an uninstrumented step, of BASIC without forensics and of
BASIC with forensics (the default) on healthy steps, their ratio, and the cost of a bad step with
and without the replay.
"""

from __future__ import annotations

import logging
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import torchtrace as tt  # noqa: E402

ROUNDS = 5
STEPS = 100


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
        self.norm = torch.nn.LayerNorm(256)
        self.drop = torch.nn.Dropout(0.1)
        self.head = torch.nn.Linear(256, 10)
        self.poison = False

    def forward(self, x):
        h = self.norm(torch.relu(self.encoder(x)))
        if self.poison:
            h = torch.sqrt(h)  # planted: NaN for negative activations
        return self.head(self.drop(h))


def step_fn(model, batch, opt):
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(model(batch[0]), batch[1])
    loss.backward()
    opt.step()
    return loss


def configure(forensics: bool, guard: str = "warn") -> None:
    tt.configure(service_name="bench", prometheus_port="off", write_files=False, register_atexit=False,
                 forensics=forensics, guard=guard, forensics_max_replays=1000)


def time_steps(fn, model, opt, batches) -> float:
    t0 = time.perf_counter()
    for b in batches:
        fn(model, b, opt)
    return (time.perf_counter() - t0) / len(batches)


def main() -> None:
    logging.disable(logging.CRITICAL)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    batches = [(torch.randn(64, 128), torch.randint(0, 10, (64,))) for _ in range(STEPS)]
    traced = tt.debug_operation(step_fn)
    results: dict[str, list[float]] = {"plain": [], "basic, forensics off": [], "basic, forensics on": []}
    for _ in range(ROUNDS):  # interleaved rounds so drift hits all variants alike
        tt.shutdown()
        results["plain"].append(time_steps(step_fn, model, opt, batches))
        configure(False)
        results["basic, forensics off"].append(time_steps(traced, model, opt, batches))
        configure(True)
        results["basic, forensics on"].append(time_steps(traced, model, opt, batches))
    tt.shutdown()
    med = {k: statistics.median(v) for k, v in results.items()}
    spread = {k: (max(v) - min(v)) / statistics.median(v) for k, v in results.items()}
    print("Healthy steps, default guard (warn) (median of %d rounds x %d steps, %s)" % (ROUNDS, STEPS, "CPU, 1 thread"))
    print(f"{'variant':<24}{'ms/step':>10}{'vs plain':>10}{'vs off':>9}{'spread':>9}")
    for k in results:
        print(f"{k:<24}{med[k] * 1e3:>10.3f}{med[k] / med['plain']:>10.3f}"
              f"{med[k] / med['basic, forensics off']:>9.3f}{spread[k]:>9.1%}")

    # The bad step: a planted sqrt of negatives; skip guard, so parameters stay healthy.
    bad: dict[str, list[float]] = {"bad step, forensics off": [], "bad step, forensics on": []}
    replay_s: list[float] = []
    for _ in range(5):
        for forensics in (False, True):
            configure(forensics, guard="skip")
            traced(model, batches[0], opt)  # warm
            model.poison = True
            t0 = time.perf_counter()
            traced(model, batches[1], opt)
            bad[f"bad step, forensics {'on' if forensics else 'off'}"].append(time.perf_counter() - t0)
            model.poison = False
            rt = tt.api.get_runtime()
            if forensics:
                replay_s.append(rt.forensics.reports[-1]["replay_seconds"])
                assert rt.forensics.reports[-1]["module"] == "", rt.forensics.reports[-1]
            tt.shutdown()
    print()
    print("A bad step (planted sqrt of negatives), guard skip, median of 5")
    print(f"{'bad step':<24}{'ms':>10}{'vs healthy':>12}")
    for k, v in bad.items():
        m = statistics.median(v)
        print(f"{k:<24}{m * 1e3:>10.3f}{m / med['basic, forensics on']:>12.1f}")
    print(f"{'replay alone':<24}{statistics.median(replay_s) * 1e3:>10.3f}"
          f"{statistics.median(replay_s) / med['basic, forensics on']:>12.1f}")


if __name__ == "__main__":
    main()
