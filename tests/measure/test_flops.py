"""Step FLOPs against the matrix-product formula and an independent FlopCounterMode; the peak table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from tests.helpers import DifferentiatingModel
from torchtrace.measure import flops as flops_mod
from torchtrace.measure import peaks as peaks_mod
from torchtrace.measure.flops import KEY_MAX_ITEMS, LOOSE, StepFlops, count_flops, shape_key
from torchtrace.measure.peaks import ACCELERATORS, PRECISIONS, find_accelerator, peak_flops, precision_key
from torchtrace.measure.shape_keys import loose_shape_key

DOCS = Path(__file__).resolve().parents[2] / "docs" / "throughput.md"


def train_step(model, opt, x, y):
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss


# ---------------------------------------------------------------- counting


@pytest.mark.parametrize("m,k,n", [(8, 64, 32), (3, 5, 7), (128, 256, 512)])
def test_linear_layer_is_exactly_the_matrix_product_formula(m, k, n):
    layer = torch.nn.Linear(k, n)
    cache = StepFlops()
    x = torch.randn(m, k, requires_grad=True)
    with cache.counting("with-input-grad"):
        layer(x).sum().backward()
    # forward 2mkn; backward: input gradient 2mkn and weight gradient 2mkn
    assert cache.lookup("with-input-grad") == 3 * 2 * m * k * n
    with cache.counting("first-layer"):
        layer(x.detach()).sum().backward()
    # a first layer's input needs no gradient: forward + weight gradient only
    assert cache.lookup("first-layer") == 2 * 2 * m * k * n


def test_mlp_step_against_the_formula_summed_over_layers():
    widths = [32, 64, 64, 10]
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(a, b), torch.nn.ReLU())
                                  for a, b in zip(widths, widths[1:])])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = 16
    x, y = torch.randn(batch, widths[0]), torch.randn(batch, widths[-1])
    _, counted = count_flops(train_step, model, opt, x, y)
    products = [2 * batch * a * b for a, b in zip(widths, widths[1:])]
    expected = 3 * sum(products) - products[0]  # no input gradient for the first layer
    assert counted == expected  # the optimizer's element-wise math adds nothing


def test_transformer_step_within_ten_percent_of_an_independent_count():
    torch.manual_seed(0)
    model = torch.nn.TransformerEncoder(
        torch.nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128, batch_first=True), num_layers=2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(4, 24, 64), torch.randn(4, 24, 64)
    cache = StepFlops()
    key = shape_key((model, opt, x, y), {})
    with cache.counting(key):
        train_step(model, opt, x, y)
    # reference: FlopCounterMode run on its own around forward and backward only
    reference = FlopCounterMode(display=False)
    with reference:
        torch.nn.functional.mse_loss(model(x), y).backward()
    ref = reference.get_total_flops()
    assert ref > 0 and abs(cache.lookup(key) - ref) <= 0.10 * ref
    # and by hand: per layer, projections 2*B*T*(4d^2 + 2*d*ff) and attention 4*B*T^2*d forward;
    # backward twice that, less the first layer's input projection (its input needs no gradient)
    b, t, d, ff, layers = 4, 24, 64, 128, 2
    linear, attention, in_proj = 2 * b * t * (4 * d * d + 2 * d * ff), 4 * b * t * t * d, 2 * b * t * 3 * d * d
    by_hand = layers * 3 * (linear + attention) - in_proj
    assert cache.lookup(key) == by_hand


def _pinn_loss(x, w1, b1, w2, b2):
    """:class:`~tests.helpers.DifferentiatingModel`'s step without modules."""
    x = x.requires_grad_(True)
    u = torch.nn.functional.linear(torch.tanh(torch.nn.functional.linear(x, w1, b1)), w2, b2)
    du = torch.autograd.grad(u.sum(), x, create_graph=True)[0]
    return ((du - torch.cos(x)) ** 2).mean()


def test_a_model_that_differentiates_in_its_own_forward_is_counted():
    """FlopCounterMode's per-module tracker fails such a model ("A leaf node was passed to
    _will_engine_execute_node"), which raised out of the user's counted step. torchtrace's
    counter keeps the global total only: it runs, and counts what FlopCounterMode counts on a
    module-free twin of the same step (no modules: nothing for the tracker to hook)."""
    model, x = DifferentiatingModel(), torch.linspace(0, 3, 32).reshape(-1, 1)
    with pytest.raises(RuntimeError, match="_will_engine_execute_node"):
        with FlopCounterMode(display=False):
            model(x.clone()).backward()
    model.zero_grad()
    cache = StepFlops()
    with cache.counting("pinn"):
        model(x.clone()).backward()
    params = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    with FlopCounterMode(display=False) as reference:
        _pinn_loss(x.clone(), *params).backward()
    assert cache.lookup("pinn") == reference.get_total_flops() > 0


