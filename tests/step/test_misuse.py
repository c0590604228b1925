"""A user's mistake is named at the point of the mistake, never counted as torchtrace's own error."""

from __future__ import annotations

import logging

import pytest
import torch

import torchtrace as tt
from torchtrace.api import get_runtime


@pytest.fixture
def model_and_opt(tiny_model):
    return tiny_model, torch.optim.SGD(tiny_model.parameters(), lr=0.1)


def test_a_string_as_model_is_refused_at_scope_creation(tt_runtime):
    with pytest.raises(TypeError, match=r"model= must be a torch.nn.Module, got str.*debug_context\(\"train_step\""):
        tt.debug_context("train_step", model="my_model")
    assert get_runtime().errors.total == 0


def test_model_and_optimizer_swapped(tt_runtime, model_and_opt):
    model, opt = model_and_opt
    with pytest.raises(TypeError, match=r"model= .* got SGD \(model and optimizer swapped\?\)"):
        tt.debug_context("train_step", model=opt, optimizer=model)
    with pytest.raises(TypeError, match=r"optimizer= .* got TinyNet \(model and optimizer swapped\?\)"):
        tt.debug_context("train_step", optimizer=model)
    with pytest.raises(TypeError, match="model and optimizer swapped"):
        tt.debug_operation(model=opt, optimizer=model)
    rt = get_runtime()
    assert rt.errors.total == 0 and rt.history.totals["steps"] == 0


def test_a_module_as_the_decorators_argument(tt_runtime, tiny_model):
    with pytest.raises(TypeError, match=r"got a torch.nn.Module where the function to decorate belongs.*model=model"):
        tt.debug_operation(tiny_model)


def test_debug_context_used_as_a_decorator_says_which_decorator_to_use(tt_runtime, model_and_opt):
    """``@tt.debug_context("train_step", ...)`` above a function: refused where it is written,
    naming the decorator that takes the same arguments, not "'StepScope' object is not callable"."""
    model, opt = model_and_opt
    with pytest.raises(TypeError, match=r"debug_context\(\) is a context manager.*"
                                        r"@torchtrace.debug_operation\(name='train_step', model=\.\.\., optimizer=\.\.\.\)"):
        @tt.debug_context("train_step", model=model, optimizer=opt)
        def train_step():
            pass
    assert get_runtime().errors.total == 0 and get_runtime().history.totals["steps"] == 0


def test_a_module_as_debug_contexts_name(tt_runtime, tiny_model):
    with pytest.raises(TypeError, match=r"first argument is the operation's name, got a TinyNet.*model=model"):
        tt.debug_context(tiny_model)
    with pytest.raises(TypeError, match="name must be a string, got int"):
        tt.debug_context(3)


def test_wrong_scaler_and_replay_types(tt_runtime, model_and_opt):
    model, opt = model_and_opt
    with pytest.raises(TypeError, match="scaler= must be a torch.amp.GradScaler"):
        tt.debug_context("train_step", model=model, optimizer=opt, scaler=1.0)
    with pytest.raises(TypeError, match="replay= must be a callable"):
        tt.debug_context("train_step", model=model, replay="again")
    with pytest.raises(TypeError, match="scaler= must be a torch.amp.GradScaler"):
        tt.debug_operation(scaler="amp")
    with pytest.raises(ValueError, match="kind='eval' is not valid; accepted values: train, evaluation"):
        tt.debug_context("evaluate", kind="eval")


@pytest.mark.parametrize("bad", [[1, 2], "dataset=train", {1: "x"}])
def test_attributes_that_are_not_a_dict_of_names_are_refused_where_given(tt_runtime, bad):
    """They were taken at decoration and raised AttributeError out of every call of the step."""
    with pytest.raises(TypeError, match="attributes= must be a dict of string keys"):
        tt.debug_operation(attributes=bad)
    with pytest.raises(TypeError, match="attributes= must be a dict of string keys"):
        tt.debug_context("train_step", attributes=bad)
    step = tt.debug_operation(attributes={"dataset": "train", "fold": 3})(lambda x: x * 2)
    assert step(torch.ones(1)).item() == 2.0


