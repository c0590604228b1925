"""Throughput through the step pipeline, each number against a reference computed another way."""

from __future__ import annotations

import dataclasses
import logging
import time

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import torchtrace as tt
from tests.helpers import DifferentiatingModel
from torchtrace import semconv
from torchtrace.api import get_runtime
from torchtrace.record import readout


def _configure(tmp_path, **kw):
    return tt.configure(prometheus_port="off", run_dir=str(tmp_path), register_atexit=False, strict=True, **kw)


def _watched(model):
    """An SGD optimizer for ``model`` and a decorated step that trains it on one batch (the
    model's output, or the first of the outputs it returns, summed as the loss)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    @tt.debug_operation(model=model, optimizer=opt)
    def train_step(x):
        opt.zero_grad()
        out = model(x)
        (out[0] if isinstance(out, tuple) else out).sum().backward()
        opt.step()

    return opt, train_step


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _counted(fn, *args):
    """FLOPs of ``fn(*args)`` as FlopCounterMode counts them: the reference the steps' are checked against."""
    with FlopCounterMode(display=False) as ref:
        fn(*args)
    return ref.get_total_flops()


def _near(got, reference):
    """Every one of ``got`` (at least one) within 10 % of ``reference``."""
    return bool(got) and all(abs(f / reference - 1) < 0.10 for f in got)


def _token_step():
    """A decorated step training an embedding on a dict batch of token ids (masked by its
    ``attention_mask`` when it has one)."""
    emb = torch.nn.Embedding(50, 8)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)

    @tt.debug_operation(model=emb, optimizer=opt)
    def train_step(batch):
        opt.zero_grad()
        out = emb(batch["input_ids"])
        if "attention_mask" in batch:
            out = out * batch["attention_mask"].unsqueeze(-1)
        out.pow(2).mean().backward()
        opt.step()

    return train_step


def test_samples_and_tokens_against_a_plain_count(tmp_path):
    _configure(tmp_path)
    try:
        train_step = _token_step()
        g = torch.Generator().manual_seed(3)
        expected = []
        for rows in (4, 7, 2):
            lengths = torch.randint(1, 9, (rows,), generator=g)
            mask = (torch.arange(8).unsqueeze(0) < lengths.unsqueeze(1)).long()
            train_step({"input_ids": torch.randint(0, 50, (rows, 8), generator=g), "attention_mask": mask})
            expected.append((rows, int(sum(int(n) for n in lengths))))  # a plain count over the rows
        records = [s for s in get_runtime().history.steps()]
        assert [(s["samples"], s["tokens"]) for s in records] == expected
    finally:
        tt.shutdown()


def test_packed_rows_count_their_sequences_in_the_steps_one_read(tmp_path):
    """Padding-free batches (one row, sequences end to end, position ids restarting at 0):
    each step's samples are its sequences and its tokens every position, against a plain count
    of the rows packed; the sequences' count rides in the step's one read; the samples series
    sums them. A count given with record_batch as a device tensor is read the same way."""
    _configure(tmp_path)
    try:
        train_step = _token_step()
        g = torch.Generator().manual_seed(4)
        expected = []
        reads = readout.reads()
        for rows in (4, 7, 2, 5):
            lengths = [int(n) for n in torch.randint(1, 9, (rows,), generator=g)]
            positions = torch.cat([torch.arange(n) for n in lengths])[None]
            train_step({"input_ids": torch.randint(0, 50, positions.shape, generator=g), "position_ids": positions})
            expected.append((rows, sum(lengths)))  # a plain count over the packed rows
        rt = get_runtime()
        rt.finish_deferred(block=True)
        assert readout.reads() - reads == 4
        assert [(s["samples"], s["tokens"]) for s in rt.history.steps()] == expected
        labels = {"operation": "train_step"}
        assert rt.metrics.value("torchtrace_samples_total", labels) == sum(r for r, _ in expected)
        with tt.debug_context("train_step", inputs=torch.zeros(1, 9)) as step:
            step.record_batch(samples=torch.tensor(3))
        assert step.record.samples == 3
    finally:
        tt.shutdown()


def test_a_step_over_a_list_of_micro_batches_counts_them_all(tmp_path):
    """A step that accumulates gradients over the list of micro-batches it is given: its
    samples and real tokens are all of theirs (a plain count over the rows), in its one read."""
    _configure(tmp_path)
    try:
        emb = torch.nn.Embedding(50, 8)
        opt = torch.optim.SGD(emb.parameters(), lr=0.1)

        @tt.debug_operation(model=emb, optimizer=opt)
        def train_step(micro_batches):
            opt.zero_grad()
            for batch in micro_batches:
                (emb(batch["input_ids"]) * batch["attention_mask"].unsqueeze(-1)).pow(2).mean().backward()
            opt.step()

        g = torch.Generator().manual_seed(6)
        expected = []
        reads = readout.reads()
        for sizes in ((4, 2), (3, 5, 1), (2, 2)):
            micro, count = [], [0, 0]
            for rows in sizes:
                lengths = torch.randint(1, 9, (rows,), generator=g)
                mask = (torch.arange(8).unsqueeze(0) < lengths.unsqueeze(1)).long()
                micro.append({"input_ids": torch.randint(0, 50, (rows, 8), generator=g), "attention_mask": mask})
                count = [count[0] + rows, count[1] + sum(int(n) for n in lengths)]  # a plain count
            train_step(micro)
            expected.append(tuple(count))
        rt = get_runtime()
        rt.finish_deferred(block=True)
        assert readout.reads() - reads == 3
        assert [(s["samples"], s["tokens"]) for s in rt.history.steps()] == expected
    finally:
        tt.shutdown()


def test_a_step_over_a_list_of_input_target_pairs_counts_them_all(tmp_path):
    """Gradient accumulation over a list of ``(inputs, targets)`` micro-batches, as a
    hand-written loop passes them: the step's samples are all of theirs (a plain count), not
    the first micro-batch's."""
    _configure(tmp_path)
    try:
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        @tt.debug_operation(model=model, optimizer=opt)
        def train_step(micro_batches):
            opt.zero_grad()
            for x, y in micro_batches:
                torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()

        expected = []
        for sizes in ((8, 8, 8, 8), (8, 3), (5, 5, 5)):
            train_step([(torch.randn(n, 4), torch.randn(n, 2)) for n in sizes])
            expected.append(sum(sizes))  # a plain count over the micro-batches
        rt = get_runtime()
        assert [s["samples"] for s in rt.history.steps()] == expected
    finally:
        tt.shutdown()


class _Tagger(torch.nn.Module):
    """A token model called with a tokenizer's output (``model(**batch)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 8)

    def forward(self, input_ids, attention_mask):
        return (self.emb(input_ids) * attention_mask.unsqueeze(-1)).pow(2).mean()


def test_a_context_without_inputs_reads_the_batch_of_the_models_only_call(tmp_path):
    """``debug_context(model=...)`` without ``inputs=``: the batch is that of the model's call
    (samples, and the mask's tokens), checked against a plain count; a step that calls the model
    on two batches (two views, micro-batches) has no samples rather than a guess, one that calls
    it twice on the same batch has that batch's; record_batch still wins; the batch's tensors
    are not kept once the step is finished."""
    import gc
    import weakref

    from torch.utils.checkpoint import checkpoint

    _configure(tmp_path)
    try:
        model = _Tagger()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(5)
        expected, got = [], []
        for rows in (4, 7, 2):
            lengths = torch.randint(1, 9, (rows,), generator=g)
            mask = (torch.arange(8).unsqueeze(0) < lengths.unsqueeze(1)).long()
            batch = {"input_ids": torch.randint(0, 50, (rows, 8), generator=g), "attention_mask": mask}
            with tt.debug_context("train_step", model=model, optimizer=opt) as step:
                opt.zero_grad()
                model(**batch).backward()
                opt.step()
            expected.append((rows, sum(int(n) for n in lengths)))  # a plain count over the rows
            got.append((step.record.samples, step.record.tokens))
        assert got == expected
        kept = weakref.ref(batch["input_ids"])
        del batch
        gc.collect()
        assert kept() is None

        x = {"input_ids": torch.zeros(3, 8, dtype=torch.long), "attention_mask": torch.ones(3, 8, dtype=torch.long)}
        view = {k: v.clone() for k, v in x.items()}
        with tt.debug_context("train_step", model=model, optimizer=opt) as step:
            (model(**x) + model(**view)).backward()
        assert (step.record.samples, step.record.tokens) == (None, None)
        # The same batch twice (R-Drop's two passes; an activation checkpoint's recomputation,
        # which calls the model again from the backward): that batch's samples and tokens.
        with tt.debug_context("train_step", model=model, optimizer=opt) as step:
            (model(**x) + model(**x)).backward()
        assert (step.record.samples, step.record.tokens) == (3, 24)
        with tt.debug_context("train_step", model=model, optimizer=opt) as step:
            checkpoint(model, use_reentrant=False, **x).backward()
        assert (step.record.samples, step.record.tokens) == (3, 24)
        with tt.debug_context("train_step", model=model, optimizer=opt) as step:
            model(**x).backward()
            step.record_batch(samples=30)
        assert step.record.samples == 30
    finally:
        tt.shutdown()


def test_a_model_another_step_watches_does_not_mark_this_steps_forward(tmp_path, caplog):
    """A GAN trained in two steps, each given its own network: the generator's step calls the
    critic on what it made. The critic's marks (put on by the critic's step) marked the
    generator's step too: its forward looked called on two batches, so its samples were lost
    (and a warning said so), and its forward phase ended at the critic's call."""
    _configure(tmp_path)
    try:
        torch.manual_seed(0)
        gen, critic = torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)
        opt_g, opt_c = torch.optim.SGD(gen.parameters(), lr=0.01), torch.optim.SGD(critic.parameters(), lr=0.01)
        records = []
        with caplog.at_level(logging.WARNING, logger="torchtrace"):
            for _ in range(3):
                with tt.debug_context("critic_step", model=critic, optimizer=opt_c) as step:
                    opt_c.zero_grad()
                    (critic(gen(torch.randn(16, 4)).detach()).mean() - critic(torch.randn(16, 8)).mean()).backward()
                    opt_c.step()
                with tt.debug_context("gen_step", model=gen, optimizer=opt_g) as step:
                    opt_g.zero_grad()
                    (-critic(gen(torch.randn(6, 4))).mean()).backward()
                    opt_g.step()
                records.append(step.record)
        assert [r.samples for r in records] == [6, 6, 6]  # the generator's one batch
        assert not [r for r in caplog.records if "gen_step called its model on several batches" in r.getMessage()]
    finally:
        tt.shutdown()


