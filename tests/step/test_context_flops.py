"""FLOPs of a ``debug_context`` given a model but no ``inputs=``, and of a step whose arguments
hold no batch: the shapes that decide them are those of the model's call, known only once
the step has called it."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import torchtrace as tt
from torchtrace.api import get_runtime
from torchtrace.measure.batch import MAX_MICRO_BATCHES


def _configure(tmp_path, **kw):
    return tt.configure(prometheus_port="off", run_dir=str(tmp_path), register_atexit=False, strict=True, **kw)


@pytest.fixture
def run(tmp_path):
    """torchtrace configured for the test, shut down after it."""
    _configure(tmp_path)
    yield
    tt.shutdown()


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _body(model, opt, x):
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()


def _reference(rows):
    """The same step on a fresh copy of the model, counted by FlopCounterMode itself."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with FlopCounterMode(display=False) as ref:
        _body(model, opt, torch.randn(rows, 16))
    return ref.get_total_flops()


def _context_steps(model, opt, rows_per_step, name="train_step"):
    records = []
    for rows in rows_per_step:
        x = torch.randn(rows, 16)
        with tt.debug_context(name, model=model, optimizer=opt) as step:
            _body(model, opt, x)
        records.append(step.record)
    return records


def test_a_context_gets_the_flops_of_its_models_call(tmp_path):
    """The first step runs under the counter (its time left out of throughput); later steps
    with the model called on the same shapes look their FLOPs up. A step on new shapes has
    none (it was not counted: its shapes were not known when it began) and the next step is
    counted, keyed by the shapes it really had."""
    _configure(tmp_path, peak_flops=1e12)
    try:
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        records = _context_steps(model, opt, (8, 8, 8, 16, 16, 16, 8))
        ref8, ref16 = _reference(8), _reference(16)
        assert [r.flops_counted for r in records] == [True, False, False, False, True, False, False]
        flops = [r.flops for r in records]
        assert flops[3] is None  # first step on 16 rows: not counted, not known
        for got, ref in zip(flops[:3] + flops[4:], (ref8, ref8, ref8, ref16, ref16, ref8)):
            assert got == pytest.approx(ref, rel=0.10)
        assert [r.samples for r in records] == [8, 8, 8, 16, 16, 16, 8]
        assert get_runtime().throughput.flops.counts == 2
        tp = get_runtime().throughput.ledger.throughput("train_step")
        assert tp is not None and tp.mfu is not None and tp.mfu > 0  # the configured peak gives MFU
    finally:
        tt.shutdown()


def test_a_short_last_batch_costs_one_counted_step_not_one_per_epoch(run):
    """Epochs of three batches of 8 rows and a last one of 5 (``drop_last=False``): the step
    after the short batch is counted once (it might have had those shapes again); it had not,
    and the short batch's shapes are not tried again, so later epochs pay for no count."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    records = _context_steps(model, opt, (8, 8, 8, 5) * 3)
    assert [i for i, r in enumerate(records) if r.flops_counted] == [0, 4]
    ref8 = _reference(8)
    for r in records:
        if r.samples == 8:
            assert r.flops == pytest.approx(ref8, rel=0.10)
        else:
            assert r.flops is None
    assert get_runtime().throughput.flops.counts == 2 and len(get_runtime().throughput.flops) == 1


def test_a_context_whose_model_sees_several_batches_stops_counting_and_gets_no_flops(run):
    """Two views of a batch, or an evaluation loop in one context: no one call's shapes are
    the step's. The counter the first step opened is left at the model's second call (an
    evaluation loop does not run under it past its first batch), nothing is recorded, and no
    later step is counted."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    records, modes = [], []
    for _ in range(4):
        x = torch.randn(8, 16)
        with tt.debug_context("two_views", model=model, optimizer=opt) as step:
            opt.zero_grad()
            first = model(x)
            modes.append(_get_current_dispatch_mode() is not None)
            (first - model(x + 1)).pow(2).mean().backward()
            modes.append(_get_current_dispatch_mode() is not None)
            opt.step()
        records.append(step.record)
    assert modes == [True, False] + [False, False] * 3  # counted until the second batch only
    assert [r.flops for r in records] == [None] * 4
    assert get_runtime().throughput.flops.counts == 0 and len(get_runtime().throughput.flops) == 0

    with tt.debug_context("evaluation", model=model) as step, torch.no_grad():
        for _ in range(3):
            model(torch.randn(8, 16))
        assert _get_current_dispatch_mode() is None
    assert step.record.flops is None and step.record.samples is None