def test_the_right_calls_still_work_and_count_no_internal_error(tt_runtime, model_and_opt):
    model, opt = model_and_opt
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    with tt.debug_context("train_step", model=model, optimizer=opt, scaler=scaler) as step:
        loss = model(torch.ones(2, 8)).pow(2).mean()
        loss.backward()
        step.record_loss(loss)
        opt.step()
    assert step.record.grad_norm is not None
    with tt.debug_context(tt.DebugLevel.BASIC) as seed_style:  # the seeds' form
        pass
    assert seed_style.record.operation == "step"
    assert get_runtime().errors.total == 0


def test_a_guard_that_cannot_act_says_so_once_per_operation(tmp_path, tiny_model, caplog):
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), guard="skip", register_atexit=False)
    try:
        caplog.set_level(logging.WARNING, logger="torchtrace")
        for i in range(3):
            with tt.debug_context("train_step", model=tiny_model) as step:  # no optimizer: skip cannot act
                tiny_model.zero_grad()
                loss = tiny_model(torch.ones(2, 8)).pow(2).mean() * (float("nan") if i == 1 else 1.0)
                loss.backward()
                step.record_loss(loss)
                with torch.no_grad():  # a hand-written update (an optimizer stepping here is the step's)
                    for p in tiny_model.parameters():
                        p.add_(p.grad, alpha=-0.1)
        warnings = [r for r in caplog.records if "cannot skip" in r.getMessage()]
        assert len(warnings) == 1 and "optimizer=" in warnings[0].getMessage()
        assert "train_step" in warnings[0].getMessage()
        rt = get_runtime()
        assert rt.history.totals["skipped_steps"] == 0 and rt.history.totals["nonfinite_steps"] >= 1
        guard = rt.summary()["guard"]
        assert guard["policy"] == "skip" and guard["not_applied"]["train_step"] >= 1
        assert rt.errors.total == 0
    finally:
        tt.shutdown()


def test_a_nan_micro_step_whose_accumulated_update_is_skipped_is_not_counted_as_gone_through(tmp_path, tiny_model):
    """Accumulation across steps: four micro-steps given the optimizer, which steps in the last;
    the first's loss is NaN. The update the NaN went into is skipped (the weights are those
    before the four steps, bit for bit), and the first micro-step made no update: before, the
    run report's ``guard.not_applied`` counted it ({"micro_step": 1}); now it counts none. A
    bad step with a hand-written update is still counted (the test above). (Non-finite: the first
    micro-step, its loss, and the last, its accumulated gradients.)"""
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), guard="skip", register_atexit=False)
    try:
        opt = torch.optim.SGD(tiny_model.parameters(), lr=0.1, momentum=0.9)
        before = [p.detach().clone() for p in tiny_model.parameters()]

        @tt.debug_operation(name="micro_step", model=tiny_model, optimizer=opt)
        def micro_step(i):
            loss = tiny_model(torch.ones(2, 8)).pow(2).mean() * (float("nan") if i == 0 else 1.0)
            loss.backward()
            tt.current_step().record_loss(loss)
            if i == 3:
                opt.step()
                opt.zero_grad()

        for i in range(4):
            micro_step(i)
        assert all(torch.equal(a, b) for a, b in zip(before, tiny_model.parameters()))
        rt = get_runtime()
        assert rt.history.totals["skipped_steps"] == 1 and rt.history.totals["nonfinite_steps"] == 2
        assert rt.summary()["guard"]["not_applied"] == {}
    finally:
        tt.shutdown()


def test_a_guard_that_acts_through_the_clip_call_does_not_warn(tmp_path, tiny_model, caplog):
    """No optimizer= but clip_grad_norm_ inside the step: the gradients are measured (and a NaN
    update skipped) at the clip call, before the update, as the warning itself advises."""
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), guard="skip", register_atexit=False)
    try:
        opt = torch.optim.SGD(tiny_model.parameters(), lr=0.1)
        caplog.set_level(logging.WARNING, logger="torchtrace")
        for i in range(3):
            before = [p.detach().clone() for p in tiny_model.parameters()]
            with tt.debug_context("train_step", model=tiny_model) as step:
                opt.zero_grad()
                loss = tiny_model(torch.ones(2, 8)).pow(2).mean() * (float("nan") if i == 1 else 1.0)
                loss.backward()
                step.record_loss(loss)
                torch.nn.utils.clip_grad_norm_(tiny_model.parameters(), 1.0)
                opt.step()
            same = all(torch.equal(a, b) for a, b in zip(before, tiny_model.parameters()))
            assert same == (i == 1), i  # the NaN update was skipped; the others applied
        assert not [r for r in caplog.records if "cannot skip" in r.getMessage()]
        assert get_runtime().history.totals["skipped_steps"] == 1
    finally:
        tt.shutdown()