def test_record_batch_overrides_what_is_inferred(tmp_path):
    _configure(tmp_path)
    try:
        with tt.debug_context("train_step", inputs=torch.zeros(8, 3)) as step:
            step.record_batch(samples=5, tokens=torch.tensor(40), flops=1e6)
        assert (step.record.samples, step.record.tokens, step.record.flops) == (5, 40, 1e6)
        with tt.debug_context("train_step", inputs=torch.zeros(8, 3)) as step:
            pass
        assert step.record.samples == 8 and step.record.tokens is None
    finally:
        tt.shutdown()


def test_record_batch_calls_in_one_step_each_give_only_what_they_name(tmp_path):
    """Two calls in one step (samples where the batch is unpacked, FLOPs where the loss is
    computed): the second names only its own values and leaves the first's. Before, each call
    replaced the whole override, so the samples given first were lost (16 inferred, not 5) and
    a later bad value dropped an earlier good one."""
    _configure(tmp_path)
    try:
        with tt.debug_context("train_step", inputs=torch.zeros(16, 3)) as step:
            step.record_batch(samples=5, tokens=40)
            step.record_batch(flops=1e6)
        assert (step.record.samples, step.record.tokens, step.record.flops) == (5, 40, 1e6)
        with tt.debug_context("train_step", inputs=torch.zeros(16, 3)) as step:
            step.record_batch(samples=5)
            step.record_batch(samples=-1, tokens=7)  # the bad samples left out: the 5 given stand
        assert (step.record.samples, step.record.tokens) == (5, 7)
        with tt.debug_context("train_step", inputs=torch.zeros(16, 3)) as step:
            step.record_batch(samples=5)
            step.record_batch(samples=6)  # a value given again: the later one wins
        assert step.record.samples == 6
    finally:
        tt.shutdown()


def test_learning_rate_of_each_group_under_a_scheduler(tmp_path):
    _configure(tmp_path)
    try:
        model = _mlp()
        opt = torch.optim.SGD([{"params": model[0].parameters(), "lr": 0.1},
                               {"params": model[2].parameters(), "lr": 0.01}])
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        seen = []
        for _ in range(5):
            with tt.debug_context("train_step", model=model, optimizer=opt) as step:
                seen.append([g["lr"] for g in opt.param_groups])  # the rates this update uses
                opt.zero_grad()
                model(torch.randn(4, 16)).pow(2).mean().backward()
                opt.step()
                sched.step()
            assert step.record.lr == seen[-1]
        assert seen[-1] == [0.025, 0.0025]
        lr = get_runtime().metrics.value("torchtrace_learning_rate", {"operation": "train_step", "group": "1"})
        assert lr == 0.0025
    finally:
        tt.shutdown()


@pytest.mark.parametrize("clip", [False, True])
def test_a_step_whose_update_the_scaler_skipped_records_the_rate_it_would_have_used(tmp_path, clip):
    """The AMP recipe: ``scaler.step``, ``scaler.update``, then the scheduler. On an overflow the
    scaler skips the optimizer's step, whose hook reads the rates: they were read at the step's
    end instead, after the scheduler had stepped (the next step's rate)."""
    _configure(tmp_path)
    try:
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 127)  # overflows until it has backed off
        overflows = 0
        for _ in range(4):
            with tt.debug_context("train_step", model=model, optimizer=opt) as step:
                opt.zero_grad()
                scaler.scale(model(torch.randn(4, 16)).pow(2).mean() * 1e6).backward()
                if clip:
                    scaler.unscale_(opt)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                seen = [g["lr"] for g in opt.param_groups]  # the rate this update uses
                scaler.step(opt)
                scaler.update()
                sched.step()
            overflows += bool(step.record.scaler_overflow)
            assert step.record.lr == seen
        assert overflows >= 2
    finally:
        tt.shutdown()


@pytest.mark.parametrize("rate, expected", [
    (0.5, [0.5]), (2, [2.0]), (torch.tensor(0.25), [0.25]), ("0.1", None), (True, None), (None, None),
    (torch.tensor([0.1, 0.2]), None),
])
def test_learning_rates_of_odd_rate_types(rate, expected):
    """What a config or a scheduler may leave in ``param_groups``: a number of any real type
    (a NumPy float from a YAML or an array) is a rate; a string, a bool or a tensor of many
    values is none, and the step has no learning rate rather than a wrong one."""
    from torchtrace.step.throughput import learning_rates

    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    opt.param_groups[0]["lr"] = rate
    assert learning_rates(opt) == expected


def test_rates_held_in_device_tensors_are_read_with_the_step():
    """The read of rates that are device tensors, on this machine's CPU tensors planted as the
    device's (the whole step on a GPU: tests/test_cuda_paths.py): each tensor's value takes its
    place among the float rates, taken when the rates were read, not after a scheduler's fill;
    no read, no rates."""
    from torchtrace.measure.learning_rates import DeviceRates, learning_rates, plan_rates, read_rates
    from torchtrace.record.readout import ReadPlan

    held = [torch.tensor(0.5), torch.tensor(0.25, dtype=torch.float64)]
    rates = DeviceRates([0.1, held[0].reshape(1).to(torch.float64, copy=True), 0.3,
                         held[1].reshape(1).to(torch.float64, copy=True)])
    held[0].fill_(9.0)  # a scheduler's in-place fill after the rates were taken
    held[1].fill_(9.0)
    plan = ReadPlan()
    plan.add("loss", torch.tensor([2.0]))
    plan_rates(rates, plan)
    values = plan.start().result()
    assert read_rates(plan, values) == [0.1, 0.5, 0.3, 0.25]
    assert plan.first("loss", values) == 2.0
    assert read_rates(plan, None) is None
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    opt.param_groups[0]["lr"] = torch.tensor(0.1, device="meta")  # not the CPU: not read now
    assert type(learning_rates(opt)) is DeviceRates


def test_learning_rate_of_a_numpy_float(tmp_path):
    numpy = pytest.importorskip("numpy")
    from torchtrace.step.throughput import learning_rates

    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    opt.param_groups[0]["lr"] = numpy.float32(0.125)
    assert learning_rates(opt) == [0.125]


def _amp_step(model, opt, scaler, form: str) -> float:
    """One step of a scaled loss (large enough to overflow while the scale is high), in one of
    the forms a user writes it; returns the step's duration."""
    def body(model, batch, opt, scaler):
        opt.zero_grad()
        scaler.scale(model(batch).pow(2).mean() * 1e4).backward()
        scaler.step(opt)
        if form != "update after the step":
            scaler.update()

    if form == "scaler as an argument":  # the decorator, no scaler=: found among the arguments
        tt.debug_operation(name="train_step")(body)(model, torch.randn(4, 16), opt, scaler=scaler)
        return get_runtime().history.steps()[-1]["duration_s"]
    with tt.debug_context("train_step", model=model, optimizer=opt, scaler=scaler) as step:
        body(model, torch.randn(4, 16), opt, scaler)
    if form == "update after the step":
        scaler.update()
    return step.record.duration_s


@pytest.mark.parametrize("form", ["update inside the step", "update after the step", "scaler as an argument"])
def test_gradscaler_overflow_steps_are_skipped_steps_in_goodput(tmp_path, form):
    """Mixed precision's loss scaler skips the optimizer's update on a step whose scaled
    gradients overflow (a run's first steps, while the scale backs off from its start). Those
    steps made no progress: goodput counts them as skipped_step, the rest as productive,
    whether ``scaler.update()`` runs inside the step or after it, and with the scaler passed
    to a decorated step. Reference: the scaler's own scale, which drops exactly on the steps
    it skipped. Before, all were productive."""
    _configure(tmp_path)
    try:
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 127, growth_interval=1000)
        overflowed, durations = [], []
        reads = readout.reads()
        for _ in range(16):
            scale = scaler.get_scale()
            durations.append(_amp_step(model, opt, scaler, form))
            overflowed.append(scaler.get_scale() < scale)
        assert readout.reads() - reads == 16  # the scaler's sign rode in each step's one read
        assert 0 < sum(overflowed) < len(overflowed)  # the run has both kinds of step
        section = get_runtime().summary()["throughput"]
        skipped = sum(d for d, o in zip(durations, overflowed) if o)
        productive = sum(d for d, o in zip(durations, overflowed) if not o)
        assert section["badput_s"]["skipped_step"] == pytest.approx(skipped, abs=1e-3)
        assert section["productive_s"] == pytest.approx(productive, abs=1e-3)
    finally:
        tt.shutdown()


def test_a_disabled_gradscaler_skips_nothing(tmp_path):
    _configure(tmp_path)
    try:
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        for _ in range(3):
            with tt.debug_context("train_step", model=model, optimizer=opt, scaler=scaler):
                opt.zero_grad()
                scaler.scale(model(torch.randn(4, 16)).pow(2).mean()).backward()
                scaler.step(opt)
                scaler.update()
        section = get_runtime().summary()["throughput"]
        assert section["badput_s"]["skipped_step"] == 0 and section["productive_s"] > 0
    finally:
        tt.shutdown()


def test_flops_are_counted_once_per_shape_and_match_the_flop_counter(tmp_path):
    _configure(tmp_path)
    try:
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def body(x):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()

        train_step = tt.debug_operation(model=model, optimizer=opt)(body)
        for batch in (8, 8, 8, 16, 16):
            train_step(torch.randn(batch, 16))
        steps = get_runtime().history.steps()
        counter = get_runtime().throughput.flops
        assert counter.counts == 2 and len(counter) == 2  # one count per input shape
        for rows in (8, 16):
            with FlopCounterMode(display=False) as ref:  # the same model and step, counted independently
                body(torch.randn(rows, 16))
            got = [s for s in steps if s["samples"] == rows]
            assert got and all(abs(s["flops"] / ref.get_total_flops() - 1) < 0.10 for s in got)
        last = get_runtime().history.last_record
        assert last.flops_counted is False and last.flops == steps[-1]["flops"]
    finally:
        tt.shutdown()


@dataclasses.dataclass
class _Batch:
    """A batch as custom training code often carries one: a dataclass of tensors."""

    inputs: torch.Tensor
    targets: torch.Tensor
    note: str = "train"


