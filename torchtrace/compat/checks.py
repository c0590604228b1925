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
from torchtrace.record import readout, rules
from torchtrace.record.step import StepRecord

_W = len(tensor_measure.STAT_NAMES)


def _dense(g: torch.Tensor) -> torch.Tensor:
    return g.to_dense() if g.is_sparse else g


def _read(stacked: torch.Tensor) -> list[float]:
    flat = stacked.reshape(-1)
    return readout.read(flat.cpu() if flat.device.type != "cpu" else flat)


def gradient_table(model: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """Parameter name -> gradient statistics (over finite values), NaN/Inf counts and the L2
    ``norm``, in model order. The norms are the core's (:func:`measure.gradients.gradient_norms`,
    what a torchtrace step records for the same gradients); one host read for everything."""
    refs = [r for r in grad_measure.named_params(model) if r.param.grad is not None]
    grads = [r.param.grad for r in refs if r.param.grad is not None]
    norms = grad_measure.gradient_norms(refs) if refs else None
    if norms is None:
        return {}
    dev = norms.norms.device
    rows = torch.stack([tensor_measure.tensor_stats(g).to(dev) for g in grads])
    values = _read(torch.cat([rows.reshape(-1), norms.norms.to(torch.float64)]))
    by_name = dict(zip(norms.names, values[len(refs) * _W:]))
    out = {}
    for i, r in enumerate(refs):
        s: dict[str, Any] = dict(zip(tensor_measure.STAT_NAMES, values[i * _W:(i + 1) * _W]))
        s["nan_count"] = int(s["nan_count"])
        s["inf_count"] = int(s["inf_count"])
        s["norm"] = by_name[r.name]
        out[r.name] = s
    return out


def gradient_report(model: torch.nn.Module, explosion: float, vanishing: float) -> GradientReport:
    """Global norm, per-parameter statistics and anomalies of ``model``'s current gradients.

    The global norm is the core's (:func:`measure.gradients.global_norm` of the core's
    per-tensor norms: a torchtrace step over the same gradients records the same value) and
    the anomalies are the core's rules (:func:`record.rules.evaluate_gradients`, with the
    per-tensor names of ADVANCED): a NaN/Inf gradient is ``nonfinite_grad`` (never an
    explosion); a finite global norm above ``explosion`` is ``grad_explosion`` with the tensors
    above it named; one below ``vanishing`` is ``grad_vanishing``; tensors below it are named
    in ``vanished_params`` either way.
    """
    stats = gradient_table(model)
    names = list(stats)
    norms = [s["norm"] for s in stats.values()]
    total = grad_measure.global_norm(norms) if norms else None
    nan_p = [n for n, s in stats.items() if s["nan_count"]]
    inf_p = [n for n, s in stats.items() if s["inf_count"]]
    # An infinite norm of finite elements (squares that overflowed) is not an Inf gradient.
    overflow = [n for n, s in stats.items() if not math.isfinite(s["norm"]) and n not in nan_p and n not in inf_p]
    record = StepRecord(operation="check_gradients", step=0, level="advanced", start_unix_ns=0)
    rules.evaluate_gradients(record, names, norms, total, explosion, vanishing, per_parameter=True,
                             overflow_only=overflow)
    anomalies: list[dict[str, Any]] = []
    sentences: list[str] = []
    for a in record.anomalies:
        if a.kind == semconv.NONFINITE_GRAD:
            anomalies.append({"kind": a.kind, "params": record.grad_nonfinite_params, "nan": nan_p, "inf": inf_p})
            sentences += [f"NaN gradient in {n}" for n in nan_p]
            sentences += [f"Inf gradient in {n}" for n in inf_p]
            sentences += [f"non-finite gradient norm in {n}" for n in overflow]
        elif a.kind == semconv.GRAD_EXPLOSION:
            anomalies.append({"kind": a.kind, "grad_norm": total, "threshold": explosion,
                              "params": record.grad_exploded_params})
            sentences.append(f"gradient explosion: norm {total:.6g} over {explosion:.6g}")
        elif a.kind == semconv.GRAD_VANISHING:
            anomalies.append({"kind": a.kind, "grad_norm": total, "threshold": vanishing,
                              "params": record.grad_vanished_params})
            sentences.append(f"gradient vanishing: norm {total:.6g} under {vanishing:.6g}")
    return GradientReport(global_norm=total, gradient_norm=total, param_stats=stats, parameter_stats=stats,
                          nonfinite_params=record.grad_nonfinite_params, exploded_params=record.grad_exploded_params,
                          vanished_params=record.grad_vanished_params, params_with_nan_grad=len(nan_p),
                          params_with_inf_grad=len(inf_p), params_with_grad=len(stats), anomalies=anomalies,
                          gradient_anomalies=sentences, threshold=explosion, vanishing_threshold=vanishing,
                          enabled=True)


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
    # The gradient's norm as a step measures it (the core's per-tensor norm).
    norms = grad_measure.gradient_norms([grad_measure.ParamRef(name, t)]) if grad is not None else None
    if norms is not None:
        pieces.append(norms.norms.to(device=pieces[0].device, dtype=torch.float64))
    values = _read(torch.cat(pieces))
    info = tensor_info(tensor_measure.describe(t, values[:_W], name))
    info["grad_norm"] = values[_W] if norms is not None else None
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
    with_grad = [(r.name, r.param.grad) for r in refs if r.param.grad is not None]
    layers = []
    if with_grad:
        dev = with_grad[0][1].device
        vals = torch.stack([torch.stack([_dense(g).abs().to(torch.float64).mean(),
                                         _dense(g).abs().to(torch.float64).max()]).to(dev)
                            for _, g in with_grad])
        flat = _read(vals)
        for i, (name, _) in enumerate(with_grad):
            layers.append(Result(name=name, mean_abs=flat[2 * i], max_abs=flat[2 * i + 1]))
    no_grad = [r.name for r in refs if r.param.grad is None and r.param.requires_grad]
    zero = [layer["name"] for layer in layers if layer["max_abs"] == 0.0]
    return Result(layers=layers, no_gradient=no_grad, zero_gradient=zero, enabled=True)


__all__ = ["analyze_parameters", "analyze_tensor", "disabled_gradient_report", "gradient_flow", "gradient_report",
           "gradient_table"]
