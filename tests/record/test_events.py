"""CUDA events reused from step to step (record/events.py), on CPU with a stand-in event class:
the pool hands a finished event out again instead of making one, per device, and bounded."""

from __future__ import annotations

import pytest
import torch

from torchtrace.record import events, readout
from torchtrace.step.phases import DeviceCycles, StepClock


class FakeEvent:
    """What the pool uses of torch.cuda.Event: record() on the current device, query(),
    elapsed_time() in ms (here: a counter of records, 1 ms apart), device."""

    now = [0.0]
    current = [0]

    def __init__(self, enable_timing: bool = False) -> None:
        self.timing = enable_timing
        self.device = None
        self.at = None

    def record(self) -> None:
        if self.device is not None and self.device.index != FakeEvent.current[0]:
            raise RuntimeError("an event recorded on another device")  # what CUDA refuses
        self.device = torch.device("cuda", FakeEvent.current[0])
        FakeEvent.now[0] += 1.0
        self.at = FakeEvent.now[0]

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: "FakeEvent") -> float:
        return other.at - self.at


@pytest.fixture()
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: FakeEvent.current[0])
    FakeEvent.current[0] = 0
    for pool in (events.TIMING, events.LANDED):
        monkeypatch.setattr(pool, "_free", {})
        monkeypatch.setattr(pool, "created", 0)


def test_a_finished_event_is_recorded_again_instead_of_a_new_one(fake_cuda):
    pool = events.EventPool(timing=True)
    first = pool.recorded()
    assert pool.created == 1 and first.timing
    pool.give_back(first, None)
    again = pool.recorded()
    assert again is first and pool.created == 1 and again.at > 1.0
    FakeEvent.current[0] = 1  # another device: its own events
    other = pool.recorded()
    assert other is not first and other.device.index == 1 and pool.created == 2
    pool.give_back(*[pool.recorded() for _ in range(events.MAX_FREE + 10)])
    assert len(pool._free[1]) == events.MAX_FREE


def test_a_step_clock_gives_its_events_back_once_its_phases_and_cycle_are_read(fake_cuda):
    """Four marks a step: three go back once its phases are read, the last (the optimizer's
    end) when the next step's cycle has been measured from it. The cycle is the device time
    from one step's last mark to the next one's."""
    cycles = DeviceCycles()

    def step(operation: str = "train_step") -> tuple[dict, float | None]:
        clock = StepClock(cuda=True)
        clock.forward_start = clock.mark()
        clock.end_forward()
        FakeEvent.now[0] += 3.0  # the backward: 4 ms between the forward's end and the optimizer's start
        clock.optimizer_start = clock.mark()
        clock.optimizer_end = clock.mark()
        return clock.phases(None), cycles.cycle(operation, clock)

    phases, cycle = step()
    assert phases == {"forward": pytest.approx(0.001), "backward": pytest.approx(0.004),
                      "optimizer": pytest.approx(0.001)}
    assert cycle is None and events.TIMING.created == 4  # an operation's first step has no cycle
    for _ in range(10):
        phases, cycle = step()
        assert phases["backward"] == pytest.approx(0.004) and cycle == pytest.approx(0.007)
    assert events.TIMING.created == 5  # ten more steps: one event more, held from step to step
    assert step("evaluate")[1] is None  # after a step of another operation: no cycle
    assert step("evaluate")[1] == pytest.approx(0.007)
    assert events.TIMING.created == 5
    host = StepClock(cuda=False)
    host.forward_start, host.forward_end = 1.0, 2.0
    host.phases(None)
    assert cycles.cycle("evaluate", host) is None  # on the host: no device cycle
    assert step("evaluate")[1] is None  # nothing spans the host step
    assert cycles.cycle("evaluate", None) is None  # a step without a clock (no model) ...
    assert step("evaluate")[1] is None  # ... ends the cycle too: none across it