def test_a_dataclass_batch_gives_samples_and_flops_per_shape(tmp_path):
    """Its fields are read like a tuple's: samples from the first tensor, and the shapes in the
    FLOP key (the key held the class alone, so a smaller last batch was charged the full
    batch's FLOPs, and the batch had no samples)."""
    _configure(tmp_path)
    try:
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def body(batch):
            opt.zero_grad()
            (model(batch.inputs) - batch.targets).pow(2).mean().backward()
            opt.step()

        train_step = tt.debug_operation(model=model, optimizer=opt)(body)
        sizes = (8, 8, 3, 8, 3)
        for rows in sizes:
            train_step(_Batch(torch.randn(rows, 16), torch.randn(rows, 4)))
        steps = get_runtime().history.steps()
        assert [s["samples"] for s in steps] == list(sizes)  # a plain count of the rows
        assert get_runtime().throughput.flops.counts == 2  # one count per shape
        for rows in (8, 3):
            got = [s["flops"] for s in steps if s["samples"] == rows]
            assert _near(got, _counted(body, _Batch(torch.randn(rows, 16), torch.randn(rows, 4)))), (rows, got)
    finally:
        tt.shutdown()


def test_a_long_list_batch_is_counted_by_its_length(tmp_path):
    """A batch as a list of per-sample tensors (a collate function that does not stack), longer
    than the shape key looks into item by item: a last batch of 40 same-size images is not the
    full batch of 64. The key held the first 32 items alone, so every list of 33 or more got
    the first one's FLOPs. Reference: FlopCounterMode on the same step at each length."""
    _configure(tmp_path)
    try:
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def body(images):
            opt.zero_grad()
            model(torch.stack(images)).pow(2).mean().backward()
            opt.step()

        train_step = tt.debug_operation(model=model, optimizer=opt)(body)
        lengths = (64, 64, 40, 33, 64, 40)
        for n in lengths:
            train_step([torch.randn(16) for _ in range(n)])
        steps = get_runtime().history.steps()
        assert get_runtime().throughput.flops.counts == 3  # one count per length
        for n in (64, 40, 33):
            got = [s["flops"] for s, length in zip(steps, lengths) if length == n]
            assert _near(got, _counted(body, [torch.randn(16) for _ in range(n)])), (n, got)
    finally:
        tt.shutdown()


def test_images_of_different_sizes_given_one_by_one_count_as_images(tmp_path):
    """A classifier over images that cannot be stacked (different sizes), its loader's
    ``collate_fn=lambda rows: rows`` giving ``(image, label)`` rows: the step's samples are
    the rows, in its record and in ``torchtrace_samples_total``, not the first image's 3
    channels. Reference: a plain count of the dataset's rows."""
    _configure(tmp_path)
    try:
        torch.manual_seed(0)
        conv, head = torch.nn.Conv2d(3, 4, 3), torch.nn.Linear(4, 5)
        model = torch.nn.ModuleDict({"conv": conv, "head": head})
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        @tt.debug_operation(model=model, optimizer=opt)
        def train_step(rows):
            opt.zero_grad()
            logits = torch.stack([head(conv(image[None]).mean((2, 3))[0]) for image, _ in rows])
            torch.nn.functional.cross_entropy(logits, torch.tensor([label for _, label in rows])).backward()
            opt.step()

        data = [(torch.rand(3, 8 + i, 9 + 2 * (i % 3)), i % 5) for i in range(14)]
        for rows in torch.utils.data.DataLoader(data, batch_size=4, collate_fn=lambda rows: rows):
            train_step(rows)
        rt = get_runtime()
        assert [s["samples"] for s in rt.history.steps()] == [4, 4, 4, 2]
        assert rt.metrics.value(semconv.M_SAMPLES, {"operation": "train_step"}) == len(data)
    finally:
        tt.shutdown()


def test_a_trainers_method_reads_its_batch_not_the_trainer(tmp_path):
    """A step decorated as a method of a trainer dataclass: the instance comes first among the
    arguments, and its tensor fields (class weights) were read as the batch, 4 samples every
    step. The method's instance is skipped, as is a trainer dataclass holding the model passed
    to a plain function. Reference: a plain count of the rows; FLOPs against FlopCounterMode."""
    _configure(tmp_path)
    try:
        net = _mlp()  # not "model": the Trainer's field of that name shadows it in the class body
        opt = torch.optim.SGD(net.parameters(), lr=0.01)

        @dataclasses.dataclass
        class Trainer:
            model: torch.nn.Module
            class_weights: torch.Tensor = dataclasses.field(default_factory=lambda: torch.ones(4))

            @tt.debug_operation(model=net, optimizer=opt)
            def train_step(self, x):
                opt.zero_grad()
                (self.model(x).pow(2) * self.class_weights).mean().backward()
                opt.step()

        @dataclasses.dataclass
        class Settings:  # no model among its fields: read only because it is the method's instance
            class_weights: torch.Tensor = dataclasses.field(default_factory=lambda: torch.ones(4))

            @tt.debug_operation(name="settings_step", model=net, optimizer=opt)
            def step(self, x):
                opt.zero_grad()
                (net(x).pow(2) * self.class_weights).mean().backward()
                opt.step()

        @tt.debug_operation(name="plain_step", model=net, optimizer=opt)
        def plain_step(trainer, x):
            opt.zero_grad()
            (trainer.model(x).pow(2) * trainer.class_weights).mean().backward()
            opt.step()

        trainer, settings = Trainer(net), Settings()
        rows = (8, 8, 3)
        for n in rows:
            trainer.train_step(torch.randn(n, 16))
            settings.step(torch.randn(n, 16))
            plain_step(trainer, torch.randn(n, 16))
        steps = get_runtime().history.steps()
        for name in ("train_step", "settings_step", "plain_step"):
            assert [s["samples"] for s in steps if s["operation"] == name] == list(rows), name
        for n in (8, 3):
            got = {s["flops"] for s in steps if s["operation"] == "train_step" and s["samples"] == n}
            assert got == {_counted(lambda x: (net(x).pow(2) * torch.ones(4)).mean().backward(), torch.randn(n, 16))}
    finally:
        tt.shutdown()


def test_a_trainer_that_grows_between_steps_is_not_in_the_flop_key(tmp_path):
    """A dataclass trainer keeping its losses in a list: as the method's instance it was part of
    the step's shape key, which changed every step, so every step until the 32-key limit ran
    under the FLOP counter (slow), and every step after it had no FLOPs."""
    _configure(tmp_path)
    try:
        net = _mlp()
        opt = torch.optim.SGD(net.parameters(), lr=0.01)

        @dataclasses.dataclass
        class Trainer:
            losses: list = dataclasses.field(default_factory=list)

            @tt.debug_operation(model=net, optimizer=opt)
            def train_step(self, x):
                opt.zero_grad()
                loss = net(x).pow(2).mean()
                loss.backward()
                opt.step()
                self.losses.append(loss.detach())

        @dataclasses.dataclass
        class Owner:  # holds the model: passed to a plain function, it is no batch either
            model: torch.nn.Module
            losses: list = dataclasses.field(default_factory=list)

        @tt.debug_operation(name="plain_step", model=net, optimizer=opt)
        def plain_step(owner, x):
            opt.zero_grad()
            loss = owner.model(x).pow(2).mean()
            loss.backward()
            opt.step()
            owner.losses.append(loss.detach())

        trainer, owner = Trainer(), Owner(net)
        for _ in range(40):
            trainer.train_step(torch.randn(8, 16))
            plain_step(owner, torch.randn(8, 16))
        assert get_runtime().throughput.flops.counts == 2  # one per operation
        reference = _counted(lambda x: net(x).pow(2).mean().backward(), torch.randn(8, 16))
        assert {s["flops"] for s in get_runtime().history.steps()} == {reference}
    finally:
        tt.shutdown()


def test_a_numpy_batch_gives_samples_and_flops_per_shape(tmp_path):
    """NumPy arrays handed to the step (converted inside it) were opaque: no samples, and one
    FLOP count for every batch, so a last batch of 3 rows was charged the 8-row count. Their
    shapes are now read. Reference: a plain count of the rows; FlopCounterMode on the step."""
    import numpy as np

    _configure(tmp_path)
    try:
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def body(x, y):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(torch.from_numpy(x)), torch.from_numpy(y)).backward()
            opt.step()

        train_step = tt.debug_operation(model=model, optimizer=opt)(body)
        rows = (8, 8, 3, 8)
        rng = np.random.default_rng(0)
        for n in rows:
            train_step(rng.standard_normal((n, 16), dtype=np.float32), rng.standard_normal((n, 4), dtype=np.float32))
        steps = get_runtime().history.steps()
        assert [s["samples"] for s in steps] == list(rows)
        for n in (8, 3):
            reference = _counted(body, np.zeros((n, 16), np.float32), np.zeros((n, 4), np.float32))
            assert {s["flops"] for s in steps if s["samples"] == n} == {reference}, n
    finally:
        tt.shutdown()


def _waits_after(sleeps):
    """The data wait of a step after each planted sleep (the loader's), checked: none before the
    first; and each sleep as really slept (a loaded machine oversleeps)."""
    waits, slept = [], []
    for pause in sleeps:
        t0 = time.perf_counter()
        time.sleep(pause)  # the loader
        slept.append(time.perf_counter() - t0)
        with tt.debug_context("train_step") as step:
            pass
        waits.append(step.record.data_wait_s)
    assert waits[0] is None  # nothing before the first step
    return waits, slept


def test_data_wait_against_planted_sleeps(tmp_path):
    _configure(tmp_path)
    try:
        waits, slept = _waits_after([0.0, 0.03, 0.06, 0.0, 0.09])
        for wait, pause in zip(waits[1:], slept[1:]):
            assert pause <= wait < pause + 0.02
    finally:
        tt.shutdown()


def test_torchtraces_own_work_between_steps_is_not_data_wait(tmp_path, monkeypatch):
    """torchtrace's bookkeeping after a step ends (here 30 ms planted in the record's hand-over)
    and before the next starts (20 ms planted in opening its span) lies between the two steps,
    but it is not the loop's: the data wait is the loader's sleep alone, and torchtrace's time
    is other badput. (Without this, sub-millisecond steps with no loader read a data-wait share
    of 30 %, over the DataLoaderStall threshold.)"""
    from torchtrace.step.runtime import Runtime

    submit, open_span = Runtime.submit, Runtime.open_span
    monkeypatch.setattr(Runtime, "submit", lambda *a: (time.sleep(0.03), submit(*a))[1])
    monkeypatch.setattr(Runtime, "open_span", lambda *a: (time.sleep(0.02), open_span(*a))[1])
    _configure(tmp_path)
    try:
        waits, slept = _waits_after([0.0, 0.04, 0.0, 0.06])
        for wait, pause in zip(waits[1:], slept[1:]):
            assert pause <= wait < pause + 0.015
        badput = get_runtime().summary()["throughput"]["badput_s"]
        assert badput["other"] >= 3 * (0.03 + 0.02)
        # Rates stay per second of wall time: torchtrace's own time is in the steps' cycles.
        assert get_runtime().throughput.ledger.throughput("train_step").seconds >= sum(waits[1:]) + 3 * 0.05
        assert badput["data_wait"] == pytest.approx(sum(waits[1:]), abs=0.005)  # (and the loop since the last)
    finally:
        tt.shutdown()