def test_minibatches_each_with_its_backward_are_the_steps_batches(run):
    """A PPO update inside one context: each minibatch sets the gradients to None, runs its
    backward and updates (CleanRL's loop). Every minibatch is one more batch of the step:
    the step's samples are all of theirs and its FLOPs all of their passes. Before, a new
    gradient made at the address of the one freed read as no backward between two calls
    (the tensor's ``id`` was compared), and 4 to 10 steps in 30 lost their samples and FLOPs."""
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    minibatches = [torch.randn(8, 16) for _ in range(4)]
    records = []
    for _ in range(30):
        with tt.debug_context("ppo_update", model=model, optimizer=opt) as step:
            for x in minibatches:
                loss = model(x).pow(2).mean()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        records.append(step.record)
    per_pass = _reference(8)  # one minibatch's forward and backward, counted by FlopCounterMode
    assert [r.samples for r in records] == [4 * 8] * 30  # a plain count over the minibatches
    assert [r.flops for r in records] == [4 * per_pass] * 30


def test_batches_each_with_its_update_are_the_steps_batches_when_gradients_are_zeroed_first(run, caplog):
    """The loop of PyTorch's MNIST example (zero_grad, forward, backward, step) inside one
    context: the gradients are None at every call of the model, so no backward showed between
    two calls, and each step lost its samples and FLOPs, with a warning that no backward ran
    between them. An update of the step's optimizer between two calls makes them two batches.
    More batches than the rules keep (an epoch in one step) are told as such."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    minibatches = [torch.randn(8, 16) for _ in range(4)]
    records = []
    for _ in range(3):
        with tt.debug_context("mnist_loop", model=model, optimizer=opt) as step:
            for x in minibatches:
                _body(model, opt, x)
        records.append(step.record)
    assert [r.samples for r in records] == [4 * 8] * 3
    assert [r.flops for r in records] == [4 * _reference(8)] * 3
    assert "several batches" not in caplog.text
    with tt.debug_context("epoch", model=model, optimizer=opt) as step:
        for _ in range(MAX_MICRO_BATCHES + 1):
            _body(model, opt, torch.randn(8, 16))
    assert step.record.samples is None
    told = [r.getMessage() for r in caplog.records if "epoch" in r.getMessage()]
    assert len(told) == 1 and f"more than {MAX_MICRO_BATCHES} batches" in told[0], told
    assert "no backward" not in told[0]


def test_record_batch_flops_win_in_a_context_and_a_context_with_inputs_is_keyed_by_them(run):
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    given = []
    for _ in range(2):
        with tt.debug_context("given", model=model, optimizer=opt) as step:
            _body(model, opt, torch.randn(8, 16))
            step.record_batch(flops=1234.0)
        given.append((step.record.flops, step.record.flops_counted))
    # The first step ran under the counter all the same: its time is not throughput.
    assert given == [(1234.0, True), (1234.0, False)]
    records = []
    for _ in range(2):
        x = torch.randn(4, 16)
        with tt.debug_context("with_inputs", model=model, optimizer=opt, inputs=x) as step:
            _body(model, opt, x)
        records.append(step.record)
    assert [r.flops_counted for r in records] == [True, False]
    assert records[1].flops == pytest.approx(_reference(4), rel=0.10)


def test_a_context_that_never_calls_its_model_is_counted_once(run):
    """The model named but the step computing through a submodule's call only: no call of the
    model says the shapes, so the first step's count is dropped and no later step pays for one."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    records = []
    for _ in range(3):
        with tt.debug_context("submodules", model=model, optimizer=opt) as step:
            opt.zero_grad()
            model[2](model[1](model[0](torch.randn(8, 16)))).sum().backward()
            opt.step()
        records.append(step.record)
    assert [r.flops_counted for r in records] == [True, False, False]
    assert [r.flops for r in records] == [None] * 3


