"""FLOPs of shapes never counted, from counts that differ in one length (measure/flop_fit.py).

A loop that pads each batch to its longest sequence gives nearly every step a new shape.
Before, the first 32 shapes each ran a step under the FLOP counter (several times slower)
and every step after had no FLOPs: no FLOP/s, no MFU for the rest of the run. Checked here
against FlopCounterMode run on every step of the same loop."""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import torchtrace as tt
from torchtrace.api import get_runtime
from torchtrace.measure.flop_fit import CONFIRM_POINTS, FIT_POINTS, SPOT_CHECK, FlopFits
from torchtrace.measure.flop_rules import RULES  # (torch's counter misses the CPU attention kernel the tiny LM runs)
from torchtrace.measure.flops import DEFAULT_MAX_SHAPES


def _key(*shapes, dtype=torch.int64):
    return ("step", tuple((torch.Size(s), dtype) for s in shapes))


def _fill(fits, lengths, flops_of, shapes_of, dtype=torch.float32):
    for n in lengths:
        fits.add(_key(*shapes_of(n)), flops_of(n), dtype)


# ---------------------------------------------------------------- the fit


def test_a_quadratic_in_the_shared_length_is_trusted_after_two_confirming_counts():
    fits = FlopFits()
    flops = lambda n: 12 * n * n + 7000 * n + 96  # noqa: E731 - attention, linear layers, a constant
    shapes = lambda n: [(4, n), (4, n), (4, n)]  # noqa: E731 - ids, mask and labels share the length
    _fill(fits, [17, 33, 9, 43], flops, shapes)
    assert fits.predict(_key(*shapes(100))) is None  # fitted through three, only one more confirms
    _fill(fits, [61], flops, shapes)
    for n in (1, 100, 511, 4096):
        assert fits.predict(_key(*shapes(n))) == flops(n)
    assert fits.predict(_key((5, 100), (5, 100), (5, 100))) is None  # another batch size: not this family
    assert fits.predict(_key((4, 100), (4, 99), (4, 100))) is None  # lengths that differ: no family


def test_lengths_beyond_those_counted_are_counted_while_there_is_room():
    """A quadratic found on short sequences need not hold for long ones (attention within a
    sliding window of 64 is linear past it): a length beyond the counted ones is counted,
    and its count ends the fit; without room to count, the fit answers."""
    fits = FlopFits()
    flops = lambda n: 4 * min(n, 64) * n + 100 * n  # noqa: E731 - a window of 64
    _fill(fits, [10, 20, 30, 40, 50], flops, lambda n: [(2, n)])
    assert fits.predict(_key((2, 200)), spot_check=True) is None  # counted
    assert fits.predict(_key((2, 200))) == 4 * 200 * 200 + 100 * 200  # what the fit says (wrong there)
    fits.add(_key((2, 200)), flops(200), torch.float32)
    assert fits.ended == 1 and fits.predict(_key((2, 45)), spot_check=True) is None


def test_flops_that_are_no_quadratic_are_never_predicted():
    fits = FlopFits()
    _fill(fits, [8, 16, 24, 32, 40, 48], lambda n: n ** 3 + n, lambda n: [(2, n)])
    assert fits.predict(_key((2, 64))) is None


def test_a_count_that_disagrees_ends_the_exact_fit_for_good():
    """After it, lengths are counted while there is room (spot_check), and without room get the
    least-squares quadratic's FLOPs, which is within 2 % of every count."""
    fits = FlopFits()
    flops = lambda n: 3 * n * n + 5 * n  # noqa: E731
    _fill(fits, [10, 20, 30, 40, 50], flops, lambda n: [(2, n)])
    assert fits.predict(_key((2, 35)), spot_check=True) == fits.predict(_key((2, 35))) == flops(35)
    fits.add(_key((2, 70)), flops(70) + 1, torch.float32)
    _fill(fits, [60, 90], flops, lambda n: [(2, n)])  # agreeing counts after it do not revive it
    assert fits.predict(_key((2, 80)), spot_check=True) is None
    approximate = fits.predict(_key((2, 80)))
    assert abs(approximate / flops(80) - 1) < 0.02


def test_counts_far_from_any_quadratic_get_no_approximation():
    fits = FlopFits()
    counts = {8: 1000, 16: 90, 24: 5000, 32: 70, 40: 9000, 48: 3}
    for n, f in counts.items():
        fits.add(_key((2, n)), f, torch.float32)
    assert fits.predict(_key((2, 64))) is None and fits.predict(_key((2, 64)), spot_check=True) is None