def test_shutdowns_own_time_is_not_the_jobs(tmp_path, monkeypatch):
    """The run report's goodput covers configure() to shutdown(): the time shutdown itself
    takes (flushing spans, stopping the server; 0.3 s planted here) is in no class and not in
    the wall time (it was data wait)."""
    import json

    from torchtrace.step.runtime import Runtime

    stop = Runtime._stop_exporters
    monkeypatch.setattr(Runtime, "_stop_exporters", lambda *a: (time.sleep(0.3), stop(*a))[1])
    began = time.perf_counter()
    _configure(tmp_path, run_id="closing")
    configured = time.perf_counter()
    _, train_step = _watched(_mlp())
    for _ in range(3):
        train_step(torch.randn(8, 16))
    called = time.perf_counter()
    tt.shutdown()
    section = json.loads((tmp_path / "closing" / "report.json").read_text())["throughput"]
    assert called - configured <= section["wall_s"] <= called - began
    assert section["badput_s"]["data_wait"] < 0.1


def test_the_time_after_the_last_step_is_not_data_wait_in_the_report(tmp_path):
    """After the loop (0.4 s planted: a save, a demo's page kept open) and before shutdown no
    step waited for data: the run report counts that stretch as other, not as data wait."""
    import json

    _configure(tmp_path, run_id="tail")
    _, train_step = _watched(_mlp())
    for _ in range(3):
        train_step(torch.randn(8, 16))
    time.sleep(0.4)
    tt.shutdown()
    badput = json.loads((tmp_path / "tail" / "report.json").read_text())["throughput"]["badput_s"]
    assert badput["data_wait"] < 0.1 and badput["other"] >= 0.4


def _evaluate(model, calls: int, grad: bool = False) -> float:
    """An evaluation loop the script does not mark (nanoGPT's estimate_loss): ``calls`` calls of
    the model with 30 ms of planted work each and 20 ms of loading between them, under no_grad
    unless ``grad``. Returns its seconds, first call to last."""
    t0 = time.perf_counter()
    with torch.set_grad_enabled(grad):
        for i in range(calls):
            if i:
                time.sleep(0.02)
            model(torch.randn(8, 16))
            time.sleep(0.03)  # (inside the call's time: the loss on the output)
    return time.perf_counter() - t0


class _Busy(torch.nn.Linear):
    def forward(self, x):
        time.sleep(0.03)
        return super().forward(x)


class _BusyOwnCall(_Busy):
    def __call__(self, *args, **kwargs):  # a class that routes its own calls: the marks are hooks
        return super().__call__(*args, **kwargs)


