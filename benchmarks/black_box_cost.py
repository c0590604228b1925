"""What the black box's writer thread costs the training: processes with it running and stopped.

The writer rewrites the rank's black box (``state.json``) every 0.5 s on a thread of its own.
Its cost to the training thread comes in rare moments (a rewrite holds the GIL for a
millisecond or so, twice a second), which the medians over short rounds of
``benchmarks/overhead.py`` cannot see: a stall in one round of hundreds leaves the median where
it was, and the writer runs during every variant there. So this benchmark compares whole
processes and means: each child trains a workload for ``--seconds``, bare and BASIC steps in
alternating blocks, and reports the mean time of each over all its steps. In ``on`` children the
writer runs as it does in any job; in ``off`` children it is stopped after ``configure()``.
Children run in shuffled triples (on, on, off): the two ``on`` children are the A/A pair, the
spread this machine gives two identical processes, which the difference on - off is judged
against.

    python benchmarks/black_box_cost.py --workloads toy,mlp --triples 6 --seconds 10
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from overhead import MLP, Workload, make_runner, median_interval, noise_verdict  # noqa: E402
from overhead import run_child as overhead_child  # noqa: E402

import torchtrace as tt  # noqa: E402
from torchtrace import api as tt_api  # noqa: E402

BLOCK_STEPS = 20  # steps of one kind in a row: long enough to hold a rewrite now and then


def child(workload: str, writer: str, seconds: float) -> dict[str, float]:
    """Train ``workload`` for ``seconds``: bare and BASIC steps in alternating blocks. The mean
    seconds a step of each, the black box's rewrites meanwhile, and its thread's CPU time."""
    torch.set_num_threads(1)
    logging.getLogger("torchtrace").setLevel(logging.ERROR)
    run_dir = tempfile.mkdtemp(prefix="torchtrace-bb-")
    tt.configure(service_name="black-box-bench", level="basic", prometheus_port=0, run_dir=run_dir,
                 register_atexit=False)
    rt = tt_api.get_runtime()
    box = rt.rank_state
    if box is None:
        raise SystemExit("no black box in this configuration")
    if writer == "off":
        box.stop()
    wl = _workload(workload)
    bare, basic = make_runner("bare", wl), make_runner("basic", wl)
    for _ in range(5):
        bare()
        basic()
    spent = {"bare": 0.0, "basic": 0.0}
    steps = {"bare": 0, "basic": 0}
    writes0, cpu0 = box.writes, _writer_cpu()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for name, run in (("bare", bare), ("basic", basic)):
            t0 = time.perf_counter()
            for _ in range(BLOCK_STEPS):
                run()
            spent[name] += time.perf_counter() - t0
            steps[name] += BLOCK_STEPS
    result = {"bare_s": spent["bare"] / steps["bare"], "basic_s": spent["basic"] / steps["basic"],
              "rewrites": box.writes - writes0, "writer_cpu_s": _writer_cpu() - cpu0,
              "seconds": sum(spent.values())}
    tt.shutdown()
    return result


def _workload(name: str) -> Workload:
    """overhead.py's toy (34 tensors, negligible compute) or 1.97M-parameter MLP."""
    torch.manual_seed(0)
    width, batch = {"toy": (8, 4), "mlp": (340, 256)}[name]
    return Workload(f"{name}-{width}x17", MLP(width),
                    lambda d: (torch.randn(batch, width, device=d), torch.randn(batch, width, device=d)), _mse,
                    torch.device("cpu"))


def _mse(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def _writer_cpu() -> float:
    """CPU seconds the black box's writer thread has used (0 when it is not running)."""
    for t in threading.enumerate():
        if t.name == "torchtrace-blackbox" and t.ident is not None:
            try:
                return time.clock_gettime(time.pthread_getcpuclockid(t.ident))
            except (OSError, ProcessLookupError):
                return 0.0
    return 0.0


def run_child(workload: str, writer: str, seconds: float) -> dict[str, float]:
    return overhead_child(__file__, ["--child", writer, "--workloads", workload, "--seconds", str(seconds)], 600)


def compare(workload: str, triples: int, seconds: float) -> list[str]:
    """Shuffled triples of children; the added cost (basic - bare, mean per step) of each child,
    then on - off and the A/A pair (on - on), each paired within its triple."""
    shuffle = random.Random(1)
    added: dict[str, list[float]] = {"on": [], "on2": [], "off": []}
    rewrites: dict[str, list[int]] = {"on": [], "off": []}
    writer_cpu: list[float] = []
    bare_ms: list[float] = []
    for _ in range(triples):
        order = ["on", "on2", "off"]
        shuffle.shuffle(order)
        for kind in order:
            r = run_child(workload, "off" if kind == "off" else "on", seconds)
            added[kind].append(r["basic_s"] - r["bare_s"])
            rewrites["off" if kind == "off" else "on"].append(int(r["rewrites"]))
            bare_ms.append(r["bare_s"] * 1e3)
            if kind != "off":
                writer_cpu.append(r["writer_cpu_s"] / r["seconds"])
    diff = [a - b for a, b in zip(added["on"], added["off"])]
    aa = [a - b for a, b in zip(added["on"], added["on2"])]
    lo, hi = median_interval(diff)
    alo, ahi = median_interval(aa)
    noise = max(abs(alo), abs(ahi))
    med = statistics.median(diff)
    verdict = noise_verdict(med, lo, hi, noise)
    us = 1e6
    return [
        f"\n{workload}: {triples} triples of {seconds:g} s children; "
        f"bare step {statistics.median(bare_ms):.3f} ms (median)",
        f"BASIC adds, mean per step: writer on {statistics.median(added['on']) * us:.1f} us, "
        f"on again {statistics.median(added['on2']) * us:.1f} us, off {statistics.median(added['off']) * us:.1f} us",
        f"the writer (on - off, per triple): {med * us:+.1f} us, 95 % interval [{lo * us:+.1f}, {hi * us:+.1f}] us; "
        f"A/A (on - on) {statistics.median(aa) * us:+.1f} us [{alo * us:+.1f}, {ahi * us:+.1f}]",
        f"the writer: {verdict}",
        f"rewrites a child: on {statistics.median(rewrites['on']):g}, off {statistics.median(rewrites['off']):g}; "
        f"the writer's CPU: {statistics.median(writer_cpu) * 1e3:.2f} ms a second of training",
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="toy,mlp", help="comma-separated: toy, mlp")
    p.add_argument("--triples", type=int, default=6)
    p.add_argument("--seconds", type=float, default=10.0, help="training time of each child")
    p.add_argument("--child", choices=("on", "off"), help=argparse.SUPPRESS)  # (one child process)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.workloads, args.child, args.seconds)))
        return 0
    print(f"# the black box's writer thread: torch {torch.__version__}, python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs, torch threads 1; children of {args.seconds:g} s in shuffled triples (on, on, off)")
    for workload in (w.strip() for w in args.workloads.split(",") if w.strip()):
        print("\n".join(compare(workload, args.triples, args.seconds)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
