"""A step that names its model but not its optimizer, whose optimizer steps inside it.

Plain loops often hand torchtrace the model only (``debug_context("train_step", model=m)``,
or a decorated step whose optimizer is a global, not an argument) and zero the gradients at
the step's end. The gradients were then gone when the step ended: the record had no gradient
norm, no learning rate, and no warning said so. Now the first optimizer that steps inside such
a step, after its backward, and updates part of the model is the step's: all of the model's
gradients are measured right before its update (with several optimizers sharing the model,
Muon-style, before the first one's). One optimizer per
parameter, stepped inside ``backward()`` (the memory-saving pattern of PyTorch's tutorial and
torchtune's ``optimizer_in_bwd``), is not taken for the step's: a warning says the step's
gradients were not measured.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import torchtrace as tt
from tests.helpers import norm64, seeded_batches, small_mlp
from torchtrace.api import get_runtime

STEPS = 4


def _model() -> torch.nn.Module:
    return small_mlp()


def _batches() -> list[torch.Tensor]:
    return seeded_batches(STEPS)


def _reference() -> tuple[list[float], list[float]]:
    """Losses and gradient norms (before each update) of the same training without torchtrace."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, norms = [], []
    for x in _batches():
        loss = model(x).pow(2).mean()
        loss.backward()
        norms.append(norm64([p.grad for p in model.parameters()]))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, norms


def _records(form: str) -> list:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)  # named nowhere: not an argument, not passed

    def body(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)  # gone at the step's end
        return loss

    records = []
    if form == "debug_context":
        for x in _batches():
            with tt.debug_context("train_step", model=model) as step:
                step.record_loss(body(x))
            records.append(step.record)
    else:
        decorated = tt.debug_operation(name="train_step", model=model)(body)
        for x in _batches():
            decorated(x)
            records.append(get_runtime().history.last_record)
    return records


@pytest.mark.parametrize("form", ["debug_context", "debug_operation"])
def test_the_optimizer_that_steps_in_a_model_only_step_is_measured(tt_runtime, form):
    losses, norms = _reference()
    records = _records(form)
    assert [r.loss for r in records] == pytest.approx(losses, rel=0, abs=0)  # bit for bit
    for record, norm in zip(records, norms):
        assert record.grad_norm == pytest.approx(norm, rel=1e-5)
        assert record.lr == [0.05]
        assert record.anomalies == []
    assert set(records[-1].phases) == {"forward", "backward", "optimizer"}


@pytest.mark.parametrize("guard", ["skip", "raise"])
def test_a_nan_gradient_is_stopped_before_the_adopted_optimizer_updates(tmp_path, guard):
    tt.configure(service_name="test", prometheus_port="off", run_dir=str(tmp_path / "runs"), strict=True,
                 register_atexit=False, guard=guard)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for i, x in enumerate(_batches()):
        if i == 2:
            x = x.clone()
            x[0, 0] = float("nan")
        before = [p.detach().clone() for p in model.parameters()]
        raised = None
        try:
            with tt.debug_context("train_step", model=model) as step:
                loss = model(x).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                step.record_loss(loss)
        except tt.NonFiniteError as exc:
            raised = exc
            opt.zero_grad(set_to_none=True)
        unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        assert unchanged is (i == 2)
        if guard == "skip":
            assert raised is None and step.record.skipped is (i == 2)
        else:
            assert (raised is not None) is (i == 2) and not step.record.skipped
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_an_optimizer_for_another_model_is_not_the_steps(tt_runtime):
    """A GAN's step names the generator: the discriminator's optimizer steps first, then the
    generator's, whose gradients are the step's."""
    torch.manual_seed(0)
    gen, disc = torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.01)
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.01)
    z = torch.randn(16, 4)
    with tt.debug_context("gan_step", model=gen) as step:
        d_loss = disc(gen(z).detach()).mean()
        d_loss.backward()
        opt_d.step()
        opt_d.zero_grad(set_to_none=True)
        g_loss = -disc(gen(z)).mean()
        g_loss.backward()
        expected = norm64([p.grad for p in gen.parameters()])
        opt_g.step()
        opt_g.zero_grad(set_to_none=True)
        opt_d.zero_grad(set_to_none=True)
        step.record_loss(g_loss)
    assert step.record.grad_norm == pytest.approx(expected, rel=1e-5)


