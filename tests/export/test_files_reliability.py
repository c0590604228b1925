"""Run-directory files: strict JSON, atomic, 0600, size-capped, one name per rank."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch

import torchtrace as tt
from torchtrace import files
from torchtrace.api import get_runtime


def _strict_loads(text: str):
    def reject(token):
        raise ValueError(f"non-strict JSON token {token}")

    return json.loads(text, parse_constant=reject)


def _clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith(("TORCHTRACE_", "OTEL_")):
            monkeypatch.delenv(name, raising=False)


def test_report_and_spans_are_strict_json_private_and_atomic(tmp_path, monkeypatch):
    _clean_env(monkeypatch)
    result = tt.configure(prometheus_port="off", run_dir=str(tmp_path), register_atexit=False, strict=True)
    with tt.debug_context("train_step") as step:
        step.record_loss(torch.tensor(float("nan")))
    tt.shutdown()
    report_text = result.report_path.read_text()
    report = _strict_loads(report_text)
    assert report["last_step"]["loss"] == "NaN"
    for line in result.spans_path.read_text().splitlines():
        _strict_loads(line)
    for path in (result.report_path, result.spans_path):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(result.run_dir.stat().st_mode) == 0o700
    assert [p.name for p in result.run_dir.iterdir() if p.name.startswith(".")] == []  # no temp or lock files left


def test_failed_atomic_write_keeps_the_previous_file(tmp_path, monkeypatch):
    target = tmp_path / "report.json"
    files.write_json_atomic(target, {"v": 1})
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError):
        files.write_json_atomic(target, {"v": 2})
    assert json.loads(target.read_text()) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]


def test_size_caps_stop_files_growing_and_are_counted(tmp_path, monkeypatch):
    _clean_env(monkeypatch)
    cap = 4096
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), register_atexit=False, strict=False,
                 max_file_bytes=cap)
    rt = get_runtime()
    for _ in range(200):
        with tt.debug_context("train_step"):
            pass
    tt.shutdown()
    assert rt.spans_path.stat().st_size <= cap
    assert rt.processors[0].dropped["export_failed"] > 0
    # The report is larger than the cap: it is not written, and the failure is counted.
    assert rt.errors.by_component.get("files", 0) >= 1
    if rt.report_path.exists():
        assert rt.report_path.stat().st_size <= cap


def test_file_names_are_per_rank(tmp_path, monkeypatch):
    _clean_env(monkeypatch)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    result = tt.configure(prometheus_port="off", run_dir=str(tmp_path), run_id="job-1", register_atexit=False)
    tt.shutdown()
    assert result.report_path.name == "report.rank3.json"
    assert result.spans_path.name == "spans.rank3.jsonl"


def test_attribute_values_are_length_limited(tmp_path, monkeypatch):
    from torchtrace import semconv

    _clean_env(monkeypatch)
    result = tt.configure(prometheus_port="off", run_dir=str(tmp_path), register_atexit=False, strict=True)
    with tt.debug_context("train_step", attributes={"user.note": "x" * 100_000}):
        pass
    tt.shutdown()
    [span] = files.read_json_lines(result.spans_path)
    assert len(span["attributes"]["user.note"]) == semconv.MAX_ATTRIBUTE_LENGTH