def test_counts_in_another_dtype_are_another_family():
    fits = FlopFits()
    flops = lambda n: 2 * n * n  # noqa: E731
    for i, n in enumerate([10, 20, 30, 40, 50]):
        fits.add(_key((2, n)), flops(n), torch.bfloat16 if i == 3 else torch.float32)
    assert fits.predict(_key((2, 70))) is None


def test_the_8th_16th_32nd_new_length_are_kept_for_a_spot_check():
    fits = FlopFits()
    flops = lambda n: n * n + n  # noqa: E731
    _fill(fits, [10, 200, 300, 400, 500], flops, lambda n: [(2, n)])
    asked = [n for n in range(11, 500) if n % 100][:70]  # within the lengths counted
    checked = [n for n in asked if fits.predict(_key((2, n)), spot_check=True) is None]
    assert checked == [asked[i - 1] for i in (SPOT_CHECK, 2 * SPOT_CHECK, 4 * SPOT_CHECK, 8 * SPOT_CHECK)]
    assert all(fits.predict(_key((2, n))) == flops(n) for n in asked)  # without room to count: the fit
    assert [n for n in asked if fits.predict(_key((2, n)), spot_check=True) is None] == checked  # the same ones


def test_a_batch_size_and_a_length_that_change_together_are_fitted_per_sample():
    """Token-budget batching: batch size and length both change every step. FLOPs are the
    batch size times a quadratic of the length (per-sample work): fitted through the per-sample
    FLOPs of three counts, trusted after two more, exact at batch sizes never counted."""
    fits = FlopFits()
    per_sample = lambda n: 12 * n * n + 7000 * n + 96  # noqa: E731
    shapes = lambda b, n: [(b, n), (b, n), (b, n)]  # noqa: E731 - ids, mask, labels
    pairs = [(64, 16), (21, 48), (9, 113), (40, 25), (5, 200)]
    for b, n in pairs:
        assert fits.predict(_key(*shapes(7, 100))) is None  # not before two counts confirmed the fit
        fits.add(_key(*shapes(b, n)), b * per_sample(n), torch.float32)
    for b, n in [(7, 100), (1, 16), (64, 200), (13, 57), (3, 150)]:
        assert fits.predict(_key(*shapes(b, n))) == b * per_sample(n)
    assert fits.predict(_key((7, 100), (7, 99), (7, 100))) is None  # lengths that differ: no family


@pytest.mark.parametrize("across", ["batch squared", "a constant per step"])
def test_work_across_the_batch_is_not_fitted_per_sample(across):
    """A contrastive loss's batch-by-batch similarities, or work that does not grow with the
    batch, make the per-sample FLOPs depend on the batch size: no fit, the shapes are counted."""
    fits = FlopFits()
    extra = (lambda b: 5 * b * b) if across == "batch squared" else (lambda b: 4096)
    pairs = [(64, 16), (21, 48), (9, 113), (40, 25), (5, 200), (12, 90), (30, 30), (8, 64)]
    for b, n in pairs:
        fits.add(_key((b, n)), b * (3 * n * n + 100 * n) + extra(b), torch.float32)
    assert fits.predict(_key((7, 100))) is None and fits.predict(_key((7, 100)), spot_check=True) is None


# ---------------------------------------------------------------- a training loop


class TinyLM(torch.nn.Module):
    """Embedding, one attention block (scaled_dot_product_attention) with an MLP, a head."""

    def __init__(self, vocab: int = 50, d: int = 32) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.out = torch.nn.Linear(d, d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, input_ids, attention_mask):
        x = self.emb(input_ids)
        q, k, v = self.qkv(x).view(*x.shape[:2], 3, 2, -1).permute(2, 0, 3, 1, 4)
        keep = attention_mask[:, None, None, :].bool()
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        x = x + self.out(a.transpose(1, 2).reshape(x.shape))
        return self.head(x + self.mlp(x))


