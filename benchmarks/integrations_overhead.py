"""Overhead of torchtrace's framework callbacks against the same framework without them.

For each framework, runs training with and without ``TorchtraceCallback``, interleaved
(plain, traced, plain, traced, ...), times the steps after a warm-up from inside the
training loop (a timing callback placed last, so torchtrace's hooks fall inside the
window), and prints the median step time of each and their ratio.

    python benchmarks/integrations_overhead.py [--repeats 5] [--steps 60] [--only lightning|transformers]

Results: benchmarks/RESULTS.md (integrations section).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's torchtrace

import torch  # noqa: E402

import torchtrace as tt  # noqa: E402

WARMUP = 5


# ---------------------------------------------------------------- Lightning
def lightning_run(traced: bool, steps: int, tmp: str) -> float:
    import logging

    import lightning.pytorch as pl

    from torchtrace.integrations.lightning import TorchtraceCallback

    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                           torch.nn.ReLU(), torch.nn.Linear(256, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class Timer(pl.Callback):
        def __init__(self):
            self.marks: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.marks.append(time.perf_counter())

    torch.manual_seed(0)
    x = torch.randn(64 * steps, 64)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=64)
    timer = Timer()
    callbacks = ([TorchtraceCallback()] if traced else []) + [timer]
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                         default_root_dir=tmp)
    trainer.fit(Module(), loader)
    return (timer.marks[-1] - timer.marks[WARMUP - 1]) / (len(timer.marks) - WARMUP)


# ---------------------------------------------------------------- plain torch, for comparison
def torch_run(traced: bool, steps: int, tmp: str) -> float:
    """The Lightning run's model and data in a hand-written loop, with and without debug_context."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                              torch.nn.ReLU(), torch.nn.Linear(256, 1))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    x = torch.randn(64 * steps, 64)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=64)
    marks: list[float] = []
    for xb, yb in loader:
        with (tt.debug_context("train_step", model=net, optimizer=opt) if traced else _null()) as step:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(net(xb), yb)
            loss.backward()
            if traced:
                step.record_loss(loss)
            opt.step()
        marks.append(time.perf_counter())
    return (marks[-1] - marks[WARMUP - 1]) / (len(marks) - WARMUP)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# ---------------------------------------------------------------- transformers
def transformers_run(traced: bool, steps: int, tmp: str) -> float:
    import transformers

    from torchtrace.integrations.transformers import TorchtraceCallback

    transformers.logging.set_verbosity_error()

    class Data(torch.utils.data.Dataset):
        def __init__(self, n):
            g = torch.Generator().manual_seed(1)
            self.ids = torch.randint(0, 100, (n, 32), generator=g)
            self.labels = torch.randint(0, 2, (n,), generator=g)

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.labels[i]}

    class Timer(transformers.TrainerCallback):
        def __init__(self):
            self.marks: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.marks.append(time.perf_counter())

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, max_position_embeddings=32, num_labels=2)
    model = transformers.BertForSequenceClassification(config)
    args = transformers.TrainingArguments(output_dir=tmp, max_steps=steps, per_device_train_batch_size=16,
                                          report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no",
                                          disable_tqdm=True, max_grad_norm=0.0)
    timer = Timer()
    callbacks = ([TorchtraceCallback()] if traced else []) + [timer]
    transformers.Trainer(model=model, args=args, train_dataset=Data(16 * steps), callbacks=callbacks).train()
    return (timer.marks[-1] - timer.marks[WARMUP - 1]) / (len(timer.marks) - WARMUP)


def bench(name: str, run, repeats: int, steps: int) -> None:
    plain: list[float] = []
    traced: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        tt.configure(service_name="bench", prometheus_port="off", run_dir=os.path.join(tmp, "runs"),
                     register_atexit=False)
        run(False, WARMUP + 2, tmp)  # imports and first-call costs out of the measurement
        for _ in range(repeats):
            plain.append(run(False, steps, tmp))
            traced.append(run(True, steps, tmp))
        tt.shutdown()
    p, t = statistics.median(plain), statistics.median(traced)
    print(f"{name:13s} steps/run={steps:4d} runs={repeats} plain={p * 1e3:8.3f} ms/step "
          f"callback={t * 1e3:8.3f} ms/step ratio={t / p:.3f}  (+{(t - p) * 1e6:.0f} us/step)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--only", choices=["lightning", "transformers", "torch"])
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 = steadier on shared CPUs)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} CPUs, threads={a.threads}, "
          f"level=basic, guard=warn")
    if a.only in (None, "torch"):
        bench("torch (ref)", torch_run, a.repeats, a.steps)
    if a.only in (None, "lightning"):
        bench("lightning", lightning_run, a.repeats, a.steps)
    if a.only in (None, "transformers"):
        bench("transformers", transformers_run, a.repeats, a.steps)


if __name__ == "__main__":
    main()
