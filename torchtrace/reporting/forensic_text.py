"""A forensic report's origin in words, for the reports and the live page: one rule, written
twice (:func:`forensic_cause` for the terminal, :data:`SENTENCE_JS` for the pages), each saying
what the report's fields say."""

from __future__ import annotations

from typing import Any


def forensic_cause(report: dict[str, Any]) -> str:
    """Where the report says the value came from, as its fields say it (the live page's and the
    HTML report's ``sentence`` is the same rule): gradients ``carried_over`` from an earlier step,
    a value that came ``input`` (the batch, when the module is the model itself), the loss
    computation, no origin found (what the replay ``tried``), or the module it was born in.

    >>> forensic_cause({"cause": "input", "module": "", "module_type": "MLP", "inputs": {"nan_count": 2}})
    "input: came in with the batch: the model's input (MLP) held 2 NaN/Inf before any module ran"
    """
    cause, module = report.get("cause") or "unknown", report.get("module")
    typed = f" ({report['module_type']})" if report.get("module_type") else ""
    carried = report.get("carried_over")
    if cause == "unknown" and carried:
        names = ", ".join(carried[:3]) + (" ..." if len(carried) > 3 else "")
        return (f"carried over: non-finite gradients from before this step ({len(carried)}: {names}), "
                "accumulated since the last update by an earlier step, whose report names the origin; "
                "this step's replay was finite")
    if cause == "input" and module == "":
        text = (f"input: came in with the batch: the model's input{typed} held {_nonfinite(report, 'inputs')} "
                "NaN/Inf before any module ran")
    elif cause == "input":
        text = (f"input: came in from outside the model's modules: the input of {module}{typed}, the first module "
                f"to receive it, held {_nonfinite(report, 'inputs')} NaN/Inf")
    elif module == "<loss>":
        text = f"{cause}: born in the loss computation, outside any module"
    elif module is None:
        text = f"{cause}: origin not found" + (f" ({report['tried']})" if report.get("tried") else "")
    else:
        where = "the model's own forward" if module == "" else module
        text = f"{cause}: born in {where}{typed}"
        if cause == "forward":
            text += f"; input finite, output {_nonfinite(report, 'outputs')} NaN/Inf"
    if report.get("op"):
        text += f"; backward op {report['op']}"
    return text


def _nonfinite(report: dict[str, Any], key: str) -> int:
    """NaN plus Inf values the report counted in its ``inputs`` or ``outputs``."""
    stats = report.get(key) or {}
    return (stats.get("nan_count") or 0) + (stats.get("inf_count") or 0)


SENTENCE_JS = r"""
(function () {
  "use strict";
  /* forensic_cause (reporting/forensic_text.py), the same rule and the same words */
  window.ttForensicSentence = function (f) {
    var cause = f.cause || "unknown", m = f.module, typed = f.module_type ? " (" + f.module_type + ")" : "";
    var bad = function (s) { s = s || {}; return (s.nan_count || 0) + (s.inf_count || 0); }, text;
    var carried = f.carried_over || [];
    if (cause === "unknown" && carried.length) {
      return "carried over: non-finite gradients from before this step (" + carried.length + ": " +
        carried.slice(0, 3).join(", ") + (carried.length > 3 ? " ..." : "") + "), accumulated since the last " +
        "update by an earlier step, whose report names the origin; this step's replay was finite";
    }
    if (cause === "input" && m === "") {
      text = "input: came in with the batch: the model's input" + typed + " held " + bad(f.inputs) +
        " NaN/Inf before any module ran";
    } else if (cause === "input") {
      text = "input: came in from outside the model's modules: the input of " + m + typed +
        ", the first module to receive it, held " + bad(f.inputs) + " NaN/Inf";
    } else if (m === "<loss>") {
      text = cause + ": born in the loss computation, outside any module";
    } else if (m === null || m === undefined) {
      text = cause + ": origin not found" + (f.tried ? " (" + f.tried + ")" : "");
    } else {
      text = cause + ": born in " + (m === "" ? "the model's own forward" : m) + typed;
      if (cause === "forward") text += "; input finite, output " + bad(f.outputs) + " NaN/Inf";
    }
    if (f.op) text += "; backward op " + f.op;
    return text;
  };
})();
"""
