"""The seeds' checks, each one host read over the core measures (measure/, record/readout).

Used by every seed-facing class; nothing here logs or records: callers decide what an event is.

>>> import torch
>>> m = torch.nn.Linear(3, 1); m(torch.ones(2, 3)).sum().backward()
>>> r = gradient_report(m, explosion=1e3, vanishing=1e-7)
>>> r.global_norm > 0, r.anomalies
(True, [])
"""

from __future__ import annotations

import math
from typing import Any

import torch

from torchtrace import semconv
from torchtrace.compat.results import GradientReport, ParameterAnalysis, Result, tensor_info
from torchtrace.measure import gradients as grad_measure
from torchtrace.measure import tensors as tensor_measure
from torchtrace.record import readout

_W = len(tensor_measure.STAT_NAMES)


def _dense(g: torch.Tensor) -> torch.Tensor:
    return g.to_dense() if g.is_sparse else g


def _read(stacked: torch.Tensor) -> list[float]:
    flat = stacked.reshape(-1)
    return readout.read(flat.cpu() if flat.device.type != "cpu" else flat)


def gradient_table(model: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """Parameter name -> gradient statistics (over finite values), counts and float64 L2 norm."""
    refs = [r for r in grad_measure.named_params(model) if r.param.grad is not None]
    if not refs:
        return {}
    dev = refs[0].param.grad.device
    rows = torch.stack([
        torch.cat([tensor_measure.tensor_stats(r.param.grad),
                   torch.linalg.vector_norm(_dense(r.param.grad).to(torch.float64)).reshape(1)]).to(dev)
        for r in refs])
    values = _read(rows)
    out = {}
    for i, r in enumerate(refs):
        row = values[i * (_W + 1):(i + 1) * (_W + 1)]
        s: dict[str, Any] = dict(zip(tensor_measure.STAT_NAMES, row[:-1]))
        s["nan_count"] = int(s["nan_count"])
        s["inf_count"] = int(s["inf_count"])
        s["norm"] = row[-1]
        out[r.name] = s
    return out


def _total(norms: list[float]) -> float | None:
    if not norms:
        return None
    if any(math.isnan(n) for n in norms):
        return float("nan")
    if any(math.isinf(n) for n in norms):
        return float("inf")
    return math.sqrt(math.fsum(n * n for n in norms))


def gradient_report(model: torch.nn.Module, explosion: float, vanishing: float) -> GradientReport:
    """Global norm, per-parameter statistics and anomalies of ``model``'s current gradients.

    Rules (one per anomaly, never two for one cause): a NaN/Inf gradient is ``nonfinite_grad``
    (never an explosion); a finite global norm above ``explosion`` is ``grad_explosion`` with
    the tensors above it named; a finite global norm below ``vanishing`` is
    ``grad_vanishing``, and tensors below it are named in ``vanished_params`` either way.
    """
    stats = gradient_table(model)
    total = _total([s["norm"] for s in stats.values()])
    nan_p = [n for n, s in stats.items() if s["nan_count"]]
    inf_p = [n for n, s in stats.items() if s["inf_count"]]
    nonfinite = [n for n, s in stats.items() if s["nan_count"] or s["inf_count"] or not math.isfinite(s["norm"])]
    finite = total is not None and math.isfinite(total)
    exploded = [n for n, s in stats.items() if math.isfinite(s["norm"]) and s["norm"] > explosion]
    vanished = [n for n, s in stats.items() if s["norm"] < vanishing]
    anomalies: list[dict[str, Any]] = []
    sentences: list[str] = []
    if nonfinite:
        anomalies.append({"kind": semconv.NONFINITE_GRAD, "params": nonfinite, "nan": nan_p, "inf": inf_p})
        sentences += [f"NaN gradient in {n}" for n in nan_p]
        sentences += [f"Inf gradient in {n}" for n in inf_p]
        sentences += [f"non-finite gradient norm in {n}" for n in nonfinite if n not in nan_p and n not in inf_p]
    if finite and total > explosion:
        anomalies.append({"kind": semconv.GRAD_EXPLOSION, "grad_norm": total, "threshold": explosion,
                          "params": exploded})
        sentences.append(f"gradient explosion: norm {total:.6g} over {explosion:.6g}")
    if finite and total < vanishing:
        anomalies.append({"kind": semconv.GRAD_VANISHING, "grad_norm": total, "threshold": vanishing,
                          "params": vanished})
        sentences.append(f"gradient vanishing: norm {total:.6g} under {vanishing:.6g}")
    return GradientReport(global_norm=total, gradient_norm=total, param_stats=stats, parameter_stats=stats,
                          nonfinite_params=nonfinite, exploded_params=exploded, vanished_params=vanished,
                          params_with_nan_grad=len(nan_p), params_with_inf_grad=len(inf_p),
                          params_with_grad=len(stats), anomalies=anomalies, gradient_anomalies=sentences,
                          threshold=explosion, vanishing_threshold=vanishing, enabled=True)


def disabled_gradient_report(reason: str) -> GradientReport:
    """What a gradient check returns when its setting turned it off: nothing measured."""
    return GradientReport(global_norm=None, gradient_norm=None, param_stats={}, parameter_stats={},
                          nonfinite_params=[], exploded_params=[], vanished_params=[], params_with_nan_grad=0,
                          params_with_inf_grad=0, params_with_grad=0, anomalies=[], gradient_anomalies=[],
                          enabled=False, disabled_by=reason)


def analyze_tensor(t: torch.Tensor, name: str = "tensor") -> Result:
    """NaN/Inf counts, statistics over finite values, shape, dtype, device, bytes, and the
    gradient's norm when the tensor has one (``grad_norm``)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"analyze_tensor expects a torch.Tensor, got {type(t).__name__}")
    grad = t.grad if t.is_leaf else None  # a non-leaf's .grad is never filled (and warns)
    pieces = [tensor_measure.tensor_stats(t)]
    if grad is not None:
        pieces.append(torch.linalg.vector_norm(grad.detach().to(torch.float64)).reshape(1).to(pieces[0].device))
    values = _read(torch.cat(pieces))
    info = tensor_info(tensor_measure.describe(t, values[:_W], name))
    info["grad_norm"] = values[_W] if grad is not None else None
    info["is_leaf"] = bool(t.is_leaf)
    return info


def analyze_parameters(model: torch.nn.Module) -> ParameterAnalysis:
    """Per parameter (by name) a tensor info; totals as attributes (see :class:`ParameterAnalysis`)."""
    refs = grad_measure.named_params(model)
    per: dict[str, Result] = {}
    if refs:
        dev = refs[0].param.device
        flat = _read(torch.stack([tensor_measure.tensor_stats(r.param).to(dev) for r in refs]))
        for i, r in enumerate(refs):
            per[r.name] = tensor_info(tensor_measure.describe(r.param, flat[i * _W:(i + 1) * _W], r.name))
    total = sum(r.param.numel() for r in refs)
    trainable = sum(r.param.numel() for r in refs if r.param.requires_grad)
    dtypes: dict[str, int] = {}
    devices: dict[str, int] = {}
    for r in refs:
        key = str(r.param.dtype).replace("torch.", "")
        dtypes[key] = dtypes.get(key, 0) + r.param.numel()
        devices[str(r.param.device)] = devices.get(str(r.param.device), 0) + r.param.numel()
    summary = {"total_parameters": total, "trainable_parameters": trainable, "frozen_parameters": total - trainable,
               "parameter_bytes": sum(r.param.numel() * r.param.element_size() for r in refs), "tensors": len(refs),
               "dtypes": dtypes, "devices": devices,
               "nonfinite_params": [n for n, d in per.items() if d["has_nan"] or d["has_inf"]]}
    return ParameterAnalysis(per, summary)


def gradient_flow(model: torch.nn.Module) -> Result:
    """Mean and max absolute gradient per parameter, in model order, and the ones with none."""
    refs = grad_measure.named_params(model)
    with_grad = [r for r in refs if r.param.grad is not None]
    layers = []
    if with_grad:
        dev = with_grad[0].param.grad.device
        vals = torch.stack([torch.stack([_dense(r.param.grad).abs().to(torch.float64).mean(),
                                         _dense(r.param.grad).abs().to(torch.float64).max()]).to(dev)
                            for r in with_grad])
        flat = _read(vals)
        for i, r in enumerate(with_grad):
            layers.append(Result(name=r.name, mean_abs=flat[2 * i], max_abs=flat[2 * i + 1]))
    no_grad = [r.name for r in refs if r.param.grad is None and r.param.requires_grad]
    zero = [layer["name"] for layer in layers if layer["max_abs"] == 0.0]
    return Result(layers=layers, no_gradient=no_grad, zero_gradient=zero, enabled=True)


__all__ = ["analyze_parameters", "analyze_tensor", "disabled_gradient_report", "gradient_flow", "gradient_report",
           "gradient_table"]