def test_counted_once_per_shape_key():
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cache = StepFlops()
    ran = []
    for batch in (4, 4, 16, 4, 16, 16, 4):
        x, y = torch.randn(batch, 8), torch.randn(batch, 4)
        key = shape_key((model, opt, x, y), {"step": len(ran)})
        if cache.needs_count(key):
            with cache.counting(key):
                train_step(model, opt, x, y)
        else:
            train_step(model, opt, x, y)
        ran.append(cache.lookup(key))
    assert cache.counts == 2 and len(cache) == 2
    assert ran == [2 * 2 * b * 8 * 4 for b in (4, 4, 16, 4, 16, 16, 4)]


def _run_counted(cache, name, fn, *args, **kwargs):
    """One step of ``name`` the way the step pipeline runs it: counted when its key needs it.
    Returns what the table says the step's FLOPs are."""
    key = (name, shape_key(args, kwargs))
    if cache.needs_count(key):
        with cache.counting(key):
            fn(*args, **kwargs)
    else:
        fn(*args, **kwargs)
    return cache.lookup(key)


@pytest.mark.parametrize("where", ["positional", "keyword"])
def test_a_list_the_step_appends_to_stops_deciding_the_key(where):
    """Past KEY_MAX_ITEMS items too (the key then holds the list's length)."""
    model = torch.nn.Linear(8, 4)
    cache = StepFlops()
    history: list = []

    def step(x, losses):
        losses.append(model(x).sum().detach())

    got = []
    for i in range(KEY_MAX_ITEMS + 8):
        x = torch.randn(4 if i % 3 else 16, 8)
        args = (x, history) if where == "positional" else (x,)
        got.append(_run_counted(cache, "train", step, *args, **({"losses": history} if where == "keyword" else {})))
    assert got == [2 * (4 if i % 3 else 16) * 8 * 4 for i in range(KEY_MAX_ITEMS + 8)]
    assert cache.counts <= 4 and cache.loose == {"train": frozenset({1})}


def test_a_loose_key_is_the_tables_key_without_looking_at_the_loose_arguments():
    class Untouchable:
        def __getattribute__(self, name):
            raise AssertionError("a loose argument was looked at")

    cache = StepFlops()
    cache.loose["train"] = frozenset({1, 3})
    x, mask = torch.zeros(4, 3), torch.ones(4, 3, dtype=torch.bool)
    args, kwargs = (x, [1.0] * 40, 7), {"history": [torch.zeros(2)] * 3, "mask": mask}
    full = cache.table_key(("train", shape_key(args, kwargs)))
    assert full[1] == loose_shape_key(args, kwargs, cache.loose["train"])
    assert full[1][1] is LOOSE and full[1][3] is LOOSE and full[1][4] == ("mask", (mask.shape, mask.dtype))
    assert loose_shape_key((x, Untouchable()), {"later": Untouchable()}, frozenset({1, 2}))[1:] == (LOOSE, LOOSE)


def test_tensors_of_other_shapes_with_the_same_flops_are_still_counted_apart():
    """A 64 x 32 image and a 32 x 64 one cost the same FLOPs; a 64 x 64 one costs twice that.
    Equal FLOPs from different tensor shapes say nothing about a third shape."""
    conv = torch.nn.Conv2d(3, 8, 3, padding=1)
    cache = StepFlops()
    got = [_run_counted(cache, "train", lambda x: conv(x).sum().backward(), torch.randn(1, 3, h, w))
           for h, w in ((64, 32), (32, 64), (64, 64))]
    assert got[0] == got[1] and got[2] == 2 * got[0]
    assert cache.counts == 3 and cache.loose == {}


def test_lists_that_differ_in_their_items_are_not_a_list_that_grew():
    """A batch given as a list of images: a different list, not a longer one."""
    conv = torch.nn.Conv2d(3, 8, 3, padding=1)
    cache = StepFlops()

    def step(images):
        for image in images:
            conv(image).sum().backward()

    batches = [[torch.randn(1, 3, 32, 64)], [torch.randn(1, 3, 64, 32)], [torch.randn(1, 3, 64, 32)] * 2]
    got = [_run_counted(cache, "train", step, batch) for batch in batches]
    assert got[0] == got[1] and got[2] == 2 * got[0] and cache.loose == {}


