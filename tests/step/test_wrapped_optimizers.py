"""Optimizers that wrap a base optimizer and share its parameter groups, passed as the step's
``optimizer=``: sharpness-aware minimisation (SAM: ``first_step`` climbs along the gradient,
a second backward, ``second_step`` climbs back and has the base optimizer update) and
Lookahead (its ``step`` has the base update the fast weights, and every ``k`` steps pulls them
towards slow ones). Both are written here after the published algorithms, as the copies
training scripts carry are.

SAM never calls its own ``step``: before, no gradient was measured (``grad_norm`` None every
step) and ``guard="skip"`` let a NaN update through, which poisoned every later step. The
base's update is now the step's: its gradients (SAM's second) are measured before it.
Lookahead's base, and the shard optimizer ``ZeroRedundancyOptimizer`` steps, were taken for a
second optimizer the skip guard could not cover, with a warning saying so.
"""

from __future__ import annotations

import logging

import pytest
import torch

import torchtrace as tt
from tests.helpers import norm64, seeded_batches, small_mlp

STEPS = 5
NAN_AT = 2


class SharpnessAware(torch.optim.Optimizer):
    def __init__(self, params, base: type[torch.optim.Optimizer], rho: float = 0.05, **kwargs) -> None:
        super().__init__(params, {"rho": rho, **kwargs})
        self.base = base(self.param_groups, **kwargs)
        self.param_groups = self.base.param_groups

    @torch.no_grad()
    def first_step(self) -> None:
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["origin"] = p.detach().clone()
                    p.add_(p.grad, alpha=float(group["rho"] / (norm + 1e-12)))
        self.zero_grad(set_to_none=True)

    @torch.no_grad()
    def second_step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if "origin" in self.state[p]:
                    p.copy_(self.state[p]["origin"])
        self.base.step()
        self.zero_grad(set_to_none=True)


