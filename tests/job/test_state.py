"""The black box: whole files only, read back as written, unreadable ones left out."""

from __future__ import annotations

import threading
import time

from torchtrace.job.state import RankState, read_states


def test_fields_written_are_read_back(tmp_path):
    box = RankState(tmp_path / "state.rank1.json", {"rank": 1, "attempt": 2})
    box.fields.update(step=7, phase="backward", loss=float("nan"))
    assert box.write()
    (state,) = read_states(tmp_path)
    assert (state["rank"], state["attempt"], state["step"], state["phase"]) == (1, 2, 7, "backward")
    assert state["loss"] == "NaN"  # strict JSON: a NaN is written as the string "NaN"
    assert state["ended"] is None and state["time"] >= state["started"]


def test_a_reader_never_sees_a_torn_file(tmp_path):
    box = RankState(tmp_path / "state.json", {"rank": 0, "blob": "x" * 20000})
    box.write()
    stop = threading.Event()

    def writer():
        step = 0
        while not stop.is_set():
            step += 1
            box.fields["step"] = step
            box.write()

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        seen = [read_states(tmp_path) for _ in range(300)]
    finally:
        stop.set()
        thread.join()
    assert all(len(states) == 1 and len(states[0]["blob"]) == 20000 for states in seen)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_unreadable_files_are_left_out_and_order_is_attempt_then_rank(tmp_path):
    (tmp_path / "state.rank0.json").write_text('{"rank": 0, "attem')
    for attempt, rank in ((1, 1), (0, 1), (1, 0)):
        sub = tmp_path / f"attempt-{attempt}"
        sub.mkdir(exist_ok=True)
        RankState(sub / f"state.rank{rank}.json", {"rank": rank, "attempt": attempt}).write()
    assert [(s["attempt"], s["rank"]) for s in read_states(tmp_path)] == [(0, 1), (1, 0), (1, 1)]


def test_no_path_keeps_fields_in_memory(tmp_path):
    box = RankState(None, {"rank": 0})
    box.fields["step"] = 3
    assert box.write() is False and box.fields["step"] == 3


def test_the_writer_thread_keeps_the_file_current_and_stops(tmp_path):
    box = RankState(tmp_path / "state.json", {"rank": 0})
    box.start(0.01)
    box.fields["step"] = 5
    deadline = time.monotonic() + 5
    while box.writes < 3 and time.monotonic() < deadline:
        threading.Event().wait(0.01)
    box.stop()
    assert box.writes >= 3 and read_states(tmp_path)[0]["step"] == 5
    assert not any(t.name == "torchtrace-blackbox" for t in threading.enumerate())
