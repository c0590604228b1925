"""Checkpoint saves and loads timed without calls: torch.save/torch.load wrapped at configure
and restored at shutdown, tt.checkpoint for anything else, a nested save counted once."""

from __future__ import annotations

import io
import threading
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


def _steps(first: int, last: int) -> None:
    for step in range(first, last + 1):
        with tt.debug_context("train_step", step=step):
            pass


def test_a_distributed_checkpoint_written_by_several_threads_counts_once(rt, tmp_path):
    """``FileSystemWriter(thread_count=3)`` writes its files from threads of its own, each item
    through ``torch.save``: those calls are part of the save on the training thread. They were
    counted as saves of their own (and their time as checkpoint badput beside the save's)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    _steps(0, 2)
    state = {f"w{i}": torch.full((256,), float(i)) for i in range(12)}
    dcp.save(state, storage_writer=FileSystemWriter(str(tmp_path / "dcp"), thread_count=3), no_dist=True)
    assert _hist(rt, "save")[0] == 1
    assert rt.rank_state.fields["checkpoint_step"] == 2


def test_an_asynchronous_save_counts_when_its_upload_completes_as_of_its_call(rt, tmp_path):
    """``dcp.async_save`` (torchtitan's asynchronous checkpoints) stages the state as it is
    called and uploads it on a thread while training goes on. The checkpoint holds the step of
    the call, and exists once the upload completes.

    Before: each ``torch.save`` of the upload thread counted as a save of its own, and the last
    one set ``checkpoint_step`` to the step finished when the upload ended (here 9, for a
    checkpoint of step 4): a restart's lost progress was short by those steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    uploading = threading.Event()
    release = threading.Event()

    class HeldWriter(FileSystemWriter):
        """Holds the upload until the test lets it go: slow storage, on cue."""

        def write_data(self, plan, planner):
            uploading.set()
            assert release.wait(30)
            return super().write_data(plan, planner)

    _steps(0, 4)
    state = {f"w{i}": torch.full((256,), float(i)) for i in range(12)}
    t0 = time.perf_counter()
    upload = dcp.async_save(state, storage_writer=HeldWriter(str(tmp_path / "async")), no_dist=True)
    called = time.perf_counter() - t0
    assert uploading.wait(30)
    _steps(5, 9)  # training goes on while the upload waits
    box = rt.rank_state.fields
    assert box.get("checkpoint_step") is None  # not saved yet: a restart now would start from scratch
    release.set()
    upload.result(timeout=30)
    deadline = time.monotonic() + 10  # (the done callback runs on the upload's thread)
    while box.get("checkpoint_step") is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert box["checkpoint_step"] == 4
    count, total = _hist(rt, "save")
    assert count == 1 and 0 < total <= called  # the call's own time: the wait the training saw


def test_an_asynchronous_save_whose_upload_fails_is_no_checkpoint(rt, tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    class FailingWriter(FileSystemWriter):
        def write_data(self, plan, planner):
            raise OSError("the bucket is gone")

    _steps(0, 3)
    upload = dcp.async_save({"w": torch.ones(4)}, storage_writer=FailingWriter(str(tmp_path / "gone")), no_dist=True)
    with pytest.raises(BaseException, match="the bucket is gone"):  # (dcp's CheckpointException is a BaseException)
        upload.result(timeout=30)
    time.sleep(0.1)
    assert rt.rank_state.fields.get("checkpoint_step") is None


def test_a_marked_save_that_hands_over_counts_once_its_upload_completes(rt, tmp_path):
    """``tt.checkpoint("save")`` around code that hands the checkpoint to a thread of its own
    (an object store's upload): the yielded call's ``upload`` is that thread's future."""
    from concurrent.futures import ThreadPoolExecutor

    release = threading.Event()
    _steps(0, 2)
    with ThreadPoolExecutor(max_workers=1) as uploads:
        with tt.checkpoint("save") as call:
            call.upload = uploads.submit(release.wait, 30)
        _steps(3, 6)
        assert rt.rank_state.fields.get("checkpoint_step") is None  # not stored yet
        release.set()
    deadline = time.monotonic() + 10  # (the done callback runs on the upload's thread)
    while rt.rank_state.fields.get("checkpoint_step") is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rt.rank_state.fields["checkpoint_step"] == 2


class _SlowFile(io.BytesIO):
    """Storage that takes 0.1 s a write: a save of a few seconds."""

    def write(self, data):
        time.sleep(0.1)
        return super().write(data)


def test_a_long_save_between_steps_is_a_checkpoint_not_a_hang(tmp_path):
    """A plain ``torch.save`` between steps (nanoGPT's checkpoint) that outlasts the hang
    timeout was flagged as a hang in phase ``data_wait`` (and, under ``on_hang="abort"``, would
    end the job in its checkpoint). The wrapped save now marks the phase ``checkpoint`` while it
    runs, with that phase's allowance. The same pause with no save in it is still a hang."""
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), run_id="slow", hang_timeout_s=2.0,
                 register_atexit=False)
    try:
        rt = current.runtime(create=False)
        box = rt.rank_state.fields
        _steps(0, 4)
        phases = []
        sampler = threading.Thread(target=lambda: [phases.append(box.get("phase")) or time.sleep(0.2)
                                                   for _ in range(10)])
        sampler.start()
        t0 = time.perf_counter()
        torch.save({"w": torch.zeros(1000)}, _SlowFile())
        took = time.perf_counter() - t0
        sampler.join()
        assert took > 3.5, took  # longer than the timeout and the watchdog's look
        assert not box.get("hangs") and not (tmp_path / "slow" / "hang.json").exists()
        assert "checkpoint" in phases and box["phase"] == "data_wait"  # (and back after it)
        assert box["checkpoint_step"] == 4
        time.sleep(took)  # the same pause, no save in it
        assert box.get("hangs") == 1 and (tmp_path / "slow" / "hang.json").exists()
    finally:
        tt.shutdown()


