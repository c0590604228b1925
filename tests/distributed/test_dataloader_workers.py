"""DataLoader worker processes (fork, forkserver, spawn) whose dataset runs instrumented code:
they neither hang nor export spans (the main process owns the run's telemetry), so no span
id is duplicated and no second server or run directory appears."""

from __future__ import annotations

import json
import multiprocessing
import os

import pytest
import torch

import torchtrace as tt


class InstrumentedDataset(torch.utils.data.Dataset):
    """Each item is built inside a debug_context, as user code with instrumented helpers does."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        with tt.debug_context("load_item"):
            return torch.full((4,), float(i))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])
def test_dataloader_workers_complete_without_duplicate_spans(method, tt_runtime, tmp_path, monkeypatch):
    if method not in multiprocessing.get_all_start_methods():
        pytest.skip(f"{method} not available")
    monkeypatch.chdir(tmp_path)  # a worker that wrongly configured itself would write ./torchtrace-runs
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with tt.debug_context("before_loader"):  # a span queued before the fork: must not be exported twice
        pass
    loader = torch.utils.data.DataLoader(InstrumentedDataset(), batch_size=4, num_workers=2,
                                         multiprocessing_context=method, timeout=30)
    total = 0.0
    for batch in loader:
        with tt.debug_context("train_step", model=model, optimizer=opt):
            model(batch).sum().backward()
            opt.step()
            opt.zero_grad()
        total += float(batch.sum())
    assert total == sum(range(16)) * 4
    tt.flush()
    spans = [json.loads(line) for line in tt_runtime.spans_path.read_text().splitlines()]
    ids = [s["span_id"] for s in spans]
    assert len(ids) == len(set(ids))
    names = sorted(s["name"] for s in spans)
    assert names == ["before_loader"] + ["train_step"] * 4  # workers exported nothing
    assert not (tmp_path / "torchtrace-runs").exists()
    # Only this process's files (its claims on their names are hidden .lock files while it runs).
    # (the black box and the hang watchdog's stack files are the parent's alone too: the
    # workers' stacks are written into the parent's workers.txt only when a hang asks for them,
    # and a run that asked none removes it at shutdown)
    assert sorted(p.name for p in tt_runtime.run_dir.iterdir() if not p.name.endswith(".lock")) == \
        ["spans.jsonl", "stacks.txt", "state.json", "workers.txt"]
    workers_file = tt_runtime.run_dir / "workers.txt"
    announced = workers_file.read_text()
    assert announced.count("torchtrace worker ") == (2 if method == "fork" else 0), announced
    tt.shutdown()
    assert not workers_file.exists()
    assert json.loads((tt_runtime.run_dir / "state.json").read_text())["pid"] == os.getpid()