def _padded_batches(n: int, seed: int = 0):
    """``n`` batches of 4 sequences of 3-90 tokens, each padded to its longest (a collator's default)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        lengths = [rng.randint(3, 90) for _ in range(4)]
        longest = max(lengths)
        ids = torch.zeros(4, longest, dtype=torch.long)
        mask = torch.zeros(4, longest, dtype=torch.long)
        for i, m in enumerate(lengths):
            ids[i, :m] = torch.randint(1, 50, (m,))
            mask[i, :m] = 1
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.clone()})
    return out


def _lm_step(model, opt):
    def step(batch):
        opt.zero_grad()
        logits = model(batch["input_ids"], batch["attention_mask"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        loss.backward()
        opt.step()
        return loss
    return step


def _reference(model, step_of, batch):
    """FlopCounterMode's count of one step on a copy (the training itself is left alone)."""
    twin = copy.deepcopy(model)
    with FlopCounterMode(display=False, custom_mapping=RULES) as ref:
        step_of(twin, torch.optim.AdamW(twin.parameters(), lr=1e-3))(batch)
    return ref.get_total_flops()


def _train(tmp_path, make_model, step_of, batches):
    """``make_model()`` (seeded) trained on ``batches`` in a decorated step:
    ``(model, runtime, each step's FLOPs)``."""
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), register_atexit=False, strict=True)
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = tt.debug_operation(name="train_step", model=model, optimizer=opt)(step_of(model, opt))
    for batch in batches:
        step(batch)
    rt = get_runtime()
    return model, rt, [r.get("flops") for r in rt.history.steps()[-len(batches):]]


def _train_tiny_lm(tmp_path, batches):
    """TinyLM trained on ``batches``: ``(runtime, the steps' FLOPs, the reference:
    FlopCounterMode's count of each step's shape, on a copy)``."""
    model, rt, got = _train(tmp_path, TinyLM, _lm_step, batches)
    shape = lambda b: tuple(b["input_ids"].shape)  # noqa: E731
    reference = {shape(b): _reference(model, _lm_step, b) for b in {shape(b): b for b in batches}.values()}
    return rt, got, [reference[shape(b)] for b in batches]


def test_a_loop_padding_to_the_longest_gets_every_steps_flops_with_few_counts(tmp_path):
    batches = _padded_batches(120)
    rt, got, reference = _train_tiny_lm(tmp_path, batches)
    lengths = [b["input_ids"].shape[1] for b in batches]
    assert len(set(lengths)) > DEFAULT_MAX_SHAPES  # more shapes than the table holds
    assert got == reference  # every step, exactly
    counted = rt.throughput.flops.counts
    distinct = len(set(lengths))
    # the counts that found and confirmed the fit, lengths beyond the counted span, the spot checks
    assert counted <= FIT_POINTS + CONFIRM_POINTS + 2 + distinct // SPOT_CHECK + 1, (counted, distinct)
    tp = rt.throughput.ledger.throughput("train_step")
    assert tp.flops_per_s is not None and tp.flops_per_s > 0


def _token_budget_batches(n: int, budget: int = 256, seed: int = 1):
    """``n`` batches of about ``budget`` tokens: a length of 8-90 each, as many sequences as fit
    (a speech or translation loader's dynamic batching); the last sequence shorter, padded."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        longest = rng.randint(8, 90)
        rows = max(1, budget // longest)
        ids = torch.randint(1, 50, (rows, longest))
        mask = torch.ones(rows, longest, dtype=torch.long)
        mask[-1, longest // 2:] = 0
        out.append({"input_ids": ids * mask, "attention_mask": mask, "labels": ids * mask})
    return out


def test_token_budget_batching_gets_every_steps_flops_with_few_counts(tmp_path):
    """Batch size and length both change every step: before, the first 32 shapes were counted
    and every step after had no FLOPs. Reference: FlopCounterMode on every distinct shape."""
    batches = _token_budget_batches(100)
    rt, got, reference = _train_tiny_lm(tmp_path, batches)
    shapes = [tuple(b["input_ids"].shape) for b in batches]
    assert len(set(shapes)) > DEFAULT_MAX_SHAPES and len({b for b, _ in shapes}) > 10
    assert got == reference  # every step, exactly
    counted = rt.throughput.flops.counts
    assert counted <= FIT_POINTS + CONFIRM_POINTS + 2 + len(set(shapes)) // SPOT_CHECK + 1, counted


class TinyConv(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, stride=2, padding=1), torch.nn.ReLU(),
                                        torch.nn.Conv2d(8, 8, 3, stride=2, padding=1))

    def forward(self, x):
        return self.body(x).mean()


def _conv_step(model, opt):
    def step(x):
        opt.zero_grad()
        model(x).backward()
        opt.step()
    return step


def _train_conv(tmp_path, sizes):
    return _train(tmp_path, TinyConv, _conv_step, [torch.randn(2, 3, size, size) for size in sizes])


def test_multi_scale_training_at_multiples_of_the_stride_gets_every_steps_flops(tmp_path):
    """Images at multiples of the total stride (4 here; 32 for most detectors): the
    convolutions' FLOPs are a quadratic of the size, fitted exactly."""
    rng = random.Random(1)
    sizes = [4 * rng.randint(8, 60) for _ in range(90)]
    model, rt, flops = _train_conv(tmp_path, sizes)
    assert len(set(sizes)) > DEFAULT_MAX_SHAPES
    assert flops == [_reference(model, _conv_step, torch.randn(2, 3, s, s)) for s in sizes]
    assert rt.throughput.flops.counts <= FIT_POINTS + CONFIRM_POINTS + 2 + len(set(sizes)) // SPOT_CHECK + 1