class _SlowRead(io.BytesIO):
    def read(self, *args):
        time.sleep(0.05)
        return super().read(*args)


def test_a_load_before_the_first_step_stays_idle(tmp_path):
    """A resume's load before the first step stays in phase ``idle``, which no timeout watches
    (a large checkpoint may take longer than the checkpoint phase's 600 s to read)."""
    buffer = io.BytesIO()
    torch.save({"w": torch.zeros(1000)}, buffer)
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), run_id="resume", register_atexit=False)
    try:
        box = current.runtime(create=False).rank_state.fields
        phases = []
        sampler = threading.Thread(target=lambda: [phases.append(box.get("phase")) or time.sleep(0.05)
                                                   for _ in range(10)])
        sampler.start()
        state = torch.load(_SlowRead(buffer.getvalue()))
        sampler.join()
        assert torch.equal(state["w"], torch.zeros(1000))
        assert set(phases) == {"idle"} and box["phase"] == "idle", phases
        assert _hist(current.runtime(create=False), "load")[0] == 1  # (timed all the same)
    finally:
        tt.shutdown()


def test_a_save_inside_a_training_step_is_checkpoint_time_not_the_steps(rt, tmp_path):
    """A loop body wrapped whole, saving every few steps (nanoGPT's order): the saves' time was
    the steps' own, productive, and goodput came out high by all of it."""
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    saved = 0.0
    for step in range(6):
        with tt.debug_context("train_step", model=model, optimizer=opt):
            opt.zero_grad()
            model(torch.randn(8, 64)).pow(2).mean().backward()
            opt.step()
            if step % 3 == 2:
                with tt.checkpoint("save"):
                    time.sleep(0.15)  # the write
                saved += _hist(rt, "save")[1] - saved
    g = rt.throughput.ledger.snapshot(time.perf_counter())
    assert saved >= 0.3
    assert g.badput["checkpoint"] == pytest.approx(saved, rel=1e-6)
    assert g.productive_s < 0.2, g  # six small steps, without the 0.3 s of saving
    assert rt.rank_state.fields["checkpoint_step"] == 4  # (the step finished before the last save)