def test_pauses_with_no_backward_in_them_are_neither_phase_on_a_gpu_too(fake_cuda):
    """A rollout on a GPU: three calls of the policy (2 ms each) with 6 ms of environment
    between them, in which no gradient moved (the gradient marks say so), then a 4 ms backward.
    Forward is the calls' 6 ms, backward the 4 ms after the last, not the pauses' 12 ms too.
    When a backward moved the gradient in the second pause only, that pause is backward time."""
    from torchtrace.measure.gradients import gradient_mark

    param = torch.zeros(2, requires_grad=True)

    def step(backward_in_pause: set[int]) -> dict | None:
        param.grad = None
        clock = StepClock(cuda=True)
        for i in range(3):
            if i > 0:
                if i in backward_in_pause:
                    param.grad = torch.ones(2) if param.grad is None else param.grad.add_(1.0)
                FakeEvent.now[0] += 5.0  # the pause: 6 ms from the call's end
            clock.announce("forward_start", gradient_mark(param))
            FakeEvent.now[0] += 1.0  # the call: 2 ms from its start mark
            clock.announce("forward_end")
        FakeEvent.now[0] += 3.0  # the backward after the last call
        clock.optimizer_start = clock.mark()
        clock.optimizer_end = clock.mark()
        out = clock.phases(None)
        events.TIMING.give_back(clock.last)
        return out

    assert step(set()) == {"forward": pytest.approx(0.006), "backward": pytest.approx(0.004),
                           "optimizer": pytest.approx(0.001)}
    assert step({2}) == {"forward": pytest.approx(0.006), "backward": pytest.approx(0.010),
                         "optimizer": pytest.approx(0.001)}
    made = events.TIMING.created
    step({1, 2})
    assert events.TIMING.created == made  # every pause's events went back, flagged or not


def test_a_landed_copy_gives_its_event_back(fake_cuda):
    event = events.LANDED.recorded()
    pending = readout.Pending(torch.tensor([1.5, 2.0], dtype=torch.float64), event)
    assert pending.ready() and pending.result() == [1.5, 2.0]
    assert events.LANDED.recorded() is event and events.LANDED.created == 1


def test_a_step_with_several_forward_calls_reads_its_pauses_from_events_and_gives_them_back(fake_cuda):
    """On a GPU the pauses between a step's forward calls are event pairs: forward is the
    calls' device time, backward the pauses' plus the last one's (a call that never ended
    included). Each mark is 1 ms after the one before; every event goes back once the phases
    are read, so the next steps make none.
    A step with more pauses than the clock keeps has no forward and backward split (its
    optimizer phase stays), and gives its events back too."""
    from torchtrace.step.phases import MAX_GAPS

    def step(calls: int) -> dict | None:
        clock = StepClock(cuda=True)
        for i in range(calls):
            if i > 0:
                FakeEvent.now[0] += 5.0  # the micro-batch's backward: 6 ms from the call's end
            clock.announce("forward_start")
            FakeEvent.now[0] += 1.0  # the forward: 2 ms from its start mark
            clock.announce("forward_end")
        clock.announce("forward_start")  # a call that never ends (a recomputation stopped early)
        FakeEvent.now[0] += 4.0  # the last backward
        clock.optimizer_start = clock.mark()
        clock.optimizer_end = clock.mark()
        out = clock.phases(None)
        events.TIMING.give_back(clock.last)
        return out

    assert step(3) == {"forward": pytest.approx(0.006), "backward": pytest.approx(0.018),
                       "optimizer": pytest.approx(0.001)}
    made = events.TIMING.created
    assert made == 2 * 3 + 1 + 2
    assert step(3)["forward"] == pytest.approx(0.006)
    assert events.TIMING.created == made  # every event of the step before was given back
    assert step(MAX_GAPS + 3) == {"optimizer": pytest.approx(0.001)}
    made = events.TIMING.created
    step(3)
    assert events.TIMING.created == made