class Lookahead(torch.optim.Optimizer):
    def __init__(self, base: torch.optim.Optimizer, k: int = 5, alpha: float = 0.5) -> None:
        super().__init__(base.param_groups, {})
        self.base, self.k, self.alpha, self.count = base, k, alpha, 0
        self.param_groups = base.param_groups
        self.slow = [p.detach().clone() for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def step(self, closure=None):
        self.base.step()
        self.count += 1
        if self.count % self.k == 0:
            fast = [p for group in self.param_groups for p in group["params"]]
            for slow, p in zip(self.slow, fast):
                slow.add_(p - slow, alpha=self.alpha)
                p.copy_(slow)


def _model() -> torch.nn.Module:
    return small_mlp()


def _batches(nan_at: int | None = None) -> list[torch.Tensor]:
    return seeded_batches(STEPS, nan_at=nan_at)


def _norm64(model: torch.nn.Module) -> float:
    return norm64(p.grad for p in model.parameters())


def _sam_step(model, opt, x, norms: list | None = None) -> torch.Tensor:
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.first_step()
    model(x).pow(2).mean().backward()
    if norms is not None:
        norms.append(_norm64(model))  # the gradient the base's update applies
    opt.second_step()
    return loss


def test_sams_update_is_the_steps(tt_runtime):
    plain = _model()
    plain_opt = SharpnessAware(plain.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    losses, norms = [], []
    for x in _batches():
        losses.append(_sam_step(plain, plain_opt, x, norms).item())
    model = _model()
    opt = SharpnessAware(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    records = []
    for x in _batches():
        with tt.debug_context("train_step", model=model, optimizer=opt) as step:
            step.record_loss(_sam_step(model, opt, x))
        records.append(step.record)
    assert [r.loss for r in records] == losses  # bit for bit
    assert [r.grad_norm for r in records] == pytest.approx(norms, rel=1e-5)
    assert [r.lr for r in records] == [[0.1]] * STEPS


def test_skip_stops_a_nan_update_of_sam(tmp_path):
    tt.configure(service_name="test", prometheus_port="off", run_dir=str(tmp_path / "runs"), strict=True,
                 register_atexit=False, guard="skip")
    model = _model()
    opt = SharpnessAware(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    for i, x in enumerate(_batches(nan_at=NAN_AT)):
        before = [p.detach().clone() for p in model.parameters()]
        with tt.debug_context("train_step", model=model, optimizer=opt) as step:
            step.record_loss(_sam_step(model, opt, x))
        unchanged = [torch.equal(a, p) for a, p in zip(before, model.parameters())]
        assert unchanged == [i == NAN_AT] * len(unchanged)
        assert step.record.skipped is (i == NAN_AT)
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_lookaheads_base_is_no_second_optimizer(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="torchtrace")
    tt.configure(service_name="test", prometheus_port="off", run_dir=str(tmp_path / "runs"), strict=True,
                 register_atexit=False, guard="skip")
    model = _model()
    opt = Lookahead(torch.optim.Adam(model.parameters(), lr=1e-2), k=STEPS)
    for i, x in enumerate(_batches(nan_at=NAN_AT)):
        before = [p.detach().clone() for p in model.parameters()]
        with tt.debug_context("train_step", model=model, optimizer=opt) as step:
            loss = model(x).pow(2).mean()
            loss.backward()
            expected = None if i == NAN_AT else _norm64(model)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step.record_loss(loss)
        unchanged = [torch.equal(a, p) for a, p in zip(before, model.parameters())]
        assert unchanged == [i == NAN_AT] * len(unchanged)
        if expected is not None:
            assert step.record.grad_norm == pytest.approx(expected, rel=1e-5)
    assert not [r.getMessage() for r in caplog.records if "second optimizer" in r.getMessage()]


def test_zeros_shard_optimizer_is_no_second_optimizer(tmp_path):
    """``ZeroRedundancyOptimizer`` (a real gloo group of one rank, in a fresh process) steps the
    Adam of its shard inside its own ``step``: that Adam updates only the step's optimizer's
    parameters, so a skip decided on the step's gradients drops its update too. Before, a
    warning said it was a second optimizer whose update was applied."""
    import json
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = f"""
import json, logging, math, torch, torch.distributed as dist, torchtrace as tt
from torch.distributed.optim import ZeroRedundancyOptimizer
said = []
class Keep(logging.Handler):
    def emit(self, record):
        said.append(record.getMessage())
logging.getLogger("torchtrace").addHandler(Keep())
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
tt.configure(service_name="zero", prometheus_port="off", run_dir={str(tmp_path)!r}, register_atexit=False,
             strict=True, guard="skip")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-2)
rows = []
for i in range(4):
    x = torch.randn(4, 8)
    if i == 2:
        x[0, 0] = float("nan")
    before = [p.detach().clone() for p in model.parameters()]
    with tt.debug_context("train_step", model=model, optimizer=opt) as step:
        loss = model(x).pow(2).mean()
        loss.backward()
        norm = math.sqrt(sum(v * v for p in model.parameters() for v in p.grad.double().flatten().tolist()))
        opt.step()
        opt.zero_grad(set_to_none=True)
        step.record_loss(loss)
    rows.append([step.record.grad_norm, norm, step.record.skipped,
                 all(torch.equal(a, p) for a, p in zip(before, model.parameters()))])
tt.shutdown()
dist.destroy_process_group()
print(json.dumps({{"rows": rows, "said": said}}))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHTRACE_", "OTEL_", "RANK", "WORLD_SIZE"))}
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, cwd=tmp_path,
                          env={**env, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for i, (recorded, norm, skipped, unchanged) in enumerate(out["rows"]):
        assert skipped is (i == NAN_AT) and unchanged is (i == NAN_AT)
        if i != NAN_AT:
            assert recorded == pytest.approx(norm, rel=1e-5)
    assert not [m for m in out["said"] if "second optimizer" in m]