def test_a_second_growing_argument_is_learnt_against_a_count_from_before_the_first():
    """The only count with the same FLOPs was made before argument 1 was known to be loose:
    it holds argument 1 as it was then, which says nothing about argument 2."""
    x = torch.ones(1, 5)
    cache = StepFlops()
    cache.record(("train", shape_key((x, [1.0], []), {})), 100)  # counted while argument 1 still counted
    cache.loose["train"] = frozenset({1})
    key = ("train", shape_key((x, [1.0, 2.0], [1.0]), {}))
    with cache.counting(key):
        torch.mm(x, torch.ones(5, 10))  # 2 * 1 * 5 * 10 = 100 FLOPs
    assert cache.loose == {"train": frozenset({1, 2})}


def test_a_1d_tensor_the_step_grows_stops_deciding_the_key():
    """``losses = torch.cat([losses, loss[None]])`` passed back in every step."""
    model = torch.nn.Linear(8, 4)
    cache = StepFlops()
    losses = torch.zeros(0)
    got = []
    for i in range(40):
        rows = 4 if i % 2 else 16
        got.append(_run_counted(cache, "train", lambda x, h: model(x).sum().backward(), torch.randn(rows, 8), losses))
        losses = torch.cat([losses, torch.ones(1)])
    assert got == [2 * 2 * (4 if i % 2 else 16) * 8 * 4 for i in range(40)]
    assert cache.counts <= 4 and cache.loose == {"train": frozenset({1})}


def test_a_batch_mapping_that_gains_a_field_is_not_a_list_that_grew():
    """Labels next to the inputs cost no counted FLOPs; the inputs' shapes still decide them."""
    linear = torch.nn.Linear(8, 4)
    cache = StepFlops()

    def step(batch):
        linear(batch["inputs"]).sum().backward()

    batches = [{"inputs": torch.randn(4, 8)}, {"inputs": torch.randn(4, 8), "labels": torch.zeros(4)},
               {"inputs": torch.randn(16, 8), "labels": torch.zeros(16)}]
    got = [_run_counted(cache, "train", step, batch) for batch in batches]
    assert got == [2 * 2 * 4 * 8 * 4, 2 * 2 * 4 * 8 * 4, 2 * 2 * 16 * 8 * 4] and cache.loose == {}


def test_a_step_that_raises_records_nothing():
    cache = StepFlops()
    with pytest.raises(ZeroDivisionError):
        with cache.counting("k"):
            torch.mm(torch.ones(2, 2), torch.ones(2, 2))
            1 / 0
    assert cache.lookup("k") is None and cache.needs_count("k") and cache.counts == 0


