"""Instrumenting a compiled model adds no graph breaks (eager and aot_eager backends, on CPU), and a
compiled step function (torchtrace's block or decorator inside it) is recorded as an eager one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import torchtrace as tt
from torchtrace import api

dynamo = pytest.importorskip("torch._dynamo")


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def _frames() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _sgd_body(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor):
    """A training step's body: zero the gradients, the loss, backward, the update."""
    def body():
        opt.zero_grad(set_to_none=True)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        return loss
    return body


def _run(compiled, opt, x, steps, instrument: bool, level: str = "basic", watched=None):
    step = _sgd_body(compiled, opt, x)
    if instrument:
        api.get_runtime().set_level(level)
        step = tt.debug_operation(name="train_step", model=watched if watched is not None else compiled,
                                  optimizer=opt)(step)
    losses = [step() for _ in range(steps)]
    return torch.stack([l.detach() for l in losses])


@pytest.mark.parametrize("backend,level,original", [("eager", "basic", False), ("aot_eager", "basic", False),
                                                     ("eager", "extreme", False), ("eager", "basic", True)])
def test_no_graph_breaks_added(tt_runtime, backend, level, original):
    """``original``: torchtrace watches the module that was compiled, so its hooks (step phases)
    sit inside the compiled code."""
    x = torch.randn(4, 8)
    results = {}
    for instrument in (False, True):
        dynamo.reset()
        from torch._dynamo.utils import counters

        counters.clear()
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        compiled = torch.compile(model, backend=backend)
        losses = _run(compiled, opt, x, 4, instrument, level, watched=model if original else None)
        results[instrument] = (_breaks(), _frames(), losses)
    (b0, g0, l0), (b1, g1, l1) = results[False], results[True]
    assert b1 == b0 == 0, f"graph breaks: bare {b0}, instrumented {b1}"
    assert g1 == g0, f"graphs compiled: bare {g0}, instrumented {g1}"
    assert torch.equal(l0, l1), "instrumenting changed the training result"
    rec = api.get_runtime().history.last_record
    assert rec is not None and rec.grad_norm is not None and rec.loss == pytest.approx(l1[-1].item())


def test_explain_reports_no_break_inside_a_step(tt_runtime):
    dynamo.reset()
    torch.manual_seed(0)
    model = Net()
    api.get_runtime().set_level("advanced")
    # The operation's first step counts its FLOPs, and compiled code runs eagerly under the
    # counter: the steps after it are the ones that run compiled.
    with tt.debug_context("explain_step", model=model):
        model(torch.randn(4, 8))
    with tt.debug_context("explain_step", model=model):
        explanation = dynamo.explain(model)(torch.randn(4, 8))
    assert explanation.graph_break_count == 0
    assert explanation.graph_count == 1


@pytest.fixture
def patched_torch():
    """torch as ``configure()`` leaves it (the clip functions, GradScaler, schedulers wrapped; the
    global optimizer hook added), put back afterwards as ``shutdown()`` does."""
    from torchtrace.step import clipping, updaters

    clipping.install()
    updaters.install()
    yield
    clipping.uninstall()
    updaters.uninstall()


def test_clip_wrapper_adds_no_graph_break(patched_torch):
    # torchtrace wraps clip_grad_norm_ (to measure before clipping); inside a compiled
    # function the wrapper must trace like torch's own function.
    from torch._dynamo.utils import counters

    wrapped = torch.nn.utils.clip_grad_norm_
    assert getattr(wrapped, "__torchtrace_wrapped__", False)
    original = wrapped.__wrapped__
    breaks = {}
    for name, clip in (("torch", original), ("torchtrace", wrapped)):
        dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        net = Net()
        net(torch.randn(4, 8)).sum().backward()

        def f(net=net, clip=clip):
            return clip(net.parameters(), 0.5)

        total = torch.compile(f, backend="eager")()
        breaks[name] = (_breaks(), float(total))
    assert breaks["torchtrace"] == breaks["torch"]