@pytest.mark.parametrize("model_class", [_Busy, _BusyOwnCall])
@pytest.mark.parametrize("where", ["between steps", "after the last step"])
def test_an_unmarked_evaluation_is_evaluation_badput_not_data_wait(tmp_path, where, model_class):
    """The model called under no_grad between steps, with no step open and no ``kind=`` marked
    (an evaluation loop of eight calls, 0.4 s): goodput books the span from its first call to
    its last as evaluation, not as data wait; also when it runs after the last step, before
    shutdown. The same calls with autograd on (a loop that trains outside its steps) stay data
    wait."""
    import json

    _configure(tmp_path, run_id="unmarked")
    model = model_class(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    train_step = tt.debug_operation(model=model, optimizer=opt)(lambda x: _train_once(model, opt, x))
    evaluated = 0.0
    for i in range(4):
        train_step(torch.randn(8, 16))
        if (i == 1 and where == "between steps") or (i == 3 and where == "after the last step"):
            evaluated = _evaluate(model, 8)
    if where == "between steps":
        section = get_runtime().throughput.section()
        assert section["badput_s"]["evaluation"] == pytest.approx(evaluated - 0.03, abs=0.02), section
        assert section["badput_s"]["data_wait"] < 0.1, section
        _evaluate(model, 4, grad=True)
        train_step(torch.randn(8, 16))
        section = get_runtime().throughput.section()
        assert section["badput_s"]["evaluation"] == pytest.approx(evaluated - 0.03, abs=0.02), section
        assert section["badput_s"]["data_wait"] >= 0.17, section
    tt.shutdown()
    badput = json.loads((tmp_path / "unmarked" / "report.json").read_text())["throughput"]["badput_s"]
    assert badput["evaluation"] == pytest.approx(evaluated - 0.03, abs=0.02), badput


def test_an_unmarked_evaluation_before_measuring_stops_is_booked_then(tmp_path):
    """Goodput pauses while nothing is measured (level off): an unmarked evaluation just before
    the level goes off is booked as it does, not left for a step that may never be measured."""
    _configure(tmp_path, run_id="unmarked-off")
    try:
        model = _Busy(16, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        train_step = tt.debug_operation(model=model, optimizer=opt)(lambda x: _train_once(model, opt, x))
        for _ in range(2):
            train_step(torch.randn(8, 16))
        evaluated = _evaluate(model, 4)
        rt = get_runtime()
        rt.set_level("off")
        assert rt.throughput.ledger.closed().badput["evaluation"] == pytest.approx(evaluated - 0.03, abs=0.02)
    finally:
        tt.shutdown()


def _train_once(model, opt, x):
    opt.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    return loss


def test_goodput_against_a_hand_computed_timeline(tmp_path):
    """configure, a slow first batch, three steps (the second's update skipped by the guard),
    a slow loader between them: productive time is the two applied steps, and every second of
    wall time is productive or counted as one kind of badput."""
    _configure(tmp_path, guard="skip")
    try:
        rt = get_runtime()
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        plan = [(0.05, False), (0.02, True), (0.08, False)]  # (loader sleep before the step, NaN?)
        durations, skipped = [], []
        for pause, nan in plan:
            time.sleep(pause)
            with tt.debug_context("train_step", model=model, optimizer=opt) as step:
                opt.zero_grad()
                loss = model(torch.randn(4, 16)).pow(2).mean() * (float("nan") if nan else 1.0)
                loss.backward()
                time.sleep(0.04)  # the step's compute
                opt.step()
            durations.append(step.record.duration_s)
            skipped.append(step.record.skipped)
        assert skipped == [False, True, False]
        section = rt.summary()["throughput"]
        productive = durations[0] + durations[2]
        assert section["productive_s"] == pytest.approx(productive, abs=0.005)
        assert section["badput_s"]["skipped_step"] == pytest.approx(durations[1], abs=0.005)
        assert section["badput_s"]["data_wait"] >= 0.02 + 0.08 - 0.005
        assert section["productive_s"] + sum(section["badput_s"].values()) == pytest.approx(section["wall_s"], rel=1e-9)
        assert section["goodput_ratio"] == pytest.approx(section["productive_s"] / section["wall_s"], rel=1e-9)
    finally:
        tt.shutdown()


def test_a_training_step_that_raised_is_not_a_skipped_update(tmp_path):
    """A step that raised (the script caught it and trained on: a collective's timeout, an
    out-of-memory error) applied no update, but neither the guard nor a loss scaler skipped
    one: its time is badput ``other``, and ``skipped_step`` stays what docs/throughput.md says,
    updates the guard or the scaler skipped. Before, a 0.15 s step that raised was 0.15 s of
    skipped_step (and a DDP rank's 30 s in gloo's timed-out all_reduce, 30 s of it). Reference:
    the steps' own durations."""
    _configure(tmp_path)
    try:
        rt = get_runtime()
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        durations = []
        for i in range(3):
            try:
                with tt.debug_context("train_step", model=model, optimizer=opt) as step:
                    opt.zero_grad()
                    model(torch.randn(4, 16)).pow(2).mean().backward()
                    time.sleep(0.15 if i == 1 else 0.02)
                    if i == 1:
                        raise RuntimeError("Timed out waiting 10000ms for recv operation to complete")
                    opt.step()
            except RuntimeError:
                pass
            durations.append(step.record.duration_s)
        section = rt.summary()["throughput"]
        assert section["badput_s"]["skipped_step"] == 0.0
        assert section["badput_s"]["other"] == pytest.approx(durations[1], abs=0.01)
        assert section["productive_s"] == pytest.approx(durations[0] + durations[2], abs=0.005)
        assert section["productive_s"] + sum(section["badput_s"].values()) == pytest.approx(section["wall_s"], rel=1e-9)
    finally:
        tt.shutdown()


def test_mfu_against_flops_and_time_with_a_configured_peak(tmp_path):
    _configure(tmp_path, peak_flops=1e9)
    try:
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        @tt.debug_operation(model=model, optimizer=opt)
        def train_step(x):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()

        for _ in range(12):
            train_step(torch.randn(8, 16))
        rt = get_runtime()
        tp = rt.throughput.ledger.throughput("train_step")
        steps = rt.history.steps()[1:]  # the counting step is left out of throughput
        flops = steps[-1]["flops"]
        assert tp.flops_per_s == pytest.approx(flops * tp.steps / tp.seconds, rel=1e-9)
        assert tp.mfu == pytest.approx(tp.flops_per_s / 1e9, rel=1e-9)
        assert rt.metrics.value(semconv.M_MFU, {"operation": "train_step"}) == pytest.approx(tp.mfu, rel=0.5)
    finally:
        tt.shutdown()


def test_on_a_gpu_the_rates_are_in_device_time(tmp_path, monkeypatch):
    """On a GPU the host runs ahead of the device until CUDA's launch queue fills: host cycles
    put an H100's rates 5-10 % off its CUDA events' (44 % with other processes on the GPU).
    The rates' time base is the device's cycle, from one step's last CUDA mark to the next's.
    Here the marks are events reading a planted device clock (10 ms of device time a step, a
    fraction of that on the host): samples/s and FLOP/s follow the device, the data wait
    share stays the host's."""
    device_ms = [0.0]

    class DeviceEvent:
        def __init__(self, enable_timing: bool = False) -> None:
            self.device, self.at = torch.device("cuda", 0), None

        def record(self) -> None:
            self.at = device_ms[0]

        def query(self) -> bool:
            return True

        def elapsed_time(self, other: "DeviceEvent") -> float:
            return other.at - self.at

    from torchtrace.record import events
    from torchtrace.step.phases import ModelMarks

    monkeypatch.setattr(torch.cuda, "Event", DeviceEvent)
    for pool in (events.TIMING, events.LANDED):  # on a GPU machine they hold real events of earlier tests
        monkeypatch.setattr(pool, "_free", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    on_host = ModelMarks.state  # (None while the marks are off or displaced, else whether on a GPU)
    monkeypatch.setattr(ModelMarks, "state", lambda self, model: None if on_host(self, model) is None else True)
    _configure(tmp_path)
    try:
        _, train_step = _watched(_mlp())
        for _ in range(30):
            time.sleep(0.002)  # the loader, on the host
            train_step(torch.randn(8, 16))
            device_ms[0] += 10.0  # what the device took for that step
        rt = get_runtime()
        tp = rt.throughput.ledger.throughput("train_step")
        flops = rt.history.steps()[-1]["flops"]
        assert tp.samples_per_s == pytest.approx(8 / 0.010, rel=1e-9)
        assert tp.flops_per_s == pytest.approx(flops / 0.010, rel=1e-9)
        steps = rt.history.steps()
        last = steps[-tp.steps:]
        waits = sum(r["data_wait_s"] for r in last)
        # The host's cycles are the steps' end-to-end times (torchtrace's own time between steps in them).
        end = [r["start_unix_ns"] / 1e9 + r["duration_s"] for r in (steps[-tp.steps - 1], steps[-1])]
        cycles = end[1] - end[0]
        assert tp.data_wait_share == pytest.approx(waits / cycles, rel=0.05)
        assert 0.0 < tp.data_wait_share < 1  # (2 ms of sleep against host steps of a few ms)
    finally:
        tt.shutdown()


@pytest.mark.parametrize("amp", ["inside", "outside", "none"])
def test_the_peak_is_taken_at_the_precision_the_step_computed_in(tmp_path, monkeypatch, amp):
    """The PyTorch AMP recipe opens autocast inside the training step, so by the step's end it is
    closed again: the peak must come from what the counted step ran (bfloat16 operands), not from
    the weights (float32). Before, MFU under autocast inside the step was taken against the
    float32 peak: on an H100, half the bfloat16 figure, so MFU read twice too high."""
    table = {torch.bfloat16: 4e9, torch.float32: 1e9}  # stands for a device's row of the peak table
    monkeypatch.setattr("torchtrace.measure.peaks.peak_flops", lambda device, dtype, override=None: table.get(dtype))
    _configure(tmp_path)
    try:
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        seen = []

        @tt.debug_operation(model=model, optimizer=opt)
        def train_step(x):
            opt.zero_grad()
            if amp == "inside":
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = model(x)
            else:
                out = model(x)
            seen.append(out.dtype)
            out.float().pow(2).mean().backward()
            opt.step()

        for _ in range(6):
            if amp == "outside":
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    train_step(torch.randn(8, 16))
            else:
                train_step(torch.randn(8, 16))
        expected = 4e9 if amp != "none" else 1e9
        assert seen[0] == (torch.float32 if amp == "none" else torch.bfloat16)
        rt = get_runtime()
        assert rt.throughput.ledger.peak_of("train_step") == expected
        tp = rt.throughput.ledger.throughput("train_step")
        assert tp.mfu == pytest.approx(tp.flops_per_s / expected, rel=1e-9)
    finally:
        tt.shutdown()


@pytest.mark.parametrize("history", ["tensors", "floats"])
def test_an_argument_that_grows_every_step_does_not_make_every_step_a_new_shape(tmp_path, history):
    """A step passed a list it appends to (its losses so far): the list's length was part of
    the FLOP table's key, so each of the first 32 steps was counted again (each several
    times slower) and every later step had no FLOPs at all. Two counts that differ only in the
    list and give the same FLOPs show the list does not decide them."""
    _configure(tmp_path)
    try:
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        @tt.debug_operation(model=model, optimizer=opt)
        def train_step(x, losses):
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            losses.append(loss.detach() if history == "tensors" else float(loss.detach()))

        losses: list = []
        shapes = [8, 8, 8, 8, 16, 16, 8, 16] + [8, 16] * 26  # two batch sizes, counted apart
        for rows in shapes:
            train_step(torch.randn(rows, 16), losses)
        reference = {rows: _counted(lambda x: model(x).pow(2).mean().backward(), torch.randn(rows, 16))
                     for rows in (8, 16)}
        steps = get_runtime().history.steps()
        assert len(steps) == len(shapes) == 60
        assert [s.get("flops") for s in steps] == [reference[rows] for rows in shapes]
        # counted: the first two steps (the second shows the list does not decide the FLOPs) and the
        # first of the other batch size
        assert get_runtime().throughput.flops.counts == 3
        # and the steps after take the short way (one key per batch size, not one per step)
        assert len(get_runtime().throughput._shapes) <= 4
    finally:
        tt.shutdown()


def test_each_operation_gets_the_peak_of_what_it_computed_in(tmp_path, monkeypatch):
    """A loop that evaluates in float32 before it trains under bfloat16 autocast: before, the
    first operation with FLOPs chose the one peak of the run (float32's), so the training
    step's MFU read four times too high here (on an H100, about fifteen)."""
    table = {torch.bfloat16: 4e9, torch.float32: 1e9}  # stands for a device's row of the peak table
    monkeypatch.setattr("torchtrace.measure.peaks.peak_flops", lambda device, dtype, override=None: table.get(dtype))
    _configure(tmp_path)
    try:
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        @tt.debug_operation(model=model, kind="evaluation")
        def evaluate(x):
            with torch.no_grad():
                return model(x).sum()

        @tt.debug_operation(model=model, optimizer=opt)
        def train_step(x):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            out.float().pow(2).mean().backward()
            opt.step()

        for _ in range(3):
            evaluate(torch.randn(8, 16))
        for _ in range(6):
            train_step(torch.randn(8, 16))
        ledger = get_runtime().throughput.ledger
        assert ledger.peak_of("evaluate") == 1e9 and ledger.peak_of("train_step") == 4e9
        for name, peak in (("evaluate", 1e9), ("train_step", 4e9)):
            tp = ledger.throughput(name)
            assert tp.flops_per_s and tp.mfu == pytest.approx(tp.flops_per_s / peak, rel=1e-9)
        section = get_runtime().throughput.section()
        assert section["peak_flops"] is None  # none configured
        assert {n: op["peak_flops"] for n, op in section["operations"].items()} == {"evaluate": 1e9, "train_step": 4e9}
    finally:
        tt.shutdown()


def test_an_operation_without_a_model_at_first_gets_its_peak_when_one_comes(tmp_path, monkeypatch):
    """FLOPs given before the operation names a model: no device to look the peak up on yet,
    and not a reason for the operation never to have MFU."""
    monkeypatch.setattr("torchtrace.measure.peaks.peak_flops", lambda device, dtype, override=None: 4e9)
    _configure(tmp_path)
    try:
        model = _mlp()
        for i in range(4):
            with tt.debug_context("train_step", model=model if i >= 2 else None) as step:
                step.record_batch(samples=8, flops=1e6)
                model(torch.randn(8, 16)).sum().backward()
            if i == 1:
                assert get_runtime().throughput.ledger.peak_of("train_step") is None
        tp = get_runtime().throughput.ledger.throughput("train_step")
        assert get_runtime().throughput.ledger.peak_of("train_step") == 4e9
        assert tp.mfu == pytest.approx(tp.flops_per_s / 4e9, rel=1e-9)
    finally:
        tt.shutdown()


def test_a_configured_peak_is_every_operations(tmp_path, monkeypatch):
    """peak_flops, when set, is the peak of every operation, whatever the table says."""
    monkeypatch.setattr("torchtrace.measure.peaks.peak_flops", lambda device, dtype, override=None: 4e9)
    _configure(tmp_path, peak_flops=2e9)
    try:
        _, train_step = _watched(_mlp())
        for _ in range(4):
            train_step(torch.randn(8, 16))
        ledger = get_runtime().throughput.ledger
        assert ledger.peak_of("train_step") == 2e9 and ledger.peak_of("never_ran") == 2e9
        assert get_runtime().throughput.section()["peak_flops"] == 2e9
    finally:
        tt.shutdown()


_SLEPT: dict[str, float] = {}
"""Seconds actually slept per phase in the current step (a loaded machine oversleeps): the
reference the measured phases are checked against."""


_SLEEPS: dict[str, int] = {}
"""How many planted sleeps each phase had in the current step."""


def _plant(phase: str, seconds: float) -> None:
    """Sleep ``seconds`` as part of ``phase``, adding the time really slept to :data:`_SLEPT`."""
    t0 = time.perf_counter()
    time.sleep(seconds)
    _SLEPT[phase] = _SLEPT.get(phase, 0.0) + time.perf_counter() - t0
    _SLEEPS[phase] = _SLEEPS.get(phase, 0) + 1


class _Slow(torch.autograd.Function):
    """Identity that sleeps in forward and in backward: planted phase times."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        _plant("forward", seconds)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _plant("backward", ctx.seconds * 2)
        return grad, None


class _SlowModel(torch.nn.Module):
    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return _Slow.apply(self.lin(x), self.seconds)


def _phase_rows(model, body, batch, steps):
    """Train ``model`` for ``steps`` steps of ``body(opt, batch)`` with SGD and a planted 80 ms
    in the optimizer's step (a pre-hook of the user's); the history rows after the first (it
    counted FLOPs), each with the seconds its step really slept per phase (the last step's
    count of sleeps per phase stays in :data:`_SLEEPS`)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    opt.register_step_pre_hook(lambda *a: _plant("optimizer", OPTIMIZER_SLEEP_S))
    train_step = tt.debug_operation(name="train_step", model=model, optimizer=opt)(lambda x: body(opt, x))
    slept = []
    for _ in range(steps):
        _SLEPT.clear()
        _SLEEPS.clear()
        train_step(batch)
        slept.append(dict(_SLEPT))
    rt = get_runtime()
    rt.finish_deferred(block=True)
    return list(zip(rt.history.steps()[1:], slept[1:]))


OPTIMIZER_SLEEP_S = 0.08
"""The optimizer's planted sleep: longer than :data:`OWN_WORK_S`, so a backward phase that took
the optimizer's time in would show."""
OWN_WORK_S = 0.05
"""What a phase may hold beyond its planted sleeps: the step's own work and this machine's
scheduling (three backwards' own work measured 12-23 ms on a quiet run, 34-37 ms in a CI run)."""


def _assert_phases_hold_their_sleeps(phases: dict[str, float], slept: dict[str, float],
                                     own_s: float = OWN_WORK_S) -> None:
    """Each phase holds its step's planted sleeps (as really slept) and at most ``own_s`` more:
    short of the next phase's sleep, so a mark in the wrong place shows."""
    assert set(slept) <= set(phases), (phases, slept)
    for phase, seconds in slept.items():
        assert seconds <= phases[phase] < seconds + own_s, (phase, phases, slept)


def test_phases_against_planted_sleeps(tmp_path):
    """Forward sleeps 30 ms (20 in the model, 10 in a forward pre-hook of the user's), backward
    40 ms, the optimizer 80 ms (a step pre-hook of the user's): each phase is measured within
    the sleep plus a few ms of the step's own work."""
    _configure(tmp_path)
    try:
        model = _SlowModel(0.02)
        model.register_forward_pre_hook(lambda *a: _plant("forward", 0.01))

        def body(opt, x):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()

        for row, slept in _phase_rows(model, body, torch.randn(2, 4), steps=4):
            phases = row["phases"]
            # The user's optimizer pre-hook was registered before torchtrace's (on the first
            # step), and torchtrace's start mark still runs first: the hook's sleep is optimizer time.
            assert set(slept) == {"forward", "backward", "optimizer"}, slept
            _assert_phases_hold_their_sleeps(phases, slept)
            total = sum(phases.values())
            assert total <= row["duration_s"] + 1e-9
    finally:
        tt.shutdown()


class _SlowOwnCall(_SlowModel):
    def __call__(self, *args, **kwargs):  # a class that routes its own calls: the marks are hooks
        return super().__call__(*args, **kwargs)


@pytest.mark.parametrize("model_class", [_SlowModel, _SlowOwnCall])
def test_micro_batches_in_one_step_split_forward_from_backward(tmp_path, model_class):
    """Gradient accumulation inside one step: three micro-batches, each a 20 ms forward and a
    40 ms backward, then an 80 ms optimizer step. Forward is the three calls (60 ms), not the
    span from the first call's start to the last one's end (140 ms, two backwards in it);
    backward is the three backwards (120 ms). The same with the marks in hooks."""
    _configure(tmp_path)
    try:
        model = model_class(0.02)

        def body(opt, batch):
            opt.zero_grad()
            for micro in batch.chunk(3):
                (model(micro).sum() / 3).backward()
            opt.step()

        for row, slept in _phase_rows(model, body, torch.randn(6, 4), steps=3):
            phases = row["phases"]
            assert slept["forward"] >= 0.06 and slept["backward"] >= 0.12, slept
            _assert_phases_hold_their_sleeps(phases, slept)
            assert sum(phases.values()) <= row["duration_s"] + 1e-9
    finally:
        tt.shutdown()


ENV_SLEEP_S = 0.04
"""A reinforcement-learning environment's step between two calls of the policy (no backward)."""


@pytest.mark.parametrize("model_class", [_SlowModel, _SlowOwnCall])
@pytest.mark.parametrize("arguments", ["batch", "none"])
def test_a_rollouts_pauses_without_a_backward_are_neither_forward_nor_backward(tmp_path, model_class, arguments):
    """A policy-gradient step (PyTorch's REINFORCE example): the policy is called on four
    states, the environment steps between the calls (a planted 40 ms each, no backward), then
    one backward over the episode and the update. Forward is the four calls (80 ms); backward
    is the backward (four 40 ms), not the environment's 120 ms with it: the pauses in which no
    gradient moved belong to neither phase. The step's arguments hold its batch, or none (the
    states come from the environment)."""
    _configure(tmp_path)
    try:
        model = model_class(0.02)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        opt.register_step_pre_hook(lambda *a: _plant("optimizer", OPTIMIZER_SLEEP_S))
        states = torch.randn(4, 4)

        def episode(*batch):
            outputs = []
            for i in range(4):
                if i:
                    _plant("env", ENV_SLEEP_S)
                outputs.append(model(states[i:i + 1]))
            opt.zero_grad()
            torch.cat(outputs).sum().backward()
            opt.step()

        step = tt.debug_operation(name="episode", model=model, optimizer=opt)(episode)
        slept = []
        for _ in range(3):
            _SLEPT.clear()
            step(*((states,) if arguments == "batch" else ()))
            slept.append(dict(_SLEPT))
        rt = get_runtime()
        rt.finish_deferred(block=True)
        for row, planted in zip(rt.history.steps()[1:], slept[1:]):
            env = planted.pop("env")
            assert env >= 3 * ENV_SLEEP_S and planted["backward"] >= 0.16, planted
            _assert_phases_hold_their_sleeps(row["phases"], planted)
            assert sum(row["phases"].values()) + env <= row["duration_s"] + 1e-9
    finally:
        tt.shutdown()


def test_a_model_under_activation_checkpointing_keeps_its_phases(tmp_path):
    """The whole model under ``checkpoint`` (non-reentrant): the backward calls the model again
    to recompute, and that call stops early with an error PyTorch catches. The forward phase
    is the first call's planted 20 ms, the recomputation is backward time (planted 40 ms), and
    the optimizer keeps its 80 ms."""
    from torch.utils.checkpoint import checkpoint

    _configure(tmp_path)
    try:
        model = _SlowModel(0.02)

        def body(opt, x):
            opt.zero_grad()
            checkpoint(model, x, use_reentrant=False).sum().backward()
            opt.step()

        rows = _phase_rows(model, body, torch.randn(2, 4, requires_grad=True), steps=3)
        # the recomputation stops before the planted sleep: one forward sleep, in forward
        assert _SLEEPS["forward"] == 1, _SLEEPS
        for row, slept in rows:
            _assert_phases_hold_their_sleeps(row["phases"], slept)
    finally:
        tt.shutdown()


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps 40 ms (backward time before the checkpoint's recomputation)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _plant("backward", 0.04)
        return grad


def test_a_reentrant_checkpoints_recomputation_keeps_the_backward_before_it(tmp_path):
    """The whole model under ``checkpoint(use_reentrant=True)``: the backward reaches the
    checkpoint after 40 ms of its own (a planted sleep after the model's output), then calls the
    model again to recompute, a call that runs to its end. No gradient of the model has moved
    yet when it begins, but the pause before it was backward, not a pause of no phase: the
    backward holds those 40 ms too."""
    from torch.utils.checkpoint import checkpoint

    _configure(tmp_path)
    try:
        model = _SlowModel(0.02)

        def body(opt, x):
            opt.zero_grad()
            _SlowBackward.apply(checkpoint(model, x, use_reentrant=True)).sum().backward()
            opt.step()

        rows = _phase_rows(model, body, torch.randn(2, 4, requires_grad=True), steps=3)
        assert _SLEEPS["forward"] == 2 and _SLEEPS["backward"] == 2, _SLEEPS  # the recomputation ran whole
        for row, slept in rows:
            _assert_phases_hold_their_sleeps(row["phases"], slept)
    finally:
        tt.shutdown()


def test_a_forward_called_past_the_model_keeps_the_optimizer_phase(tmp_path, caplog):
    """``model.forward(x)`` called directly goes past the call seam: the step has no forward
    or backward phase (where the backward began is not known), but its optimizer phase (a
    planted 30 ms in a step pre-hook) is still measured, and the log says once why the others
    are missing. Without an optimizer either, no phases."""
    caplog.set_level(logging.WARNING, logger="torchtrace")
    _configure(tmp_path)
    try:
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        opt.register_step_pre_hook(lambda *a: time.sleep(0.03))

        @tt.debug_operation(model=model, optimizer=opt)
        def train_step(x):
            opt.zero_grad()
            model.forward(x).sum().backward()
            opt.step()

        @tt.debug_operation(model=model)
        def evaluate(x):
            return model.forward(x).sum()

        for _ in range(3):
            train_step(torch.randn(2, 16))
            evaluate(torch.randn(2, 16))
        rt = get_runtime()
        rt.finish_deferred(block=True)
        rows = rt.history.steps()
        trained = [row for row in rows if row["operation"] == "train_step"]
        assert all(set(row["phases"]) == {"optimizer"} for row in trained), trained
        assert all(0.03 <= row["phases"]["optimizer"] < 0.03 + 0.035 for row in trained)
        assert all("phases" not in row for row in rows if row["operation"] == "evaluate")
        labels = {"run_id": rt.settings.run_id, "rank": "0", "operation": "train_step", "phase": "optimizer"}
        assert rt.metrics.registry.get_sample_value("torchtrace_step_phase_seconds_count", labels) == 3
        labels["phase"] = "forward"
        assert not rt.metrics.registry.get_sample_value("torchtrace_step_phase_seconds_count", labels)
        said = [r.getMessage() for r in caplog.records if "forward was not" in r.getMessage()]
        assert len(said) == 1 and "model(...)" in said[0], said
    finally:
        tt.shutdown()


def test_level_off_takes_the_phase_marks_off_the_model(tmp_path):
    """At OFF (and with throughput off) the model's call is PyTorch's own again; the next step
    that measures throughput puts the marks back. The user's hooks are left alone; shutdown
    takes torchtrace's optimizer hooks off too."""
    _configure(tmp_path)
    try:
        model = _mlp()
        opt, train_step = _watched(model)

        user_hook = model.register_forward_hook(lambda *a: None)
        train_step(torch.randn(8, 16))
        # A plain module: the call-through seam, no hooks of torchtrace's.
        assert model.__dict__.get("_compiled_call_impl") is not None
        assert len(model._forward_pre_hooks) == 0 and len(model._forward_hooks) == 1
        assert len(opt._optimizer_step_pre_hooks) >= 1
        rt = get_runtime()
        rt.set_level("off")
        assert "_compiled_call_impl" not in model.__dict__ and len(model._forward_hooks) == 1  # the user's stays
        train_step(torch.randn(8, 16))
        assert "_compiled_call_impl" not in model.__dict__
        rt.set_level("basic")
        train_step(torch.randn(8, 16))
        assert model.__dict__.get("_compiled_call_impl") is not None
        rt.finish_deferred(block=True)
        assert set(rt.history.steps()[-1]["phases"]) == {"forward", "backward", "optimizer"}
        user_hook.remove()
    finally:
        tt.shutdown()
    assert "_compiled_call_impl" not in model.__dict__  # shutdown gives the model back as it was
    assert len(opt._optimizer_step_pre_hooks) == 0 and len(opt._optimizer_step_post_hooks) == 0


class _OwnCall(torch.nn.Linear):
    def __call__(self, *args, **kwargs):  # a class that routes its own calls
        return super().__call__(*args, **kwargs)


def test_a_module_with_its_own_call_gets_hooks_and_the_same_phases(tmp_path):
    _configure(tmp_path)
    try:
        model = _OwnCall(16, 4)
        _, train_step = _watched(model)

        train_step(torch.randn(8, 16))
        train_step(torch.randn(8, 16))
        assert "_compiled_call_impl" not in model.__dict__
        assert len(model._forward_pre_hooks) == 1 and len(model._forward_hooks) == 1
        rt = get_runtime()
        rt.finish_deferred(block=True)
        assert set(rt.history.steps()[-1]["phases"]) == {"forward", "backward", "optimizer"}
    finally:
        tt.shutdown()
    assert len(model._forward_pre_hooks) == 0 and len(model._forward_hooks) == 0


def test_a_watched_model_pickles_and_copies_without_torchtrace(tmp_path):
    """``torch.save`` of the whole module and ``copy.deepcopy`` while torchtrace watches it:
    the copies compute the same and carry nothing of torchtrace's."""
    import copy
    import io

    _configure(tmp_path)
    try:
        model = _mlp()
        _, train_step = _watched(model)

        train_step(torch.randn(8, 16))
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        copied = copy.deepcopy(model)
        x = torch.randn(3, 16)
        for other in (loaded, copied):
            assert "_compiled_call_impl" not in other.__dict__
            assert torch.equal(other(x), model(x))
    finally:
        tt.shutdown()


@pytest.mark.parametrize("level", ["basic", "advanced", "extreme"])
def test_a_watched_model_is_freed_as_soon_as_the_user_drops_it(tmp_path, level):
    """Nothing of torchtrace's keeps a dropped model: no reference cycle through the forward
    marks, no cache holding its parameters. With the garbage collector off, the model and its
    parameters' memory go when the user's last reference does."""
    import gc
    import weakref

    _configure(tmp_path, level=level)
    try:
        def train_and_drop():
            model = _mlp()
            _, train_step = _watched(model)

            for _ in range(3):
                train_step(torch.randn(8, 16))
            get_runtime().finish_deferred(block=True)
            assert model.__dict__.get("_compiled_call_impl") is not None
            return weakref.ref(model), weakref.ref(next(model.parameters()))

        gc.disable()
        try:
            gone, param = train_and_drop()  # every reference of the user's dropped on return
            assert gone() is None and param() is None
        finally:
            gc.enable()
    finally:
        tt.shutdown()


def test_an_evaluation_under_no_grad_has_no_backward_phase(tmp_path):
    """The metric computation after an evaluation's forward is not a backward pass."""
    _configure(tmp_path)
    try:
        model = _mlp()

        @tt.debug_operation(name="eval_step", model=model, kind="evaluation")
        def eval_step(x):
            with torch.no_grad():
                out = model(x)
            time.sleep(0.05)  # the metrics after the forward
            return float(out.sum())

        for _ in range(3):
            eval_step(torch.randn(8, 16))
        rt = get_runtime()
        rt.finish_deferred(block=True)
        rows = rt.history.steps()
        assert all(set(row["phases"]) == {"forward"} for row in rows), [row["phases"] for row in rows]
        # The forward is a few µs; the 50 ms after it are not in it (the first step counted FLOPs).
        assert all(row["phases"]["forward"] < 0.05 for row in rows[1:]), [row["phases"] for row in rows]
    finally:
        tt.shutdown()


class _Tagged(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 4)
        self.tag = "original"

    def forward(self, x):
        return self.lin(x), self.tag


def test_a_copy_of_the_models_dict_calls_itself_not_the_model(tmp_path):
    """DataParallel makes its replicas by copying the module's ``__dict__``, torchtrace's
    forward marks included: a replica's call must run the replica (its own parameters and
    attributes, on its own device), never the model the marks were made for."""
    _configure(tmp_path)
    try:
        model = _Tagged()
        opt, train_step = _watched(model)

        train_step(torch.randn(8, 16))
        assert model.__dict__.get("_compiled_call_impl") is not None
        replica = model._replicate_for_data_parallel()  # what torch.nn.parallel.replicate does per module
        replica.tag = "replica"
        x = torch.randn(2, 16)
        assert replica(x)[1] == "replica" and model(x)[1] == "original"
        with tt.debug_context("inner", model=model, optimizer=opt):  # inside a step, too
            assert replica(x)[1] == "replica"
        train_step(torch.randn(8, 16))
        get_runtime().finish_deferred(block=True)
        assert set(get_runtime().history.steps()[-1]["phases"]) == {"forward", "backward", "optimizer"}
    finally:
        tt.shutdown()


def test_time_at_level_off_is_not_data_wait(tmp_path):
    """An operator turns torchtrace off for a while (the job goes on training) and on again:
    that stretch is no class of goodput and not in its wall time; before, it was counted as
    data wait all at once, and the low-goodput alert fired on a healthy job."""
    _configure(tmp_path)
    try:
        model = _mlp()
        opt, train_step = _watched(model)
        rt = get_runtime()
        for _ in range(5):
            train_step(torch.randn(8, 16))
        rt.set_level("off")
        t0 = time.perf_counter()
        for _ in range(5):
            train_step(torch.randn(8, 16))
            time.sleep(0.1)
        off = time.perf_counter() - t0
        rt.set_level("basic")
        for _ in range(5):
            train_step(torch.randn(8, 16))
        rt.finish_deferred(block=True)
        g = rt.throughput.ledger.closed()
        assert off >= 0.5
        assert g.badput["data_wait"] < 0.1, g.badput
        assert g.wall_s < time.perf_counter() - rt.throughput.ledger.configured_at - 0.45
        assert g.productive_s + sum(g.badput.values()) == pytest.approx(g.wall_s, abs=1e-9)
    finally:
        tt.shutdown()


def test_a_run_configured_at_level_off_has_no_goodput_until_it_measures(tmp_path):
    """Configured at level off, the run has no goodput to show (it said 0 %: all startup)
    and /metrics has no goodput ratio; the first measured step starts its accounting."""
    tt.configure(prometheus_port=0, run_dir=str(tmp_path), register_atexit=False, strict=True, level="off")
    try:
        rt = get_runtime()
        time.sleep(0.2)
        assert rt.throughput.ledger.snapshot(time.perf_counter()).ratio is None
        assert rt.metrics.registry.get_sample_value(
            "torchtrace_goodput_ratio", {"run_id": rt.settings.run_id, "rank": "0"}) is None
        model = _mlp()
        opt, train_step = _watched(model)
        rt.set_level("basic")
        train_step(torch.randn(8, 16))
        rt.finish_deferred(block=True)
        g = rt.throughput.ledger.closed()
        assert g.badput["startup"] < 0.15 and g.productive_s > 0
    finally:
        tt.shutdown()


@pytest.mark.parametrize("level", ["basic", "extreme"])
def test_a_model_that_differentiates_in_its_forward_trains_as_without_torchtrace(tmp_path, level):
    """The step whose FLOPs were counted raised out of the user's loop (FlopCounterMode's
    module tracker fails torch.autograd.grad inside a forward); now it trains to the same
    weights as an uninstrumented copy, with FLOPs and all three phases."""
    _configure(tmp_path, level=level)
    try:
        model, bare = DifferentiatingModel(), DifferentiatingModel()
        opt, bare_opt = torch.optim.Adam(model.parameters(), lr=1e-2), torch.optim.Adam(bare.parameters(), lr=1e-2)

        @tt.debug_operation(model=model, optimizer=opt)
        def train_step(x):
            opt.zero_grad()
            loss = model(x)
            loss.backward()
            opt.step()
            return loss

        for _ in range(4):
            x = torch.linspace(0, 3, 32).reshape(-1, 1)
            train_step(x.clone())
            bare_opt.zero_grad()
            bare(x.clone()).backward()
            bare_opt.step()
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), bare.parameters()))
        rt = get_runtime()
        rt.finish_deferred(block=True)
        rows = rt.history.steps()
        assert len(rows) == 4 and rt.errors.total == 0
        assert all(row["flops"] > 0 and set(row["phases"]) == {"forward", "backward", "optimizer"} for row in rows)
    finally:
        tt.shutdown()