def test_the_count_notes_the_dtype_most_flops_ran_in():
    """The precision a step's products ran at is what its operands were: bfloat16 inside an
    autocast region, float32 outside. Mixed, the larger share of FLOPs (by the matrix-product
    formula, 2*m*k*n) decides."""
    small, large = torch.nn.Linear(8, 8, bias=False), torch.nn.Linear(64, 64, bias=False)
    cache = StepFlops()
    with cache.counting("mixed"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            inside = small(torch.randn(4, 8))
        outside = large(torch.randn(4, 64))
    assert (inside.dtype, outside.dtype) == (torch.bfloat16, torch.float32)
    assert cache.lookup("mixed") == 2 * 4 * 8 * 8 + 2 * 4 * 64 * 64
    assert cache.compute_dtype("mixed") == torch.float32  # 32768 FLOPs in float32, 512 in bfloat16
    with cache.counting("amp"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            large(torch.randn(4, 64))
        small(torch.randn(4, 8))
    assert cache.compute_dtype("amp") == torch.bfloat16
    assert cache.compute_dtype("never counted") is None


def test_room_for_a_bounded_number_of_shapes():
    cache = StepFlops(max_shapes=2)
    cache.record("a", 1)
    cache.record("b", 2)
    cache.record("c", 3)
    assert (cache.lookup("c"), cache.needs_count("c"), len(cache)) == (None, False, 2)
    cache.record("a", 10)  # a known key can be updated (user-supplied FLOPs)
    assert cache.lookup("a") == 10
    with pytest.raises(ValueError, match="max_shapes"):
        StepFlops(max_shapes=0)


def test_shape_key_reads_shapes_and_dtypes_not_values():
    model = torch.nn.Linear(3, 3)
    a = shape_key((model, torch.zeros(4, 3), 1), {"batch": {"ids": torch.zeros(4, 7, dtype=torch.long)}})
    b = shape_key((model, torch.ones(4, 3), 2), {"batch": {"ids": torch.ones(4, 7, dtype=torch.long)}})
    assert a == b and hash(a) == hash(b)
    assert a != shape_key((model, torch.zeros(5, 3), 1), {"batch": {"ids": torch.zeros(4, 7, dtype=torch.long)}})
    assert a != shape_key((model, torch.zeros(4, 3), 1), {"batch": {"ids": torch.zeros(4, 8, dtype=torch.long)}})
    assert a != shape_key((model, torch.zeros(4, 3, dtype=torch.float64), 1),
                          {"batch": {"ids": torch.zeros(4, 7, dtype=torch.long)}})
    assert shape_key((), {}) == ()
    assert len(shape_key(tuple(range(100)), {})) == flops_mod.KEY_MAX_ITEMS


def test_shape_key_reads_numpy_arrays_shapes_and_dtypes():
    import numpy as np

    def key(*args):
        return shape_key(args, {})
    assert key(np.zeros((8, 3), np.float32)) == key(np.ones((8, 3), np.float32))
    assert key(np.zeros((8, 3), np.float32)) != key(np.zeros((3, 3), np.float32))
    assert key(np.zeros((8, 3), np.float32)) != key(np.zeros((8, 3), np.float64))
    assert key((np.zeros((8, 3)), np.zeros(8))) != key((np.zeros((2, 3)), np.zeros(2)))


@pytest.mark.parametrize("nest", [lambda items: items, lambda items: (items,), lambda items: {"images": items}])
def test_shape_key_of_a_long_sequence_holds_its_length(nest):
    """Past KEY_MAX_ITEMS items the key holds the sequence's length: lists of 64 and of 40
    same-shape tensors differ (the same 32 first items), lists of equal length do not."""
    n = flops_mod.KEY_MAX_ITEMS
    def key(length):
        return shape_key((nest([torch.zeros(3) for _ in range(length)]),), {})
    assert key(2 * n) != key(n + 8) != key(n + 1)
    assert key(2 * n) == key(2 * n) and key(n) != key(n + 1)


# ---------------------------------------------------------------- peaks

NAMES = [  # as torch.cuda.get_device_name reports them -> (product, dense bf16 TFLOP/s)
    ("NVIDIA A100-SXM4-80GB", "A100 SXM", 312),
    ("NVIDIA A100-SXM4-40GB", "A100 SXM", 312),
    ("NVIDIA A100-PCIE-40GB", "A100 PCIe", 312),
    ("NVIDIA A100 80GB PCIe", "A100 PCIe", 312),
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.5),
    ("NVIDIA H100 PCIe", "H100 PCIe", 756.5),
    ("NVIDIA H100 NVL", "H100 NVL", 835.5),
    ("NVIDIA H200", "H200 SXM", 989.5),
    ("NVIDIA B200", "B200", 2250),
    ("NVIDIA GB200", "GB200", 2500),
    ("NVIDIA H200 NVL", "H200 NVL", 835.5),
    ("NVIDIA GH200 480GB", "GH200", 989.5),
    ("NVIDIA L4", "L4", 121),
    ("NVIDIA L40S", "L40S", 362.05),
    ("NVIDIA A10G", "A10G", 70),
    ("NVIDIA A10", "A10", 125),
    ("Tesla V100-SXM2-16GB", "V100 SXM2", None),
    ("Tesla V100-PCIE-32GB", "V100 PCIe", None),
    ("Tesla V100S-PCIE-32GB", "V100S PCIe", None),
    ("Tesla T4", "T4", None),
    ("NVIDIA GeForce RTX 4090", "RTX 4090", 165.2),
    ("AMD Instinct MI300X", "MI300X", 1307.4),
    ("AMD Instinct MI250X/MI250", "MI250X", 383),
]


@pytest.mark.parametrize("name,product,bf16", NAMES)
def test_device_names_find_their_row(name, product, bf16):
    assert find_accelerator(name).product == product
    value = peak_flops(name, torch.bfloat16)
    if bf16 is None:
        assert value is None  # no bf16 tensor cores: emulated, no peak
    else:
        assert value == pytest.approx(bf16 * 1e12)


@pytest.mark.parametrize("name", ["NVIDIA GeForce RTX 4090 Laptop GPU", "NVIDIA GeForce RTX 4090 D", "NVIDIA RTX A6000",
                                  "NVIDIA A100-SXM4-40GB MIG 1g.5gb", "Intel(R) Xeon(R)", ""])
def test_unknown_devices_have_no_peak(name):
    assert peak_flops(name, torch.bfloat16) is None


def test_every_row_is_ordered_like_the_hardware():
    """fp32 <= tf32 <= fp16 and bf16 == fp16 where both exist: catches a digit typed in the wrong column."""
    for row in ACCELERATORS:
        f = row.flops
        assert set(f) <= set(PRECISIONS) and {"fp32", "tf32", "fp16"} <= set(f), row.product
        assert f["fp32"] <= f["tf32"] <= f["fp16"], row.product
        assert f.get("bf16", f["fp16"]) == f["fp16"], row.product
        assert 1e12 < f["fp32"] < 1e15 and row.source, row.product


def test_dtype_selects_the_precision():
    assert peak_flops("NVIDIA H100 80GB HBM3", "tf32") == pytest.approx(494.5e12)
    assert peak_flops("NVIDIA H100 80GB HBM3", "fp32") == pytest.approx(67e12)
    assert peak_flops("NVIDIA H100 80GB HBM3", torch.float16) == pytest.approx(989.5e12)
    assert peak_flops("NVIDIA H100 80GB HBM3", torch.float64) is None
    assert peak_flops("Tesla V100-SXM2-16GB", "tf32") == peak_flops("Tesla V100-SXM2-16GB", "fp32") == 15.7e12
    assert precision_key(torch.float32, tf32=True) == "tf32" and precision_key(torch.float32, tf32=False) == "fp32"
    assert precision_key("bfloat16") == "bf16" and precision_key("int8") is None


def test_float32_follows_torch_tf32_switch():
    """``fp32_precision`` where this torch has it (2.11 has, 2.6 has not), else ``allow_tf32``."""
    matmul = torch.backends.cuda.matmul
    try:
        name, on, off = "fp32_precision", "tf32", "ieee"
        before = matmul.fp32_precision
    except AttributeError:
        name, on, off = "allow_tf32", True, False
        before = matmul.allow_tf32
    try:
        setattr(matmul, name, on)
        assert precision_key(torch.float32) == "tf32"
        assert peak_flops("NVIDIA A100-SXM4-80GB", torch.float32) == pytest.approx(156e12)
        setattr(matmul, name, off)
        assert precision_key(torch.float32) == "fp32"
        assert peak_flops("NVIDIA A100-SXM4-80GB", torch.float32) == pytest.approx(19.5e12)
    finally:
        setattr(matmul, name, before)


def test_cpu_has_no_peak_unless_overridden():
    for device in ("cpu", torch.device("cpu"), "meta"):
        assert peak_flops(device, torch.float32) is None
        assert peak_flops(device, torch.float32, override=3.5e12) == 3.5e12
    assert peak_flops("NVIDIA H100 80GB HBM3", torch.bfloat16, override=1e15) == 1e15
    if not torch.cuda.is_available():
        assert peak_flops("cuda:0", torch.bfloat16) is None and peak_flops(0, torch.bfloat16) is None


def test_docs_list_every_row_with_its_numbers_and_source():
    text = DOCS.read_text(encoding="utf-8")
    for row in ACCELERATORS:
        line = next((l for l in text.splitlines() if l.startswith(f"| {row.product} |")), None)
        assert line is not None, f"docs/throughput.md has no table row for {row.product}"
        numbers = [float(x) for x in re.findall(r"\d+(?:\.\d+)?", line.split("|", 2)[2])]
        for precision in PRECISIONS:
            if precision in row.flops:
                value = row.flops[precision] / 1e12
                assert any(abs(n - value) < 1e-6 for n in numbers), (row.product, precision, line)


@pytest.mark.parametrize("module", ["torchtrace.measure.flops", "torchtrace.measure.shape_keys", "torchtrace.measure.peaks",
                                    "torchtrace.measure.batch"])
def test_docstring_examples_run(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted > 0 and result.failed == 0


def test_the_peak_is_looked_up_in_the_autocasts_dtype():
    """An autocast open around the step picks the peak's precision; without one, the weights'."""
    model, cache = torch.nn.Linear(4, 4), {}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        peaks_mod.model_peak(model, None, cache)
    peaks_mod.model_peak(model, None, cache)
    assert sorted(cache) == ["cpu/torch.bfloat16", "cpu/torch.float32"]