def test_a_guard_with_an_optimizer_does_not_warn(tmp_path, tiny_model, caplog):
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), guard="skip", register_atexit=False)
    try:
        opt = torch.optim.SGD(tiny_model.parameters(), lr=0.1)
        caplog.set_level(logging.WARNING, logger="torchtrace")
        with tt.debug_context("train_step", model=tiny_model, optimizer=opt):
            tiny_model(torch.ones(2, 8)).pow(2).mean().backward()
            opt.step()
        assert not [r for r in caplog.records if "cannot skip" in r.getMessage()]
        assert get_runtime().summary()["guard"]["not_applied"] == {}
    finally:
        tt.shutdown()


def test_an_optimizer_stepping_after_its_step_is_said_once(tmp_path, tiny_model, caplog):
    """A step around the forward and backward only, its optimizer stepping after the block:
    the update's gradients are not measured and the guard cannot act on them. Before, nothing
    said so: the records had no gradient norm and a NaN update was applied under ``skip``.
    Micro-batches whose last one steps the optimizer inside its step are not warned about."""
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), guard="skip", register_atexit=False)
    try:
        opt = torch.optim.SGD(tiny_model.parameters(), lr=0.1)
        caplog.set_level(logging.WARNING, logger="torchtrace")
        for micro in range(4):  # accumulation: the optimizer steps in the last micro-batch's step
            with tt.debug_context("micro_step", model=tiny_model, optimizer=opt):
                tiny_model(torch.ones(2, 8)).pow(2).mean().backward()
                if micro == 3:
                    opt.step()
                    opt.zero_grad()
        for _ in range(3):
            opt.zero_grad()
            with tt.debug_context("forward_backward", model=tiny_model, optimizer=opt) as step:
                tiny_model(torch.ones(2, 8)).pow(2).mean().backward()
            opt.step()
            assert step.record.grad_norm is None
        said = [r.getMessage() for r in caplog.records if "stepped after the step ended" in r.getMessage()]
        assert len(said) == 1
        assert "forward_backward (SGD)" in said[0] and "guard='skip'" in said[0] and "inside the step" in said[0]
        assert get_runtime().errors.total == 0
    finally:
        tt.shutdown()


@pytest.mark.parametrize("kind", ["evaluation", "checkpoint"])
def test_an_evaluation_with_the_model_does_not_report_the_last_training_steps_gradients(tmp_path, tiny_model,
                                                                                     caplog, kind):
    """An evaluation (or checkpoint) operation given the model makes no gradients: what is left on
    the parameters is the last training step's. Measuring them at its end gave the evaluation
    that step's gradient norm, a non-finite step for a NaN the training step already reported,
    and a false "cannot skip the updates" warning under guard="skip"."""
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), guard="skip", register_atexit=False)
    try:
        opt = torch.optim.SGD(tiny_model.parameters(), lr=0.1)
        caplog.set_level(logging.WARNING, logger="torchtrace")

        @tt.debug_operation(name="train_step", model=tiny_model, optimizer=opt)
        def train(x):
            opt.zero_grad()
            tiny_model(x).pow(2).mean().backward()
            opt.step()

        @tt.debug_operation(name="evaluate", model=tiny_model, kind=kind)
        def evaluate(x):
            with torch.no_grad():
                return tiny_model(x).mean()

        train(torch.ones(2, 8))
        evaluate(torch.ones(3, 8))
        next(tiny_model.parameters()).grad.fill_(float("nan"))  # left over, as after a skipped update
        evaluate(torch.ones(3, 8))
        records = {s["operation"]: s for s in get_runtime().history.steps()}
        assert records["train_step"]["grad_norm"] > 0  # the training step's own are measured
        steps = [s for s in get_runtime().history.steps() if s["operation"] == "evaluate"]
        assert len(steps) == 2
        assert all(s.get("grad_norm") is None and not s.get("nonfinite") for s in steps), steps
        assert not [r for r in caplog.records if "cannot skip" in r.getMessage()]
        assert get_runtime().history.totals["steps"] == 3 and get_runtime().history.totals["nonfinite_steps"] == 0
    finally:
        tt.shutdown()


