"""TrainedParameters: FLOP counts dropped when the parameters with gradients change, and how often."""

from __future__ import annotations

from types import SimpleNamespace

from torchtrace.measure.flops import StepFlops
from torchtrace.step.trainable import MAX_RECOUNTS, TrainedParameters


def _grads(n):
    return SimpleNamespace(stats=SimpleNamespace(names=[f"p{i}" for i in range(n)]))


def test_a_change_drops_only_that_operations_counts_and_a_flapping_one_stops_after_the_limit():
    flops, warned, forgotten = StepFlops(), [], []
    flops.record(("train", ("a",)), 100)
    flops.record(("eval", ("a",)), 40)
    trained = TrainedParameters(flops, lambda key, *msg: warned.append(key), lambda: forgotten.append(1))
    assert not trained.changed("train", _grads(6), counted=True)
    assert not trained.changed("train", _grads(6), counted=False)
    assert not trained.changed("train", None, counted=False)  # no gradients measured: nothing known
    assert trained.changed("train", _grads(2), counted=False)  # the backbone was frozen
    assert flops.lookup(("train", ("a",))) is None and flops.needs_count(("train", ("a",)))
    assert flops.lookup(("eval", ("a",))) == 40 and forgotten == [1]
    # Experts that get gradients in some steps only: recounted MAX_RECOUNTS times, then kept, said once.
    changes = 1
    for i in range(3 * MAX_RECOUNTS):
        flops.record(("train", ("a",)), 100)
        trained.changed("train", _grads(6 + i % 2), counted=True)
        changes += trained.changed("train", _grads(7 - i % 2), counted=False)
    assert changes == MAX_RECOUNTS and len(set(warned)) == 1