def test_model_compile_after_torchtrace_watched_it(tt_runtime):
    """``model.compile()`` on a module whose call seam holds torchtrace's forward marks: the
    user's compiled call wins, training goes on with the same losses as without torchtrace
    (strict mode: an internal error would raise), and shutdown leaves the compiled call alone."""
    x = torch.randn(4, 8)
    losses = {}
    for instrument in (False, True):
        dynamo.reset()
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        first = _run(model, opt, x, 2, instrument)
        if instrument:
            assert getattr(model.__dict__.get("_compiled_call_impl"), "__torchtrace_phase_marks__", False)
        model.compile(backend="eager")
        theirs = model.__dict__["_compiled_call_impl"]
        assert not getattr(theirs, "__torchtrace_phase_marks__", False)
        losses[instrument] = torch.cat([first, _run(model, opt, x, 3, instrument)])
        if instrument:
            api.get_runtime().set_level("off")  # takes torchtrace's marks off: none are left to take
            assert model.__dict__["_compiled_call_impl"] is theirs
    assert torch.equal(losses[False], losses[True])


@pytest.mark.parametrize("form", ["torch.compile(model)", "model.compile() before", "model.compile() after"])
def test_a_compiled_model_has_its_flops_and_phases(tt_runtime, form, caplog):
    """Every way of compiling a model gets the step's FLOPs (equal to FlopCounterMode on the
    same step run eagerly) and all three phases, compiles as many graphs as without torchtrace
    and trains to the same losses, with no warning. ``model.compile()`` fills the call seam that
    holds torchtrace's forward marks: the marks go around the compiled call, outside the
    compiled code (inside it they would be traced away), before or after the user compiles.
    (``torch.compile(model)``'s wrapper was told it had no forward of its own: its forward is
    set on the instance.)"""
    from torch._dynamo.utils import counters
    from torch.utils.flop_counter import FlopCounterMode

    x = torch.randn(4, 8)
    torch.manual_seed(0)
    reference = Net()
    with FlopCounterMode(display=False) as counter:
        reference(x).pow(2).mean().backward()
    results = {}
    for instrument in (False, True):
        dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if form == "torch.compile(model)":
            called = torch.compile(model, backend="eager")
            losses = _run(called, opt, x, 4, instrument)
        elif form == "model.compile() before":
            model.compile(backend="eager")
            losses = _run(model, opt, x, 4, instrument)
        else:
            first = _run(model, opt, x, 2, instrument)
            model.compile(backend="eager")
            losses = torch.cat([first, _run(model, opt, x, 3, instrument)])
        results[instrument] = (_frames(), losses)
    (g0, l0), (g1, l1) = results[False], results[True]
    assert g0 >= 1 and g1 == g0, f"graphs compiled: bare {g0}, instrumented {g1}"
    assert torch.equal(l0, l1), "instrumenting changed the training result"
    rows = api.get_runtime().history.steps()
    assert rows and all(row["flops"] == counter.get_total_flops() for row in rows), [r.get("flops") for r in rows]
    assert all(set(row["phases"]) == {"forward", "backward", "optimizer"} for row in rows), \
        [row.get("phases") for row in rows]
    assert not [r.getMessage() for r in caplog.records if r.name.startswith("torchtrace")]


