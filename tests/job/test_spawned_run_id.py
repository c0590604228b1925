"""The run id that ranks started through ``multiprocessing`` derive from their parent
(:func:`torchtrace.job.identity.spawned_run_id`), checked in this process with this process
standing in for the parent. The real spawns are in tests/test_spawned_children.py."""

from __future__ import annotations

import calendar
import json
import multiprocessing
import os
import re
import time
from types import SimpleNamespace

import pytest

from torchtrace.config.parsers import check_run_id
from torchtrace.job import identity as job_identity

STATE = "state.rank1.json"


@pytest.fixture
def as_our_child(monkeypatch):
    """``multiprocessing.parent_process()`` names this process, as it does in a spawned rank."""
    monkeypatch.setattr(multiprocessing, "parent_process", lambda: SimpleNamespace(pid=os.getpid()))


def _ended_black_box(path, pid=os.getpid() + 1_000_000) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"pid": pid, "ended": "completed", "host": None}))


def test_none_outside_a_multiprocessing_child(tmp_path):
    assert multiprocessing.parent_process() is None
    assert job_identity.spawned_run_id(tmp_path, STATE) is None


def test_the_id_is_the_parents_start_and_is_the_same_on_every_call(as_our_child, tmp_path):
    first = job_identity.spawned_run_id(tmp_path, STATE)
    assert first == job_identity.spawned_run_id(None, STATE) and check_run_id(first, "run_id") == first
    stamp, digest = re.fullmatch(r"(\d{8}-\d{6})-([0-9a-f]{6})", first).groups()
    started = calendar.timegm(time.strptime(stamp, "%Y%m%d-%H%M%S"))
    # Read another way: from the uptime, to about 10 ms. The id's stamp rounds down twice (the
    # kernel's boot time is whole seconds, and so is the stamp), so it lies up to 2 s before.
    assert -0.05 <= job_identity.process_start_time(os.getpid()) - started < 2.05


def test_a_later_launch_takes_the_next_free_id(as_our_child, tmp_path):
    first = job_identity.spawned_run_id(tmp_path, STATE)
    _ended_black_box(tmp_path / first / STATE)
    assert job_identity.spawned_run_id(tmp_path, STATE) == f"{first}-2"
    _ended_black_box(tmp_path / f"{first}-2" / STATE)
    assert job_identity.spawned_run_id(tmp_path, STATE) == f"{first}-3"
    # Each rank looks at its own slot only: rank 0, whose black boxes are not there, keeps the first.
    assert job_identity.spawned_run_id(tmp_path, "state.rank0.json") == first


def test_a_live_sibling_of_the_same_launch_keeps_the_id(as_our_child, tmp_path):
    """The same rank's slot held by a live process of this host (the same launch configured
    twice) is not an earlier launch."""
    first = job_identity.spawned_run_id(tmp_path, STATE)
    path = tmp_path / first / STATE
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"pid": os.getpid(), "ended": None}))
    assert job_identity.spawned_run_id(tmp_path, STATE) == first