def test_a_step_that_draws_its_batch_itself_is_keyed_by_its_models_call(run):
    """``train_step(batches)`` with ``batches`` an iterator the step calls ``next`` on, or a
    step with no arguments: its arguments hold no batch, so the shapes of the model's call
    decide its FLOPs and give its samples. Before, every step had the first step's FLOPs
    (16-row steps read the 32-row count) and none had samples."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rows = (32, 32, 16, 16, 16, 32)
    batches = iter([torch.randn(n, 16) for n in rows])

    @tt.debug_operation(model=model, optimizer=opt)
    def train_step(source):
        _body(model, opt, next(source))

    records = []
    for _ in rows:
        train_step(batches)
        records.append(get_runtime().history.last_record)
    assert [r.samples for r in records] == list(rows)
    assert [r.flops_counted for r in records] == [True, False, False, True, False, False]
    ref32, ref16 = _reference(32), _reference(16)
    # The first 16-row step has none: its shapes were known only once it ran.
    for got, ref in zip([r.flops for r in records], (ref32, ref32, None, ref16, ref16, ref32)):
        assert got == (None if ref is None else pytest.approx(ref, rel=0.10))

    @tt.debug_operation(name="no_arguments", model=model, optimizer=opt)
    def no_arguments():
        _body(model, opt, torch.randn(8, 16))

    records = []
    for _ in range(3):
        no_arguments()
        records.append(get_runtime().history.last_record)
    assert [(r.samples, r.flops_counted) for r in records] == [(8, True), (8, False), (8, False)]
    assert all(r.flops == pytest.approx(_reference(8), rel=0.10) for r in records)


class _Holder:
    """A batch object of the user's own class (no dataclass, no mapping): nothing to read."""

    def __init__(self, x):
        self.x = x


def test_a_batch_of_the_users_own_class_is_read_through_the_models_call(run):
    """Such an object says nothing of its shapes, so its steps are keyed by the model's call:
    samples from it, and FLOPs per its shapes. Before, no samples, and every step had the
    first step's FLOPs."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    @tt.debug_operation(model=model, optimizer=opt)
    def train_step(batch):
        _body(model, opt, batch.x)

    records = []
    for rows in (8, 8, 4, 4):
        train_step(_Holder(torch.randn(rows, 16)))
        records.append(get_runtime().history.last_record)
    assert [(r.samples, r.flops_counted) for r in records] == [(8, True), (8, False), (4, False), (4, True)]
    for got, ref in zip([r.flops for r in records], (_reference(8), _reference(8), None, _reference(4))):
        assert got == (None if ref is None else pytest.approx(ref, rel=0.10))


class _Wrapper(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = _mlp()


class _TakesHolder(_Wrapper):
    """A model that takes the user's batch object itself and unpacks it in its forward."""

    def forward(self, batch):
        return self.net(batch.x)


def test_a_model_called_on_the_users_own_object_keeps_the_arguments_key(run):
    """Neither the arguments nor the model's call say the batch: the step stays keyed by its
    arguments (one count for every batch of that type, as documented) and has no samples."""
    model = _TakesHolder()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    @tt.debug_operation(model=model, optimizer=opt)
    def train_step(batch):
        opt.zero_grad()
        model(batch).pow(2).mean().backward()
        opt.step()

    records = []
    for _ in range(3):
        train_step(_Holder(torch.randn(8, 16)))
        records.append(get_runtime().history.last_record)
    assert [(r.samples, r.flops_counted) for r in records] == [(None, True), (None, False), (None, False)]
    assert all(r.flops == pytest.approx(_reference(8), rel=0.10) for r in records)
    assert not get_runtime().throughput.calls.opaque


