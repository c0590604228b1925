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

from torchtrace.forensics.blame import ModuleCalls, localise
from torchtrace.measure import gradients as grad_measure
from torchtrace.measure import tensors as tensor_measure
from torchtrace.measure.activations import first_tensor, layer_modules
from torchtrace.measure.autograd_graph import graph_leaves
from torchtrace.record import readout


def _call(model: torch.nn.Module, inputs: object) -> Any:
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def _display(name: str, model: torch.nn.Module, childless: bool) -> str:
    if name:
        return name
    return type(model).__name__ if childless else "(root)"


def _layer_rows(rows: list[dict[str, Any]], model: torch.nn.Module,
                leaves_only: bool) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Label every call (``name#n`` for repeats) and pick the listed layers: leaves and modules
    computing in their own forward (or every module but the root); the root's row apart."""
    childless = next(iter(model.children()), None) is None
    counts: dict[str, int] = {}
    layers: list[dict[str, Any]] = []
    root_row = None
    for r in rows:
        name = _display(r["module"], model, childless)
        n = counts.get(name, 0)
        counts[name] = n + 1
        r["label"] = name if n == 0 else f"{name}#{n}"
        if r["module"] == "":
            root_row = r
        listed = (r["is_leaf"] or r["own_compute"]) if leaves_only else True
        if r["module"] == "" and not childless:
            listed = False
        if listed and r["shape"] is not None:
            layers.append({"name": r["label"], "module": r["type"], "input_shapes": r["input_shapes"],
                           "shape": r["shape"], "dtype": r["dtype"],
                           "device": r["device"], "mean": r["mean"], "std": r["std"], "min": r["min"],
                           "max": r["max"], "nan_count": r["nan_count"], "inf_count": r["inf_count"],
                           "nonfinite_count": r["nan_count"] + r["inf_count"], "time_s": r["time_s"],
                           "own_compute": bool(r["own_compute"] and not r["is_leaf"])})
    return layers, root_row


def debug_forward_pass(model: torch.nn.Module, inputs: object, layer_hooks: bool = True,
                       leaves_only: bool = True) -> dict[str, Any]:
    """Run ``model(inputs)`` and report each layer's output shape, dtype, statistics and time,
    and which module made a NaN/Inf, by the forensics rule (:mod:`torchtrace.forensics.blame`).

    Every module is watched. The ``layers`` list holds the leaves and every module with
    children that computes in its own ``forward`` (its output is none of its children's
    outputs: ``nn.MultiheadAttention`` inside ``nn.TransformerEncoderLayer``), in completion
    order; ``leaves_only=False`` lists every module but the root. A repeated call of one
    module is listed as ``name#1``, ``name#2``...

    Returns ``{"output": ..., "layers": [{name, module, input_shapes, shape, dtype, device, mean, std, min,
    max, nan_count, inf_count, nonfinite_count, time_s, own_compute}], "nonfinite_layers": [...],
    "first_nonfinite_layer", "nonfinite_origin": {cause, module, module_type}, "time_s",
    "output_stats"}``. ``first_nonfinite_layer`` is the module the rule blames: the first,
    innermost first, whose output is non-finite while its inputs are finite (cause
    ``"forward"``); when the model's own input is non-finite (cause ``"input"``) it is the
    first listed layer with a non-finite output. Statistics are over finite values (float64);
    ``time_s`` per layer is host wall time (on CUDA, launch time unless synchronised). One host
    read for everything.

    >>> import torch, torchtrace as tt
    >>> m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
    >>> tt.debug_forward_pass(m, torch.ones(2, 4))["first_nonfinite_layer"] is None
    True
    """
    if not layer_hooks:
        t0 = time.perf_counter()
        output = _call(model, inputs)
        return {"output": output, "layers": [], "nonfinite_layers": [], "first_nonfinite_layer": None,
                "nonfinite_origin": None, "time_s": time.perf_counter() - t0}
    calls = ModuleCalls(model, timing=True)
    t0 = time.perf_counter()
    with calls:
        output = _call(model, inputs)
    total = time.perf_counter() - t0
    rows = calls.host_rows(calls.values_read())
    calls.calls = []  # nothing derived from the activations stays referenced
    layers, root_row = _layer_rows(rows, model, leaves_only)
    origin = localise(rows)
    blamed = rows[origin["index"]] if origin["cause"] == "forward" else None
    bad = [layer["name"] for layer in layers if layer["nonfinite_count"]]
    first = blamed["label"] if blamed is not None else (bad[0] if bad else None)
    if first is not None and first not in bad:
        bad.insert(0, first)  # a blamed module not in the list: the root computing in its own forward
    result: dict[str, Any] = {"output": output, "layers": layers, "time_s": total, "nonfinite_layers": bad,
                              "first_nonfinite_layer": first, "nonfinite_origin": None}
    if origin["cause"] is not None:
        result["nonfinite_origin"] = {"cause": origin["cause"], "module": rows[origin["index"]]["label"],
                                      "module_type": origin["module_type"]}
    if root_row is not None and root_row["shape"] is not None:
        result["output_stats"] = {"name": "output", "shape": root_row["shape"], "dtype": root_row["dtype"],
                                  "device": root_row["device"],
                                  **{k: root_row[k] for k in ("mean", "std", "min", "max", "nan_count", "inf_count")},
                                  "has_nan": root_row["nan_count"] > 0, "has_inf": root_row["inf_count"] > 0}
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
        leaves = [(f"param_{i}", leaf) for i, leaf in enumerate(graph_leaves(loss))]
    t0 = time.perf_counter()
    loss.backward(retain_graph=retain_graph)
    elapsed = time.perf_counter() - t0
    with_grad = [(n, p.grad) for n, p in leaves if p.grad is not None]
    params: dict[str, dict[str, Any]] = {}
    if with_grad:
        rows = torch.stack([torch.cat([tensor_measure.tensor_stats(g),
                                       torch.linalg.vector_norm(grad_measure.dense(g).to(torch.float64)).reshape(1)])
                            for _, g in with_grad])
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


def debug_training_step(model: torch.nn.Module, inputs: object, targets: object, loss_fn: Callable[..., torch.Tensor],
                        optimizer: torch.optim.Optimizer | None = None, layer_hooks: bool = True, *,
                        backward_stats: bool = True, before_step: Callable[[], Any] | None = None,
                        on_loss: Callable[[torch.Tensor], Any] | None = None) -> dict[str, Any]:
    """One training step, fully inspected: forward layer statistics, loss, backward gradient
    statistics, then ``optimizer.step()`` (skipped when the loss or a gradient is non-finite).

    Args:
        layer_hooks / backward_stats: False runs that half plainly (no statistics).
        before_step: called after backward and before the optimizer step; its result is
            returned under ``"before_step"`` (a gradient check, a clip).
        on_loss: called with the loss tensor before backward (hand it to an open step).

    Returns ``{"forward", "loss", "backward", "optimizer_stepped", "time_s"}``; the forward
    report has no ``output`` key (the output is not retained).

    >>> import torch, torchtrace as tt
    >>> m = torch.nn.Linear(3, 1); opt = torch.optim.SGD(m.parameters(), lr=0.1)
    >>> out = tt.debug_training_step(m, torch.ones(4, 3), torch.zeros(4, 1), torch.nn.functional.mse_loss, opt)
    >>> out["optimizer_stepped"]
    True
    """
    t0 = time.perf_counter()
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    fwd = debug_forward_pass(model, inputs, layer_hooks=layer_hooks)
    output = fwd.pop("output")
    loss = loss_fn(output, targets)
    del output
    loss_value = readout.read(loss.detach().reshape(-1)[:1].to(torch.float64).cpu())[0]
    if on_loss is not None:
        on_loss(loss)
    if backward_stats:
        bwd = debug_backward_pass(loss, model=model)
        finite_grads = not bwd["nonfinite_params"]
    else:
        t1 = time.perf_counter()
        loss.backward()
        bwd = {"time_s": time.perf_counter() - t1}
        finite_grads = True
    del loss
    out: dict[str, Any] = {"forward": fwd, "loss": loss_value, "backward": bwd}
    if before_step is not None:
        out["before_step"] = before_step()
        check = out["before_step"]
        if isinstance(check, dict) and check.get("nonfinite_params"):
            finite_grads = False
    stepped = False
    if optimizer is not None and finite_grads and math.isfinite(loss_value):
        optimizer.step()
        stepped = True
    out["optimizer_stepped"] = stepped
    out["time_s"] = time.perf_counter() - t0
    return out


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state, analysed: its ``type``, every ``param_groups`` entry's
    hyper-parameters (``lr``, ``betas``, ``weight_decay``...: everything but the parameters),
    ``params`` (tensors it updates), ``params_with_state``, ``steps`` (the largest ``step``
    count in its state), and per tensor-valued state entry (``exp_avg``, ``exp_avg_sq``,
    ``momentum_buffer``...) the float64 global L2 norm over the parameters (``state_norms``,
    NaN when one holds a NaN) and which entries are non-finite (``nonfinite_state``). One host
    read; norms by the gradient norms' kernels (:func:`torchtrace.measure.gradients.parameter_norms`).

    >>> import torch
    >>> m = torch.nn.Linear(2, 1); opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    >>> m(torch.ones(1, 2)).sum().backward(); opt.step()
    >>> round(optimizer_state(opt)["state_norms"]["momentum_buffer"], 6)  # sqrt(1 + 1 + 1)
    1.732051
    """
    groups = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    by_key: dict[str, list[grad_measure.ParamRef]] = {}
    steps: list[torch.Tensor | float] = []
    with_state = 0
    for p in params:
        state = optimizer.state.get(p)
        if not state:
            continue
        with_state += 1
        for key, value in state.items():
            if key == "step":
                steps.append(value)
            elif isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex()):
                by_key.setdefault(key, []).append(grad_measure.ParamRef(key, value))
    keys = sorted(by_key)
    pieces: list[torch.Tensor] = []
    for key in keys:
        piece = grad_measure.parameter_norms(by_key[key])
        # (never None: every key holds at least one tensor)
        if piece is not None:
            pieces.append(piece)
    step_values = [torch.as_tensor(v, dtype=torch.float64).reshape(1).cpu() for v in steps]
    flat = readout.read(torch.cat([piece.cpu() for piece in pieces] + step_values)) if pieces or step_values else []
    norms: dict[str, float] = {}
    start = 0
    for key in keys:
        count = len(by_key[key])
        norms[key] = grad_measure.global_norm(flat[start:start + count])
        start += count
    step_counts = flat[start:]
    return {"type": type(optimizer).__name__, "param_groups": groups, "params": len(params),
            "params_with_state": with_state, "steps": int(max(step_counts)) if step_counts else 0,
            "state_norms": norms, "nonfinite_state": [k for k, v in norms.items() if not math.isfinite(v)]}


__all__ = ["debug_forward_pass", "debug_backward_pass", "inspect_model", "debug_training_step", "layer_modules",
           "optimizer_state"]