def test_an_epoch_holding_steps_is_not_counted_and_its_steps_are(tmp_path):
    """A decorated epoch calling a decorated training step: the epoch, the outermost, took the
    FLOP count, so the whole first epoch ran under the counter (several times slower) and the
    steps never had FLOPs. A step with an optimizer inside another operation makes that one a
    container: its count is dropped at once and the steps are counted (against
    FlopCounterMode on the same step). A sub-operation without an optimizer inside a step
    (a loss function of its own) leaves the step's count alone."""
    _configure(tmp_path)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        data = [(torch.randn(8, 16), torch.randn(8, 4)) for _ in range(5)]

        @tt.debug_operation(name="loss_of")
        def loss_of(out, y):
            return torch.nn.functional.mse_loss(out, y)

        @tt.debug_operation(name="train_step", model=model, optimizer=opt)
        def train_step(x, y):
            opt.zero_grad()
            loss = loss_of(model(x), y)
            loss.backward()
            opt.step()
            return loss

        @tt.debug_operation(name="train_epoch")
        def train_epoch(loader):
            for x, y in loader:
                train_step(x, y)

        for _ in range(2):
            train_epoch(data)
        with FlopCounterMode(display=False) as reference:
            torch.nn.functional.mse_loss(model(data[0][0]), data[0][1]).backward()
        rt = get_runtime()
        rt.finish_deferred(block=True)
        rows = rt.history.steps()
        by_op = {op: [r for r in rows if r["operation"] == op] for op in ("train_epoch", "train_step", "loss_of")}
        assert [r.get("flops") for r in by_op["train_epoch"]] == [None, None]
        assert [r.get("flops") for r in by_op["train_step"]] == [reference.get_total_flops()] * 10
        assert all(r.get("flops") is None for r in by_op["loss_of"])
        assert rt.throughput.flops.counts == 1  # one step ran under the counter: the first training step
    finally:
        tt.shutdown()