def test_a_save_while_the_step_before_waits_for_its_copy_is_booked_after_that_step(rt, tmp_path, monkeypatch):
    """On a GPU a step's record waits for its copy and is booked when the next step ends. A
    save between the two, booked at once, went into the goodput ledger before the step that
    preceded it, whose time then read as data wait. Here the runtime says a record is pending
    while the save is booked: the save waits, and goes in with the next step, after the one
    before it. Every step's time stays productive, the save's is checkpoint badput."""
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step():
        with tt.debug_context("train_step", model=model, optimizer=opt):
            model(torch.randn(2, 4)).sum().backward()
            time.sleep(0.05)
            opt.step()
            opt.zero_grad()

    for _ in range(2):
        step()
    ledger = rt.throughput.ledger
    productive = ledger.closed().productive_s
    monkeypatch.setattr(rt, "records_pending", lambda: True)
    t0 = time.perf_counter()
    torch.save({"x": torch.zeros(1 << 16)}, tmp_path / "b.pt")
    time.sleep(0.05)
    saved = time.perf_counter() - t0
    assert ledger.closed().badput["checkpoint"] == 0  # waiting for the step before it
    monkeypatch.undo()
    step()
    g = ledger.closed()
    assert 0 < g.badput["checkpoint"] <= saved
    # The wait between the steps is the planted 0.05 s after the save and the loop's own
    # moments; the step before the save read as data wait would add its 0.05 s more.
    assert g.productive_s >= productive + 0.05 and g.badput["data_wait"] < 0.09


def test_an_evaluation_step_is_not_the_jobs_last_step(tmp_path):
    """Training steps numbered 0-19 and an evaluation operation (its own steps, 0-3) after
    every fifth, with a save after training step 9. Before, each evaluation's number became the
    black box's last step: the checkpoint read step 1 (the second evaluation's), the job's last
    step 3, and ``torchtrace why`` said "last step 3" of a run that trained 20 steps (a killed
    run's lost steps were counted from it too). Now only training steps are the job's."""
    from torchtrace.job.state import read_states
    from torchtrace.job.story import job_story

    tt.configure(prometheus_port="off", run_dir=str(tmp_path), run_id="evals", register_atexit=False)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @tt.debug_operation(model=model, optimizer=opt)
    def train_step(x):
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        return loss

    @tt.debug_operation(model=model, kind="evaluation")
    def eval_step(x):
        with torch.no_grad():
            return model(x).pow(2).mean()

    for s in range(20):
        train_step(torch.randn(8, 4))
        if s % 5 == 4:
            eval_step(torch.randn(8, 4))
        if s == 9:
            torch.save(model.state_dict(), tmp_path / "ck.pt")
    tt.shutdown()
    (state,) = read_states(tmp_path / "evals")
    assert (state["step"], state["checkpoint_step"]) == (19, 9)
    (attempt,) = job_story(tmp_path / "evals")["attempts"]
    assert attempt["last_step"] == 19


def test_safetensors_file_functions_are_timed_once_each_and_restored(rt, tmp_path):
    """safetensors' ``save_file``/``load_file`` (and ``save_model``/``load_model``, which call
    them) are checkpoints of their own: they write no ``torch.save`` and were not timed at all.
    Inside another save they count nothing more."""
    import safetensors.torch as st

    original = st.save_file.__wrapped__
    _steps(0, 1)
    st.save_file({"w": torch.ones(1 << 16)}, str(tmp_path / "a.safetensors"))
    assert torch.equal(st.load_file(str(tmp_path / "a.safetensors"))["w"], torch.ones(1 << 16))
    model = torch.nn.Linear(4, 4)
    st.save_model(model, str(tmp_path / "m.safetensors"))
    st.load_model(model, str(tmp_path / "m.safetensors"))
    with tt.checkpoint("save"):
        st.save_file({"w": torch.zeros(4)}, str(tmp_path / "inner.safetensors"))
    assert _hist(rt, "save")[0] == 3 and _hist(rt, "load")[0] == 2
    assert rt.rank_state.fields["checkpoint_step"] == 1
    tt.shutdown()
    assert st.save_file is original


