"""What a forensic replay saw, turned into the report: the cause and the module where a NaN or
Inf was born (the rule of :mod:`torchtrace.forensics.blame`), with the producer's statistics.

:func:`analyse` reads the replay recorder's device flags and statistics in one host read.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from torchtrace import semconv
from torchtrace.forensics import blame
from torchtrace.forensics.recorder import Recorder
from torchtrace.measure import tensors as tensor_measure
from torchtrace.record import readout

# Causes a report can name (report["cause"]) and the anomaly kind each one counts as.
CAUSE_KIND = {
    "input": semconv.NONFINITE_INPUT,
    "forward": semconv.NONFINITE_OUTPUT,
    "loss": semconv.NONFINITE_LOSS,
    "backward": semconv.NONFINITE_GRAD,
    "parameter": semconv.NONFINITE_PARAM,
    "unknown": semconv.NONFINITE_GRAD,
    # Everything on this rank was finite with DDP's sync off: the non-finite gradients came
    # from another rank through the all-reduce.
    "peer": semconv.NONFINITE_GRAD,
}

def owner(param_name: str, module_names: set[str]) -> str:
    """The innermost module among ``module_names`` that holds the parameter ``param_name``."""
    parts = param_name.split(".")
    for i in range(len(parts) - 1, -1, -1):
        cand = ".".join(parts[:i])
        if cand in module_names:
            return cand
    return ""



def _depth(name: str) -> int:
    return 0 if not name else name.count(".") + 1



def _describe(values: list[float]) -> dict[str, Any]:
    s = dict(zip(tensor_measure.STAT_NAMES, values))
    return {k: (v if math.isfinite(v) else None) if k not in ("nan_count", "inf_count") else
            (int(v) if math.isfinite(v) else None) for k, v in s.items()}



def analyse(report: dict[str, Any], rec: Recorder, loss_value, grad_bad, bad_params, module_names) -> None:
    done = rec.calls  # completion order: children before parents
    if done:
        flat = torch.cat([torch.stack([c["in_finite"].to(torch.float64).cpu(), c["out_finite"].to(torch.float64).cpu()])
                          for c in done] + [torch.cat([c["in_stats"], c["out_stats"]]) for c in done])
        values = readout.read(flat)
        n = len(done)
        for i, c in enumerate(done):
            c["in_ok"] = bool(values[2 * i])
            c["out_ok"] = bool(values[2 * i + 1])
            base = 2 * n + 12 * i
            c["inputs"] = _describe(values[base:base + 6]) if c["has_in"] else None
            c["outputs"] = _describe(values[base + 6:base + 12])
    report["loss"] = loss_value if loss_value is None or math.isfinite(loss_value) else str(loss_value)
    report["nonfinite_grads"] = grad_bad[: semconv.MAX_NAMES_PER_ATTRIBUTE]
    report["nonfinite_params"] = bad_params[: semconv.MAX_NAMES_PER_ATTRIBUTE]
    report["modules_seen"] = len(done)
    producer: dict[str, Any] | None = None
    cause = "unknown"
    if bad_params:
        cause = "parameter"
        producer = {"module": owner(bad_params[0], module_names), "type": None}
    else:
        # The rule debug_forward_pass follows too (forensics/blame.py): the innermost module
        # whose output went non-finite from finite inputs, else the first given a bad input.
        rows = [{"module": c["module"], "type": c["type"], "order": c["call"], "has_inputs": c["has_in"],
                 "in_ok": c["in_ok"], "out_ok": c["out_ok"]} for c in done]
        found = blame.localise(rows)
        if found["cause"] is not None:
            cause = found["cause"]
            producer = done[found["index"]]
        elif loss_value is not None and not math.isfinite(loss_value):
            cause = "loss"
            producer = {"module": "<loss>", "type": None}
        elif grad_bad:
            cause = "backward"
            producer = _backward_producer(rec, grad_bad, module_names) or {"module": "<loss>", "type": None}
    report["cause"] = cause
    report["kind"] = CAUSE_KIND[cause]
    report["overflow"] = False
    if producer is not None:
        report["module"] = producer.get("module")
        report["module_type"] = producer.get("type")
        if producer.get("inputs") is not None or producer.get("outputs") is not None:
            report["inputs"] = producer.get("inputs")
            report["outputs"] = producer.get("outputs")
            report["output_dtype"] = producer.get("out_dtype")
            out = producer.get("outputs") or {}
            report["overflow"] = bool(cause == "forward" and (out.get("inf_count") or 0) > 0
                                      and not (out.get("nan_count") or 0))


def _backward_producer(rec: Recorder, grad_bad: list[str], module_names: set[str]) -> dict[str, Any] | None:
    flags = rec.grad_flags
    if flags:
        values = readout.read(torch.stack([f.to(torch.float64).cpu() for _, _, f in flags]))
    else:
        values = []
    out_ok: dict[str, bool] = {}
    in_bad: set[str] = set()
    for (name, side, _), ok in zip(flags, values):
        if side == "out":
            out_ok[name] = out_ok.get(name, True) and bool(ok)
        elif not ok:
            in_bad.add(name)
    own_bad = {owner(p, module_names) for p in grad_bad}
    cands = [m for m in module_names if out_ok.get(m, True) and (m in in_bad or m in own_bad)]
    if not cands:
        return None
    best = max(cands, key=_depth)
    kind = next((c["type"] for c in rec.calls if c["module"] == best), None)
    return {"module": best, "type": kind}


__all__ = ["CAUSE_KIND", "analyse", "owner"]
