"""Forensic replay: find the module that produced a NaN/Inf, on the one step that had one.

Healthy steps pay only for remembering how to replay (the RNG state and a replay callable).
When a step's loss or gradients are non-finite, the step is run again on the same inputs and
RNG state, with the parameters unchanged, under forward hooks on every module (pass A), and,
when the forward was clean, once more under ``torch.autograd.detect_anomaly(check_nan=True)``
to name the backward op (pass B). The optimizer's ``step`` (and a GradScaler's ``step``,
``unscale_`` and ``update``) are no-ops during the replay; gradients, buffers, RNG state and
training flags are restored afterwards, and so is what the step keeps outside its model (its
optimizers' other parameters' gradients, other modules' buffers, Python's and NumPy's
generators: :class:`~torchtrace.forensics.isolation.OutsideState`), so the replay never
changes the training result.
"""

from __future__ import annotations

import math
import numbers
import re
import time
import warnings
from typing import Any, Callable, Sequence

import torch

from torchtrace import semconv
from torchtrace.errors import get_logger
from torchtrace.forensics.analysis import CAUSE_KIND, analyse, owner
from torchtrace.forensics.isolation import (
    accumulation_held,
    capture_rng,
    eager,
    finished,
    is_distributed_data_parallel,
    local_only,
    neutralised,
    outside_kept,
    restore_rng,
    sharded_by_fsdp,
)
from torchtrace.forensics.recorder import Recorder
from torchtrace.measure.names import user_name, wrapper_prefix
from torchtrace.record import readout

logger = get_logger("torchtrace.forensics")

_OP_RE = re.compile(r"Function '([^']+)' returned (nan|inf)", re.IGNORECASE)
_LOW_PRECISION = (torch.float16, torch.bfloat16)


class _BackwardWatch:
    """Post-accumulate-grad hooks on the parameters: whether the replayed step ran backward
    itself, and which gradients came out non-finite, even when the step zeroes its gradients
    before it returns (nanoGPT's order: ``zero_grad`` last)."""

    def __init__(self, params: list[tuple[str, torch.nn.Parameter]]) -> None:
        self.ran = False
        self.flags: dict[str, torch.Tensor] = {}
        self.handles = []
        for name, p in params:
            if p.requires_grad:
                self.handles.append(p.register_post_accumulate_grad_hook(self._hook(name)))

    def _hook(self, name: str) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            self.ran = True
            if p.grad is not None:
                ok = torch.isfinite(p.grad.detach()).all()
                self.flags[name] = ok if name not in self.flags else self.flags[name] & ok
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def _error_text(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__qualname__}: {first[:200]}" if first else type(exc).__qualname__


def replay(model: torch.nn.Module, run: Callable[[], Any], rng: tuple | None, optimizers: list[Any],
           scalers: list[Any], extract_loss: Callable[[Any], Any], others: tuple = ()) -> dict[str, Any]:
    """Replay one step and return the forensic report (a JSON-ready dict).

    ``run`` re-executes the step (forward, loss and usually backward); when it runs no
    backward and returns a loss that requires grad, the replay calls ``backward`` itself.
    ``others``: the step's arguments, where a DistributedDataParallel wrapper is looked for
    (the replay runs with its synchronisation off: :func:`local_only`).
    Everything the replay touches is restored before returning.
    """
    t0 = time.perf_counter()
    prefix = wrapper_prefix(model)
    params = [(user_name(n, prefix), p) for n, p in model.named_parameters()]
    module_names = {user_name(n, prefix) for n, _ in model.named_modules()}
    saved_grads = [(p, p.grad) for _, p in params]
    saved_buffers = [(b, b.detach().clone()) for b in model.buffers()]
    # The parameters too: a step that updates them by hand (``p.data.add_(p.grad, alpha=-lr)``,
    # no optimizer to neutralise) would change them in the replay.
    saved_params = [(p, p.detach().clone()) for _, p in params]
    saved_training = [(m, m.training) for m in model.modules()]
    rng_now = capture_rng()
    report: dict[str, Any] = {"replayed": True, "model": type(model).__name__}
    if any(type(p).__name__ == "DTensor" for _, p in params) or sharded_by_fsdp(model, others):
        # FSDP (either API) / tensor parallel: the forward gathers shards from the other ranks, which do not replay.
        report.update(replayed=False, cause="unknown", kind=CAUSE_KIND["unknown"], module=None,
                      tried="not replayed: the parameters are sharded (FSDP, DTensor), and a replay on one rank "
                            "would issue collectives the other ranks never join",
                      replay_seconds=time.perf_counter() - t0)
        return report
    try:
        with local_only(model, others), eager(), outside_kept(model, optimizers), accumulation_held():
            # Parameters that are already non-finite explain everything downstream.
            pflags = readout.read(torch.stack([torch.isfinite(p.detach()).all().cpu() for _, p in params])
                                  .to(torch.float64)) if params else []
            bad_params = [n for (n, _), ok in zip(params, pflags) if not ok]
            rec = Recorder(model)
            loss_value, pass_a_error, grad_bad = _run_once(model, run, rng, optimizers, scalers, extract_loss, params,
                                                           rec)
            _put_back(saved_params)
            analyse(report, rec, loss_value, grad_bad, bad_params, module_names)
            if pass_a_error is not None:
                report["replay_error"] = pass_a_error
            if report["cause"] in ("backward", "unknown") and grad_bad:
                report["op"] = _anomaly_op(model, run, rng, optimizers, scalers, extract_loss, params)
            _no_origin_found(report, rec, is_distributed_data_parallel(model, others) and not grad_bad
                             and loss_value is not None)
            _carried_over(report, [(n, g) for (n, _), (_, g) in zip(params, saved_grads)])
            magnitudes = _magnitudes(params, bad_params)
            report["largest_params"] = [{"name": n, "max_abs": v} for n, v, _ in magnitudes[:LARGEST_SHOWN]]
            _blame_extreme_parameters(report, magnitudes, module_names)
    finally:
        for p, g in saved_grads:
            p.grad = g
        _put_back(saved_params)
        _put_back(saved_buffers)
        for m, flag in saved_training:
            m.training = flag
        restore_rng(rng_now)
    report["replay_seconds"] = time.perf_counter() - t0
    return report