def test_sizes_off_the_stride_end_the_exact_fit_and_stay_within_ten_percent(tmp_path):
    """At other sizes the strides make FLOPs a step function of the size: the quadratic fitted
    at multiples of 4 is off there (a few %, these sizes) until a spot check's count
    disagrees and ends it; from then on sizes are counted until the table is full, then get
    the least-squares quadratic's FLOPs if it is within 2 % of every count, else none. Every
    FLOP figure a step gets is within 10 % of FlopCounterMode's."""
    rng = random.Random(2)
    sizes = [96, 128, 104, 120, 112, 136] + [rng.randint(96, 160) for _ in range(120)]
    model, rt, flops = _train_conv(tmp_path, sizes)
    reference = [_reference(model, _conv_step, torch.randn(2, 3, s, s)) for s in sizes]
    assert all(f is None or abs(f / r - 1) < 0.10 for f, r in zip(flops, reference)), \
        [(s, f, r) for s, f, r in zip(sizes, flops, reference) if f is not None and abs(f / r - 1) >= 0.10]
    assert all(f is not None for f in flops[:DEFAULT_MAX_SHAPES])  # counted or fitted while the table had room
    families = [f for fs in rt.throughput.flops.fits._families.values() for f in fs]
    assert any(f.inexact for f in families)  # a spot check ended the exact fit
    assert any(f != r for f, r in zip(flops, reference) if f is not None)  # some steps' FLOPs were the fit's


def test_a_size_fitted_before_a_spot_check_disagreed_is_counted_when_it_comes_again(tmp_path):
    """The step side keeps each shape's FLOPs once final; FLOPs that came from a fit a count
    later disagreed with are dropped then, so a size seen again gets its own count."""
    sizes = [96, 104, 112, 120, 128, 136] + list(range(97, 111, 2)) + [97]
    model, rt, flops = _train_conv(tmp_path, sizes)
    first, again = sizes.index(97), len(sizes) - 1
    reference = _reference(model, _conv_step, torch.randn(2, 3, 97, 97))
    assert rt.throughput.flops.fits.ended == 1  # the 8th length the fit was asked for (109) was counted
    assert flops[first] != reference and abs(flops[first] / reference - 1) < 0.10  # the fit's, before
    assert flops[again] == reference  # counted, after


def test_a_memory_bank_that_grows_every_step_keeps_its_flops(tmp_path):
    """A step passed a 2-d tensor that grows by a row each step (a queue of past embeddings
    for a contrastive loss): every step a new shape. Its FLOPs are linear in the rows (a
    quadratic with no square term), so a fit covers it: every step's FLOPs, few counts."""
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), register_atexit=False, strict=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step_of(m, o):
        def train_step(x, bank):
            o.zero_grad()
            z = m(x)
            (z @ bank.T).logsumexp(dim=1).mean().backward()  # against every row of the bank
            o.step()
        return train_step

    step = tt.debug_operation(name="train_step", model=model, optimizer=opt)(step_of(model, opt))
    x, bank = torch.randn(8, 16), torch.randn(4, 16)
    banks = []
    for _ in range(60):
        step(x, bank)
        banks.append(bank)
        bank = torch.cat([bank, torch.randn(1, 16)])
    rt = get_runtime()
    flops = [r.get("flops") for r in rt.history.steps()[-60:]]
    reference = []
    for b in banks:
        twin = copy.deepcopy(model)
        with FlopCounterMode(display=False, custom_mapping=RULES) as counter:
            step_of(twin, torch.optim.SGD(twin.parameters(), lr=0.01))(x, b)
        reference.append(counter.get_total_flops())
    assert flops == reference
    assert rt.throughput.flops.counts <= FIT_POINTS + CONFIRM_POINTS + 60 // SPOT_CHECK + 1
