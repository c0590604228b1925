"""The collectives this rank entered: PyTorch's flight recorder, and a counter around
``torch.distributed``'s Python calls.

The flight recorder (``TORCH_FR_BUFFER_SIZE``; ``TORCH_NCCL_TRACE_BUFFER_SIZE`` for NCCL)
records every collective a process group runs, also those issued from C++ such as DDP's
gradient all-reduce, which never passes through ``torch.distributed.all_reduce``. Where torch
has ``_dump_fr_trace_json`` (2.13 does) gloo and NCCL both record into it; an older torch
(2.6) has only NCCL's recorder, read through ``_dump_nccl_trace_json``, and gloo's collectives
are counted from Python there (:func:`records_every_backend`). :func:`enable` turns it on with
a small buffer when neither variable is set: gloo reads it at its first collective, NCCL when
its process group is created (set the variable before ``init_process_group`` there; ``0`` keeps it off). It is
read off the training thread (the watchdog, about once a second; a dump of 64 entries takes
well under a millisecond), and on it once every ``rank_skew_interval`` steps (the times at
which this rank entered its collectives: :mod:`torchtrace.probes.straggler`).

Where no recorder runs (switched off, another backend), :func:`count_calls` wraps the
``torch.distributed`` functions so each call is counted with its op and group; it cannot see
DDP's all-reduce (C++), nor a function imported by name before torchtrace was configured.

>>> enabled({"TORCH_FR_BUFFER_SIZE": "64"})
True
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any, Callable, Mapping

ENV_BUFFER = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
DEFAULT_ENTRIES = "64"
COUNTED = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
           "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "reduce", "gather", "scatter",
           "all_to_all", "all_to_all_single", "barrier", "monitored_barrier", "send", "recv")
_WRAPPED = "__torchtrace_counted__"


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """True when a flight-recorder buffer size above 0 is set."""
    env = os.environ if environ is None else environ
    for name in ENV_BUFFER:
        raw = env.get(name)
        if raw is not None and raw.strip():
            try:
                return int(raw) > 0
            except ValueError:
                return False
    return False


def enable() -> bool:
    """Turn the recorder on with :data:`DEFAULT_ENTRIES` entries unless the user set its size."""
    if not any(os.environ.get(name, "").strip() for name in ENV_BUFFER):
        os.environ[ENV_BUFFER[0]] = DEFAULT_ENTRIES
    return enabled()


def _initialized() -> bool:
    try:
        import torch.distributed as dist

        return dist.is_available() and dist.is_initialized()
    except Exception:
        return False


def _c10d() -> Any:
    """torch's c10d bindings, or None in a build without them."""
    try:
        from torch._C import _distributed_c10d as c10d
    except ImportError:
        return None
    return c10d


def _dump() -> Callable[[bool, bool], bytes] | None:
    """torch's recorder dump: ``_dump_fr_trace_json`` (every backend), else NCCL's own
    ``_dump_nccl_trace_json`` (an older torch), else None (a build with neither)."""
    c10d = _c10d()
    return getattr(c10d, "_dump_fr_trace_json", None) or getattr(c10d, "_dump_nccl_trace_json", None)


def records_every_backend() -> bool:
    """Whether this torch's recorder sees gloo's collectives as well as NCCL's (it has
    ``_dump_fr_trace_json``). Where it does not, :func:`count_calls` is needed besides it."""
    return hasattr(_c10d(), "_dump_fr_trace_json")


def entries() -> list[dict[str, Any]] | None:
    """The collectives the recorder holds (every group's, the oldest dropped past its buffer
    size), each a dict with ``record_id`` (this process's count from 0, all groups) and
    ``time_created_ns`` (on :func:`time.time_ns`'s clock) among others; None without a
    recorder, a process group or a readable dump."""
    dump_json = _dump()
    if dump_json is None or not enabled() or not _initialized():
        return None
    try:
        dump = json.loads(dump_json(True, False))
    except Exception:
        return None
    held = dump.get("entries", []) if isinstance(dump, dict) else None
    return held if isinstance(held, list) else None


def last_collective() -> dict[str, Any] | None:
    """The last collective the recorder holds: ``seq`` (this process's count, all groups),
    ``op``, ``group``, ``group_seq`` and ``active`` (entered, not completed); None without a
    recorder, a process group or any entry."""
    held = entries()
    if not held:
        return None
    last = max(held, key=lambda e: e.get("record_id", -1))
    group = last.get("process_group") or ["", ""]
    state = str(last.get("state", ""))
    return {"seq": int(last.get("record_id", -1)) + 1, "op": str(last.get("profiling_name", "")),
            "group": str(group[1] if len(group) > 1 else group[0]), "group_seq": last.get("collective_seq_id"),
            "active": not last.get("retired", False) and state != "completed"}


def count_calls(began: Callable[[str, str], Any], ended: Callable[[Any], None]) -> int:
    """Wrap :data:`COUNTED` in ``torch.distributed`` (once per process): ``began(op, group)``
    before each call, ``ended(its result)`` after. Returns how many functions were wrapped."""
    try:
        import torch.distributed as dist
    except Exception:
        return 0
    wrapped = 0
    for name in COUNTED:
        fn = getattr(dist, name, None)
        if fn is None or getattr(fn, _WRAPPED, False):
            continue
        setattr(dist, name, _counted(fn, name, began, ended))
        wrapped += 1
    return wrapped


def _counted(fn: Callable[..., Any], op: str, began: Callable[[str, str], Any],
             ended: Callable[[Any], None]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(*args: object, **kwargs: object) -> Any:
        group = kwargs.get("group")
        token = began(op, getattr(group, "group_name", None) or "default")
        try:
            return fn(*args, **kwargs)
        finally:
            ended(token)

    setattr(call, _WRAPPED, True)
    return call
