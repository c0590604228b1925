"""The verdict on a job from its black boxes, and the ranks it blames.

Only the black boxes are read (files in the run directory), never the communicator that may
be the thing that hangs. The rules, in order:

0. a rank that ended (by a signal or an exception) or vanished while stuck in a hang its
   watchdog had flagged, no step finished since, ended because of the hang: a launcher or
   scheduler tearing the hung job down (SIGTERM, then SIGKILL for a rank stuck in a C call,
   which cannot run its handler), or the collective's own timeout. So did, flagged or not, a
   rank that ended with an exception inside a collective that a peer, alive after that end,
   never reached (its count of collectives is lower: a collective timeout shorter than the
   hang timeout), and that peer. When every rank that ended or vanished did so, the verdict is
   ``hang`` (rule 2, those ranks judged where they were stuck), and the reason says how each
   ended;
1. a rank that ended with an exception, or whose process is gone without saying how it
   ended (SIGKILL, the OOM killer), is blamed: verdict ``died``. Ranks that all ended with
   torchtrace's ``NonFiniteError`` (``guard="raise"``: one decision, agreed at one step)
   name the ranks whose own loss was not finite, else all of them. Ranks the others saw gone
   while they ran come first, then ranks gone without a word (the others' exceptions are
   most likely their collectives failing for want of it); of ranks that all raised, the first
   to end (the others raised after it, in a collective it never joined, as a rule);
2. a rank whose heartbeat stopped while its process lives (a thread holding the GIL in a C
   call stops every Python thread, the black box's writer too), or whose watchdog flagged a
   hang with no progress since, is stuck: verdict ``hang``. Among the ranks still alive
   (stuck, or within an allowance of their own: a checkpoint save to storage that stopped
   answering) and those that ended stuck, the culprits are those not inside the collective
   the others wait in (a lower collective
   sequence number than theirs); without that difference, those behind the others (a lower
   step, or the same step at an earlier phase); without any difference, all of them. Ranks
   waiting at one collective number in collectives of different kinds (an all_reduce and a
   barrier: a rank out of data left its loop) are named in the reason;
3. every rank ``completed``: ``completed`` (the reason says how many ranks have a black box,
   if not all); every rank ended, some stopped by a signal (a
   scheduler's preemption, torchrun passing its agent's SIGTERM on, a user's ^C):
   ``preempted``, with no culprit (the stop came from outside); every rank ended otherwise (an
   ending a later torchtrace wrote): ``ended``; every rank alive and progressing within its
   timeout: ``healthy``; otherwise (some rank stalled beyond half its timeout, a rank stopped
   while the others run, or fewer black boxes than the world size): ``running``, no verdict
   yet, and the reason says which.

>>> judge([{"rank": 0, "ended": "completed"}], now=0.0)["verdict"]
'completed'
"""

from __future__ import annotations

import math
from typing import Any

from torchtrace.files import from_strict
from torchtrace.job.ending import crash_of, hung_to_the_end, last_seen, stuck_at_a_collective
from torchtrace.job.identity import process_alive

STALE_S = 10.0
"""A heartbeat older than this is stopped (the black box is rewritten every 0.5 s, a watchdog
tick every second)."""
PHASE_ORDER = {"idle": 0, "data_wait": 1, "forward": 2, "backward": 3, "collective": 3, "optimizer": 4,
               "evaluation": 1, "checkpoint": 1}


def _died(state: dict[str, Any], condition_now: str) -> str:
    """How a rank that died went, for the verdict's reason."""
    if condition_now != "gone":
        return "ended with an exception"
    crash = crash_of(state)
    return f"crashed ({crash})" if crash is not None else "is gone (its process no longer exists)"


def condition(state: dict[str, Any], now: float) -> str:
    """One rank's condition: ``ended:<how>``, ``gone``, ``silent``, ``hung``, ``stalled`` or ``running``."""
    if state.get("ended"):
        return f"ended:{state['ended']}"
    alive = process_alive(state)
    if alive is False:
        return "gone"
    heartbeat = state.get("time")
    hang = state.get("hang")
    if isinstance(hang, dict) and hang.get("since") == state.get("progress"):
        return "hung"
    if isinstance(heartbeat, (int, float)) and now - heartbeat > STALE_S:
        return "silent"
    progress, timeout = state.get("progress"), state.get("hang_timeout_s")
    if (state.get("phase") not in (None, "idle") and isinstance(progress, (int, float))
            and isinstance(timeout, (int, float)) and now - progress > timeout / 2):
        return "stalled"
    return "running"


