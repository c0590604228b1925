"""The no-sync guarantee: at BASIC and ADVANCED, one host read per recorded step, through readout.

On CPU we count torchtrace's reads (readout.reads()) and every Python-level host read a
tensor offers (.item(), .tolist(), bool(), float(), int()) while the instrumented loop runs: the
only ones allowed are readout's. On CUDA the loop runs under sync debug mode "error".
"""

from __future__ import annotations

import pytest
import torch

import torchtrace as tt
from torchtrace import api
from torchtrace.record import readout


class MLP(torch.nn.Module):
    def __init__(self, width: int = 16, layers: int = 5) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class HostReadCounter:
    """Counts Python-level device-to-host reads on tensors, and which ones readout made."""

    NAMES = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")

    def __init__(self, monkeypatch) -> None:
        self.calls: dict[str, int] = {n: 0 for n in self.NAMES}
        for name in self.NAMES:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, original))

    def _wrap(self, name, original):
        def counted(t, *args, **kwargs):
            self.calls[name] += 1
            return original(t, *args, **kwargs)
        return counted


def _train(model, opt, steps, device="cpu"):
    x = torch.randn(8, 16, device=device)

    @tt.debug_operation(name="train_step", model=model, optimizer=opt)
    def train_step(batch):
        opt.zero_grad(set_to_none=True)
        loss = model(batch).pow(2).mean()
        loss.backward()
        opt.step()
        return loss

    for _ in range(steps):
        train_step(x)


@pytest.mark.parametrize("forensics", [False, True])
@pytest.mark.parametrize("level", ["basic", "advanced"])
def test_one_host_read_per_step_through_readout(tmp_path, monkeypatch, level, forensics):
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), strict=True, register_atexit=False,
                 forensics=forensics)
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    api.get_runtime().set_level(level)
    _train(model, opt, 2)  # warm-up (first-use paths)
    counter = HostReadCounter(monkeypatch)
    before = readout.reads()
    peeks_before = readout.cpu_peeks()
    steps = 7
    _train(model, opt, steps)
    made = readout.reads() - before
    assert made == steps, f"{made} host reads through readout for {steps} steps"
    # With forensics on, CPU gradients are also looked at in the optimizer pre-hook, so a
    # replay would see the parameters before the update. That look is readout.peek_cpu(),
    # which refuses any tensor not already in host memory: on a GPU it cannot happen.
    peeks = readout.cpu_peeks() - peeks_before
    assert peeks == (steps if forensics else 0)
    # The only Python-level host reads are readout's .tolist(): one read per step (+ the peeks).
    assert counter.calls["tolist"] == steps + peeks
    others = {k: v for k, v in counter.calls.items() if k != "tolist" and v}
    assert others == {}, f"host reads outside readout: {others}"
    rec = api.get_runtime().history.last_record
    assert rec is not None and rec.step == steps + 1 and rec.grad_norm is not None
    # The values read are the real ones: global norm against a float64 reference.
    ref = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters())).item()
    assert rec.grad_norm == pytest.approx(ref, rel=1e-5)


class _Tokens(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.out = torch.nn.Linear(16, 4)

    def forward(self, input_ids, attention_mask):
        return (self.out(self.emb(input_ids)) * attention_mask.unsqueeze(-1)).pow(2).mean()


@pytest.mark.parametrize("form", ["context", "iterator"])
def test_steps_keyed_by_the_models_call_make_one_host_read_each(tmp_path, monkeypatch, form):
    """A ``debug_context`` without inputs and a step drawing its batch from an iterator: the
    batch (a mask's token count on the device) and the FLOPs come from the model's call, the
    counted steps among them, and still one read a step, through readout, and no other."""
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), strict=True, register_atexit=False)
    torch.manual_seed(0)
    model = _Tokens()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    lengths = (6, 6, 9, 9, 9, 6, 12, 12)
    batches = [{"input_ids": torch.randint(0, 50, (4, n), generator=g),
                "attention_mask": (torch.rand(4, n, generator=g) > 0.3).long()} for n in lengths]
    source = iter(batches)

    @tt.debug_operation(name="train_step", model=model, optimizer=opt)
    def drawn(it):
        opt.zero_grad(set_to_none=True)
        model(**next(it)).backward()
        opt.step()

    counter = HostReadCounter(monkeypatch)
    before, peeks_before = readout.reads(), readout.cpu_peeks()
    records = []
    for batch in batches:
        if form == "context":
            with tt.debug_context("train_step", model=model, optimizer=opt):
                opt.zero_grad(set_to_none=True)
                model(**batch).backward()
                opt.step()
        else:
            drawn(source)
        records.append(api.get_runtime().history.last_record)
    assert readout.reads() - before == len(batches)
    # (A decorated step can be replayed: on the CPU, forensics peeks at its gradients before
    # the update, through readout; see the test above.)
    peeks = readout.cpu_peeks() - peeks_before
    assert peeks == (len(batches) if form == "iterator" else 0)
    assert counter.calls["tolist"] == len(batches) + peeks
    assert {k: v for k, v in counter.calls.items() if k != "tolist" and v} == {}
    tt.flush()
    assert sum(r.flops_counted for r in records) >= 3  # counted steps ran inside the loop
    assert [r.tokens for r in records] == [int(b["attention_mask"].sum()) for b in batches]
    tt.shutdown()


def test_off_makes_no_read_and_no_span(tt_runtime, monkeypatch):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rt = api.get_runtime()
    rt.set_level("off")
    counter = HostReadCounter(monkeypatch)
    before = readout.reads()
    steps_before = rt.history.totals.get("steps", 0)
    _train(model, opt, 5)
    assert readout.reads() == before
    assert sum(counter.calls.values()) == 0
    assert rt.history.totals.get("steps", 0) == steps_before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("level", ["basic", "advanced"])
def test_cuda_loop_runs_under_sync_debug_error(tt_runtime, level):
    torch.manual_seed(0)
    model = MLP().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, foreach=True)
    rt = api.get_runtime()
    rt.set_level(level)
    _train(model, opt, 2, device="cuda")
    torch.cuda.synchronize()
    before = readout.reads()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _train(model, opt, 5, device="cuda")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert readout.reads() - before == 5
    rt.flush(5.0)
    assert rt.history.last_record.grad_norm is not None
    # The phases are device times from CUDA events (recorded in the model's call seam and the
    # optimizer's hooks), read once the step's copy landed: no sync, and every phase measured.
    phases = rt.history.steps()[-1].get("phases")
    assert phases is not None and set(phases) == {"forward", "backward", "optimizer"}
    assert all(v > 0 for v in phases.values())


def test_peek_cpu_refuses_anything_but_cpu_tensors():
    from torchtrace.record import readout

    assert readout.peek_cpu(torch.tensor([1.0, 2.0])) == [1.0, 2.0]
    with pytest.raises(ValueError, match="CPU tensors only"):
        readout.peek_cpu(torch.tensor([1.0], device="meta"))
