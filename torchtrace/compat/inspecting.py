"""``PyTorchDebugger``'s checks: gradients, parameters, tensors, forward/backward passes, a
training step, memory. A mixin over the core measures; the class itself is in
:mod:`torchtrace.compat.debugger`.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable

import torch

from torchtrace import semconv
from torchtrace.compat import checks, steps
from torchtrace.compat.results import GradientReport, ParameterAnalysis, Result
from torchtrace.compat.settings import DebugConfig, check_arguments, positive
from torchtrace.errors import NonFiniteError
from torchtrace.measure import memory as mem_measure
from torchtrace.record.growth import GrowthTracker
from torchtrace.tools import inspection, memory

_EVENT = {semconv.NONFINITE_GRAD: ("nonfinite_gradient", logging.ERROR),
          semconv.GRAD_EXPLOSION: ("gradient_explosion", logging.WARNING),
          semconv.GRAD_VANISHING: ("gradient_vanishing", logging.WARNING)}
_MESSAGES = {"nonfinite_gradient": "NaN/Inf gradients in {names}",
             "gradient_explosion": "Gradient explosion detected: norm {norm:.6g} over {thr:.6g}",
             "gradient_vanishing": "Gradient vanishing detected: norm {norm:.6g} under {thr:.6g}"}


class CheckingMixin:
    """Checks of :class:`~torchtrace.compat.PyTorchDebugger` (needs ``config``, ``_log``,
    ``_note_anomalies``, ``_off``)."""

    config: DebugConfig
    _log: Callable[..., Any]
    last_forward_pass: Result | None

    # ------------------------------------------------------------ gradients
    def check_gradients(self, model: torch.nn.Module, second: object = None, *, gradient_threshold: Any = None,
                        threshold: Any = None, step: int | None = None, loss: Any = None) -> GradientReport:
        """Global norm, per-parameter statistics and anomalies of the model's current gradients.

        The three seeds' forms, told apart by type and keyword (see
        :func:`~torchtrace.compat.settings.check_arguments`): ``check_gradients(model,
        gradient_threshold=1.0)``, ``check_gradients(model, step)``, ``check_gradients(model,
        loss)``. The threshold defaults to the config's ``explosion_threshold``. A check inside
        an open step hands the step the model and the loss. With ``clip_on_anomaly`` an
        explosion clips the gradients to ``clip_max_norm`` (``report["clipped_to"]``).
        ``enable_gradient_checking=False`` (or level OFF): nothing is measured,
        ``report.enabled`` is False.
        """
        thr, step, loss = check_arguments(second, gradient_threshold=gradient_threshold, threshold=threshold,
                                          step=step, loss=loss)
        if self._off("enable_gradient_checking"):
            return checks.disabled_gradient_report(self._off("enable_gradient_checking"))
        thr = self.config.explosion_threshold if thr is None else thr
        report = checks.gradient_report(model, thr, self.config.vanishing_threshold)
        report["step"] = step
        report["loss"] = steps.loss_value(loss) if loss is not None else None
        in_step = steps.share_with_step(model, loss)
        for a in report["anomalies"]:
            kind, level = _EVENT[a["kind"]]
            names = a.get("params", [])[:semconv.MAX_NAMES_PER_ATTRIBUTE]
            data = {"kind": a["kind"], "gradient_norm": report["global_norm"], "threshold": a.get("threshold", thr),
                    "params": names, "step": step}
            self._log(kind, _MESSAGES[kind].format(norm=report["global_norm"], thr=a.get("threshold", thr),
                                                   names=", ".join(names[:8])), data, level)
        steps.report([a["kind"] for a in report["anomalies"]], "check_gradients", step=step, loss=report["loss"],
                     grad_norm=report["global_norm"], in_step=in_step)
        self._note_anomalies(report["gradient_anomalies"])
        self._count_violations(report)
        if report["anomalies"] and self.config.clip_on_anomaly and report.is_finite():
            torch.nn.utils.clip_grad_norm_(model.parameters(), self.config.clip_max_norm)
            report["clipped_to"] = self.config.clip_max_norm
            self._log("gradient_clipped", f"gradients clipped to norm {self.config.clip_max_norm}",
                      {"max_norm": self.config.clip_max_norm})
        if not report["anomalies"]:
            self._log("gradient_check", f"gradient norm {report['global_norm']}",
                      {"gradient_norm": report["global_norm"]}, logging.DEBUG)
        return report

    def analyze_gradients(self, model: torch.nn.Module, *args: object, **kwargs: object) -> GradientReport:
        """Seed 001's name for :meth:`check_gradients`."""
        return self.check_gradients(model, *args, **kwargs)

    def _named_norms(self, model: torch.nn.Module) -> dict[str, float]:
        return {n: s["norm"] for n, s in checks.gradient_table(model).items()}

    def check_gradient_explosion(self, model: torch.nn.Module, threshold: float | None = None) -> list[str]:
        """Names of parameters whose gradient norm is finite and above ``threshold``.

        A NaN/Inf gradient is not an explosion: it is logged as ``nonfinite_gradient`` (see
        :meth:`check_gradients`' ``nonfinite_params``) and left out of this list.
        """
        if self._off("enable_gradient_checking"):
            return []
        thr = self.config.explosion_threshold if threshold is None else positive(threshold, "threshold")
        norms = self._named_norms(model)
        out = [n for n, v in norms.items() if math.isfinite(v) and v > thr]
        bad = [n for n, v in norms.items() if not math.isfinite(v)]
        if out:
            self._log("gradient_explosion", f"{len(out)} parameter(s) with gradient norm over {thr}",
                      {"params": out, "threshold": thr}, logging.WARNING)
        if bad:
            self._log("nonfinite_gradient", f"{len(bad)} parameter(s) with non-finite gradients", {"params": bad},
                      logging.ERROR)
        self._violations["explosion"] += bool(out)
        self._violations["nonfinite"] += bool(bad)
        return out

    def check_gradient_vanishing(self, model: torch.nn.Module, threshold: float | None = None) -> list[str]:
        """Names of parameters whose gradient norm is below ``threshold``."""
        if self._off("enable_gradient_checking"):
            return []
        thr = self.config.vanishing_threshold if threshold is None else positive(threshold, "threshold")
        out = [n for n, v in self._named_norms(model).items() if v < thr]
        if out:
            self._log("gradient_vanishing", f"{len(out)} parameter(s) with gradient norm under {thr}",
                      {"params": out, "threshold": thr}, logging.WARNING)
            self._violations["vanishing"] += 1
        return out

    def check_nonfinite_gradients(self, model: torch.nn.Module) -> None:
        """Raise :class:`~torchtrace.NonFiniteError` when any gradient of ``model`` is non-finite."""
        bad = [n for n, v in self._named_norms(model).items() if not math.isfinite(v)]
        if bad:
            raise NonFiniteError(f"non-finite gradients in {', '.join(bad[:8])}", kinds=[semconv.NONFINITE_GRAD])

    def clip_gradients(self, model: torch.nn.Module, max_norm: float = 1.0) -> float:
        """Clip the model's gradients to ``max_norm``; returns the norm before clipping."""
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), positive(max_norm, "max_norm"))
        value = steps.loss_value(norm)
        self._log("gradient_clipped", f"gradient norm {value:.4g} clipped to {max_norm}",
                  {"gradient_norm": value, "max_norm": max_norm})
        return value

    def analyze_gradient_flow(self, model: torch.nn.Module) -> Result:
        """Mean and max absolute gradient per parameter, and parameters with no or zero gradient."""
        if self._off("enable_gradient_checking"):
            return Result(layers=[], no_gradient=[], zero_gradient=[], enabled=False)
        return checks.gradient_flow(model)

    def _count_violations(self, report: GradientReport) -> None:
        kinds = {a["kind"] for a in report["anomalies"]}
        self._violations["nonfinite"] += semconv.NONFINITE_GRAD in kinds
        self._violations["explosion"] += semconv.GRAD_EXPLOSION in kinds
        self._violations["vanishing"] += semconv.GRAD_VANISHING in kinds

    # ------------------------------------------------------------ tensors and parameters
    def analyze_tensor(self, tensor: torch.Tensor, name: str = "tensor") -> Result:
        """NaN/Inf counts, statistics over finite values (``mean``/``mean_value``...), shape, bytes."""
        info = checks.analyze_tensor(tensor, name)
        if info["has_nan"] or info["has_inf"]:
            self._log("tensor_anomaly", f"{name} holds {info['nan_count']} NaN and {info['inf_count']} Inf",
                      {"name": name, "nan_count": info["nan_count"], "inf_count": info["inf_count"]},
                      logging.WARNING)
        return info

    def analyze_model_parameters(self, model: torch.nn.Module) -> ParameterAnalysis:
        """Parameter name -> tensor info; totals as attributes (``result.total_parameters``)."""
        out = checks.analyze_parameters(model)
        bad = out.summary["nonfinite_params"]
        if bad:
            self._log("parameter_anomaly", f"NaN/Inf parameter(s): {', '.join(bad[:8])}", {"params": bad},
                      logging.ERROR)
            steps.report([semconv.NONFINITE_PARAM], "check_model_parameters", data={"params": bad[:8]})
        return out

    def check_model_parameters(self, model: torch.nn.Module) -> Result:
        """Totals, ``param_stats`` (name -> info) and ``ok`` (False when a parameter is non-finite)."""
        out = self.analyze_model_parameters(model)
        return Result(out.summary, param_stats=dict(out), ok=not out.summary["nonfinite_params"])

    # ------------------------------------------------------------ forward, backward, a step
    def debug_forward_pass(self, model: torch.nn.Module, inputs: object, layer_hooks: bool = True) -> Any:
        """Run ``model(inputs)`` and return its outputs (seed 000: ``outputs =
        debugger.debug_forward_pass(...)``); the per-layer report (shapes, statistics, time,
        the module that made a NaN/Inf) is :attr:`last_forward_pass` and a ``forward_pass``
        event. ``debug_mode=False`` or ``layer_hooks=False``: a plain forward, no report."""
        hooks = bool(layer_hooks) and not self._off("debug_mode")
        report = inspection.debug_forward_pass(model, inputs, layer_hooks=hooks)
        output = report.pop("output")
        self.last_forward_pass = Result(report)
        if hooks:
            data = {"layers": [{k: layer[k] for k in ("name", "module", "shape", "mean", "std", "nonfinite_count",
                                                      "time_s")} for layer in report["layers"]],
                    "time_s": report["time_s"], "nonfinite_origin": report["nonfinite_origin"]}
            self._log("forward_pass", f"{len(report['layers'])} layer(s) in {report['time_s']:.4g} s", data,
                      logging.DEBUG)
            if report["first_nonfinite_layer"] is not None:
                self._log("activation_anomaly", f"first non-finite output in {report['first_nonfinite_layer']}",
                          {"layers": report["nonfinite_layers"], "origin": report["nonfinite_origin"]},
                          logging.WARNING)
        return output

    def debug_backward_pass(self, loss: torch.Tensor, retain_graph: bool = False,
                            model: torch.nn.Module | None = None) -> Result:
        """``loss.backward(retain_graph=...)`` timed, with per-parameter gradient statistics.

        ``debug_mode=False``: a plain backward (``{"time_s", "enabled": False}``).
        """
        if self._off("debug_mode"):
            t0 = time.perf_counter()
            loss.backward(retain_graph=retain_graph)
            return Result(time_s=time.perf_counter() - t0, enabled=False)
        out = Result(inspection.debug_backward_pass(loss, model=model, retain_graph=retain_graph), enabled=True)
        if out["nonfinite_params"]:
            self._log("nonfinite_gradient", f"NaN/Inf gradients in {', '.join(out['nonfinite_params'][:8])}",
                      {"params": out["nonfinite_params"]}, logging.ERROR)
        self._log("backward_pass", f"backward in {out['time_s']:.4g} s, gradient norm {out['global_norm']}",
                  {"time_s": out["time_s"], "gradient_norm": out["global_norm"]}, logging.DEBUG)
        return out

    def debug_training_step(self, model: torch.nn.Module, inputs: object, targets: object, loss_fn: Callable[..., Any],
                            optimizer: torch.optim.Optimizer | None = None,
                            gradient_threshold: float | None = None) -> Result:
        """One training step as a torchtrace step (span ``debug_training_step``, step metrics):
        forward statistics, loss, backward statistics, a gradient check at
        ``gradient_threshold``, then the optimizer step (skipped on NaN/Inf)."""
        thr = None if gradient_threshold is None else positive(gradient_threshold, "gradient_threshold")
        checking = not self._off("enable_gradient_checking")
        debugging = not self._off("debug_mode")
        with steps.open_step("debug_training_step", model=model, optimizer=optimizer,
                             level=self.config.level, mode=self.config.mode, inputs=(inputs, targets)):
            out = inspection.debug_training_step(
                model, inputs, targets, loss_fn, optimizer, layer_hooks=debugging, backward_stats=debugging,
                on_loss=lambda loss: steps.share_with_step(model, loss),
                before_step=(lambda: self.check_gradients(model, gradient_threshold=thr)) if checking else None)
        out = Result(out)
        if "before_step" in out:
            out["gradient_check"] = out.pop("before_step")
        if steps.nonfinite(out["loss"]):
            self._log("loss_anomaly", f"loss is {out['loss']}", {"loss": str(out["loss"])}, logging.ERROR)
        return out

    def inspect_model(self, model: torch.nn.Module, input_shape: tuple[int, ...] | list[int] | None = None,
                      **kwargs: Any) -> Result:
        """Layers, parameter counts, dtypes, devices and a validating forward pass (names the layer
        where shapes stop fitting)."""
        out = Result(inspection.inspect_model(model, input_shape, **kwargs))
        fwd = out.get("forward")
        if fwd is not None and not fwd["ok"]:
            self._log("shape_mismatch", f"forward fails in {fwd['failed_layer']}: {fwd['error']}",
                      {"layer": fwd["failed_layer"]}, logging.WARNING)
        return out

    # ------------------------------------------------------------ memory
    def profile_memory(self, name_or_model: object = None, model: torch.nn.Module | None = None) -> Result:
        """Memory now (seed 003: ``profile_memory("training_batch")``; seed 001:
        ``profile_memory_usage(model)["total"]``).

        Keys: ``cpu_memory`` (process RSS, percent of physical memory), ``gpu_memory`` (CUDA
        allocated, MB; None without CUDA), ``rss_bytes`` and the CUDA byte counters,
        ``system_memory_percent``, ``memory_leaks`` (sentences: sustained RSS growth over this
        debugger's recent calls, and ``memory_leak`` anomalies the run recorded since the last
        call), and with a model its ``parameters_bytes``, ``gradients_bytes``, ``buffers_bytes``
        and ``total`` (their sum).
        """
        name = name_or_model if isinstance(name_or_model, str) else None
        if isinstance(name_or_model, torch.nn.Module):
            model = name_or_model
        elif name_or_model is not None and name is None:
            raise TypeError(f"profile_memory: the first argument must be a name (str) or an nn.Module, "
                            f"got {type(name_or_model).__name__}")
        out = Result(memory.memory_profile(model))
        out["name"] = name or f"profile_{self._profiles}"
        self._profiles += 1
        out["memory_leaks"] = self._memory_leaks(out["rss_bytes"])
        self._snapshot(out["name"], out)
        self._note_leaks(out)
        return out

    def _note_leaks(self, out: Result) -> None:
        """One ``memory_leak`` event when a leak is first seen, not one per call. A leak seen
        again after fewer clean calls than the detector's window is the same leak: the growth
        test can miss a call or two of a real leak (a noisy heap: other threads allocating), and
        each miss would otherwise log it anew (13 events for one leak, seen on a GPU machine)."""
        if out["memory_leaks"]:
            if not self._leaking:
                for leak in out["memory_leaks"]:
                    self._log("memory_leak", leak, {"name": out["name"]}, logging.WARNING)
            self._leaking, self._clean_calls = True, 0
        elif self._leaking:
            self._clean_calls += 1
            self._leaking = self._clean_calls < self._growth.window

    def profile_memory_usage(self, model: torch.nn.Module | None = None) -> Result:
        """Seed 001's name: :meth:`profile_memory` of a model (``["total"]`` = its tensor bytes)."""
        return self.profile_memory(model)

    def _memory_leaks(self, rss: int) -> list[str]:
        """Sustained growth over this debugger's recent calls, by the leak detector's rule
        (:class:`~torchtrace.record.growth.GrowthTracker`: robust slope over a window, after a
        window of warm-up), of the bytes malloc has handed out (glibc; RSS elsewhere): unlike
        RSS it falls when memory is freed, so an allocator keeping pages is not a leak."""
        heap = mem_measure.heap_in_use_bytes()
        tracker: GrowthTracker = self._growth
        tracker.add(self._profiles, heap if heap is not None else rss)
        leaks = []
        if tracker.sustained():
            what = "heap in use" if heap is not None else "process memory"
            leaks.append(f"{what} grew {tracker.slope / 2 ** 20:.2f} MB per call over the last "
                         f"{tracker.window} profile_memory calls")
        leaks.extend(self._run_leaks())
        return leaks