def _position(state: dict[str, Any]) -> tuple[float, int]:
    current = state.get("current_step")
    if isinstance(current, int):
        return float(current), PHASE_ORDER.get(str(state.get("phase")), 0)
    last = state.get("step")
    # Between steps: past the last one, before the next's forward.
    return (float(last) + 0.5 if isinstance(last, int) else -1.0), 0


def stuck_culprits(stuck: list[dict[str, Any]]) -> tuple[list[int], str]:
    """Among the stuck ranks, those the others wait for, and why."""
    seqs: dict[int, int] = {}
    for s in stuck:
        seq = s.get("collective_seq")
        if isinstance(seq, int):
            seqs[s["rank"]] = seq
    if len(seqs) == len(stuck) and len(set(seqs.values())) > 1:
        top = max(seqs.values())
        behind = sorted(r for r, q in seqs.items() if q < top)
        return behind, f"not inside collective #{top} that the others entered"
    mismatch = _mismatch(stuck) if len(seqs) == len(stuck) else ""
    positions = {s["rank"]: _position(s) for s in stuck}
    if len(set(positions.values())) > 1:
        front = max(positions.values())
        return sorted(r for r, p in positions.items() if p < front), mismatch + "behind the other ranks (step, phase)"
    phases = {_stuck_phase(s) for s in stuck}
    where = f" in {phases.pop()}" if len(phases) == 1 and None not in phases else ""
    return sorted(positions), mismatch + "stuck" + where


def _stuck_phase(state: dict[str, Any]) -> str | None:
    """The phase a rank is stuck in: the one its hang was flagged in (a rank that ended since
    has its phase reset), else its black box's."""
    hang = state.get("hang")
    phase = (hang.get("phase") if isinstance(hang, dict) else None) or state.get("phase")
    return str(phase) if phase else None


def _mismatch(stuck: list[dict[str, Any]]) -> str:
    """``ranks in different collectives at #11 (rank 0 all_reduce, rank 1 barrier); `` when the
    stuck ranks, at one collective number, wait in collectives of different kinds (a rank that
    ran out of data waits in its loop's closing barrier while the others wait in a backward's
    all_reduce), else ``""``."""
    ops = {s["rank"]: s.get("collective_op") for s in stuck if s.get("collective_active") and s.get("collective_op")}
    if len(ops) < len(stuck) or len(set(ops.values())) < 2:
        return ""
    where = ", ".join(f"rank {r} {op}" for r, op in sorted(ops.items()))
    return f"ranks in different collectives at #{stuck[0].get('collective_seq')} ({where}); "


def _int_field(state: dict[str, Any], name: str) -> int:
    """The black box's integer field ``name``, 0 when missing or not an integer."""
    value = state.get(name)
    return value if isinstance(value, int) else 0


