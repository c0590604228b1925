"""A decorated method of a trainer class watches the model, optimizer and scaler among its
object's attributes; a training step with nothing to watch says so once."""

from __future__ import annotations

import copy
import logging

import torch

import torchtrace as tt
from torchtrace.api import get_runtime


def _configure(tmp_path, **kw):
    return tt.configure(prometheus_port="off", run_dir=str(tmp_path), register_atexit=False, strict=True, **kw)


class Trainer:
    """The shape of many training scripts: the step is a method, the model and optimizer are
    attributes, beside an EMA copy (not trained by the optimizer) and a loss module."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        self.ema = copy.deepcopy(self.model)
        self.criterion = torch.nn.CrossEntropyLoss()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.epochs = 3

    @tt.debug_operation(name="trainer_step")
    def train_step(self, x, y):
        self.optimizer.zero_grad()
        loss = self.criterion(self.model(x), y)
        loss.backward()
        self.optimizer.step()
        return loss


def test_a_trainer_method_watches_its_model_and_optimizer(tmp_path):
    """Gradient norm against float64 norms of the same step's gradients (taken on a copy),
    the three phases, and the optimizer's learning rate, none of which the step had before."""
    _configure(tmp_path)
    try:
        trainer = Trainer()
        torch.manual_seed(1)
        batches = [(torch.randn(5, 6), torch.randint(0, 3, (5,))) for _ in range(3)]
        expected = []
        for x, y in batches:
            twin = copy.deepcopy(trainer.model)
            trainer.criterion(twin(x), y).backward()
            expected.append(torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(p.grad.double()) for p in twin.parameters()])).item())
            trainer.train_step(x, y)
        rt = get_runtime()
        rt.finish_deferred(block=True)
        rows = rt.history.steps()
        assert [row["grad_norm"] for row in rows] == [pytest_approx(v) for v in expected]
        assert all(set(row["phases"]) == {"forward", "backward", "optimizer"} for row in rows)
        assert rt.history.last_record.lr == [trainer.optimizer.param_groups[0]["lr"]]
        assert all(row["samples"] == 5 for row in rows)
    finally:
        tt.shutdown()


def pytest_approx(value):
    import pytest

    return pytest.approx(value, rel=1e-5)


def test_a_model_replaced_on_the_object_is_watched_from_the_next_step(tmp_path):
    _configure(tmp_path)
    try:
        trainer = Trainer()
        x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
        trainer.train_step(x, y)
        rt = get_runtime()
        rt.finish_deferred(block=True)
        first = rt.history.last_record.grad_names
        trainer.model = torch.nn.Sequential(torch.nn.Linear(6, 3))  # a new model and its optimizer
        trainer.optimizer = torch.optim.SGD(trainer.model.parameters(), lr=0.01)
        trainer.train_step(x, y)
        rt.finish_deferred(block=True)
        record = rt.history.last_record
        assert len(first) == 4 and len(record.grad_names) == 2
        assert record.lr == [0.01]
    finally:
        tt.shutdown()


def test_a_model_holding_another_attribute_is_the_one_watched(tmp_path):
    """``self.backbone`` is part of ``self.model``: the model is the one that holds both."""
    _configure(tmp_path)
    try:
        trainer = Trainer()
        trainer.backbone = trainer.model[0]
        trainer.train_step(torch.randn(4, 6), torch.randint(0, 3, (4,)))
        rt = get_runtime()
        rt.finish_deferred(block=True)
        assert len(rt.history.last_record.grad_names) == 4
    finally:
        tt.shutdown()


class Gan:
    """Two models, two optimizers: which is "the" model is not for torchtrace to guess."""

    def __init__(self) -> None:
        self.generator = torch.nn.Linear(4, 4)
        self.discriminator = torch.nn.Linear(4, 1)
        self.g_opt = torch.optim.SGD(self.generator.parameters(), lr=0.1)
        self.d_opt = torch.optim.SGD(self.discriminator.parameters(), lr=0.1)

    @tt.debug_operation(name="gan_step")
    def step(self, z):
        self.g_opt.zero_grad()
        loss = self.discriminator(self.generator(z)).mean()
        loss.backward()
        self.g_opt.step()
        return loss


def test_an_ambiguous_object_watches_nothing_and_says_so_once(tmp_path, caplog):
    _configure(tmp_path)
    try:
        gan = Gan()
        with caplog.at_level(logging.WARNING, logger="torchtrace"):
            for _ in range(3):
                gan.step(torch.randn(2, 4))
        rt = get_runtime()
        rt.finish_deferred(block=True)
        assert rt.history.last_record.grad_norm is None and rt.history.last_record.loss is not None
        said = [r.getMessage() for r in caplog.records if "no model or optimizer to watch" in r.getMessage()]
        assert len(said) == 1 and "gan_step" in said[0] and "model=" in said[0] and "optimizer=" in said[0]
    finally:
        tt.shutdown()