class _NoRepr:
    """A value whose repr fails (a lazy proxy not yet materialised)."""

    def __repr__(self):
        raise RuntimeError("not materialised yet")


@pytest.mark.parametrize("given,name", [
    (dict(flops=10**400), "flops"), (dict(samples=_NoRepr()), "samples"), (dict(flops=_NoRepr()), "flops"),
    (dict(tokens=10**5000), "tokens"),
    (dict(samples="8"), "samples"), (dict(samples=-1), "samples"), (dict(samples=2.5), "samples"),
    (dict(samples=True), "samples"), (dict(tokens=torch.tensor([1, 2])), "tokens"), (dict(tokens=float("nan")), "tokens"),
    (dict(tokens=-3), "tokens"), (dict(flops="x"), "flops"), (dict(flops=-5), "flops"), (dict(flops=float("inf")), "flops"),
])
def test_bad_record_batch_values_are_left_out_with_a_warning(tt_runtime, model_and_opt, caplog, given, name):
    """Inside the step nothing raises: the bad value is named in a warning and left out, what
    torchtrace infers stands in for it, the counters stay numbers that only grow, and no
    internal error is counted (strict mode would raise one)."""
    from tests.helpers import scrape, value

    model, opt = model_and_opt

    @tt.debug_operation(name="train_step", model=model, optimizer=opt)
    def train_step(x):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        tt.current_step().record_batch(**given)

    with caplog.at_level(logging.WARNING, logger="torchtrace"):
        for _ in range(2):
            train_step(torch.randn(4, 8))
    rt = get_runtime()
    rt.finish_deferred(block=True)
    warned = [r.getMessage() for r in caplog.records if "record_batch" in r.getMessage()]
    assert len(warned) == 1 and f"{name}=" in warned[0] and "accepted values" in warned[0]
    row = rt.history.steps()[-1]
    assert row["samples"] == 4  # inferred from the input, the bad value left out
    if name == "tokens":
        assert "tokens" not in row
    if name == "flops":
        assert row["flops"] == rt.throughput.flops.lookup(("train_step", ((torch.Size([4, 8]), torch.float32),)))
    samples = scrape(tt_runtime.metrics_url)
    assert value(samples, "torchtrace_samples_total", operation="train_step") == 8
    assert rt.errors.total == 0


@pytest.mark.parametrize("given,name,when", [
    (dict(samples=torch.tensor(-3)), "samples", "read"), (dict(tokens=torch.tensor(-7)), "tokens", "read"),
    (dict(samples=torch.tensor(float("nan"))), "samples", "dtype"), (dict(samples=torch.tensor(2.7)), "samples", "dtype"),
    (dict(tokens=torch.tensor(float("inf"))), "tokens", "dtype"), (dict(tokens=torch.tensor(True)), "tokens", "dtype"),
])
def test_bad_record_batch_tensors_leave_what_was_inferred(tmp_path, caplog, given, name, when):
    """A one-element tensor that is no count: a bool or floating one is left out at once (its
    dtype is host metadata), a negative integer one when the step's one read lands. Either way
    a warning names it, what torchtrace inferred stands (the batch's 4 rows, its mask's real
    tokens: a plain count), and no host read is added (one per step, as without it)."""
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), register_atexit=False, strict=True)
    try:
        emb = torch.nn.Embedding(50, 8)
        opt = torch.optim.SGD(emb.parameters(), lr=0.1)

        @tt.debug_operation(model=emb, optimizer=opt)
        def train_step(batch, give):
            opt.zero_grad()
            (emb(batch["input_ids"]) * batch["attention_mask"].unsqueeze(-1)).pow(2).mean().backward()
            opt.step()
            if give:
                tt.current_step().record_batch(**given)

        ids = torch.randint(0, 50, (4, 6))
        mask = torch.tensor([[1] * 6, [1] * 3 + [0] * 3, [1] * 5 + [0], [1] * 2 + [0] * 4])
        real = sum(int(v) for row in mask.tolist() for v in row)  # a plain count: 16
        from torchtrace.record import readout
        with caplog.at_level(logging.WARNING, logger="torchtrace"):
            train_step({"input_ids": ids, "attention_mask": mask}, False)
            reads = readout.reads()
            for _ in range(2):
                train_step({"input_ids": ids, "attention_mask": mask}, True)
            rt = get_runtime()
            rt.finish_deferred(block=True)
        assert readout.reads() - reads == 2  # the step's one read each, no more
        warned = [r.getMessage() for r in caplog.records if "record_batch" in r.getMessage()]
        assert len(warned) == 1 and f"{name}=" in warned[0] and "accepted values" in warned[0], warned
        assert [(s["samples"], s["tokens"]) for s in rt.history.steps()] == [(4, real)] * 3
        assert rt.metrics.value("torchtrace_samples_total", {"operation": "train_step"}) == 12
        assert rt.metrics.value("torchtrace_tokens_total", {"operation": "train_step"}) == 3 * real
        assert rt.errors.total == 0
    finally:
        tt.shutdown()