def test_an_operation_that_gives_its_flops_is_not_counted_again(run):
    """``record_batch(flops=...)`` in a step: its first step ran under the counter (the count
    begins before the step says anything), no later step does, on new shapes too; the given
    FLOPs are every step's. Before, each new shape's first step was counted again (and slowed)
    for FLOPs that the given ones replaced."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    @tt.debug_operation(model=model, optimizer=opt)
    def train_step(x):
        _body(model, opt, x)
        tt.current_step().record_batch(flops=1000.0 * x.shape[0])

    records = []
    for rows in (8, 8, 16, 4):
        train_step(torch.randn(rows, 16))
        records.append(get_runtime().history.last_record)
    for rows in (8, 16):
        with tt.debug_context("context", model=model, optimizer=opt) as step:
            _body(model, opt, torch.randn(rows, 16))
            step.record_batch(flops=1000.0 * rows)
        records.append(step.record)
    assert [(r.flops, r.flops_counted) for r in records] == [
        (8000.0, True), (8000.0, False), (16000.0, False), (4000.0, False), (8000.0, True), (16000.0, False)]
    assert get_runtime().throughput.flops.counts == 2  # the first step of each operation


def test_the_users_own_flop_counter_inside_a_step_keeps_its_count(run):
    """A FlopCounterMode of the user's entered inside a context that calls the model on two
    batches: torchtrace's count, open below it, is not left at the second call (leaving a
    mode pops the innermost one: it was the user's, whose count came out 512 instead of the
    step's), and the user's count equals the same step's count without torchtrace."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    def step(model, opt, x1, x2):
        with FlopCounterMode(display=False) as mine:
            (model(x1) + model(x2)).sum().backward()
        opt.step()
        return mine.get_total_flops()

    torch.manual_seed(0)
    x1, x2 = torch.randn(4, 8), torch.randn(4, 8)
    plain = torch.nn.Linear(8, 8)
    reference = step(plain, torch.optim.SGD(plain.parameters(), lr=0.01), x1, x2)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    counts = []
    for _ in range(2):
        with tt.debug_context("two_batches", model=model, optimizer=opt) as ctx:
            counts.append(step(model, opt, x1, x2))
        assert ctx.record.flops is None
        assert _get_current_dispatch_mode_stack() == []
    assert counts == [reference, reference]


