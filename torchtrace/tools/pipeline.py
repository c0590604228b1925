"""Pipelines: objects holding several modules, and iterative inference loops."""

from __future__ import annotations

import math
from typing import Any

import torch
from opentelemetry import trace

from torchtrace import current, semconv
from torchtrace.measure import tensors as tensor_measure
from torchtrace.record import readout
from torchtrace.record.monitor import record_anomalies


def _components(obj: object) -> dict[str, torch.nn.Module]:
    """The modules of a pipeline-like object, by name.

    A dict or list of modules; a module's children; otherwise the object's module attributes
    together with the modules of its ``components`` dict when it has one (a diffusers pipeline
    lists its parts there), each module once, under its first name.
    """
    if isinstance(obj, dict):
        items = list(obj.items())
    elif isinstance(obj, (list, tuple)):
        items = [(str(i), v) for i, v in enumerate(obj)]
    elif isinstance(obj, torch.nn.Module):
        items = list(obj.named_children())
    else:
        items = list(getattr(obj, "__dict__", {}).items())
        extra = getattr(obj, "components", None)
        if isinstance(extra, dict):
            items.extend(extra.items())
        unique, seen = [], set()
        for k, v in items:
            if isinstance(v, torch.nn.Module) and id(v) not in seen:
                seen.add(id(v))
                unique.append((k, v))
        items = unique
    return {str(k): v for k, v in items if isinstance(v, torch.nn.Module)}


def analyze_pipeline(obj: object) -> dict[str, Any]:
    """Parameter counts, bytes, dtypes and devices per component of a multi-module object.

    ``obj`` may be any object with module attributes (a diffusion pipeline, an
    encoder/decoder pair), a dict or list of modules, or a module (its children). No host
    read of tensor values happens. Parameters shared between components count once in
    the totals.

    >>> import torch, torchtrace as tt
    >>> class Pipe: pass
    >>> p = Pipe(); p.text = torch.nn.Linear(2, 3); p.unet = torch.nn.Linear(3, 3)
    >>> tt.analyze_pipeline(p)["total_parameters"]
    21
    """
    comps = _components(obj)
    out: dict[str, Any] = {"components": {}}
    seen: set[int] = set()
    total = trainable = nbytes = 0
    for name, module in comps.items():
        dtypes: dict[str, int] = {}
        devices: dict[str, int] = {}
        n = t = b = 0
        for p in module.parameters():
            k = p.numel()
            n += k
            t += k if p.requires_grad else 0
            b += k * p.element_size()
            dt = str(p.dtype).replace("torch.", "")
            dtypes[dt] = dtypes.get(dt, 0) + k
            devices[str(p.device)] = devices.get(str(p.device), 0) + k
            if id(p) not in seen:
                seen.add(id(p))
                total += k
                trainable += k if p.requires_grad else 0
                nbytes += k * p.element_size()
        out["components"][name] = {"type": type(module).__name__, "parameters": n, "trainable_parameters": t,
                                   "parameter_bytes": b, "dtypes": dtypes, "devices": devices,
                                   "training": module.training,
                                   "buffers": sum(x.numel() for x in module.buffers())}
    out.update(total_parameters=total, trainable_parameters=trainable, parameter_bytes=nbytes,
               component_count=len(comps))
    return out


def monitor_loop_step(name: str, step: int, tensor: torch.Tensor) -> dict[str, Any]:
    """Statistics of one iteration of an inference loop (a sampler, a decoder), as a span event.

    The event ``torchtrace.loop_step`` goes on the current span (or on a short span named
    ``name`` when none is recording); a NaN/Inf counts as a ``nonfinite_output`` anomaly.
    One host read per call.
    """
    values = readout.read(tensor_measure.tensor_stats(tensor).cpu())
    stats = dict(zip(tensor_measure.STAT_NAMES, values))
    stats["nan_count"] = int(stats["nan_count"])
    stats["inf_count"] = int(stats["inf_count"])
    nonfinite = bool(stats["nan_count"] or stats["inf_count"])
    attrs: dict[str, Any] = {semconv.LOOP_NAME: name, semconv.LOOP_STEP: step, semconv.LOOP_NONFINITE: nonfinite}
    for key, value in stats.items():
        if isinstance(value, int) or math.isfinite(value):
            attrs[semconv.LOOP_STAT_PREFIX + key] = value
    rt = current.runtime()
    if rt is not None:
        try:
            span = trace.get_current_span()
            if span.is_recording():
                span.add_event(semconv.EVENT_LOOP_STEP, attrs)
            else:
                with rt.tracer.start_as_current_span(name) as own:
                    own.add_event(semconv.EVENT_LOOP_STEP, attrs)
        except Exception as exc:
            rt.errors.report("tracing", exc)
    if nonfinite:
        record_anomalies([semconv.NONFINITE_OUTPUT], step, None, None, operation=name)
    return {"name": name, "step": step, "nonfinite": nonfinite, **stats}
