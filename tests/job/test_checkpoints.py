"""Checkpoint saves and loads timed without calls: torch.save/torch.load wrapped at configure
and restored at shutdown, tt.checkpoint for anything else, a nested save counted once."""

from __future__ import annotations

import time

import pytest
import torch

import torchtrace as tt
from torchtrace import current, semconv


@pytest.fixture
def rt(tmp_path):
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), run_id="ck", register_atexit=False)
    yield current.runtime(create=False)
    tt.shutdown()


def _hist(rt, kind):
    labels = {"kind": kind}
    count = rt.metrics.value(semconv.M_CHECKPOINT_SECONDS + "_count", labels)
    total = rt.metrics.value(semconv.M_CHECKPOINT_SECONDS + "_sum", labels)
    return count, total


def test_torch_save_and_load_are_timed_and_restored(rt, tmp_path):
    original_save = torch.save.__wrapped__
    for step in range(3):
        with tt.debug_context("train_step", step=step):
            pass
    t0 = time.perf_counter()
    torch.save({"x": torch.zeros(1 << 20)}, tmp_path / "a.pt")
    took = time.perf_counter() - t0
    torch.load(tmp_path / "a.pt")
    count, total = _hist(rt, "save")
    assert count == 1 and 0 < total <= took
    assert _hist(rt, "load")[0] == 1
    box = rt.rank_state.fields
    assert box["checkpoint_step"] == 2 and box["checkpoint_seconds"]["save"] == pytest.approx(total)
    assert rt.throughput.ledger.snapshot(time.perf_counter()).badput["checkpoint"] > 0
    tt.shutdown()
    assert torch.save is original_save and not hasattr(torch.save, "__wrapped__")


def test_a_save_inside_a_save_counts_once(rt, tmp_path):
    with tt.checkpoint("save"):
        torch.save({"x": 1}, tmp_path / "inner.pt")
        with tt.checkpoint("save"):
            pass
    assert _hist(rt, "save")[0] == 1


def test_a_save_that_raises_counts_nothing(rt, tmp_path):
    with pytest.raises(RuntimeError):
        with tt.checkpoint("save"):
            raise RuntimeError("disk gone")
    assert _hist(rt, "save")[0] == 0 and rt.rank_state.fields.get("checkpoint_step") is None


def test_checkpoint_names_the_accepted_kinds():
    with pytest.raises(ValueError, match="save, load"):
        with tt.checkpoint("snapshot"):
            pass


def test_distributed_checkpoint_is_wrapped_when_imported(rt, tmp_path):
    import torch.distributed.checkpoint as dcp

    assert hasattr(dcp.save, "__wrapped__")
    dcp.save({"w": torch.ones(4)}, checkpoint_id=str(tmp_path / "dcp"))
    state = {"w": torch.zeros(4)}
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"))
    assert torch.equal(state["w"], torch.ones(4))
    assert _hist(rt, "save")[0] == 1 and _hist(rt, "load")[0] == 1  # its inner torch.save calls not again