def test_a_step_given_the_module_inside_torch_compiles_wrapper_says_which_to_give(tt_runtime, fresh_dynamo, caplog):
    """``compiled = torch.compile(model)``, then ``model=model`` and ``compiled(x)`` in the step (a
    script that keeps the plain module for its checkpoints): the module's call runs inside the
    compiled code, where the forward marks are traced away. The step keeps its optimizer phase
    and the warning says to give the step the module it calls."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level("WARNING", logger="torchtrace"):
        _run(torch.compile(model, backend="eager"), opt, torch.randn(4, 8), 3, True, watched=model)
    rows = api.get_runtime().history.steps()[1:]  # (the first call, which compiles, is seen)
    assert rows and all(set(row["phases"]) == {"optimizer"} for row in rows), [row.get("phases") for row in rows]
    (warning,) = [r.getMessage() for r in caplog.records if "forward was not seen" in r.getMessage()]
    assert "model=torch.compile(model)" in warning, warning


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_a_compiled_optimizer_step_gets_no_graph_break_from_torchtrace(patched_torch):
    """torchtrace's global optimizer step pre-hook (which notes optimizers stepped inside a
    step) stays out of a compiled ``optimizer.step()``: the same graphs as without the hook, no
    graph break the bare step lacks (torch's own only), none from reading torchtrace's context
    variable. (On Python 3.13 dynamo counts torch's own break once with the hook and twice
    without it, the graphs alike; on 3.10-3.12 twice in both.)"""
    from torch._dynamo.utils import counters

    from torchtrace.step import updaters

    breaks, graphs = {}, {}
    for hooked in (False, True):
        if not hooked:
            updaters.uninstall()
        else:
            updaters.install()
        dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        net = Net()
        opt = torch.optim.Adam(net.parameters(), lr=0.01)
        net(torch.randn(4, 8)).sum().backward()
        torch.compile(lambda: opt.step(), backend="eager")()
        breaks[hooked] = dict(counters["graph_break"])
        graphs[hooked] = counters["stats"]["unique_graphs"]
    assert updaters._hook_handle is not None
    assert graphs[True] == graphs[False] >= 1
    assert breaks[False] and all(count <= breaks[False].get(reason, 0) for reason, count in breaks[True].items()), \
        (breaks[True], breaks[False])
    assert not any("ContextVar" in reason for reason in breaks[True])


def _plain_losses_and_norms(steps: int) -> tuple[list[float], list[float]]:
    """The reference: the same training without torchtrace or compilation; each step's loss and
    its gradient's global 2-norm summed in float64 in a plain loop."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    losses, norms = [], []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = model(x).pow(2).mean()
        loss.backward()
        norms.append(sum(float(v) ** 2 for p in model.parameters() for v in p.grad.double().flatten()) ** 0.5)
        opt.step()
        losses.append(loss.item())
    return losses, norms


@pytest.fixture
def fresh_dynamo():
    """dynamo without what earlier compilations cached, and left so: the frames it skipped here
    (torchtrace's phase marks, called from a function it runs eagerly) stay skipped in later
    compilations of the same process otherwise."""
    dynamo.reset()
    yield
    dynamo.reset()


@pytest.mark.parametrize("form", ["torch.compile(decorated step)", "debug_context in a compiled function"])
def test_a_compiled_step_function_is_recorded_like_an_eager_one(tt_runtime, fresh_dynamo, form, caplog):
    """Some training scripts compile the whole step function, torchtrace's block or decorator
    included. torchtrace's entry and exit are never traced: the graph breaks there and they run
    eagerly. The step is recorded as without the compiler: no internal error (strict mode raises
    one), the same losses as the plain loop, each step's loss and gradient norm, its FLOPs
    (equal to FlopCounterMode's on the eager step), its three phases, and no warning."""
    from torch.utils.flop_counter import FlopCounterMode

    steps = 4
    losses, norms = _plain_losses_and_norms(steps)
    x = torch.randn(4, 8)
    with FlopCounterMode(display=False) as counter:
        Net()(x).pow(2).mean().backward()
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    body = _sgd_body(model, opt, torch.randn(4, 8))
    if form == "torch.compile(decorated step)":
        step = torch.compile(tt.debug_operation(name="train_step", model=model, optimizer=opt)(body),
                             backend="eager")
    else:
        def in_block():
            with tt.debug_context("train_step", model=model, optimizer=opt) as scope:
                loss = body()
                scope.record_loss(loss)
            return loss

        step = torch.compile(in_block, backend="eager")
    got = [step().item() for _ in range(steps)]
    assert got == losses
    rows = api.get_runtime().history.steps()
    assert [row["step"] for row in rows] == list(range(steps))
    assert [row["loss"] for row in rows] == pytest.approx(losses, rel=1e-6)
    assert [row["grad_norm"] for row in rows] == pytest.approx(norms, rel=1e-5)
    assert [row["flops"] for row in rows] == [counter.get_total_flops()] * steps
    assert all(set(row["phases"]) == {"forward", "backward", "optimizer"} for row in rows), \
        [row.get("phases") for row in rows]
    assert not [r.getMessage() for r in caplog.records if r.name.startswith("torchtrace")]


def test_importing_torchtrace_does_not_import_the_compiler():
    """The step's entry and exit keep out of torch.compile without importing it: ``import
    torchtrace`` leaves ``torch._dynamo`` unimported (a second of import time, and NumPy)."""
    import subprocess
    import sys

    code = "import sys, torchtrace; print('torch._dynamo' in sys.modules, 'torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True"]


