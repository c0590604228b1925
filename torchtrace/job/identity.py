"""Which job this process belongs to, and which attempt of it this is.

A *job* is every rank and every attempt (restart) of one training run. Its id is the
``job_id`` setting (``TORCHTRACE_JOB_ID``), else the launcher's (``TORCHELASTIC_RUN_ID``,
``SLURM_JOB_ID``), else the run id. The attempt number comes from the launcher
(``TORCHELASTIC_RESTART_COUNT``, ``SLURM_RESTART_COUNT``) or is counted in the run directory.

**Where attempts live.** Attempt 0 writes where a run always wrote:
``<run_dir>/<run_id>/spans.jsonl``, ``report.json``, ``state.json`` (``.rankN`` for rank N).
Attempt N > 0 writes the same names under ``<run_dir>/<run_id>/attempt-N/``. So a run that
never restarts looks as it always did, and a restart with the same run id (torchrun's default)
never appends to, or overwrites, an earlier attempt's files.

**Counting.** An attempt's slot for this rank is taken when its black box (``state*.json``)
exists and was written by another process that is over (it said how it ended, or its pid is
gone from this host). A live process of the same host and rank still writing there is not an
earlier attempt but the same run started twice: it shares the slot, and
:func:`torchtrace.files.claim_file` gives the second one file names of its own, as before.
The launcher's count, when there is one, is where counting starts.

>>> launcher_attempt({"TORCHELASTIC_RESTART_COUNT": "2"})
2
>>> attempt_dir(Path("runs/job"), 0), attempt_dir(Path("runs/job"), 3)
(PosixPath('runs/job'), PosixPath('runs/job/attempt-3'))
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import multiprocessing
import os
import re
import socket
import time
from pathlib import Path
from typing import Any, Mapping

from torchtrace.config import new_run_id

ATTEMPT_PREFIX = "attempt-"
"""An attempt's directory name under the run's: ``attempt-1``, ``attempt-2`` ..."""

_ATTEMPT_DIR = re.compile(r"attempt-(\d{1,6})\Z")


def job_id_from(given: str | None, run_id: str, environ: Mapping[str, str] | None = None) -> str:
    """The job id: ``given`` (the setting), else torchrun's or Slurm's, else the run id.

    >>> job_id_from(None, "r1", {"SLURM_JOB_ID": "4242"})
    '4242'
    """
    env = os.environ if environ is None else environ
    if given:
        return given
    elastic = env.get("TORCHELASTIC_RUN_ID", "").strip()
    if elastic and elastic != "none":
        return elastic
    slurm = env.get("SLURM_JOB_ID", "").strip()
    return slurm or run_id


def launcher_attempt(environ: Mapping[str, str] | None = None) -> int | None:
    """The restart count the launcher gives (torchrun, Slurm), or None."""
    env = os.environ if environ is None else environ
    for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        raw = env.get(name, "").strip()
        if raw.isdigit():
            return int(raw)
    return None


def attempt_dir(root: Path, attempt: int) -> Path:
    """Where ``attempt`` writes its files: the run directory itself for attempt 0."""
    return root if attempt == 0 else root / f"{ATTEMPT_PREFIX}{attempt}"


def attempt_dirs(root: Path) -> list[tuple[int, Path]]:
    """Every attempt directory of a run, ``(attempt, path)`` in attempt order (0 is ``root``)."""
    found = [(0, root)]
    try:
        children = list(root.iterdir())
    except OSError:
        return found
    for child in children:
        match = _ATTEMPT_DIR.match(child.name)
        if match and child.is_dir() and not child.is_symlink():
            found.append((int(match.group(1)), child))
    found.sort()
    return found


def choose_attempt(root: Path, state_name: str, start: int = 0) -> int:
    """The first attempt from ``start`` whose slot for this rank (its black box ``state_name``)
    is free, or held by a live process of this host (the same run started twice)."""
    attempt = start
    while _slot_taken(attempt_dir(root, attempt) / state_name):
        attempt += 1
    return attempt


def _slot_taken(path: Path) -> bool:
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return False
    except (OSError, ValueError):
        # Something is there that is not a black box we can read: never write over it.
        return True
    if not isinstance(state, dict):
        return True
    if state.get("pid") == os.getpid():
        return False  # this process configured again: the same attempt
    return state.get("ended") is not None or process_alive(state) is False


def process_alive(state: Mapping[str, Any]) -> bool | None:
    """Whether the process that wrote the black box ``state`` still runs.

    False once it is gone: no such pid, a zombie (ended, not yet reaped by its launcher), a
    process that has begun to exit, or a pid that names another process now (pids are reused).
    A box that names no pid names no process that runs. None where it cannot be asked: it ran
    on another host.
    """
    host = state.get("host")
    if host is not None and host != socket.gethostname():
        return None
    pid = state.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: /proc still tells whether it runs
    except OSError:
        return None
    return _not_ending(pid) and _same_process(pid, state.get("process_started"))


PF_EXITING = 0x4
"""The kernel's flag on a task that has begun to exit (in the flags, the 9th field of
``/proc/PID/stat``)."""


def _not_ending(pid: int) -> bool:
    """Whether live process ``pid`` is neither a zombie nor exiting. A SIGKILLed rank's sockets
    close (its peers' collectives fail at once) while the kernel may still be freeing its
    memory, milliseconds before it becomes a zombie; a peer looking then must see it gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            stat = f.read().rsplit(")", 1)[-1].split()
        return stat[0] != "Z" and not int(stat[6]) & PF_EXITING
    except FileNotFoundError:
        # Reaped by its launcher since the first look, where /proc exists at all.
        return not os.path.isdir("/proc/self")
    except (OSError, IndexError, ValueError):
        return True


def _same_process(pid: int, started: object) -> bool:
    """A live pid is the writer's only if it started when the writer did (pids are reused)."""
    if not isinstance(started, (int, float)):
        return True
    now = process_start_time(pid)
    return now is None or abs(now - started) < 2.0


def process_start_time(pid: int | str = "self") -> float | None:
    """When process ``pid`` started (unix time, from ``/proc``, to about 10 ms), or None where unknown."""
    ticks = _start_ticks(pid)
    try:
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    if ticks is None:
        return None
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


LAUNCHER_RUN = "TORCHTRACE_LAUNCHER_RUN"
"""Set by a configured process in its own environment, which the processes it starts inherit:
``<pid> <run id>`` (see :func:`launched_rank_run_id`). torchtrace's own: not a setting."""


_offered_ahead: tuple[int, str] | None = None
"""``(pid, run id)`` of :func:`offer_run_id_ahead` in this process, until it is configured."""


def offer_run_id_ahead(rank: int, distributed: bool) -> None:
    """Offer a new run id before this process is configured, to the ranks it may start first
    (a Lightning callback is built before Lightning's launcher starts the ranks of
    ``devices=N``, and torchtrace is set up at the first step, after it). This process takes
    the same id when it is configured (:func:`run_id_offered_ahead`). Nothing changes in a rank
    that takes its parent's offer, nor where this process has offered one already."""
    global _offered_ahead
    if launched_rank_run_id(rank, distributed) is not None:
        return
    if os.environ.get(LAUNCHER_RUN, "").partition(" ")[0] == str(os.getpid()):
        return
    _offered_ahead = (os.getpid(), new_run_id())
    os.environ[LAUNCHER_RUN] = f"{os.getpid()} {_offered_ahead[1]}"


def run_id_offered_ahead() -> str | None:
    """The run id :func:`offer_run_id_ahead` offered in this process, while it stands (the
    process was not configured since, nor took its offer back); else None."""
    if _offered_ahead is None:
        return None
    pid, run_id = _offered_ahead
    if pid != os.getpid() or os.environ.get(LAUNCHER_RUN) != f"{pid} {run_id}":
        return None
    return run_id


def hand_over_run_id(run_id: str) -> None:
    """Offer this process's run id to the ranks it may start (:func:`launched_rank_run_id`).
    A rank that took its parent's offer leaves that offer in place: a second ``configure()``
    of it takes the same run id again. An offer made ahead of the configuration is spent:
    a later ``configure()`` of this process draws a new run id."""
    global _offered_ahead
    _offered_ahead = None
    if os.environ.get(LAUNCHER_RUN) == f"{os.getppid()} {run_id}":
        return
    os.environ[LAUNCHER_RUN] = f"{os.getpid()} {run_id}"


def take_back_run_id() -> None:
    """Withdraw this process's offer (at shutdown): a later run of this process has its own id."""
    if os.environ.get(LAUNCHER_RUN, "").partition(" ")[0] == str(os.getpid()):
        del os.environ[LAUNCHER_RUN]


def launched_rank_run_id(rank: int, distributed: bool, environ: Mapping[str, str] | None = None) -> str | None:
    """The run id of the configured process that started this one, for a rank other than 0 of a
    world of more than one that its parent started (Lightning's launcher for ``devices=N``: the
    user's script, configured at its top, is rank 0 and starts the others with its environment);
    None otherwise. Ranks started by a process that is not torchtrace's (torchrun's agent, a
    shell), and rank 0, which may be a new job's first process, keep their own; so do ranks
    ``multiprocessing`` started, which share theirs (:func:`spawned_run_id`).

    >>> launched_rank_run_id(1, True, {LAUNCHER_RUN: f"{os.getppid()} 20261130-120000-abc123"})
    '20261130-120000-abc123'
    >>> launched_rank_run_id(1, True, {LAUNCHER_RUN: "1 20261130-120000-abc123"}) is None  # not the parent
    True
    """
    env = os.environ if environ is None else environ
    pid, _, run_id = env.get(LAUNCHER_RUN, "").partition(" ")
    if not distributed or rank == 0 or not run_id or pid != str(os.getppid()):
        return None
    if multiprocessing.parent_process() is not None:
        return None
    return run_id


PARENT_SETTINGS = "TORCHTRACE_PARENT_SETTINGS"
"""Set by a configured process in its own environment, which the processes it starts inherit:
a JSON object of its pid, run id, job id and ``configure()`` arguments (see
:func:`offer_settings`). torchtrace's own: not a setting."""

NOT_HANDED_DOWN = ("otlp_headers", "debug_token", "run_id", "job_id")
"""``configure()`` arguments an offer leaves out: secrets are not copied into the environment
(a child reads its own, from ``OTEL_EXPORTER_OTLP_HEADERS`` and ``TORCHTRACE_DEBUG_TOKEN``),
and the run and job ids go as the parent's, for the child to name its run by."""


@dataclasses.dataclass(frozen=True)
class SettingsOffer:
    """What a configured parent offers the children ``multiprocessing`` spawns: its run id, its
    job id, and the arguments its ``configure()`` was given (less :data:`NOT_HANDED_DOWN`)."""

    run_id: str
    job_id: str
    args: dict[str, Any]


def offer_settings(args: Mapping[str, Any], run_id: str, job_id: str) -> None:
    """Offer this process's ``configure()`` arguments to the processes ``multiprocessing``
    spawns from it (a spawn or forkserver child runs the main script as ``__mp_main__``, so a
    ``configure()`` under ``if __name__ == "__main__":`` never runs there). An argument whose
    value JSON cannot hold is left out."""
    given: dict[str, Any] = {}
    for name, value in args.items():
        if value is None or name in NOT_HANDED_DOWN:
            continue
        value = value.value if isinstance(value, enum.Enum) else value
        value = str(value) if isinstance(value, Path) else value
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            continue
        given[name] = value
    os.environ[PARENT_SETTINGS] = json.dumps({"pid": os.getpid(), "run_id": run_id, "job_id": job_id,
                                              "args": given})


def take_back_settings() -> None:
    """Withdraw this process's offer (at shutdown)."""
    if settings_offer(os.getpid()) is not None:
        del os.environ[PARENT_SETTINGS]


def settings_offer(pid: int) -> SettingsOffer | None:
    """The offer process ``pid`` made, as this process inherited it; None where there is none,
    or it is another process's (a grandparent's), or it cannot be read."""
    try:
        offer = json.loads(os.environ.get(PARENT_SETTINGS, ""))
        if offer["pid"] != pid:
            return None
        return SettingsOffer(str(offer["run_id"]), str(offer["job_id"]), dict(offer["args"]))
    except (ValueError, TypeError, KeyError):
        return None


def parents_settings() -> SettingsOffer | None:
    """In a process ``multiprocessing`` started, the offer its parent made; else None."""
    parent = multiprocessing.parent_process()
    return settings_offer(parent.pid) if parent is not None and parent.pid is not None else None


def spawned_run_id(run_dir: Path | None, state_name: str) -> str | None:
    """A run id that every process one parent started through ``multiprocessing`` computes
    alike (the ranks of ``torch.multiprocessing.spawn`` or Lightning's ``ddp_spawn``): the
    parent's start time (UTC, to the second) and 6 hex digits of a hash of its host, boot time,
    pid and start. None in a process ``multiprocessing`` did not start, or where ``/proc`` does
    not tell when the parent started.

    Each rank reads the same integers (the boot time in seconds and the parent's start in clock
    ticks since boot), so no rank can round to another second than the others.

    A later launch from the same parent (a script that spawns twice, a notebook run again)
    finds there, under ``run_dir``, this rank's black box (``state_name``) of an earlier one,
    ended: a launcher that starts processes this way never restarts them, so it is not a second
    attempt but a run of its own, ``<id>-2``, ``<id>-3``..., the first whose slot is free, which
    every rank of it finds alike."""
    parent = multiprocessing.parent_process()
    if parent is None or parent.pid is None:
        return None
    first = _run_id_of_parent(parent.pid)
    if first is None:
        return None
    run_id, launch = first, 1
    while run_dir is not None and _slot_taken(run_dir / run_id / state_name):
        launch += 1
        run_id = f"{first}-{launch}"
    return run_id


def agent_run_id(environ: Mapping[str, str] | None = None) -> str | None:
    """The run id the ranks torchrun started on this host share when its rendezvous names none
    (no ``--rdzv-id``: ``TORCHELASTIC_RUN_ID`` is ``none``), where each rank took a run id of its
    own before, and the ranks' black boxes never met. Derived, as :func:`spawned_run_id`'s is,
    from their parent: torchrun's agent, which starts them and starts them again after a
    failure, so every attempt of the job finds the others too. Ranks on other hosts have agents
    of their own. None when the rendezvous names an id, outside torchrun, or where ``/proc``
    does not tell when the agent started."""
    env = os.environ if environ is None else environ
    if env.get("TORCHELASTIC_RUN_ID", "").strip() != "none":
        return None
    return _run_id_of_parent(os.getppid())


def slurm_step_run_id(distributed: bool, environ: Mapping[str, str] | None = None) -> str | None:
    """The run id the ranks of one Slurm job step share when ``srun`` starts them itself (no
    torchrun): ``slurm-<job id>.<step id>``. Before, each rank took a run id of its own, and the
    ranks' black boxes never met. A requeued job keeps its job and step ids, so its attempts
    (``SLURM_RESTART_COUNT``) find one another. None for a process that is not a rank of a world
    of more than one (the tasks of a step may be independent trials), for a step of one task, and
    outside a job step.

    >>> slurm_step_run_id(True, {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "8"})
    'slurm-4242.0'
    >>> slurm_step_run_id(False, {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "8"}) is None
    True
    """
    env = os.environ if environ is None else environ
    job, step = env.get("SLURM_JOB_ID", "").strip(), env.get("SLURM_STEP_ID", "").strip()
    tasks = env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", "")).strip()
    if not distributed or not job or not step or not tasks.isdigit() or int(tasks) < 2:
        return None
    run_id = f"slurm-{job}.{step}"
    return run_id if re.fullmatch(r"[A-Za-z0-9_.-]{1,128}", run_id) else None


def _run_id_of_parent(pid: int) -> str | None:
    """A run id every child of process ``pid`` computes alike: its start time (UTC, to the second)
    and 6 hex digits of a hash of the host, boot time, pid and start; None where ``/proc`` does
    not tell when it started."""
    ticks, booted = _start_ticks(pid), _boot_time()
    if ticks is None or booted is None:
        return None
    started = booted + ticks // os.sysconf("SC_CLK_TCK")
    digest = hashlib.sha256(f"{socket.gethostname()} {booted} {pid} {ticks}".encode()).hexdigest()[:6]
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime(started)) + "-" + digest


def proc_stat(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command's name: the state first (``Z``: a
    zombie), the parent's pid second, the start in clock ticks since the boot 20th; None where
    the process or ``/proc`` is not there."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _start_ticks(pid: int | str) -> int | None:
    """When process ``pid`` started, in clock ticks since the boot (``/proc/<pid>/stat``), or None."""
    fields = proc_stat(pid)
    try:
        return int(fields[19]) if fields is not None else None
    except (ValueError, IndexError):
        return None


def _boot_time() -> int | None:
    """When this host booted, in whole unix seconds (``btime`` of ``/proc/stat``), or None."""
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("btime "):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None
