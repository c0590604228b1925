"""A small finished run directory with two non-finite steps, each replayed and its update skipped.

20 steps of a two-layer regression behind a normalising layer ``norm`` that has no epsilon:
- step 7: one sample of the batch is all zeros, so ``norm`` makes it 0/0 = NaN (cause ``forward``);
- step 13: the batch itself carries a NaN (cause ``input``).
The guard is ``skip`` and the scope is given ``replay=``, so each bad step has one forensic
replay and one skipped update.
"""

from __future__ import annotations

import torch

import torchtrace as tt

from ..export.debug_helpers import runtime

NAN_STEP = 7
INPUT_NAN_STEP = 13
BAD_STEPS = (NAN_STEP, INPUT_NAN_STEP)
STEPS = 20


class Normalised(torch.nn.Module):
    """``norm`` (x / ||x||, no epsilon) -> ``encoder`` -> tanh -> ``head``."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = _Norm()
        self.encoder = torch.nn.Linear(8, 16)
        self.act = torch.nn.Tanh()
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.act(self.encoder(self.norm(x))))


class _Norm(torch.nn.Module):
    def forward(self, x):
        return x / x.norm(dim=-1, keepdim=True)


def batch(i: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g)
    if i == NAN_STEP:
        x[3] = 0.0
    elif i == INPUT_NAN_STEP:
        x[5, 2] = float("nan")
    return x, y


def make_run(tmp_path) -> tuple[object, list[dict]]:
    """Run, shut down, and return (run directory, the history's step summaries before shutdown)."""
    result = tt.configure(service_name="report-test", prometheus_port="off", run_dir=str(tmp_path / "runs"),
                          register_atexit=False, strict=True, guard="skip")
    torch.manual_seed(0)
    model = Normalised()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    for i in range(STEPS):
        x, y = batch(i, g)

        def forward_and_loss(x=x, y=y):
            return torch.nn.functional.mse_loss(model(x), y)

        with tt.debug_context("train_step", model=model, optimizer=opt, replay=forward_and_loss, inputs=x) as step:
            loss = forward_and_loss()
            opt.zero_grad()
            loss.backward()
            step.record_loss(loss)
            opt.step()
    tt.flush()
    steps = runtime().history.steps()
    tt.shutdown()
    return result.run_dir, steps
