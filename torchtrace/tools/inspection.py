"""Layer-by-layer debugging: forward and backward statistics, model inspection, a whole step.

Every function reads its device statistics to the host once, at the end, and removes every
hook it installed, also when the model raises.

>>> import torch, torchtrace as tt
>>> m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
>>> out = tt.debug_forward_pass(m, torch.ones(2, 4))
>>> [layer["name"] for layer in out["layers"]]
['0', '1']
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

import torch

from torchtrace.measure import gradients as grad_measure
from torchtrace.measure import tensors as tensor_measure
from torchtrace.measure.activations import LayerHooks, first_tensor, layer_modules
from torchtrace.record import readout


def _call(model: torch.nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def debug_forward_pass(model: torch.nn.Module, inputs: Any, layer_hooks: bool = True,
                       leaves_only: bool = True) -> dict[str, Any]:
    """Run ``model(inputs)`` and report each layer's output shape, dtype, statistics and time.

    Returns ``{"output": ..., "layers": [{name, module, shape, dtype, device, mean, std, min, max,
    nan_count, inf_count, nonfinite_count, time_s}], "nonfinite_layers": [...], "first_nonfinite_layer",
    "time_s"}``. Statistics are over finite values (float64). ``time_s`` per layer is host wall
    time (on CUDA it is launch time unless the device is synchronised).
    """
    hooks = LayerHooks(model, leaves_only=leaves_only, timing=True) if layer_hooks else None
    t0 = time.perf_counter()
    try:
        output = _call(model, inputs)
    finally:
        if hooks is not None:
            hooks.remove()
    total = time.perf_counter() - t0
    layers: list[dict[str, Any]] = []
    out_t = first_tensor(output)
    pieces = []
    if hooks is not None and hooks.stats:
        pieces.append(hooks.stacked().reshape(-1))
    if out_t is not None:
        pieces.append(tensor_measure.tensor_stats(out_t).to(pieces[0].device if pieces else out_t.device))
    values = readout.read(torch.cat(pieces).cpu()) if pieces else []
    if hooks is not None and hooks.stats:
        layers = hooks.rows(values)
    result: dict[str, Any] = {"output": output, "layers": layers, "time_s": total}
    if out_t is not None:
        result["output_stats"] = tensor_measure.describe(out_t, values[-len(tensor_measure.STAT_NAMES):], "output")
    bad = [l["name"] for l in layers if l["nonfinite_count"]]
    result["nonfinite_layers"] = bad
    result["first_nonfinite_layer"] = bad[0] if bad else None
    if hooks is not None:
        hooks.stats = []  # nothing derived from the activations stays referenced
    return result


def debug_backward_pass(loss: torch.Tensor, model: torch.nn.Module | None = None,
                        retain_graph: bool = False) -> dict[str, Any]:
    """``loss.backward()`` timed, then per-parameter gradient statistics (one host read).

    Without ``model`` the parameters are found from the graph's leaves that received a
    gradient (named ``param_<i>``). Returns ``{"time_s", "global_norm", "params": {name: {norm,
    mean, std, min, max, nan_count, inf_count}}, "nonfinite_params", "no_grad_params"}``.
    """
    leaves: list[tuple[str, torch.Tensor]]
    if model is not None:
        leaves = [(r.name, r.param) for r in grad_measure.named_params(model)]
    else:
        leaves = []
        seen: set[int] = set()
        stack = [loss.grad_fn]
        while stack:
            fn = stack.pop()
            if fn is None or id(fn) in seen:
                continue
            seen.add(id(fn))
            var = getattr(fn, "variable", None)
            if isinstance(var, torch.Tensor):
                leaves.append((f"param_{len(leaves)}", var))
            stack.extend(n for n, _ in fn.next_functions)
    t0 = time.perf_counter()
    loss.backward(retain_graph=retain_graph)
    elapsed = time.perf_counter() - t0
    with_grad = [(n, p) for n, p in leaves if p.grad is not None]
    params: dict[str, dict[str, Any]] = {}
    if with_grad:
        rows = torch.stack([torch.cat([tensor_measure.tensor_stats(p.grad),
                                       torch.linalg.vector_norm(grad_measure.dense(p.grad).to(torch.float64)).reshape(1)])
                            for _, p in with_grad])
        flat = readout.read(rows.reshape(-1).cpu())
        w = len(tensor_measure.STAT_NAMES) + 1
        for i, (name, _) in enumerate(with_grad):
            row = flat[i * w:(i + 1) * w]
            s = dict(zip(tensor_measure.STAT_NAMES, row[:-1]))
            s["nan_count"] = int(s["nan_count"])
            s["inf_count"] = int(s["inf_count"])
            s["norm"] = row[-1]
            params[name] = s
    norms = [s["norm"] for s in params.values()]
    total = math.sqrt(math.fsum(n * n for n in norms)) if norms else None
    return {"time_s": elapsed, "global_norm": total, "params": params,
            "nonfinite_params": [n for n, s in params.items() if s["nan_count"] or s["inf_count"]],
            "no_grad_params": [n for n, p in leaves if p.grad is None and p.requires_grad]}



def inspect_model(model: torch.nn.Module, input_shape: tuple[int, ...] | list[int] | None = None, *,
                  dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> dict[str, Any]:
    """Layers, parameter counts per module, dtypes and devices; with ``input_shape`` a validating
    forward pass on a dummy input (zeros, under ``no_grad``, model mode restored).

    A failure names the layer: ``result["forward"] = {"ok": False, "failed_layer": "head",
    "failed_module": "Linear", "input_shapes": [[2, 7]], "error": "..."}``.
    """
    params = list(model.named_parameters())
    first = params[0][1] if params else None
    dtype = dtype or (first.dtype if first is not None and first.is_floating_point() else torch.float32)
    device = device or (first.device if first is not None else "cpu")
    layers = []
    for name, mod in model.named_modules():
        own = list(mod.parameters(recurse=False))
        total = sum(p.numel() for p in mod.parameters())
        layers.append({"name": name or "(root)", "module": type(mod).__name__,
                       "parameters": sum(p.numel() for p in own), "parameters_total": total,
                       "trainable": sum(p.numel() for p in own if p.requires_grad),
                       "dtypes": sorted({str(p.dtype).replace("torch.", "") for p in own}),
                       "devices": sorted({str(p.device) for p in own})})
    result: dict[str, Any] = {
        "model": type(model).__name__,
        "layers": layers,
        "total_parameters": sum(p.numel() for _, p in params),
        "trainable_parameters": sum(p.numel() for _, p in params if p.requires_grad),
        "parameter_bytes": sum(p.numel() * p.element_size() for _, p in params),
        "dtypes": sorted({str(p.dtype).replace("torch.", "") for _, p in params}),
        "devices": sorted({str(p.device) for _, p in params}),
    }
    if input_shape is not None:
        result["forward"] = _validate_forward(model, tuple(input_shape), dtype, device)
    return result


def _validate_forward(model, shape, dtype, device) -> dict[str, Any]:
    stack: list[tuple[str, str, list]] = []
    failed: dict[str, Any] = {}
    shapes: dict[str, list[int]] = {}
    handles = []

    def pre(name):
        def hook(mod, inputs):
            ins = [list(t.shape) for t in inputs if isinstance(t, torch.Tensor)]
            stack.append((name, type(mod).__name__, ins))
        return hook

    def post(name):
        def hook(mod, inputs, output):
            if stack:
                stack.pop()
            t = first_tensor(output)
            if t is not None:
                shapes[name] = list(t.shape)
        return hook

    try:
        for name, mod in model.named_modules():
            label = name or "(root)"
            handles.append(mod.register_forward_pre_hook(pre(label)))
            handles.append(mod.register_forward_hook(post(label)))
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                out = model(torch.zeros(shape, dtype=dtype, device=device))
        except Exception as exc:
            name, kind, ins = stack[-1] if stack else ("(root)", type(model).__name__, [list(shape)])
            failed = {"ok": False, "failed_layer": name, "failed_module": kind, "input_shapes": ins,
                      "error": f"{type(exc).__name__}: {str(exc)[:500]}", "output_shapes": shapes}
        else:
            t = first_tensor(out)
            failed = {"ok": True, "output_shape": list(t.shape) if t is not None else None, "output_shapes": shapes}
        finally:
            model.train(was_training)
    finally:
        for h in handles:
            h.remove()
    return failed


def debug_training_step(model: torch.nn.Module, inputs: Any, targets: Any, loss_fn: Callable[..., torch.Tensor],
                        optimizer: torch.optim.Optimizer | None = None, layer_hooks: bool = True) -> dict[str, Any]:
    """One training step, fully inspected: forward layer statistics, loss, backward gradient
    statistics, then ``optimizer.step()`` (skipped when gradients are non-finite).

    Returns ``{"forward", "loss", "backward", "optimizer_stepped", "time_s"}``; the forward
    report has no ``output`` key (the output is not retained).
    """
    t0 = time.perf_counter()
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    fwd = debug_forward_pass(model, inputs, layer_hooks=layer_hooks)
    output = fwd.pop("output")
    loss = loss_fn(output, targets)
    del output
    loss_value = readout.read(loss.detach().reshape(-1)[:1].to(torch.float64).cpu())[0]
    bwd = debug_backward_pass(loss, model=model)
    del loss
    stepped = False
    if optimizer is not None and not bwd["nonfinite_params"] and math.isfinite(loss_value):
        optimizer.step()
        stepped = True
    return {"forward": fwd, "loss": loss_value, "backward": bwd, "optimizer_stepped": stepped,
            "time_s": time.perf_counter() - t0}


__all__ = ["debug_forward_pass", "debug_backward_pass", "inspect_model", "debug_training_step", "layer_modules"]