_STAND_IN = '''
import torch
from safetensors.torch import save_file


class Accelerator:
    """As accelerate's: one file per object, a safetensors model and torch.save for the rest."""

    def save_state(self, output_dir):
        save_file({"w": torch.ones(4)}, output_dir + "/model.safetensors")
        for name in ("optimizer", "scheduler", "random_states"):
            torch.save({name: 1}, output_dir + "/" + name + ".bin")

    def load_state(self, input_dir):
        for name in ("optimizer", "scheduler", "random_states"):
            torch.load(input_dir + "/" + name + ".bin")
'''


def _one_checkpoint_each(rt, accelerator, tmp_path):
    assert hasattr(type(accelerator).save_state, "__wrapped__")
    _steps(0, 2)
    out = tmp_path / "state"
    out.mkdir()
    t0 = time.perf_counter()
    accelerator.save_state(str(out))
    took = time.perf_counter() - t0
    accelerator.load_state(str(out))
    count, total = _hist(rt, "save")
    assert count == 1 and 0 < total <= took
    assert _hist(rt, "load")[0] == 1
    assert rt.rank_state.fields["checkpoint_step"] == 2
    tt.shutdown()
    assert not hasattr(type(accelerator).save_state, "__wrapped__")


def test_an_accelerate_save_state_is_one_checkpoint_with_its_whole_time(rt, tmp_path):
    """``Accelerator.save_state`` writes a file per object (the model, the optimizer, the
    scheduler, the random states): it counted as 3 or 4 saves, the time of its inner
    ``torch.save`` calls only (the safetensors model, most of it, was not timed). It is one
    save, timed whole, and ``load_state`` one load."""
    accelerate = pytest.importorskip("accelerate")
    model = torch.nn.Linear(8, 8)
    accelerator = accelerate.Accelerator(cpu=True)
    accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    _one_checkpoint_each(rt, accelerator, tmp_path)


def test_an_accelerator_imported_after_configure_is_wrapped_as_it_is_imported(rt, tmp_path, monkeypatch):
    """The same through the import hook, with a stand-in ``accelerate`` package where the real
    one is not installed (its save_state writes as accelerate's does)."""
    import importlib.util
    import sys

    if importlib.util.find_spec("accelerate") is not None:
        pytest.skip("accelerate is installed: the test above uses the real one")
    package = tmp_path / "site" / "accelerate"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("from accelerate.accelerator import Accelerator\n")
    (package / "accelerator.py").write_text(_STAND_IN)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    for name in ("accelerate", "accelerate.accelerator"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    import accelerate

    _one_checkpoint_each(rt, accelerate.Accelerator(), tmp_path)


def test_idle_after_the_last_step_is_no_hang_and_no_badput(tmp_path):
    """``tt.idle()``: training is over for now (the script evaluates, serves, or keeps a page
    up). The time after it was ``data_wait`` under the regular timeout: the demo's 30 s hold
    was reported as a training hang, and counted as badput ``other``. The next step ends it."""
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), run_id="idle", hang_timeout_s=2.0,
                 register_atexit=False)
    try:
        rt = current.runtime(create=False)
        box = rt.rank_state.fields
        _steps(0, 4)
        tt.idle()
        assert box["phase"] == "idle"
        time.sleep(4.0)  # longer than the timeout and the watchdog's look
        assert not box.get("hangs") and not (tmp_path / "idle" / "hang.json").exists()
        assert rt.throughput.ledger.snapshot(time.perf_counter()).badput["other"] < 1.0
        _steps(5, 5)
        assert box["phase"] == "data_wait" and box["step"] == 5
        time.sleep(4.0)  # the same pause after a step: watched again
        assert box.get("hangs") == 1
    finally:
        tt.shutdown()


