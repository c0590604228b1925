"""Checkpoint saves and loads, timed without a call in the training code.

:func:`install` wraps ``torch.save``, ``torch.load``, ``torch.distributed.checkpoint``'s
``save`` and ``load``, accelerate's ``Accelerator.save_state`` and ``load_state``, and
safetensors' ``save_file``, ``load_file``, ``save_model`` and ``load_model`` (at ``configure()``;
the last three where the application imports them, :data:`WHEN_IMPORTED`); :func:`uninstall`
puts the originals back (at ``shutdown()``). Each call is timed and handed to the sink (the runtime): the histogram
``torchtrace_checkpoint_seconds{kind}``, badput ``checkpoint``, and the black box's
``checkpoint_step``. :func:`checkpoint` (``tt.checkpoint("save")``) marks any other saving or
loading code the same way.

A save inside another save (Lightning's checkpoint IO calling ``torch.save``; a distributed
checkpoint that calls ``torch.save`` per shard; ``save_state`` saving the model, the optimizer,
the scheduler and the random states one file each) counts once: only the outermost call of each
thread is timed, and the sink counts only calls on the thread that trains (a distributed
checkpoint's writer threads save its items while the training thread waits in it).

``torch.distributed.checkpoint.async_save`` stages the state as it is called and uploads it on
a thread of its own while training goes on: the call is timed (the wait the training sees), and
the sink is handed the upload's future: the checkpoint exists once the upload completes.

The calls torch makes itself (``ZeroRedundancyOptimizer`` sending its shards between ranks as
``torch.save``'d bytes, ``torch.hub`` loading downloaded weights) are serialisation, not
checkpoints, and are not counted.

Limits: code that took its own reference before ``configure()`` (``from torch import save``;
``from safetensors.torch import save_file``, as transformers' ``save_pretrained`` does) calls
the original and is not timed (mark it with :func:`checkpoint`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.util
import logging
import sys
import threading
import time
from concurrent.futures import Future
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any, Callable, Iterator, Sequence

import torch

from torchtrace.job import progress

logger = logging.getLogger(__name__)

KINDS = ("save", "load")
"""The values of the ``kind`` label of ``torchtrace_checkpoint_seconds``."""

Sink = Callable[[str, float, float, "TimedCall"], None]
"""``sink(kind, start, end, call)``: perf_counter seconds of one outermost save or load, and
what its code said of it (:class:`TimedCall`: an asynchronous save's upload, a part)."""

_sink: Sink | None = None
_depth = threading.local()
_originals: list[tuple[Any, str, Callable[..., Any]]] = []


def install(sink: Sink) -> None:
    """Time checkpoint calls from now on and hand each to ``sink``. Installing again only
    replaces the sink.

    The modules of :data:`WHEN_IMPORTED` (``torch.distributed.checkpoint`` takes seconds to
    import; accelerate and safetensors are the application's own) are wrapped when the
    application imports them (now, those it already has), never imported by torchtrace.
    """
    global _sink
    _sink = sink
    if _originals:
        return
    _wrap(torch, "save", "save", own_calls=False)
    _wrap(torch, "load", "load", own_calls=False)
    for name, wrap in WHEN_IMPORTED.items():
        if name in sys.modules:
            wrap(sys.modules[name])
    if not any(isinstance(f, _WrapOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _WrapOnImport())


DCP = "torch.distributed.checkpoint"


def _wrap_dcp(dcp: ModuleType) -> None:
    if _sink is None:
        return
    for name, kind in (("save", "save"), ("load", "load"), ("save_state_dict", "save"),
                       ("load_state_dict", "load")):
        _wrap_if_there(dcp, name, kind)
    if callable(getattr(dcp, "async_save", None)) and not _wrapped(dcp, "async_save"):
        _wrap_async_save(dcp, "async_save")


def _wrap_accelerate(module: ModuleType) -> None:
    """``Accelerator.save_state`` and ``load_state``: one checkpoint each, however many files
    (and ``torch.save`` calls) they write or read."""
    accelerator = getattr(module, "Accelerator", None)
    if isinstance(accelerator, type):
        _wrap_if_there(accelerator, "save_state", "save")
        _wrap_if_there(accelerator, "load_state", "load")


def _wrap_safetensors(module: ModuleType) -> None:
    """safetensors' file functions (not ``save``/``load``, which make and read bytes in memory)."""
    for name, kind in (("save_file", "save"), ("save_model", "save"), ("load_file", "load"),
                       ("load_model", "load")):
        _wrap_if_there(module, name, kind)


WHEN_IMPORTED: dict[str, Callable[[ModuleType], None]] = {
    DCP: _wrap_dcp,
    "accelerate.accelerator": _wrap_accelerate,  # (where ``Accelerator`` is defined)
    "safetensors.torch": _wrap_safetensors,
}
"""The modules whose checkpoint functions are wrapped as the application imports them."""


def _wrapped(owner: object, name: str) -> bool:
    return any(o is owner and n == name for o, n, _ in _originals)


def _wrap_if_there(owner: object, name: str, kind: str) -> None:
    """``owner.name`` timed as a ``kind`` call, if it is there, once (and torchtrace is installed)."""
    if _sink is not None and callable(getattr(owner, name, None)) and not _wrapped(owner, name):
        _wrap(owner, name, kind)


class _WrapOnImport(importlib.abc.MetaPathFinder):
    """Wraps the checkpoint functions of a module of :data:`WHEN_IMPORTED` once the application
    imports it."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        wrap = WHEN_IMPORTED.get(fullname)
        if wrap is None:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original_exec = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            original_exec(module)
            try:
                wrap(module)
            except Exception:  # never break the application's import
                logger.debug("torchtrace could not wrap %s", fullname, exc_info=True)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def uninstall() -> None:
    """Put every wrapped function back; nothing is timed afterwards."""
    global _sink
    _sink = None
    for finder in [f for f in sys.meta_path if isinstance(f, _WrapOnImport)]:
        sys.meta_path.remove(finder)
    while _originals:
        owner, name, original = _originals.pop()
        if getattr(getattr(owner, name, None), "__wrapped__", None) is original:
            setattr(owner, name, original)


def _wrap(owner: object, name: str, kind: str, own_calls: bool = True) -> None:
    """``owner.name`` timed as a ``kind`` call. ``own_calls`` False: not the calls torch makes
    itself (see :func:`_called_by_torch`)."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def timed(*args: object, **kwargs: object) -> Any:
        if not own_calls and _called_by_torch():
            return original(*args, **kwargs)
        with _timed(kind):
            return original(*args, **kwargs)

    setattr(owner, name, timed)
    _originals.append((owner, name, original))


def _called_by_torch() -> bool:
    """Whether the ``torch.save`` or ``torch.load`` being called was called by torch's own code:
    serialisation inside a library call, not the application's checkpoint. ``ZeroRedundancyOptimizer.
    consolidate_state_dict`` sends each rank's shard to one rank as ``torch.save``'d bytes, which
    that rank ``torch.load``s: counted as checkpoints, a rank that saved nothing held a save in its
    black box. (A distributed checkpoint's own saves are inside its wrapped ``save`` already.)"""
    caller = sys._getframe(2)  # (0: this function, 1: the wrapper, 2: who called torch.save)
    return str(caller.f_globals.get("__name__", "")).startswith("torch.")


def _wrap_async_save(owner: object, name: str) -> None:
    """``dcp.async_save``, timed as a save whose checkpoint exists once its upload completes."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def timed(*args: object, **kwargs: object) -> object:
        with _timed("save") as call:
            response = original(*args, **kwargs)
            # A Future, or (where the staging is asynchronous too) a response that holds the
            # staging's future and the upload's.
            upload = getattr(response, "upload_completion", response)
            call.upload = upload if callable(getattr(upload, "add_done_callback", None)) else None
            return response

    setattr(owner, name, timed)
    _originals.append((owner, name, original))


class TimedCall:
    """What the sink learns of a timed save or load besides its time.

    ``upload``: for a save that only hands the checkpoint over to be stored on another thread
    (``dcp.async_save``, Lightning's ``AsyncCheckpointIO``), a future that completes once it is
    stored. The checkpoint then counts, holding the step of the call, when the future completes
    without error; one that fails is no checkpoint.

    ``part``: True for one part of a checkpoint whose parts run at moments of their own (a
    Hugging Face Trainer's resume loads the model, then the optimizer, then the random states,
    with other work between): its time is checkpoint time, but the checkpoint is counted once,
    whole, by whoever knows it is complete (:func:`torchtrace.step.job.checkpoint_counted`).

    ``seconds``: the call's time once it ended, where it was handed to the sink (the thread's
    outermost, torchtrace configured, no exception); else None."""

    def __init__(self) -> None:
        self.upload: Future[Any] | None = None
        self.part = False
        self.seconds: float | None = None


@contextlib.contextmanager
def _timed(kind: str) -> Iterator[TimedCall]:
    """Time the block as a ``kind`` call and hand it to the sink, if it is the thread's
    outermost and did not raise."""
    depth = getattr(_depth, "n", 0)
    _depth.n = depth + 1
    call = TimedCall()
    # The watchdog's view: a long save is a checkpoint, with its allowance, not a hang.
    before = progress.checkpoint_began() if depth == 0 and _sink is not None and progress.on_training_thread() \
        else None
    start = time.perf_counter()
    finished = False
    try:
        yield call
        finished = True
    finally:
        _depth.n = depth
        if before is not None:
            progress.phase_ended("checkpoint", before)
        sink = _sink
        # A save that raised saved nothing: no checkpoint to resume from.
        if depth == 0 and sink is not None and finished:
            end = time.perf_counter()
            call.seconds = end - start
            try:
                sink(kind, start, end, call)
            except Exception:  # never break the user's save
                logger.debug("torchtrace could not record a checkpoint %s", kind, exc_info=True)


@contextlib.contextmanager
def checkpoint(kind: str = "save") -> Iterator[TimedCall]:
    """Mark a checkpoint save or load that torchtrace cannot see on its own.

    Its time goes to ``torchtrace_checkpoint_seconds{kind}`` and to badput ``checkpoint``; a
    save sets the black box's ``checkpoint_step`` to the last step finished. Inside another
    save or load (wrapped or marked) it counts nothing more, nor on a thread other than the
    one that trains (there the step it holds is not known). A block that raises counts nothing.

    A block that only hands the checkpoint over to be stored elsewhere sets the yielded call's
    ``upload`` to a future that completes once it is stored (:class:`TimedCall`).

    Raises:
        ValueError: ``kind`` is not ``save`` or ``load`` (at the call, before the block runs).

    >>> import torchtrace as tt
    >>> with tt.checkpoint("save"):
    ...     pass
    """
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not valid; accepted values: {', '.join(KINDS)}")
    with _timed(kind) as call:
        yield call