LARGEST_SHOWN = 3


def _magnitudes(params: list, bad_params: list[str]) -> list[tuple[str, float, torch.dtype]]:
    """The finite parameters' largest magnitudes, (name, max |value|, dtype), largest first:
    after a huge learning rate the weights it blew up come first, though they are still finite.
    One host read."""
    finite = [(n, p) for n, p in params if n not in bad_params and p.numel()]
    if not finite:
        return []
    values = readout.read(torch.stack([p.detach().abs().amax().to(torch.float64).cpu() for _, p in finite]))
    return sorted(((n, v, p.dtype) for (n, p), v in zip(finite, values)), key=lambda row: row[1], reverse=True)


def extreme_magnitude(dtype: torch.dtype) -> float:
    """The magnitude from which a finite parameter of ``dtype`` counts as blown up: the dtype's
    largest value to the power 3/4 (2.6e28 for float32 and bfloat16, 4.1e3 for float16).

    A product of two values a quarter of that range apart already overflows, so ordinary
    arithmetic on such a weight makes Inf; trained weights sit many orders of magnitude lower.
    """
    return float(torch.finfo(dtype).max) ** 0.75 if dtype.is_floating_point else math.inf


def _blame_extreme_parameters(report: dict[str, Any], magnitudes: list, module_names: set[str]) -> None:
    """A finite parameter past :func:`extreme_magnitude` (a huge learning rate's update, a
    corrupted checkpoint) explains an overflow found downstream: the cause becomes
    ``parameter`` and the module its owner. ``found_in`` keeps where the value went non-finite
    (cause, module, and that module's statistics), and ``kind`` stays the anomaly counted
    there. An input that was already non-finite, or a replay that found everything finite
    (``unknown``, ``peer``), is left as it is."""
    if report.get("cause") not in ("forward", "loss", "backward"):
        return
    extreme = [(n, v) for n, v, dtype in magnitudes if v >= extreme_magnitude(dtype)]
    if not extreme:
        return
    found = {"cause": report["cause"]}
    for key in ("module", "module_type", "op", "inputs", "outputs", "output_dtype"):
        if key in report:
            found[key] = report.pop(key)
    report["found_in"] = found
    report["extreme_params"] = [{"name": n, "max_abs": v} for n, v in extreme[:LARGEST_SHOWN]]
    report.update(cause="parameter", module=owner(extreme[0][0], module_names), module_type=None)