def test_a_process_whose_first_step_is_compiled_records_it(tmp_path):
    """The first step a process ever enters is inside a compiled step function: the entry is
    then still the plain method when dynamo meets it (it becomes the disabled one at its first
    call), and the steps are still recorded with their FLOPs and phases. A fresh process: in
    this one, earlier tests' steps made the swap already."""
    import json
    import subprocess
    import sys

    code = f"""
import json, torch, torchtrace as tt
from torchtrace import api
from tests.test_compile import Net, _sgd_body
tt.configure(service_name="first", prometheus_port="off", run_dir={str(tmp_path)!r}, register_atexit=False,
             strict=True)
torch.manual_seed(0)
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
body = _sgd_body(model, opt, torch.randn(4, 8))
step = torch.compile(tt.debug_operation(name="train_step", model=model, optimizer=opt)(body), backend="eager")
for _ in range(3):
    step()
rows = api.get_runtime().history.steps()
print(json.dumps([[row["flops"], sorted(row["phases"])] for row in rows]))
tt.shutdown()
"""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, cwd=root)
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    # Net, 4 x 8 -> 16 -> 4: forward 2*4*8*16 + 2*4*16*4 = 1536 FLOPs, backward twice that less the
    # first layer's input gradient (2*4*8*16 = 1024): 1536 + 3072 - 1024 = 3584
    assert rows == [[3584, ["backward", "forward", "optimizer"]]] * 3


@pytest.mark.parametrize("named", [True, False], ids=["optimizer named", "optimizer adopted"])
@pytest.mark.parametrize("clip", [False, True], ids=["no clip", "clip"])
@pytest.mark.parametrize("order", ["debug_operation(torch.compile(step))", "torch.compile(debug_operation(step))"])
def test_a_nan_in_a_compiled_step_function_is_replayed_and_skipped(tmp_path, monkeypatch, fresh_dynamo, order,
                                                                    clip, named):
    """A compiled step function calls ``optimizer.step()`` (and ``clip_grad_norm_``) inside the
    compiled code, so torchtrace measures the gradients from there: the optimizer's step
    pre-hook, the clip, or the global hook through which a step given no optimizer adopts the
    one that steps. Before, dynamo traced them, and the replay they start on a non-finite step
    failed inside the trace (an internal error: no forensic report). Now they run eagerly,
    outside the compiler: the replay names the input, the guard skips the update, and the
    parameters are as before the step."""
    for name in list(os.environ):
        if name.startswith(("TORCHTRACE_", "OTEL_")):
            monkeypatch.delenv(name, raising=False)
    tt.configure(service_name="test", prometheus_port="off", run_dir=str(tmp_path), strict=True,
                 register_atexit=False, guard="skip")
    try:
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def train_step(x):
            loss = model(x).pow(2).mean()
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        decorate = tt.debug_operation(name="train_step", model=model, optimizer=opt if named else None)
        if order == "debug_operation(torch.compile(step))":
            step = decorate(torch.compile(train_step, backend="eager"))
        else:
            step = torch.compile(decorate(train_step), backend="eager")
        step(torch.randn(4, 8))
        before = [p.detach().clone() for p in model.parameters()]
        bad = torch.randn(4, 8)
        bad[1, 3] = float("nan")
        step(bad)
        rt = api.get_runtime()
        record = rt.history.last_record
        assert "nonfinite_grad" in record.anomaly_kinds and record.skipped
        assert rt.forensics.reports and rt.forensics.reports[-1]["cause"] == "input"
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    finally:
        tt.shutdown()