def test_the_rate_set_between_a_clip_and_the_update_is_the_one_recorded(tmp_path):
    """A warm-up that sets the rate after clip_grad_norm_ (which measures the gradients early)
    and before optimizer.step(): the step records the rate its update used."""
    _configure(tmp_path)
    try:
        model = _mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        used, recorded = [], []
        for it in range(5):
            with tt.debug_context("train_step", model=model, optimizer=opt) as step:
                opt.zero_grad()
                model(torch.randn(4, 16)).pow(2).mean().backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                for group in opt.param_groups:
                    group["lr"] = 1e-3 * min(1.0, (it + 1) / 4)
                used.append(opt.param_groups[0]["lr"])
                opt.step()
            recorded.append(step.record.lr[0])
        assert recorded == used
        assert used[:4] == [0.00025, 0.0005, 0.00075, 0.001]
    finally:
        tt.shutdown()


class _Delegating(torch.optim.Optimizer):
    """A wrapper that never runs ``Optimizer.__init__`` and keeps the real optimizer under a
    name of its own (not ``.optimizer``): torch's step hooks cannot be registered on it."""

    def __init__(self, inner):
        self._inner = inner
        self.defaults = inner.defaults

    @property
    def param_groups(self):
        return self._inner.param_groups

    @property
    def state(self):
        return self._inner.state

    def step(self, closure=None):
        return self._inner.step(closure)

    def zero_grad(self, set_to_none=True):
        self._inner.zero_grad(set_to_none)