def test_an_epoch_counter_below_the_users_own_mode_is_left_alone(run):
    """An epoch context (a model, no inputs: its first step counts) holding a decorated step
    with an optimizer, inside the user's own FlopCounterMode: the step's start would drop the
    epoch's count, which here sits below the user's mode; it is left open instead, and the
    user's count equals the same steps' count without torchtrace."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    def steps(model, opt, train_step):
        with FlopCounterMode(display=False) as mine:
            for _ in range(2):
                train_step(torch.ones(4, 16))
        return mine.get_total_flops()

    plain = _mlp()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.01)
    reference = steps(plain, plain_opt, lambda x: _body(plain, plain_opt, x))
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    train_step = tt.debug_operation(model=model, optimizer=opt)(lambda x: _body(model, opt, x))
    with tt.debug_context("epoch", model=model):
        mine = steps(model, opt, train_step)
    assert mine == reference
    assert _get_current_dispatch_mode_stack() == []


class _OwnCall(_Wrapper):
    """A module class with a ``__call__`` of its own: its marks are forward hooks, not the seam."""

    def forward(self, x):
        return self.net(x)

    def __call__(self, *args, **kwargs):
        return super().__call__(*args, **kwargs)


@pytest.mark.parametrize("form", ["torch.compile(model)", "model.compile()", "own __call__"])
def test_a_context_reads_the_call_of_a_model_marked_by_hooks(run, form):
    """``torch.compile(model)`` (a wrapper whose marks are hooks) and a class with its own
    ``__call__`` had the phases but neither samples nor FLOPs in a context without inputs: the
    hooks did not keep the call's arguments, as the seam does. Against a plain count and
    FlopCounterMode on the same step."""
    if form == "own __call__":
        model = _OwnCall()
    else:
        model = _mlp()
        if form == "model.compile()":
            model.compile(backend="eager")
        else:
            model = torch.compile(model, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    records = _context_steps(model, opt, (8, 8, 8))
    assert [(r.samples, r.flops_counted) for r in records] == [(8, True), (8, False), (8, False)]
    assert all(r.flops == pytest.approx(_reference(8), rel=0.10) for r in records)
    assert all(r.phases and r.phases["forward"] > 0 for r in records)


def _double_dqn_body(model, opt, obs, next_obs):
    with torch.no_grad():  # the online network picks the next actions: no training batch
        next_actions = model(next_obs).argmax(1)
    opt.zero_grad()
    q = model(obs).gather(1, next_actions[:, None])
    (q - 1.0).pow(2).mean().backward()
    opt.step()


def _evaluate_after_body(model, opt, x, held_out):
    _body(model, opt, x)
    with torch.no_grad():  # a held-out batch looked at after the update: no training batch
        model(held_out)


@pytest.mark.parametrize("body,no_grad_rows", [(_double_dqn_body, 8), (_evaluate_after_body, 4)],
                         ids=["double-dqn", "evaluate-after-update"])
def test_a_call_without_autograd_beside_the_training_call_is_not_a_batch_of_the_step(run, caplog, body,
                                                                                     no_grad_rows):
    """Double DQN picks the next actions with the online network under ``no_grad``, on the next
    states, before its training call; a loop may look at a held-out batch under ``no_grad``
    after the update. Neither call trains: the step's samples are its training batch's 8, and
    its FLOPs all that ran (FlopCounterMode's count of the same body). Before, the first read
    as two views of a batch (no samples, no FLOPs, and a warning) and the second as one more
    micro-batch (8 + 4 samples)."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    reference_model = _mlp()
    reference_opt = torch.optim.SGD(reference_model.parameters(), lr=0.01)
    with FlopCounterMode(display=False) as ref:
        body(reference_model, reference_opt, torch.randn(8, 16), torch.randn(no_grad_rows, 16))
    records = []
    for _ in range(5):
        with tt.debug_context("train_step", model=model, optimizer=opt) as step:
            body(model, opt, torch.randn(8, 16), torch.randn(no_grad_rows, 16))
        records.append(step.record)
    assert [r.samples for r in records] == [8] * 5
    assert [r.flops for r in records] == [ref.get_total_flops()] * 5
    assert "several batches" not in caplog.text


def test_a_replayed_step_keeps_its_batch_and_flops(tmp_path, caplog):
    """The word-language-model step in the form docs/forensics.md shows: ``debug_context(model=,
    replay=closure)``, a clip and a hand-written update, ``guard="skip"``. Its batch is known
    from the model's call. On a NaN step the forensic replay calls the model again, on its own
    hidden state (another tensor): that call was taken for a second batch of the step, which
    then had no samples, tokens or FLOPs (None where the other steps read 20, 700 and their
    FLOPs), and a warning said the loop called its model on several batches. A replay's calls
    are none of the step's."""
    import logging

    import torch.nn.functional as F

    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder, self.rnn = torch.nn.Embedding(100, 16), torch.nn.LSTM(16, 16)
            self.decoder = torch.nn.Linear(16, 100)
            self.bad = False

        def forward(self, x, h):
            out, h = self.rnn(self.encoder(x), h)
            logits = self.decoder(out).view(-1, 100)
            return F.log_softmax(logits * float("nan") if self.bad else logits, 1), h

    _configure(tmp_path, guard="skip")
    caplog.set_level(logging.WARNING, logger="torchtrace")
    try:
        torch.manual_seed(0)
        model = LM()
        hidden = (torch.zeros(1, 20, 16), torch.zeros(1, 20, 16))
        rows = []
        for step in range(4):
            data, targets = torch.randint(0, 100, (35, 20)), torch.randint(0, 100, (700,))
            h_in = tuple(t.detach() for t in hidden)
            model.bad = step == 2
            with tt.debug_context("train_batch", model=model,
                                  replay=lambda: F.nll_loss(model(data, h_in)[0], targets)) as st:
                model.zero_grad()
                out, hidden = model(data, tuple(t.detach() for t in hidden))
                loss = F.nll_loss(out, targets)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
                for p in model.parameters():
                    p.data.add_(p.grad, alpha=-20)
                st.record_loss(loss)
            model.bad = False
            record = st.record
            rows.append((record.skipped, record.samples, record.tokens, record.flops))
        assert [r[0] for r in rows] == [False, False, True, False]
        assert [r[1:3] for r in rows] == [(20, 700)] * 4
        assert rows[2][3] == rows[0][3] > 0
        assert not [r for r in caplog.records if "several batches" in r.getMessage()]
    finally:
        tt.shutdown()