def _evaluate(model, how, tmp_path):
    """0.3 s of work between steps: an evaluation, marked or not, or a checkpoint save."""
    x = torch.randn(2, 4)
    if how == "unmarked":
        with torch.no_grad():
            model(x)
            time.sleep(0.3)
            model(x)
    elif how == "marked":
        with tt.debug_context("evaluate", model=model, kind="evaluation"), torch.no_grad():
            model(x)
            time.sleep(0.3)
    else:
        with tt.checkpoint("save"):
            time.sleep(0.3)


def _train(model, first, last):
    for step in range(first, last + 1):
        with tt.debug_context("train_step", model=model, step=step):
            model(torch.randn(2, 4)).sum().backward()


@pytest.mark.parametrize("how", ["unmarked", "marked", "checkpoint"])
def test_work_after_idle_is_booked_as_itself_and_goodput_stays_paused(tmp_path, how):
    """After ``tt.idle()``, an evaluation of the watched model (marked or not) or a checkpoint
    save is booked as evaluation or checkpoint badput, and goodput stays paused until the next
    training step. An unmarked evaluation ended the pause: the idle time after it was counted
    as data wait (3.0 s -> 23.1 s, and the next step's ``data_wait_s`` was 15.2 s)."""
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), run_id="idle_" + how, register_atexit=False)
    try:
        ledger = current.runtime(create=False).throughput.ledger
        model = torch.nn.Linear(4, 1)
        _train(model, 0, 3)
        tt.idle()
        before = ledger.snapshot(time.perf_counter()).badput
        _evaluate(model, how, tmp_path)
        time.sleep(1.5)  # serving, waiting: no class's time
        _train(model, 4, 4)
        after = ledger.closed().badput
        kind = "checkpoint" if how == "checkpoint" else "evaluation"
        assert after[kind] - before[kind] >= 0.25, (before, after)
        assert after["data_wait"] - before["data_wait"] < 0.5, (before, after)
        assert after["other"] - before["other"] < 0.5, (before, after)
    finally:
        tt.shutdown()


@pytest.mark.parametrize("how", ["marked", "checkpoint"])
def test_work_after_idle_has_its_phase_then_idle_again(tmp_path, how):
    """An evaluation marked ``kind="evaluation"`` (or a checkpoint save) after ``tt.idle()``
    runs in its own phase, then the process is idle again until the next training step. The
    marked evaluation ended the idle: the wait after it was ``data_wait``, reported as a
    training hang under the timeout."""
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), run_id="idle_phase", hang_timeout_s=2.0,
                 register_atexit=False)
    try:
        box = current.runtime(create=False).rank_state.fields
        model = torch.nn.Linear(4, 1)
        _train(model, 0, 3)
        tt.idle()
        phases = []
        sampler = threading.Thread(target=lambda: [phases.append(box.get("phase")) or time.sleep(0.05)
                                                   for _ in range(5)])
        sampler.start()
        _evaluate(model, how, tmp_path)
        sampler.join()
        assert ("checkpoint" if how == "checkpoint" else "evaluation") in phases, phases
        assert box["phase"] == "idle"
        time.sleep(4.0)  # longer than the timeout and the watchdog's look
        assert not box.get("hangs") and not (tmp_path / "idle_phase" / "hang.json").exists()
        _train(model, 4, 4)
        assert box["phase"] == "data_wait" and box["step"] == 4
    finally:
        tt.shutdown()


def test_idle_does_nothing_outside_a_run_or_inside_a_step(tmp_path):
    tt.idle()  # never configured: nothing to say it to
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), run_id="idle2", register_atexit=False)
    try:
        box = current.runtime(create=False).rank_state.fields
        with tt.debug_context("train_step", step=0):
            tt.idle()
            assert box["phase"] != "idle"
    finally:
        tt.shutdown()