@pytest.mark.parametrize("hidden", [True, False])
def test_an_optimizer_wrapper_without_torchs_hooks_keeps_every_record(tmp_path, hidden):
    """The wrapper's real optimizer is found among its attributes; a wrapper holding none it can
    name (``hidden=False``: two) is measured at the step's end. Either way every step has its
    record, loss, learning rate and goodput; no internal error."""
    _configure(tmp_path)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 1)
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        opt = _Delegating(sgd)
        if not hidden:
            opt._spare = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.5)

        @tt.debug_operation(name="train_step", model=model, optimizer=opt)
        def train_step(x):
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            return loss

        rt = get_runtime()
        losses, rates = [], []
        for _ in range(5):
            losses.append(train_step(torch.randn(4, 8)).item())
            rates.append(rt.history.last_record.lr)
        rt.finish_deferred(block=True)
        steps = rt.history.steps()
        assert [s["loss"] for s in steps] == pytest.approx(losses)
        assert rates == [[0.1]] * 5
        assert all(s.get("grad_norm") is not None for s in steps)
        assert rt.summary()["throughput"]["productive_s"] > 0
        if hidden:  # the real optimizer's hooks: the update's phase
            assert all("optimizer" in s["phases"] for s in steps)
    finally:
        tt.shutdown()


def test_each_operation_has_room_for_its_own_shapes(tmp_path):
    """A training operation whose images change height and width every step fills its own
    room in the FLOP table, not the evaluation's: the evaluation that starts later, on one
    shape, gets FlopCounterMode's count."""
    import random

    _configure(tmp_path)
    try:
        torch.manual_seed(0)
        rng = random.Random(0)
        net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                                  torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 10))
        opt = torch.optim.SGD(net.parameters(), lr=0.01)

        @tt.debug_operation(name="train_step", model=net, optimizer=opt)
        def train_step(x, y):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
            opt.step()

        @tt.debug_operation(name="evaluate", model=net, kind="evaluation")
        def evaluate(x):
            with torch.no_grad():
                return net(x)

        for _ in range(45):
            train_step(torch.randn(2, 3, rng.randint(8, 40), rng.randint(8, 40)), torch.randint(0, 10, (2,)))
        x = torch.randn(2, 3, 32, 32)
        for _ in range(3):
            evaluate(x)
        with torch.no_grad():
            reference = _counted(net, x)
        rt = get_runtime()
        rt.finish_deferred(block=True)
        assert rt.throughput.flops.counts >= 32  # the training filled its room
        flops = [s.get("flops") for s in rt.history.steps() if s["operation"] == "evaluate"]
        assert flops == [reference] * 3
    finally:
        tt.shutdown()


@pytest.mark.parametrize("form", ["many", "deep", "tokens"])
def test_batches_the_shape_key_sees_only_part_of_are_counted_every_step(tmp_path, form):
    """Over 32 micro-batches (the key holds the first 32), or micro-batches nested three
    containers deep (the key holds their container's type): a short last micro-batch, or
    smaller micro-batches, change the samples the key does not see. Each step's samples (and
    tokens, for token ids without a mask) equal a plain count over its micro-batches."""
    _configure(tmp_path)
    try:
        torch.manual_seed(0)
        model = torch.nn.Embedding(10, 3) if form == "tokens" else torch.nn.Linear(4, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def batches(sizes):
            if form == "tokens":
                return [{"input_ids": torch.ones(k, 8, dtype=torch.long)} for k in sizes]
            micro = [(torch.rand(k, 4), torch.randint(0, 3, (k,))) for k in sizes]
            return micro if form == "many" else {"student": {"micro": micro}}

        @tt.debug_operation(name="train_step", model=model, optimizer=opt)
        def train_step(batch):
            opt.zero_grad()
            if form == "tokens":
                for mb in batch:
                    model(mb["input_ids"]).mean().backward()
            else:
                for x, y in (batch if form == "many" else batch["student"]["micro"]):
                    torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

        plans = ([[4, 4], [4, 4], [2, 2], [4, 1]] if form == "deep"
                 else [[2] * 40, [2] * 40, [2] * 39 + [1], [2] * 33 + [1] * 7])
        for sizes in plans:
            train_step(batches(sizes))
        rt = get_runtime()
        rt.finish_deferred(block=True)
        steps = rt.history.steps()
        assert [s.get("samples") for s in steps] == [sum(p) for p in plans]
        if form == "tokens":
            assert [s.get("tokens") for s in steps] == [8 * sum(p) for p in plans]
    finally:
        tt.shutdown()


def test_goodput_of_operations_that_hold_steps(tmp_path):
    """An evaluation pass (``kind="evaluation"``) around evaluation steps: its loading between
    them (planted sleeps) is evaluation, not data wait. An epoch operation around training
    steps: its validation after them (a planted sleep, no step) is data wait, not productive;
    productive is its steps' own time."""
    _configure(tmp_path)
    try:
        model = torch.nn.Linear(16, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        own = []

        @tt.debug_operation(name="train_step", model=model, optimizer=opt)
        def train_step(x):
            t = time.perf_counter()
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            time.sleep(0.01)
            opt.step()
            own.append(time.perf_counter() - t)

        @tt.debug_operation(name="eval_step", model=model, kind="evaluation")
        def eval_step(x):
            with torch.no_grad():
                return model(x).pow(2).mean()

        def load():
            time.sleep(0.02)
            return torch.randn(8, 16)

        rt = get_runtime()

        def booked():
            s = rt.summary()["throughput"]
            return dict(s["badput_s"], productive=s["productive_s"])

        for _ in range(2):
            train_step(load())
        before = booked()
        with tt.debug_context("evaluate", kind="evaluation"):
            for _ in range(5):
                eval_step(load())
        after = booked()
        assert after["evaluation"] - before["evaluation"] >= 0.1  # the five loads, at least
        assert after["data_wait"] - before["data_wait"] < 0.05  # (the loads were 0.1 s of it; now the entry's only)

        @tt.debug_operation(name="epoch")
        def epoch():
            for _ in range(4):
                train_step(load())
            time.sleep(0.15)  # validation and a checkpoint, no step of their own

        own.clear()
        before = booked()
        epoch()
        after = booked()
        assert after["productive"] - before["productive"] == pytest.approx(sum(own), abs=0.02)  # (not the 0.15 s)
        assert after["data_wait"] - before["data_wait"] >= 0.15 + 3 * 0.02
    finally:
        tt.shutdown()


@pytest.mark.parametrize("change", ["freeze", "unfreeze"])
def test_flops_follow_parameters_frozen_or_unfrozen(tmp_path, change):
    """Fine-tuning that freezes the backbone (or unfreezes it) after a few steps: the backward
    computes other FLOPs. The step that finds the change has none (not the old count), the next
    one is counted again, and every later step's FLOPs equal FlopCounterMode's on a copy of the
    model as it then is."""
    import copy

    _configure(tmp_path)
    try:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                  torch.nn.ReLU(), torch.nn.Linear(256, 10))
        opt = torch.optim.SGD(net.parameters(), lr=1e-3)
        backbone = list(net.parameters())[:4]
        if change == "unfreeze":
            for p in backbone:
                p.requires_grad_(False)

        def body(model, x, y):
            torch.nn.functional.cross_entropy(model(x), y).backward()

        @tt.debug_operation(name="train_step", model=net, optimizer=opt)
        def train_step(x, y):
            opt.zero_grad()
            body(net, x, y)
            opt.step()

        expected = []
        for i in range(7):
            if i == 3:
                for p in backbone:
                    p.requires_grad_(change == "unfreeze")
            x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
            expected.append(_counted(body, copy.deepcopy(net), x, y))
            train_step(x, y)
        rt = get_runtime()
        rt.finish_deferred(block=True)
        steps = rt.history.steps()
        assert expected[0] != expected[3]
        assert [s.get("flops") for s in steps] == expected[:3] + [None] + expected[4:]
    finally:
        tt.shutdown()


def test_a_closure_step_keeps_the_optimizer_phase_and_says_why_once(tmp_path, caplog):
    """optimizer.step(closure) (LBFGS): the forward and backward run inside the update, with
    no boundary to split them at; the phases hold the whole update as the optimizer's, its
    time within the step's, and the log says why, once."""
    caplog.set_level(logging.WARNING, logger="torchtrace")
    _configure(tmp_path)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
        opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3)
        x, y = torch.randn(64, 32), torch.randn(64, 1)

        @tt.debug_operation(name="train_step", model=model, optimizer=opt)
        def train_step(x, y):
            def closure():
                opt.zero_grad()
                loss = (model(x) - y).pow(2).mean()
                loss.backward()
                return loss
            return opt.step(closure)

        for _ in range(3):
            train_step(x, y)
        rt = get_runtime()
        rt.finish_deferred(block=True)
        steps = rt.history.steps()
        assert all(set(s["phases"]) == {"optimizer"} and 0 < s["phases"]["optimizer"] <= s["duration_s"]
                   for s in steps)
        said = [r.getMessage() for r in caplog.records if "inside optimizer.step(closure)" in r.getMessage()]
        assert len(said) == 1
        assert not [r for r in caplog.records if "forward was not seen" in r.getMessage()]
    finally:
        tt.shutdown()