def test_the_seeds_level_block_compiles_a_compiled_model_once_and_leaves_it_compiled(tt_runtime, fresh_dynamo):
    """``with debug_context(DebugLevel.BASIC)`` watches its block through global module hooks.
    Registered anew for every block, their new ids failed dynamo's guards: every step compiled
    the model again, and past the recompile limit (8) it ran uncompiled, after shutdown too.
    Now the hooks stay from the first block to shutdown: the model compiles at the first step
    and once more after shutdown (the hooks gone), and every step runs a compiled graph."""
    compiles, runs = [0], [0]

    def counting(gm, example_inputs):
        compiles[0] += 1

        def run(*args):
            runs[0] += 1
            return gm.forward(*args)
        return run

    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 2))
    compiled = torch.compile(model, backend=counting)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step():
        opt.zero_grad()
        torch.nn.functional.mse_loss(compiled(torch.randn(4, 6)), torch.randn(4, 2)).backward()
        opt.step()

    with tt.debug_context(tt.DebugLevel.BASIC):
        step()
    first_compiles, first_runs = compiles[0], runs[0]
    assert first_runs >= 1
    for _ in range(11):
        with tt.debug_context(tt.DebugLevel.BASIC):
            step()
    assert compiles[0] == first_compiles and runs[0] == 12 * first_runs
    tt.shutdown()
    before = compiles[0]
    for _ in range(5):
        step()
    assert compiles[0] - before <= first_compiles and runs[0] >= 12 * first_runs + 5


@pytest.mark.xfail(strict=True, reason="a clip traced by torch.compile is not measured: the norm recorded is the "
                                       "update's, after the clip (docs/usage.md, Clipping)")
def test_a_clip_inside_a_compiled_step_function_records_the_norm_before_clipping(tmp_path, monkeypatch, fresh_dynamo):
    """A compiled step function that clips (``torch.compile(debug_operation(step))``), and an
    exploding step (its loss x 1e6). The eager step records the norm before the clip, 603,917,
    and a ``grad_explosion``; compiled, the clip wrapper steps aside inside the trace (no graph
    break) and the gradients are first measured at the update, already clipped: 0.99999991, no
    anomaly. Known and documented; kept here as what should hold."""
    for name in list(os.environ):
        if name.startswith(("TORCHTRACE_", "OTEL_")):
            monkeypatch.delenv(name, raising=False)
    tt.configure(service_name="test", prometheus_port="off", run_dir=str(tmp_path), register_atexit=False,
                 throughput=False)
    try:
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def train_step(x, scale):
            opt.zero_grad(set_to_none=True)
            loss = model(x).pow(2).mean() * scale
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            return loss

        step = torch.compile(tt.debug_operation(name="train_step", model=model, optimizer=opt)(train_step),
                             backend="eager")
        x = torch.randn(4, 8)
        step(x, torch.tensor(1.0))
        reference = model(x).pow(2).mean() * 1e6
        opt.zero_grad(set_to_none=True)
        reference.backward()
        expected = float(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(p.grad.double()) for p in model.parameters()])))
        opt.zero_grad(set_to_none=True)
        step(x, torch.tensor(1e6))
        record = api.get_runtime().history.last_record
        assert record.grad_norm == pytest.approx(expected, rel=1e-5)
    finally:
        tt.shutdown()
