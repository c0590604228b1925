"""The hot-path shortcuts give the same numbers as the slow ways (float64 references)."""

from __future__ import annotations

import math
import os

import psutil
import pytest
import torch

from torchtrace.measure import gradients, memory


def _refs(tensors):
    refs = []
    for i, g in enumerate(tensors):
        p = torch.nn.Parameter(torch.zeros(g.shape, dtype=g.dtype))
        p.grad = g
        refs.append(gradients.ParamRef(f"p{i}", p))
    return refs


def _ref_norm(g):
    return math.sqrt(sum(float(v) ** 2 for v in g.detach().double().reshape(-1).tolist()))


@pytest.mark.parametrize("dtypes", [
    [torch.float32] * 5,
    [torch.float32, torch.float64, torch.float32, torch.float16, torch.float64],
    [torch.bfloat16, torch.float32],
])
def test_gradient_norms_match_float64_reference(dtypes):
    torch.manual_seed(1)
    grads = [(torch.randn(7, i + 2) * (i + 1)).to(dt) for i, dt in enumerate(dtypes)]
    stats = gradients.gradient_norms(_refs(grads))
    by_name = dict(zip(stats.names, stats.norms.double().tolist()))
    assert sorted(by_name) == [f"p{i}" for i in range(len(grads))]
    for i, g in enumerate(grads):
        assert by_name[f"p{i}"] == pytest.approx(_ref_norm(g), rel=1e-5), (i, g.dtype)
    total = math.sqrt(sum(_ref_norm(g) ** 2 for g in grads))
    assert stats.total.dtype == torch.float64
    assert float(stats.total) == pytest.approx(total, rel=1e-5)
    want = torch.float64 if torch.float64 in dtypes else torch.float32
    assert stats.norms.dtype == want
    # grads follow names (used on the overflow path)
    for name, g in zip(stats.names, stats.grads):
        assert g is grads[int(name[1:])]


def test_nonfinite_and_sparse_still_handled():
    g_nan = torch.tensor([1.0, float("nan")])
    g_inf = torch.tensor([float("inf"), 1.0])
    sparse = torch.sparse_coo_tensor([[0, 3]], [3.0, 4.0], (5,))
    stats = gradients.gradient_norms(_refs([g_nan, g_inf, sparse]))
    norms = dict(zip(stats.names, stats.norms.tolist()))
    assert math.isnan(norms["p0"]) and math.isinf(norms["p1"]) and norms["p2"] == pytest.approx(5.0)


def test_statm_rss_agrees_with_psutil():
    fast = memory.rss_bytes()
    slow = psutil.Process(os.getpid()).memory_info().rss
    assert abs(fast - slow) <= 4 * 1024 * 1024, (fast, slow)
    assert memory.sample(cuda=False).rss > 0


@pytest.mark.parametrize("dtypes", [[torch.float32] * 4, [torch.float32, torch.float64, torch.float16]])
def test_parameter_norms_match_float64_reference(dtypes):
    torch.manual_seed(2)
    params = [(torch.randn(3, i + 2) * (i + 1)).to(dt) for i, dt in enumerate(dtypes)]
    refs = [gradients.ParamRef(f"w{i}", torch.nn.Parameter(p)) for i, p in enumerate(params)]
    norms = gradients.parameter_norms(refs)
    assert norms.dtype == torch.float64
    for got, p in zip(norms.tolist(), params):
        assert got == pytest.approx(_ref_norm(p), rel=1e-5)


def test_update_norms_match_float64_reference_for_mixed_dtypes():
    torch.manual_seed(3)
    dtypes = [torch.float32, torch.float64, torch.bfloat16]
    refs = [gradients.ParamRef(f"w{i}", torch.nn.Parameter(torch.randn(4, i + 3).to(dt))) for i, dt in enumerate(dtypes)]
    before = gradients.snapshot_parameters(refs)
    start = [r.param.detach().double().clone() for r in refs]
    with torch.no_grad():
        for i, r in enumerate(refs):
            r.param.add_(torch.randn_like(r.param) * (i + 1) * 0.1)
    got = gradients.update_norms(refs, before)
    assert got.dtype == torch.float64
    for g, r, s in zip(got.tolist(), refs, start):
        assert g == pytest.approx(float((r.param.detach().double() - s).norm()), rel=1e-2 if r.param.dtype == torch.bfloat16 else 1e-6)


def test_the_cuda_counters_are_torchs_own_from_one_read(monkeypatch):
    """A step's CUDA memory comes from one read of the allocator's statistics; torch's
    memory_allocated, memory_reserved and max_memory_allocated each flatten all of them (548 us
    a step for the three on an H200 machine). The numbers are the ones those functions give,
    here from a stand-in allocator's statistics shaped like torch's."""
    def side(n):
        return {"current": n, "peak": 3 * n, "allocated": 5 * n, "freed": 4 * n}

    stats = {"allocated_bytes": {"all": side(1000), "small_pool": side(200), "large_pool": side(800)},
             "reserved_bytes": {"all": side(4096), "small_pool": side(2048), "large_pool": side(2048)},
             "active_bytes": {"all": side(900)}, "num_alloc_retries": 0, "num_ooms": 0}
    reads = []

    def nested(device=None):
        reads.append(device)
        return stats

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", nested)
    monkeypatch.setattr(torch.cuda.memory, "memory_stats_as_nested_dict", nested)
    sample = memory.sample(cuda=True)
    assert len(reads) == 1
    reference = (torch.cuda.memory_allocated(0), torch.cuda.memory_reserved(0), torch.cuda.max_memory_allocated(0))
    assert len(reads) == 4 and reference == (1000, 4096, 3000)  # torch's own functions, one flattening each
    assert (sample.cuda_allocated, sample.cuda_reserved, sample.cuda_peak_allocated) == reference
    assert sample.device == "cuda:0" and sample.rss > 0
