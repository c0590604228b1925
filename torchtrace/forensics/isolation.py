"""What keeps a forensic replay from changing anything outside it, or waiting on anyone.

A replay runs the user's step once more, on one rank, inside the optimizer's hook. So the
optimizers', schedulers' and scalers' updates become no-ops (:func:`neutralised`),
DistributedDataParallel issues no collective (:func:`local_only`), torch.compile'd code runs
eagerly so that the hooks see every module (:func:`eager`), an ``async def`` step is driven
to its end outside the event loop (:func:`finished`), and the RNG state is the step's
(:func:`capture_rng`, :func:`restore_rng`).
"""

from __future__ import annotations

import contextlib
import inspect
import random
import sys
import weakref
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import torch
from torch.optim import swa_utils

from torchtrace.measure.scaler import find_side_effect_owners

if TYPE_CHECKING:
    from torchtrace.step.scope import StepScope


# ---------------------------------------------------------------- RNG and state capture
def capture_rng() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """The CPU and CUDA generator states (host-side: no device synchronisation)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def restore_rng(state: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


@contextlib.contextmanager
def host_rng_kept() -> Iterator[None]:
    """Python's global ``random`` and NumPy's (where NumPy is imported) as the block found them."""
    python_rng = random.getstate()
    numpy = sys.modules.get("numpy")
    numpy_rng = numpy.random.get_state() if numpy is not None else None
    try:
        yield
    finally:
        random.setstate(python_rng)
        if numpy is not None:
            numpy.random.set_state(numpy_rng)


@contextlib.contextmanager
def rng_kept() -> Iterator[None]:
    """Every global generator a model's forward may draw from (torch's CPU and CUDA ones,
    Python's, NumPy's) as the block found them: work done on the side (a check's forward with
    Dropout, a measurement's training on a copy) leaves the user's next draw where it was."""
    torch_rng = capture_rng()
    try:
        with host_rng_kept():
            yield
    finally:
        restore_rng(torch_rng)


# ---------------------------------------------------------------- neutralising side effects
@contextlib.contextmanager
def neutralised(optimizers: list[Any], scalers: list[Any]) -> Iterator[None]:
    """``optimizer.step`` and a GradScaler's ``step/unscale_/update`` become no-ops (instance patch)."""
    patched: list[tuple[Any, str, bool, Any]] = []

    def patch(obj: object, name: str) -> None:
        had = name in vars(obj)
        patched.append((obj, name, had, vars(obj).get(name)))
        setattr(obj, name, lambda *a, **k: None)

    try:
        for opt in optimizers:  # optimizers, schedulers, and weight averages (AveragedModel)
            patch(opt, "update_parameters" if isinstance(opt, swa_utils.AveragedModel) else "step")
        for sc in scalers:
            for name in ("step", "unscale_", "update"):
                patch(sc, name)
        yield
    finally:
        for obj, name, had, old in reversed(patched):
            if had:
                setattr(obj, name, old)
            else:
                try:
                    delattr(obj, name)
                except AttributeError:
                    pass


def side_effect_owners(scope: StepScope) -> tuple[list[Any], list[Any]]:
    """Optimizers and GradScalers among a step scope's arguments (their updates are neutralised
    in a replay), the scope's own, and the other optimizers and learning-rate schedulers that
    stepped in it (a scheduler's ``step`` is neutralised like an optimizer's)."""
    opts, scalers = find_side_effect_owners(*scope.inputs) if scope.inputs is not None else ([], [])
    for optimizer in (scope.optimizer, *(scope.forensics.stepped or ())):
        if optimizer is not None and optimizer not in opts:
            opts.append(optimizer)
    if scope.scaler is not None and scope.scaler not in scalers:
        scalers.append(scope.scaler)
    return opts, scalers


def _is_ddp(obj: object) -> bool:
    return isinstance(obj, torch.nn.parallel.DistributedDataParallel)


def is_distributed_data_parallel(model: torch.nn.Module, others: tuple = ()) -> bool:
    """A DistributedDataParallel wrapper is the model or among the step's arguments."""
    return any(_is_ddp(m) for m in (model, *others))


_FSDP_MODELS: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()


def sharded_by_fsdp(model: torch.nn.Module, others: tuple = ()) -> bool:
    """FSDP's first API (``FullyShardedDataParallel``) is the model, holds part of it, or is
    among the step's arguments: its shards are plain tensors, and its forward all-gathers them
    from every rank. (FSDP2's are DTensors.) Looked for only where that module is imported; a
    model's modules once."""
    fsdp = getattr(sys.modules.get("torch.distributed.fsdp"), "FullyShardedDataParallel", None)
    if fsdp is None:
        return False
    known = _FSDP_MODELS.get(model)
    if known is None:
        known = any(isinstance(m, fsdp) for m in model.modules())
        try:
            _FSDP_MODELS[model] = known
        except TypeError:  # a model without weak references: looked at again next time
            pass
    return known or any(isinstance(o, fsdp) for o in others)


@contextlib.contextmanager
def local_only(model: torch.nn.Module, others: tuple = ()) -> Iterator[None]:
    """No collective in the replay: DistributedDataParallel's gradient all-reduce and buffer
    broadcast are switched off (what ``no_sync()`` does, and the forward's buffer sync too) on
    every DDP wrapper among the model and the step's arguments. Only the rank whose step is
    replayed runs the replay: a collective there would wait for ranks that never join it."""
    wrappers = [m for m in (model, *others) if _is_ddp(m)]
    saved = [(w, w.require_backward_grad_sync, w.require_forward_param_sync) for w in wrappers]
    try:
        for w in wrappers:
            w.require_backward_grad_sync = False
            w.require_forward_param_sync = False
        yield
    finally:
        for w, backward, forward in saved:
            w.require_backward_grad_sync = backward
            w.require_forward_param_sync = forward


class OutsideState:
    """What a step keeps outside its model, kept while a replay runs and put back after it:

    - the gradients of parameters the step's optimizers train that the model does not hold (a
      multi-task loss's weights): set aside, so that the replay's backward makes gradients of
      its own, and put back (a replay's backward added to them, its ``zero_grad`` wiped them);
    - the gradients and buffers of every other module the replay runs (a critic's, a
      teacher's): found by a global forward pre-hook as each first runs; the buffers (BatchNorm
      statistics) are copied and copied back;
    - Python's global ``random`` and NumPy's (where NumPy is imported): a replay's draws (a
      mixup weight) are undone. The replay itself draws from them where the step left them.

    Parameter values outside the model are not copied: only an optimizer changes them, and the
    step's are neutralised (a teacher model is not copied whole).
    """

    def __init__(self, model: torch.nn.Module, optimizers: list[Any]) -> None:
        self._inside = {id(t) for t in (*model.parameters(), *model.buffers())}
        self._inside_modules = {id(m) for m in model.modules()}
        self._seen: set[int] = set()
        self._grads: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self._buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._set_aside(p for opt in optimizers for group in getattr(opt, "param_groups", ()) for p in group["params"])

    def _set_aside(self, params: Iterable[torch.Tensor]) -> None:
        for p in params:
            if id(p) not in self._inside and id(p) not in self._seen:
                self._seen.add(id(p))
                self._grads.append((p, p.grad))
                p.grad = None

    def _copy(self, buffers: Iterable[torch.Tensor]) -> None:
        for b in buffers:
            if id(b) not in self._inside and id(b) not in self._seen:
                self._seen.add(id(b))
                self._buffers.append((b, b.detach().clone()))

    def before_forward(self, module: torch.nn.Module, args: object) -> None:
        """The global forward pre-hook: a module outside the model, on its first run."""
        if id(module) not in self._inside_modules:
            self._set_aside(module.parameters(recurse=False))
            self._copy(module.buffers(recurse=False))

    def put_back(self) -> None:
        with torch.no_grad():
            for b, saved in self._buffers:
                b.copy_(saved)
        for p, grad in self._grads:
            p.grad = grad


@contextlib.contextmanager
def outside_kept(model: torch.nn.Module, optimizers: list[Any]) -> Iterator[None]:
    """A replay leaves the step's state outside ``model`` as it found it (:class:`OutsideState`)."""
    state = OutsideState(model, optimizers)
    handle = torch.nn.modules.module.register_module_forward_pre_hook(state.before_forward)
    try:
        with host_rng_kept():
            yield
    finally:
        handle.remove()
        state.put_back()


@contextlib.contextmanager
def accumulation_held() -> Iterator[None]:
    """accelerate's ``Accelerator.accumulate(model)`` counts a micro-batch on every entry, and
    that count decides which micro-batch updates: a replay that entered it again moved every
    later update one micro-batch on. In a replay it is an empty ``with`` (the gradients'
    synchronisation as the step left it; the replay issues no collective anyway). Nothing is
    patched where accelerate is not imported."""
    module = sys.modules.get("accelerate.accelerator")
    accelerator = getattr(module, "Accelerator", None)
    counting = vars(accelerator).get("accumulate") if accelerator is not None else None
    if counting is None:
        yield
        return
    accelerator.accumulate = lambda self, *models: contextlib.nullcontext()  # type: ignore[union-attr]
    try:
        yield
    finally:
        accelerator.accumulate = counting  # type: ignore[union-attr]


def eager() -> contextlib.AbstractContextManager:
    """torch.compile'd code runs eagerly in the replay, so every module's hooks run in Python
    (traced by dynamo, the recorder's bookkeeping is not kept)."""
    stance = getattr(getattr(torch, "compiler", None), "set_stance", None)
    if stance is None:
        return contextlib.nullcontext()
    return stance("force_eager")


_MAX_BARE_YIELDS = 10_000


def finished(out: object) -> Any:
    """The result of a replayed ``async def`` step: its coroutine is driven here, outside the
    event loop (the replay runs inside the optimizer's hook, which cannot await). Bare yields
    (``await asyncio.sleep(0)``) are passed over; awaiting a pending future of the loop (real
    I/O) cannot go on here, and raises ``RuntimeError`` saying so (the report's ``tried``).
    Anything else is returned as it is.

    >>> async def step():
    ...     return 3
    >>> finished(step())
    3
    """
    if not inspect.iscoroutine(out):
        return out
    try:
        for _ in range(_MAX_BARE_YIELDS):
            try:
                awaited = out.send(None)
            except StopIteration as stop:
                return stop.value
            if awaited is not None:
                raise RuntimeError("the async step awaited a pending future, which a replay outside the event "
                                   "loop cannot wait for; give replay= a synchronous callable")
        raise RuntimeError("the async step kept yielding; give replay= a synchronous callable")
    finally:
        out.close()




def autocast_state() -> tuple[tuple[str, torch.dtype], ...]:
    """The autocasts enabled now, as (device type, dtype) pairs: what a replay of a forward
    that ran under a framework's autocast (the Hugging Face Trainer's ``bf16=``/``fp16=``)
    must run under again, or an overflow in half precision would not happen in the replay.

    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     autocast_state()
    (('cpu', torch.bfloat16),)
    """
    return tuple((device, torch.get_autocast_dtype(device)) for device in ("cpu", "cuda")
                 if torch.is_autocast_enabled(device))


@contextlib.contextmanager
def autocast_as(state: tuple[tuple[str, torch.dtype], ...]) -> Iterator[None]:
    """Run the block under the autocasts of :func:`autocast_state` (none: as it is)."""
    with contextlib.ExitStack() as stack:
        for device, dtype in state:
            stack.enter_context(torch.autocast(device_type=device, dtype=dtype))
        yield

__all__ = ["autocast_as", "autocast_state", "capture_rng", "eager", "finished", "is_distributed_data_parallel",
           "local_only", "neutralised", "restore_rng", "side_effect_owners"]