def latest_attempt(states: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The black boxes of the last attempt, one per rank (the latest written)."""
    if not states:
        return []
    last = max(_int_field(s, "attempt") for s in states)
    ranks: dict[int, dict[str, Any]] = {}
    for s in states:
        if _int_field(s, "attempt") != last:
            continue
        rank = _int_field(s, "rank")
        if rank not in ranks or (s.get("time") or 0) >= (ranks[rank].get("time") or 0):
            ranks[rank] = dict(s, rank=rank)
    return [ranks[r] for r in sorted(ranks)]


def judge(states: list[dict[str, Any]], now: float) -> dict[str, Any]:
    """The verdict on one attempt's black boxes (see the module's rules).

    Returns ``{"verdict", "culprit_ranks", "reason", "conditions": {rank: condition}}``.
    """
    boxes = latest_attempt(states)
    conditions = {s["rank"]: condition(s, now) for s in boxes}
    by_rank = {s["rank"]: s for s in boxes}
    out: dict[str, Any] = {"verdict": "running", "culprit_ranks": [], "reason": "", "conditions": conditions}
    if not boxes:
        out["reason"] = "no black box found"
        return out
    died = [r for r, c in conditions.items() if c in ("gone", "ended:exception", "ended:killed")]
    at_a_collective = stuck_at_a_collective(boxes)
    torn_down = [s for s in boxes if _ended_while_hung(s, conditions[s["rank"]], at_a_collective)]
    if torn_down and set(died) <= {s["rank"] for s in torn_down}:
        # Every rank that ended did so stuck in a hang its watchdog had flagged: a launcher or
        # scheduler tearing the hung job down, or the collective's own timeout. The hang is the story.
        out.update(_hang(boxes, conditions, torn_down))
        return out
    # A rank its peers saw gone while they still ran is the first to go: the others died of it.
    named = {r for s in boxes for r in (s.get("peers_gone") or []) if r in died}
    vanished = [r for r in died if conditions[r] == "gone"]
    if named:
        died = sorted(named)
    elif vanished:
        # A rank that vanished without a word, beside ranks that ended with an exception: the
        # exceptions are most likely the collective failing for want of it.
        died = vanished
    stopped = _guard_stop(boxes, died) if not named and not vanished else None
    if stopped is not None:
        out.update(verdict="died", culprit_ranks=stopped[0], reason=stopped[1])
        return out
    followers: list[int] = []
    if not named and not vanished and len(died) > 1:
        # Ranks that all raised: the first to end is the cause; the others raised after its last
        # sign of life, most likely in a collective that failed for want of it (as the job story
        # orders them).
        seen = {s["rank"]: last_seen(s) for s in boxes}
        first = min(died, key=lambda r: seen[r])
        died, followers = [first], sorted(r for r in died if r != first)
    if died:
        reason = "; ".join(f"rank {r} " + _died(by_rank[r], conditions[r]) for r in died)
        if followers:
            reason += (f"; {_ranks(followers)} ended with one after it (most likely a collective that failed for "
                       "want of it)")
        out.update(verdict="died", culprit_ranks=died, reason=reason)
        return out
    if any(conditions[s["rank"]] in ("hung", "silent") or s.get("ended") == "hang" for s in boxes):
        out.update(_hang(boxes, conditions, []))
        return out
    out.update(_neither_died_nor_hung(boxes, conditions))
    return out


def _guard_stop(boxes: list[dict[str, Any]], died: list[int]) -> tuple[list[int], str] | None:
    """Ranks that all ended with torchtrace's ``NonFiniteError``: the guard's decision under
    ``guard="raise"``, agreed by every rank at one step, not one rank's failure the others
    followed. The culprits are the ranks whose own loss was not finite (the NaN or Inf began
    in their batch), else all of them. None when some rank that died ended otherwise."""
    by_rank = {s["rank"]: s for s in boxes}
    if not died or any(by_rank[r].get("end_detail") != "NonFiniteError" for r in died):
        return None
    steps = {_int_field(by_rank[r], "step") for r in died}
    at = f" at step {steps.pop()}" if len(steps) == 1 else ""
    reason = f"the guard (guard='raise') stopped {_ranks(died)} with NonFiniteError{at}; "
    losses = {r: from_strict(by_rank[r].get("loss")) for r in died}
    bad = [r for r, loss in losses.items() if loss is not None and not math.isfinite(loss)]
    if bad:
        return bad, reason + f"{_ranks(bad)} had a non-finite loss of its own"
    return sorted(died), reason + "no rank's own loss was non-finite (its gradients were)"


def _ended_while_hung(state: dict[str, Any], condition_now: str, at_a_collective: set[int]) -> bool:
    """The rank ended by a signal or an exception, or vanished (SIGKILL: a rank stuck in a C call
    cannot run its SIGTERM handler, and its launcher kills it), stuck: its watchdog had flagged
    a hang and it finished no step after that, or it is one of ``at_a_collective``
    (:func:`~torchtrace.job.ending.stuck_at_a_collective`: a collective's timeout ended a wait
    for a peer stuck elsewhere before any watchdog flagged it)."""
    return (condition_now in ("gone", "ended:preempted", "ended:exception", "ended:killed")
            and (hung_to_the_end(state) or state["rank"] in at_a_collective))


def _hang(boxes: list[dict[str, Any]], conditions: dict[int, str], torn_down: list[dict[str, Any]]) -> dict[str, Any]:
    """Rule 2: the verdict ``hang``, its culprits and reason; ``torn_down``, the ranks that ended
    while stuck in it, are judged where they were stuck, and the reason says how they ended."""
    ended = {s["rank"] for s in torn_down}
    silent = [s["rank"] for s in boxes if conditions[s["rank"]] == "silent"]
    if silent and len(silent) < len(boxes) and not ended:
        culprits, why = silent, ("heartbeat stopped while the process lives (a thread holds the GIL, "
                                 "or the process is stopped)")
    else:
        # The ranks waiting on a stuck peer are stuck too, flagged or not yet (stalled), and the
        # peer may be within a long allowance of its own (a checkpoint save to storage that
        # stopped answering): judge among every rank still alive, and those that ended stuck.
        pool = [s for s in boxes if conditions[s["rank"]] in ("hung", "silent", "stalled", "running")
                or s.get("ended") == "hang" or s["rank"] in ended]
        culprits, why = stuck_culprits(pool)
    if torn_down:
        ends: dict[str, list[int]] = {}
        for s in torn_down:
            ends.setdefault(_how_it_ended(s, conditions[s["rank"]]), []).append(s["rank"])
        why += "; then " + ", ".join(f"{_ranks(ranks)} {how}" for how, ranks in ends.items())
    return {"verdict": "hang", "culprit_ranks": culprits, "reason": why}


def _how_it_ended(state: dict[str, Any], condition_now: str) -> str:
    """``gone (killed while stuck)``, ``stopped by SIGTERM``, ``ended with an exception``."""
    if condition_now == "gone":
        return "gone (killed while stuck)"
    end = _end_of(state)
    if end.startswith("preempted"):
        return "stopped by " + (end.partition(" ")[2].strip("()") or "a signal")
    return "ended with an exception" if end == "exception" else f"ended {end}"


def _neither_died_nor_hung(boxes: list[dict[str, Any]], conditions: dict[int, str]) -> dict[str, Any]:
    """Rule 3: the verdict (``completed``, ``preempted``, ``ended``, ``healthy`` or ``running``)
    and its reason, for ranks none of which died or hung."""
    out: dict[str, Any] = {"verdict": "running", "reason": ""}
    world = max((s.get("world_size") or 1) for s in boxes)
    missing = f"{len(boxes)} of {world} ranks have a black box" if len(boxes) < world else ""
    if all(c == "ended:completed" for c in conditions.values()):
        reason = f"{_ranks(list(conditions))} completed; {missing}" if missing else "every rank completed"
        out.update(verdict="completed", reason=reason)
        return out
    if missing:
        out["reason"] = missing
        return out
    ends = {s["rank"]: _end_of(s) for s in boxes if conditions[s["rank"]].startswith("ended:")}
    stopped = {r: end for r, end in ends.items() if end.startswith("preempted")}
    if len(ends) == len(boxes):
        if stopped:
            signals = sorted({end.partition(" ")[2].strip("()") or "a signal" for end in stopped.values()})
            out.update(verdict="preempted", reason=f"{_ranks(list(stopped))} stopped by {' or '.join(signals)}")
        else:
            out.update(verdict="ended", reason="every rank ended: " + "; ".join(
                f"{_ranks([r for r in ends if ends[r] == end])} {end}" for end in sorted(set(ends.values()))))
    elif all(c in ("running", "ended:completed") for c in conditions.values()):
        out.update(verdict="healthy", reason="every rank is progressing")
    elif any(c == "stalled" for c in conditions.values()):
        out["reason"] = "some rank is stalled, not yet past its hang timeout"
    else:
        out["reason"] = "; ".join(f"rank {r} ended {end}" for r, end in sorted(ends.items())
                                  if end != "completed") + "; the others run"
    return out


def _end_of(state: dict[str, Any]) -> str:
    """How a rank's black box says it ended, with the signal of a stop: ``preempted (SIGTERM)``."""
    ended = str(state.get("ended"))
    detail = state.get("end_detail")
    if ended == "preempted" and isinstance(detail, str) and detail.startswith("SIG"):
        return f"preempted ({detail})"
    return ended


def _ranks(ranks: list[int]) -> str:
    """``rank 3`` or ``ranks 0, 1``."""
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