def test_good_record_batch_tensors_win_in_the_steps_one_read(tmp_path):
    """Integer tensors (a mask's sum) given to record_batch win over what was inferred, read
    with the step's one read: against a plain count."""
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), register_atexit=False, strict=True)
    try:
        from torchtrace.record import readout
        with tt.debug_context("train_step", inputs=torch.zeros(8, 3)) as step:
            pass
        reads = readout.reads()
        mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
        with tt.debug_context("train_step", inputs=torch.zeros(8, 3)) as step:
            step.record_batch(samples=(mask.sum(dim=1) > 1).sum(), tokens=mask.sum(), flops=10.0)
        assert readout.reads() - reads <= 1
        assert (step.record.samples, step.record.tokens, step.record.flops) == (1, 3, 10.0)
    finally:
        tt.shutdown()


def test_a_generator_function_is_refused_at_decoration(tt_runtime, model_and_opt):
    # Decorated, the step ran around the generator's creation only: a span of no work with the
    # batch's samples and no loss, the training itself outside it, and nothing said.
    model, opt = model_and_opt

    def steps(x):
        yield model(x).sum()

    async def async_steps(x):
        yield model(x).sum()

    for fn in (steps, async_steps):
        with pytest.raises(TypeError, match=r"debug_operation: .*steps is a generator function.*one training step"):
            tt.debug_operation(model=model, optimizer=opt)(fn)
        with pytest.raises(TypeError, match="is a generator function"):
            tt.debug_operation(fn)
    with pytest.raises(TypeError, match="got a torch.nn.Module where the function to decorate belongs"):
        tt.debug_operation(model=model)(model)  # the keyword form checks what it decorates too
    assert get_runtime().history.totals["steps"] == 0


def test_an_operation_without_a_name_of_its_own_is_named_after_what_it_calls(tt_runtime, model_and_opt):
    # A functools.partial and a callable object have no __name__: both were "operation", so
    # two different steps shared one operation's step count, throughput and FLOP counts.
    import functools

    model, opt = model_and_opt

    def train_step(x, scale):
        return model(x).sum() * scale

    class Evaluate:
        def __call__(self, x):
            return model(x).sum()

    train = tt.debug_operation(model=model)(functools.partial(train_step, scale=2.0))
    evaluate = tt.debug_operation(kind="evaluation")(Evaluate())
    with torch.no_grad():
        train(torch.randn(4, 8))
        evaluate(torch.randn(4, 8))
    assert get_runtime().history.totals["steps"] == 2
    assert dict(get_runtime().history.operations) == {"train_step": 1, "Evaluate": 1}


@pytest.mark.parametrize("value, shown", [(object(), "object"), (torch.tensor(0.1), "Tensor"),
                                          ([1, object()], "object"), ({"inner": object()}, "object")])
def test_attribute_values_a_span_cannot_hold_are_refused_where_given(tt_runtime, caplog, value, shown):
    """They were taken, then the SDK warned of them on every step's span (two lines a step for
    two such values) and wrote None or their str() instead."""
    pattern = rf"attributes\['cfg'\] holds a {shown}; accepted values: str, bool, int, float"
    with pytest.raises(TypeError, match=pattern):
        tt.debug_operation(attributes={"cfg": value})
    with pytest.raises(TypeError, match=pattern):
        tt.debug_context("train_step", attributes={"cfg": value})
    caplog.set_level(logging.WARNING)
    step = tt.debug_operation(attributes={"a": "x", "b": [1, 2.5], "c": {"d": (True, b"e")}, "n": None})(
        lambda x: x * 2)
    for _ in range(3):
        step(torch.ones(1))
    assert not [r for r in caplog.records if "Invalid type" in r.getMessage()]
