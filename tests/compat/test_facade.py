"""compat/ is a facade (issue 46): its checks are the core's measures and rules, so a seed
check and a torchtrace step give the same numbers, to the bit, and the same anomalies."""

from __future__ import annotations

import ast
import logging
import threading
from pathlib import Path

import pytest
import torch

import torchtrace as tt
from tests.compat.common import ref_norm, small_classifier, spans
from torchtrace import PyTorchDebugger, semconv
from torchtrace.compat import AsyncTrainingLogger


def _step_and_check(tt_runtime, scale: float, plant=None, level: str = "basic"):
    model = small_classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
    debugger = PyTorchDebugger()
    with tt.debug_context("train_step", model=model, optimizer=opt, level=level) as step:
        loss = torch.nn.functional.cross_entropy(model(x), y) * scale
        loss.backward()
        if plant is not None:
            plant(model)
        ref = ref_norm(p.grad for p in model.parameters())
        report = debugger.check_gradients(model, loss)
        opt.step()
    tt.flush()
    span = [s for s in spans(tt_runtime) if s["name"] == "train_step"][-1]
    return report, step, span, ref


def test_compat_global_norm_is_the_cores_to_the_bit(tt_runtime):
    report, step, _, ref = _step_and_check(tt_runtime, 1.0)
    assert report["global_norm"] == step.record.grad_norm  # the same value, not merely close
    assert report["global_norm"] == pytest.approx(ref, rel=1e-6)  # and right: float64 plain loop
    per_tensor = dict(zip(step.record.grad_names, step.record.grad_norms))
    assert {n: s["norm"] for n, s in report["param_stats"].items()} == per_tensor


def test_compat_anomalies_are_the_core_rules(tt_runtime):
    # An explosion, at ADVANCED: the level whose steps name the tensors, as the seed checks do.
    report, step, span, _ = _step_and_check(tt_runtime, 1e6, level="advanced")
    kinds = [a["kind"] for a in report["anomalies"]]
    assert kinds == [semconv.GRAD_EXPLOSION] == [a.kind for a in step.record.anomalies]
    assert report["exploded_params"] == step.record.grad_exploded_params


def test_compat_nonfinite_gradients_name_the_cores_params(tt_runtime):
    def plant(model):
        model[0].weight.grad[0, 0] = float("nan")
        model[2].bias.grad[1] = float("inf")

    report, step, _, _ = _step_and_check(tt_runtime, 1.0, plant)
    assert [a["kind"] for a in report["anomalies"]] == [semconv.NONFINITE_GRAD]
    assert report["nonfinite_params"] == step.record.grad_nonfinite_params == ["0.weight", "2.bias"]
    assert report["gradient_anomalies"] == ["NaN gradient in 0.weight", "Inf gradient in 2.bias"]
    assert (report["params_with_nan_grad"], report["params_with_inf_grad"]) == (1, 1)


def _private_reads(path: Path) -> list[str]:
    """``obj._name`` reads where ``obj`` is not ``self``/``cls`` (another object's private)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            if not (isinstance(base, ast.Name) and base.id in ("self", "cls")):
                out.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return out


def test_compat_reads_no_private_attribute_of_another_object():
    root = Path(tt.__file__).parent / "compat"
    found = [hit for path in sorted(root.glob("*.py")) for hit in _private_reads(path)]
    assert found == []


class _Gate(logging.Handler):
    """A handler that holds the writer until the test opens the gate."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.messages: list[str] = []

    def emit(self, record):
        self.gate.wait(5)
        self.messages.append(record.getMessage())


def test_async_logger_on_the_standard_queue_listener_drops_and_counts_when_full(capsys):
    target = logging.getLogger("facade.gate")
    target.setLevel(logging.INFO)
    target.propagate = False
    handler = _Gate()
    target.addHandler(handler)
    log = AsyncTrainingLogger(user_id=1, model_name="tiny", logger=target, queue_size=2)
    try:
        for i in range(6):
            log.log_info(f"record {i}")
        # One record is with the (held) handler, two wait in the queue: by hand, 3 of 6 dropped
        # (the first may not have left the queue yet: then 4).
        assert log.dropped in (3, 4)
        handler.gate.set()
        assert log.flush(timeout=5.0)
        assert len(handler.messages) == 6 - log.dropped
        assert handler.messages[0] == "record 0"
    finally:
        log.close()
        target.removeHandler(handler)
    assert "Traceback" not in capsys.readouterr().err  # a full queue is counted, not reported as an error
    assert not [t for t in threading.enumerate() if t.name == "torchtrace-training-logger"]