def test_a_step_given_its_model_and_optimizer_is_not_warned_about(tmp_path, caplog):
    _configure(tmp_path)
    try:
        gan = Gan()
        op = tt.debug_operation(name="gan_step", model=gan.generator, optimizer=gan.g_opt)(Gan.step.__wrapped__)
        with caplog.at_level(logging.WARNING, logger="torchtrace"):
            op(gan, torch.randn(2, 4))
            with tt.debug_context("evaluation", kind="evaluation") as step:  # not a training step
                step.record_loss(torch.tensor(1.0))
            with tt.debug_context("by_hand") as step:  # a context names what it watches itself
                step.record_loss(torch.tensor(1.0))
        get_runtime().finish_deferred(block=True)
        assert get_runtime().history.last_record.loss == 1.0
        assert not [r for r in caplog.records if "no model or optimizer" in r.getMessage()]
    finally:
        tt.shutdown()


class ScaledTrainer(Trainer):
    def __init__(self) -> None:
        super().__init__()
        self.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)

    @tt.debug_operation(name="scaled_step")
    def scaled_step(self, x, y):
        self.optimizer.zero_grad()
        loss = self.criterion(self.model(x), y)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return loss


def test_a_scaler_attribute_is_left_alone_by_the_replay_and_counted_in_goodput(tmp_path):
    """A batch with a NaN: the scaler skips the update and backs off once (its own update),
    not twice (the forensic replay calls the method again, with the scaler's update
    neutralised), and the step counts as skipped in goodput."""
    _configure(tmp_path)
    try:
        trainer = ScaledTrainer()
        x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
        trainer.scaled_step(x, y)
        before = trainer.scaler.get_scale()
        x[1, 2] = float("nan")
        trainer.scaled_step(x, y)
        rt = get_runtime()
        rt.finish_deferred(block=True)
        record = rt.history.last_record
        assert record.forensics is not None  # the step was replayed
        assert trainer.scaler.get_scale() == before / 2
        assert record.scaler_overflow
        assert rt.throughput.ledger.closed().badput["skipped_step"] > 0
    finally:
        tt.shutdown()


class SelfTraining(torch.nn.Module):
    """A module that trains itself: its optimizer is an attribute of the module."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(6, 3)
        self.optimizer = torch.optim.SGD(self.net.parameters(), lr=0.1)

    def forward(self, x):
        return self.net(x)

    @tt.debug_operation(name="self_step")
    def train_step(self, x, y):
        self.optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(self(x), y)
        loss.backward()
        self.optimizer.step()
        return loss


def test_a_modules_own_method_watches_the_optimizer_it_keeps(tmp_path):
    _configure(tmp_path)
    try:
        model = SelfTraining()
        model.train_step(torch.randn(4, 6), torch.randint(0, 3, (4,)))
        rt = get_runtime()
        rt.finish_deferred(block=True)
        record = rt.history.last_record
        assert record.lr == [0.1] and set(record.phases) == {"forward", "backward", "optimizer"}
        assert len(record.grad_names) == 2 and record.grad_norm is not None
    finally:
        tt.shutdown()


class LazyTrainer:
    """Builds its optimizer (and scheduler) in its first step, as some scripts do."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        self.optimizer = None
        self.best = None

    @tt.debug_operation(name="lazy_step")
    def train_step(self, x, y):
        if self.optimizer is None:
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(self.model(x), y)
        loss.backward()
        self.optimizer.step()
        self.best = loss.item() if self.best is None else min(self.best, loss.item())
        return loss


def test_an_optimizer_set_on_the_object_after_the_first_step_is_watched_from_the_next(tmp_path):
    """The attributes were worked out once, at the first call, when ``self.optimizer`` was
    still None: the optimizer was never watched (no learning rate, no phases, no skip guard)
    and nothing was said. An attribute that was None is looked at again once it is set."""
    _configure(tmp_path, guard="skip")
    try:
        trainer = LazyTrainer()
        x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
        for _ in range(3):
            trainer.train_step(x, y)
        rt = get_runtime()
        rt.finish_deferred(block=True)
        rows = rt.history.steps()
        assert [row.get("phases") and "optimizer" in row["phases"] for row in rows][1:] == [True, True]
        assert rt.history.last_record.lr == [0.05]
    finally:
        tt.shutdown()