def test_an_optimizer_per_parameter_stepped_in_backward_is_said_not_measured(tt_runtime, caplog):
    caplog.set_level(logging.WARNING, logger="torchtrace")

    def train(model: torch.nn.Module, instrumented: bool) -> list[float]:
        per_param = {p: torch.optim.Adam([p], lr=1e-3) for p in model.parameters()}

        def step_now(p: torch.Tensor) -> None:
            per_param[p].step()
            per_param[p].zero_grad(set_to_none=True)

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(step_now)
        losses = []
        for x in _batches():
            if instrumented:
                with tt.debug_context("train_step", model=model) as step:
                    loss = model(x).pow(2).mean()
                    loss.backward()
                    step.record_loss(loss)
                assert step.record.grad_norm is None
            else:
                loss = model(x).pow(2).mean()
                loss.backward()
            losses.append(loss.item())
        return losses

    model = _model()
    plain = copy.deepcopy(model)
    assert train(model, True) == train(plain, False)  # bit for bit
    said = [r.getMessage() for r in caplog.records if "gradients were not measured" in r.getMessage()]
    assert len(said) == 1, said
    assert "train_step" in said[0] and "optimizer=" in said[0]


def _split_optimizers(model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    """Two optimizers sharing the model, as Muon-style recipes do (one for the matrices, another
    for the vectors)."""
    matrices = [p for p in model.parameters() if p.ndim == 2]
    vectors = [p for p in model.parameters() if p.ndim != 2]
    return [torch.optim.SGD(matrices, lr=0.05, momentum=0.9), torch.optim.Adam(vectors, lr=0.01)]


def _split_step(model, optimizers, x) -> torch.Tensor:
    loss = model(x).pow(2).mean()
    loss.backward()
    for opt in optimizers:
        opt.step()
    model.zero_grad(set_to_none=True)
    return loss


def test_several_optimizers_sharing_the_model_are_measured_together(tt_runtime):
    """Each optimizer updates part of the model: the first to step takes the step's check, and
    the norm is the whole model's (before, none updated every parameter: nothing was measured)."""
    plain = _model()
    plain_opts = _split_optimizers(plain)
    losses, norms = [], []
    for x in _batches():
        loss = plain(x).pow(2).mean()
        loss.backward()
        norms.append(norm64([p.grad for p in plain.parameters()]))
        for opt in plain_opts:
            opt.step()
        plain.zero_grad(set_to_none=True)
        losses.append(loss.item())
    model = _model()
    optimizers = _split_optimizers(model)
    records = []
    for x in _batches():
        with tt.debug_context("train_step", model=model) as step:
            step.record_loss(_split_step(model, optimizers, x))
        records.append(step.record)
    assert [r.loss for r in records] == losses  # bit for bit
    assert [r.grad_norm for r in records] == pytest.approx(norms, rel=1e-5)
    assert [r.lr for r in records] == [[0.05]] * STEPS  # the first optimizer's
    assert set(records[-1].phases) == {"forward", "backward", "optimizer"}


def test_skip_drops_every_optimizers_update_of_a_bad_step(tmp_path):
    tt.configure(service_name="test", prometheus_port="off", run_dir=str(tmp_path / "runs"), strict=True,
                 register_atexit=False, guard="skip")
    model = _model()
    optimizers = _split_optimizers(model)
    for i, x in enumerate(_batches()):
        if i == 2:
            x = x.clone()
            x[0, 0] = float("nan")
        before = [p.detach().clone() for p in model.parameters()]
        with tt.debug_context("train_step", model=model) as step:
            step.record_loss(_split_step(model, optimizers, x))
        unchanged = [torch.equal(a, p) for a, p in zip(before, model.parameters())]
        assert unchanged == [i == 2] * len(unchanged)
        assert step.record.skipped is (i == 2)
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def _sparse_model():
    """An embedding with ``sparse=True`` under ``SparseAdam``, a head under ``Adam``."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"emb": torch.nn.Embedding(50, 8, sparse=True), "head": torch.nn.Linear(8, 1)})
    sparse = torch.optim.SparseAdam(list(model["emb"].parameters()), lr=1e-2)
    dense = torch.optim.Adam(model["head"].parameters(), lr=1e-2)
    return model, sparse, dense


def test_a_sparse_embeddings_optimizer_and_the_rests_are_measured_together(tt_runtime):
    """``nn.Embedding(sparse=True)`` with ``SparseAdam``, an ``Adam`` for the rest: the norm
    counts the sparse gradient's values too."""
    model, sparse, dense = _sparse_model()
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        idx = torch.randint(0, 50, (16, 4), generator=gen)
        with tt.debug_context("train_step", model=model) as step:
            loss = model["head"](model["emb"](idx).mean(1)).pow(2).mean()
            loss.backward()
            expected = norm64([model["emb"].weight.grad.coalesce().values(), *[p.grad for p in model["head"].parameters()]])
            sparse.step()
            dense.step()
            model.zero_grad(set_to_none=True)
            step.record_loss(loss)
        assert step.record.grad_norm == pytest.approx(expected, rel=1e-5)


def test_a_second_optimizer_updating_the_models_other_parameters_is_said_once(tt_runtime, caplog):
    """The same model, but the step names the dense part's optimizer (``optimizer=dense``), as
    a loop that passes both does: the norm is the dense parameters' alone (``SparseAdam``'s
    embedding is another optimizer's), and a warning says once, whatever the guard, which of
    the model's parameters another optimizer updated unmeasured. A GAN's step given its
    generator and the generator's optimizer, in which the discriminator's optimizer steps too,
    says nothing: the discriminator is no part of the step's model."""
    caplog.set_level(logging.WARNING, logger="torchtrace")
    model, sparse, dense = _sparse_model()
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        idx = torch.randint(0, 50, (16, 4), generator=gen)
        with tt.debug_context("train_step", model=model, optimizer=dense) as step:
            loss = model["head"](model["emb"](idx).mean(1)).pow(2).mean()
            loss.backward()
            expected = norm64([p.grad for p in model["head"].parameters()])
            sparse.step()
            dense.step()
            model.zero_grad(set_to_none=True)
            step.record_loss(loss)
        assert step.record.grad_norm == pytest.approx(expected, rel=1e-5)
    said = [r.getMessage() for r in caplog.records if "not measured" in r.getMessage()]
    assert len(said) == 1 and "SparseAdam" in said[0] and "emb.weight" in said[0] and "train_step" in said[0], said
    caplog.clear()
    generator, critic = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    opt_g, opt_d = torch.optim.SGD(generator.parameters(), lr=0.1), torch.optim.SGD(critic.parameters(), lr=0.1)
    for _ in range(2):
        with tt.debug_context("gan_step", model=generator, optimizer=opt_g):
            fake = generator(torch.randn(8, 4))
            critic(fake.detach()).mean().backward()
            opt_d.step()
            opt_g.zero_grad()
            (-critic(fake).mean()).backward()
            opt_g.step()
    assert not [r.getMessage() for r in caplog.records if "not measured" in r.getMessage()]


def test_a_closure_optimizer_is_measured_when_its_closure_has_run(tt_runtime):
    """LBFGS in a model-only step: ``optimizer.step(closure)`` makes the gradients inside the
    closure, so they are measured as its first evaluation returns (before, at the optimizer's
    pre-hook: the gradients the previous step's last evaluation had left)."""
    def run(instrumented: bool) -> tuple[list[float], list[float]]:
        model = _model()
        opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
        losses, norms = [], []
        for x in _batches():
            first: list[float] = []

            def closure() -> torch.Tensor:
                opt.zero_grad()
                loss = model(x).pow(2).mean()
                loss.backward()
                if not first:
                    first.append(norm64(p.grad for p in model.parameters()))
                return loss

            if instrumented:
                with tt.debug_context("train_step", model=model) as step:
                    step.record_loss(opt.step(closure))
                losses.append(step.record.loss)
                norms.append(step.record.grad_norm)
            else:
                losses.append(opt.step(closure).item())
                norms.append(first[0])
        return losses, norms

    plain_losses, first_norms = run(False)
    losses, norms = run(True)
    assert losses == plain_losses  # bit for bit
    assert norms == pytest.approx(first_norms, rel=1e-5)
