"""``clip_grad_norm_`` inside a step gives torch's own results bit for bit: the returned total
norm and the clipped gradients, against torch's unwrapped function on a twin with the same
gradients. Where the norms are reused, the step reads the gradients once (the counter of
``test_clipping_bytes``); the listed fallbacks run torch's whole function."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import torchtrace as tt
from tests.step.test_clipping_bytes import GradientReads

# torch's function itself, under the wrapper (functools.wraps keeps it as __wrapped__).
TORCH_CLIP = torch.nn.utils.clip_grad_norm_.__wrapped__ if hasattr(torch.nn.utils.clip_grad_norm_, "__wrapped__") \
    else torch.nn.utils.clip_grad_norm_

# The grid runs on a GPU too where one is present (not yet run on one: see docs/performance.md).
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
SHAPES = [(7, 3), (64,), (33, 17), (5,), (128, 9), (1,), (300,)]


def _params(dtypes: list[torch.dtype], seed: int, scale: float, poison: str | None = None,
            device: str = "cpu") -> list[torch.nn.Parameter]:
    """Parameters with random gradients of ``dtypes`` (cycled), magnitudes up to ``scale``."""
    gen = torch.Generator().manual_seed(seed)
    params = []
    for i, shape in enumerate(SHAPES):
        dtype = dtypes[i % len(dtypes)]
        p = torch.nn.Parameter(torch.randn(shape, generator=gen).to(device, dtype))
        p.grad = (torch.randn(shape, generator=gen) * scale * float(torch.rand(1, generator=gen))).to(device, dtype)
        params.append(p)
    if poison is not None:
        params[2].grad.view(-1)[5] = float(poison)
    return params


def _twin(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    twins = []
    for p in params:
        t = torch.nn.Parameter(p.detach().clone())
        t.grad = p.grad.clone()
        twins.append(t)
    return twins


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1).view(torch.uint8) if a.numel() else a,
                                                                   b.view(-1).view(torch.uint8) if b.numel() else b)


def _clip_in_step(params, clip_kwargs, optimizer=True):
    """Clip inside a torchtrace step: (returned norm, gradient bytes read / gradient bytes)."""
    opt = torch.optim.SGD(params, lr=0.0) if optimizer else None
    model = torch.nn.Module()
    for i, p in enumerate(params):
        model.register_parameter(f"p{i}", p)
    grads = [p.grad for p in params]
    counter = GradientReads(grads)
    with tt.debug_context("train_step", model=model, optimizer=opt):
        with counter:
            got = torch.nn.utils.clip_grad_norm_(params, **clip_kwargs)
    total = sum(g.numel() * g.element_size() for g in grads)
    return got, counter.read / total


DTYPES = {
    "f32": [torch.float32],
    "f64": [torch.float64],
    "bf16": [torch.bfloat16],
    "f16": [torch.float16],
    "bf16+f32": [torch.bfloat16, torch.float32],
    "f16+f64+bf16": [torch.float16, torch.float64, torch.bfloat16],
}


@pytest.mark.parametrize("foreach", [None, True, False])
@pytest.mark.parametrize("max_norm", [1e-3, 0.7, 5.0, 1e6])
@pytest.mark.parametrize("dtypes", sorted(DTYPES))
@pytest.mark.parametrize("device", DEVICES)
def test_total_norm_and_clipped_gradients_are_torchs_bit_for_bit(tt_runtime, device, dtypes, max_norm, foreach):
    for seed in range(3):
        params = _params(DTYPES[dtypes], seed, scale=10.0 ** seed, device=device)
        twins = _twin(params)
        want = TORCH_CLIP(twins, max_norm, foreach=foreach)
        got, read = _clip_in_step(params, {"max_norm": max_norm, "foreach": foreach})
        assert _same_bits(got, want), (got, want)
        for p, t in zip(params, twins):
            assert _same_bits(p.grad, t.grad)
        # The norms were reused: one pass, torchtrace's (torch's whole function for
        # foreach=False off the CPU).
        assert read == (2.0 if foreach is False and device != "cpu" else 1.0)


def test_the_cases_checked_clip_and_do_not_clip(tt_runtime):
    """The grid above has max_norms that clip and ones that leave the gradients alone."""
    params = _params([torch.float32], 0, scale=1.0)
    norm = float(TORCH_CLIP(_twin(params), 1e6))
    assert 1e-3 < norm < 1e6


@pytest.mark.parametrize("poison", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("dtypes", ["f32", "bf16", "f16"])
def test_non_finite_gradients_give_torchs_result(tt_runtime, poison, dtypes):
    params = _params(DTYPES[dtypes], 1, scale=1.0, poison=poison)
    twins = _twin(params)
    want = TORCH_CLIP(twins, 1.0)
    got, _read = _clip_in_step(params, {"max_norm": 1.0})
    assert _same_bits(got, want)
    for p, t in zip(params, twins):
        assert torch.equal(p.grad.isnan(), t.grad.isnan())
        assert _same_bits(torch.nan_to_num(p.grad), torch.nan_to_num(t.grad))


def test_an_fp16_norm_that_overflows_is_torchs_inf(tt_runtime):
    """A finite fp16 gradient whose norm exceeds fp16's range: torch's norm is inf."""
    params = _params([torch.float16], 0, scale=1.0)
    params[1].grad.fill_(60000.0)
    twins = _twin(params)
    want = TORCH_CLIP(twins, 1.0)
    got, _read = _clip_in_step(params, {"max_norm": 1.0})
    assert math.isinf(float(want))
    assert _same_bits(got, want)
    for p, t in zip(params, twins):
        assert _same_bits(p.grad, t.grad)


@pytest.mark.parametrize("poison", [None, "nan", "inf"])
def test_error_if_nonfinite_raises_as_torch_does(tt_runtime, poison):
    params = _params([torch.float32], 2, scale=1.0, poison=poison)
    twins = _twin(params)
    try:
        want, want_error = TORCH_CLIP(twins, 0.5, error_if_nonfinite=True), None
    except RuntimeError as exc:
        want, want_error = None, exc
    try:
        got, _read = _clip_in_step(params, {"max_norm": 0.5, "error_if_nonfinite": True})
        got_error = None
    except RuntimeError as exc:
        got, got_error = None, exc
    assert (want_error is None) == (got_error is None) == (poison is None)
    if want_error is not None:
        assert str(got_error) == str(want_error)
    else:
        assert _same_bits(got, want)
    for p, t in zip(params, twins):  # raised before clipping: the gradients are untouched
        assert torch.equal(p.grad.nan_to_num(), t.grad.nan_to_num())


@pytest.mark.parametrize("norm_type", [1.0, 3.0, math.inf, 2])
def test_other_norm_types_fall_back_to_torch(tt_runtime, norm_type):
    params = _params([torch.float32], 3, scale=1.0)
    twins = _twin(params)
    want = TORCH_CLIP(twins, 0.5, norm_type=norm_type)
    got, read = _clip_in_step(params, {"max_norm": 0.5, "norm_type": norm_type})
    assert _same_bits(got, want)
    for p, t in zip(params, twins):
        assert _same_bits(p.grad, t.grad)
    assert read == (1.0 if norm_type == 2 else 2.0)  # the fallback reads the gradients again


def test_a_subset_a_generator_and_a_single_tensor_reuse_the_norms(tt_runtime):
    for pick in (lambda ps: ps[2:5], lambda ps: ps[::-2], lambda ps: iter(ps[1:]), lambda ps: ps[3]):
        params = _params([torch.float32, torch.bfloat16], 4, scale=3.0)
        twins = _twin(params)
        want = TORCH_CLIP(pick(twins), 0.2)
        opt = torch.optim.SGD(params, lr=0.0)
        with tt.debug_context("train_step", optimizer=opt):
            got = torch.nn.utils.clip_grad_norm_(pick(params), 0.2)
        assert _same_bits(got, want)
        for p, t in zip(params, twins):
            assert _same_bits(p.grad, t.grad)


def test_an_empty_generator_warns_as_torch_does(tt_runtime):
    """torch 2.13 warns that an empty generator clips nothing; 2.6 does not: the same here."""
    with warnings.catch_warnings(record=True) as torchs:
        warnings.simplefilter("always")
        want = TORCH_CLIP((p for p in []), 1.0)
    params = _params([torch.float32], 5, scale=1.0)
    opt = torch.optim.SGD(params, lr=0.0)
    with tt.debug_context("train_step", optimizer=opt):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = torch.nn.utils.clip_grad_norm_((p for p in []), 1.0)
    assert float(got) == float(want) == 0.0
    assert [str(w.message) for w in caught] == [str(w.message) for w in torchs]
    if torch.__version__ >= "2.13":
        assert any("empty generator" in str(w.message) for w in caught)


def test_the_deprecated_clip_grad_norm_reuses_the_norms_too(tt_runtime):
    params = _params([torch.float32], 6, scale=2.0)
    twins = _twin(params)
    want = TORCH_CLIP(twins, 0.3)
    grads = [p.grad for p in params]
    counter = GradientReads(grads)
    with tt.debug_context("train_step", optimizer=torch.optim.SGD(params, lr=0.0)):
        with counter, warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            got = torch.nn.utils.clip_grad_norm(params, 0.3)
    assert _same_bits(got, want)
    assert counter.read == sum(g.numel() * g.element_size() for g in grads)


def test_a_second_clip_in_the_step_uses_torchs_function(tt_runtime):
    """The second call cannot know its gradients are unchanged since the first: torch's pass."""
    params = _params([torch.float32], 7, scale=2.0)
    twins = _twin(params)
    want = [TORCH_CLIP(twins[:3], 0.1), TORCH_CLIP(twins[3:], 0.1)]
    with tt.debug_context("train_step", optimizer=torch.optim.SGD(params, lr=0.0)):
        got = [torch.nn.utils.clip_grad_norm_(params[:3], 0.1), torch.nn.utils.clip_grad_norm_(params[3:], 0.1)]
    assert all(_same_bits(g, w) for g, w in zip(got, want))
    for p, t in zip(params, twins):
        assert _same_bits(p.grad, t.grad)