def _put_back(saved: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for t, v in saved:
            t.copy_(v)


def _no_origin_found(report: dict[str, Any], rec: Recorder, ddp_all_finite: bool) -> None:
    """Nothing non-finite found: with DDP and everything finite on this rank, the gradients came
    through the all-reduce (``peer``); either way ``tried`` says what the replay did."""
    if report["cause"] == "unknown" and ddp_all_finite and not report.get("replay_error"):
        report.update(cause="peer", kind=CAUSE_KIND["peer"], module=None)
    if report["cause"] in ("unknown", "peer"):
        report["tried"] = _tried(report, rec)


def found_all_finite(report: dict[str, Any]) -> bool:
    """The replay ran to its end and found nothing non-finite on this rank: a loss came back,
    and no module's output, gradient or parameter was non-finite (``unknown``, without a
    replay error)."""
    return (report.get("cause") == "unknown" and bool(report.get("replayed")) and not report.get("replay_error")
            and report.get("loss") is not None and not report.get("nonfinite_grads"))


def _many_ranks() -> bool:
    """A process group of more than one rank: non-finite gradients its replay does not make may
    have come through an all-reduce."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _carried_over(report: dict[str, Any], grads: list[tuple[str, torch.Tensor | None]]) -> None:
    """The replay found nothing non-finite (a loss came back, every gradient finite), but the
    gradients the step had made were not: on one process, they were non-finite before its
    backward (accumulated by an earlier step since the last update, which found the origin).
    ``carried_over`` names them."""
    if not found_all_finite(report) or _many_ranks():
        return
    held = [(n, g) for n, g in grads if g is not None]
    if not held:
        return
    flags = readout.read(torch.stack([torch.isfinite(g).all().cpu() for _, g in held]).to(torch.float64))
    bad = [n for (n, _), ok in zip(held, flags) if not ok]
    if bad:
        report["carried_over"] = bad[: semconv.MAX_NAMES_PER_ATTRIBUTE]


def _tried(report: dict[str, Any], rec: Recorder) -> str:
    """What the replay did, for a report that found no origin (said instead of a module)."""
    if report.get("replay_error"):
        return f"the replayed step raised {report['replay_error']}"
    parts = [f"replayed the step under forward hooks on {len(rec.names)} modules ({report.get('modules_seen', 0)} "
             f"ran)"]
    loss = report.get("loss")
    parts.append("no loss came back" if loss is None else f"loss {loss}")
    parts.append("every output, gradient and parameter was finite on this rank" if not report.get("nonfinite_grads")
                 else f"{len(report['nonfinite_grads'])} non-finite gradient(s), no module output non-finite")
    return "; ".join(parts)


def _run_once(model, run, rng, optimizers, scalers, extract_loss, params, rec: Recorder | None):
    """Pass A. Returns the loss (a number or None), the replay's error text, and the names of
    the gradients the replayed backward made non-finite."""
    for _, p in params:
        p.grad = None
    if rng is not None:
        restore_rng(rng)
    error = None
    loss_value = None
    watch = _BackwardWatch(params)
    if rec is not None:
        rec.install()
    try:
        with neutralised(optimizers, scalers), torch.enable_grad():
            try:
                out = finished(run())
            except Exception as exc:  # the replayed step failed: report, do not raise
                logger.debug("torchtrace forensics: the replayed step raised", exc_info=True)
                return None, _error_text(exc), _watched_bad(watch, params)
            loss = extract_loss(out)
            if isinstance(loss, torch.Tensor):
                if not watch.ran and loss.requires_grad:
                    try:
                        loss.backward()
                    except Exception as exc:
                        error = _error_text(exc)
                loss_value = readout.read(loss.detach().reshape(-1)[:1].to(torch.float64).cpu())[0]
            elif isinstance(loss, numbers.Real) and not isinstance(loss, bool):  # a NumPy float too
                loss_value = float(loss)
    finally:
        watch.remove()
        if rec is not None:
            rec.remove()
    return loss_value, error, _watched_bad(watch, params)


def _watched_bad(watch: _BackwardWatch, params) -> list[str]:
    """Non-finite gradients as the replayed backward made them (the hooks' flags), else as the
    parameters hold them now."""
    if not watch.flags:
        return _nonfinite_grads(params)
    names = [n for n, _ in params if n in watch.flags]
    flags = readout.read(torch.stack([watch.flags[n].cpu() for n in names]).to(torch.float64))
    return [n for n, ok in zip(names, flags) if not ok]


def _nonfinite_grads(params) -> list[str]:
    with_grad = [(n, p.grad) for n, p in params if p.grad is not None]
    if not with_grad:
        return []
    flags = readout.read(torch.stack([torch.isfinite(g).all().cpu() for _, g in with_grad]).to(torch.float64))
    return [n for (n, _), ok in zip(with_grad, flags) if not ok]


def _anomaly_op(model, run, rng, optimizers, scalers, extract_loss, params) -> str | None:
    """Pass B: the backward op that first returned NaN/Inf, from ``detect_anomaly``'s error."""
    op = None
    prev = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.autograd.detect_anomaly(check_nan=True):
                for _, p in params:
                    p.grad = None
                if rng is not None:
                    restore_rng(rng)
                watch = _BackwardWatch(params)
                with neutralised(optimizers, scalers), torch.enable_grad():
                    try:
                        out = finished(run())
                        loss = extract_loss(out)
                        if isinstance(loss, torch.Tensor) and loss.requires_grad and not watch.ran:
                            loss.backward()
                    except RuntimeError as exc:
                        m = _OP_RE.search(str(exc))
                        op = m.group(1) if m else None
                    finally:
                        watch.remove()
    finally:
        torch.set_anomaly_enabled(*prev)
    return op