@pytest.mark.parametrize("poison", [None, "nan"])
def test_under_guard_skip_the_clip_returns_torchs_norm(tmp_path, poison):
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), strict=True, register_atexit=False, guard="skip")
    try:
        params = _params([torch.float32, torch.bfloat16], 8, scale=2.0, poison=poison)
        twins = _twin(params)
        want = TORCH_CLIP(twins, 0.4)
        got, read = _clip_in_step(params, {"max_norm": 0.4})
        assert _same_bits(got, want) or (poison and math.isnan(float(got)) and math.isnan(float(want)))
        if poison is None:
            assert read == 1.0
            for p, t in zip(params, twins):
                assert _same_bits(p.grad, t.grad)
        else:  # skipped: the gradients are zeroed after the clip (guard semantics)
            assert all(not p.grad.any() for p in params)
    finally:
        tt.shutdown()


def test_dtensor_gradients_fall_back_to_torchs_function(tmp_path, monkeypatch):
    """FSDP2-style DTensor gradients (a one-rank mesh): torchtrace measures their local shards,
    not the gradients the clip is given, so the clip is torch's own: the same results."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from torchtrace.measure import clip_norm

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    tt.configure(prometheus_port="off", run_dir=str(tmp_path / "runs"), strict=True, register_atexit=False)
    try:
        mesh = init_device_mesh("cpu", (1,))
        gen = torch.Generator().manual_seed(9)
        plain = [torch.randn(6, 3, generator=gen) for _ in range(3)]

        def dtensor_params():
            params = []
            for g in plain:
                p = torch.nn.Parameter(distribute_tensor(torch.zeros(6, 3), mesh, [Shard(0)]))
                p.grad = distribute_tensor(g.clone(), mesh, [Shard(0)])
                params.append(p)
            return params

        params, twins = dtensor_params(), dtensor_params()
        want = TORCH_CLIP(twins, 0.1)
        reused = []
        real_total_norm = clip_norm.total_norm

        def spy(*args, **kwargs):
            result = real_total_norm(*args, **kwargs)
            reused.append(result is not None)
            return result

        monkeypatch.setattr(clip_norm, "total_norm", spy)
        with tt.debug_context("train_step", optimizer=torch.optim.SGD(params, lr=0.0)):
            got = torch.nn.utils.clip_grad_norm_(params, 0.1)
        assert reused == [False]
        assert torch.equal(got.full_tensor(), want.full_tensor())
        for p, t in zip(params, twins):
            assert torch.equal(p.grad.full_tensor(), t.grad.full_tensor())
    finally:
        tt.shutdown()
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph")
def test_gradients_of_a_create_graph_backward_give_a_norm_without_a_graph(tt_runtime):
    torch.manual_seed(10)
    model = torch.nn.Linear(6, 3)
    twin = torch.nn.Linear(6, 3)
    twin.load_state_dict(model.state_dict())
    x = torch.randn(4, 6)
    twin(x).pow(2).sum().backward(create_graph=True)
    want = TORCH_CLIP(twin.parameters(), 0.01)
    with tt.debug_context("train_step", model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0)):
        model(x).pow(2).sum().backward(create_graph=True)
        got = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    assert got.grad_fn is None and not got.requires_grad
    assert _same_bits(got, want)
    for p, t in zip(model.parameters(), twin.parameters()):
        assert _same_bits(p.grad.detach(), t.grad.detach())
        p.grad = t.grad = None  # breaks the parameter-gradient cycle create_graph makes
