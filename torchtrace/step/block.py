"""A step that finds out what its block does: the seeds' ``with debug_context(DebugLevel.BASIC)``.

Seed 001 opens its autograd-debugging block with a level only (no model, no optimizer, no
loss) and expects it to debug what runs inside. :class:`WatchedBlock` wraps such a step and,
while the block runs, watches through torch's public global hooks:

- the model: the first outermost module call with parameters (a forward hook on every
  module, ``torch.nn.modules.module.register_module_forward_pre_hook`` / ``..._hook``);
- the optimizer: ``torch.optim.optimizer.register_optimizer_step_pre_hook``; its step measures
  the gradients as it will use them (``StepScope.check_gradients_now``);
- the loss: the tensor ``backward()`` is called on (a ``TorchFunctionMode`` that sees
  ``Tensor.backward`` and ``torch.autograd.backward``), handed to ``record_loss``;
- with neither model nor optimizer, the gradients of the leaf tensors that loss's graph
  reached (the tensors the block made), watched as the step's model.

The global hooks are registered at the first such block and stay until ``shutdown()``: they
lead to the block open on the calling thread, and do nothing outside one. Registered anew
for every block, their new ids made ``torch.compile`` recompile a compiled model at every
step, until its recompile limit left it uncompiled for good. The mode exists only inside the
block (removed on exit, on error too); it routes every torch call of the block through
Python: a cost paid only by this seed form, small next to the autograd anomaly detection it
comes with.
"""

from __future__ import annotations

import contextvars
import logging
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.overrides import TorchFunctionMode

from torchtrace import current
from torchtrace.levels import DebugLevel, DebugMode
from torchtrace.measure.autograd_graph import graph_leaves
from torchtrace.step.scope import StepScope

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

logger = logging.getLogger(__name__)


class BlockTensors(torch.nn.Module):
    """Leaf tensors a block's backward reached, watched as a model's parameters
    (``tensor0``, ``tensor1``... in graph order)."""

    def __init__(self, leaves: list[torch.Tensor]) -> None:
        super().__init__()
        self.leaves = leaves

    # (leaf tensors, not Parameters: the override's return type is wider than torch's)
    def named_parameters(self, prefix: str = "", recurse: bool = True,  # type: ignore[override]
                         remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        for i, leaf in enumerate(self.leaves):
            yield f"{prefix}tensor{i}", leaf


class _BackwardWatch(TorchFunctionMode):
    """Sees every ``backward()`` of the block and hands its tensor to ``block.saw_loss``."""

    def __init__(self, block: WatchedBlock) -> None:
        super().__init__()
        self.block = block

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if (func is torch.Tensor.backward or func is torch.autograd.backward) and args:
            self.block.saw_loss(args[0])
        return func(*args, **(kwargs or {}))


class WatchedBlock:
    """A step (:class:`~torchtrace.step.scope.StepScope`) whose block is watched for its model,
    optimizer and loss; ``with`` yields the step itself.

    >>> import torch, torchtrace as tt
    >>> _ = tt.configure(prometheus_port="off", write_files=False)
    >>> w = torch.ones(3, requires_grad=True)
    >>> with tt.debug_context(tt.DebugLevel.BASIC) as step:
    ...     (w * 2).sum().backward()
    >>> round(step.record.grad_norm, 4)  # sqrt(3 * 2 ** 2)
    3.4641
    >>> tt.shutdown()
    """

    def __init__(self, scope: StepScope) -> None:
        self.scope = scope
        self.model: torch.nn.Module | None = None
        self.loss: torch.Tensor | None = None
        self.stepped = False
        self._depth = 0
        self._token: contextvars.Token[WatchedBlock | None] | None = None
        self._mode: _BackwardWatch | None = None

    def __enter__(self) -> StepScope:
        scope = self.scope.__enter__()
        if scope.active:
            try:
                self._install()
            except Exception as exc:
                self._remove()
                _report(exc)
        return scope

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            self._remove()
            self._hand_over()
        except Exception as err:
            _report(err)
        finally:
            self.loss = None
            self.model = None
        return self.scope.__exit__(exc_type, exc, tb)

    async def __aenter__(self) -> StepScope:
        return self.__enter__()

    async def __aexit__(self, exc_type, exc, tb) -> bool:
        return self.__exit__(exc_type, exc, tb)

    # ------------------------------------------------------------ hooks
    def _install(self) -> None:
        _watch()
        self._token = _OPEN.set(self)
        self._mode = _BackwardWatch(self)
        self._mode.__enter__()

    def _remove(self) -> None:
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)
        if self._token is not None:
            token, self._token = self._token, None
            _OPEN.reset(token)

    def _pre_forward(self, module: torch.nn.Module, args: tuple) -> None:
        self._depth += 1

    def _post_forward(self, module: torch.nn.Module, args: tuple, output: object) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth == 0 and self.model is None and self.scope.model is None:
            # The outermost call with parameters is the model (a loss module has none).
            if next(module.parameters(), None) is not None:
                self.model = module
                self.scope.model = module

    def _before_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if not self.stepped:
            self.stepped = True
            self.scope.check_gradients_now(optimizer)

    def saw_loss(self, loss: object) -> None:
        if isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.grad_fn is not None:
            self.loss = loss
            self.scope.record_loss(loss)

    # ------------------------------------------------------------ exit
    def _hand_over(self) -> None:
        """Without a model or optimizer, the leaves the loss's graph reached are the step's model."""
        if self.stepped or self.scope.model is not None or self.loss is None:
            return
        leaves = [t for t in graph_leaves(self.loss) if t.grad is not None]
        if leaves:
            self.scope.model = BlockTensors(leaves)


_OPEN: contextvars.ContextVar[WatchedBlock | None] = contextvars.ContextVar("torchtrace_block", default=None)
_handles: list[RemovableHandle] = []


def _watch() -> None:
    """Register the global hooks that lead to the open block, once (until :func:`unwatch`)."""
    if _handles:
        return
    module_hooks = torch.nn.modules.module
    _handles.append(module_hooks.register_module_forward_pre_hook(_pre_forward))
    _handles.append(module_hooks.register_module_forward_hook(_post_forward))
    _handles.append(register_optimizer_step_pre_hook(_before_step))


def unwatch() -> None:
    """Remove the global hooks (idempotent; at ``shutdown()``)."""
    for handle in _handles:
        handle.remove()
    _handles.clear()


def _pre_forward(module: torch.nn.Module, args: tuple) -> None:
    block = _OPEN.get()
    if block is not None:
        block._pre_forward(module, args)


def _post_forward(module: torch.nn.Module, args: tuple, output: object) -> None:
    block = _OPEN.get()
    if block is not None:
        block._post_forward(module, args, output)


def _before_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    block = _OPEN.get()
    if block is not None:
        block._before_step(optimizer, args, kwargs)


def level_block(level: DebugLevel, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                step: int | None = None, mode: DebugMode | str | None = None, attributes: dict[str, Any] | None = None,
                replay: Callable[[], Any] | None = None, scaler: torch.amp.GradScaler | None = None,
                kind: str = "train", inputs: object = None) -> WatchedBlock:
    """The seeds' ``debug_context(DebugLevel.BASIC)``: a step named ``step`` at ``level``, under
    autograd anomaly detection (``DebugMode.ANOMALY_DETECTION`` unless ``mode`` says
    otherwise), that finds the block's model, optimizer and loss itself. The other arguments
    are :func:`torchtrace.debug_context`'s."""
    scope = StepScope("step", model=model, optimizer=optimizer, step=step, level=level,
                      mode=DebugMode.ANOMALY_DETECTION if mode is None else mode, attributes=attributes,
                      replay=replay, scaler=scaler, kind=kind, inputs=((inputs,), {}) if inputs is not None else None)
    return WatchedBlock(scope)


def _report(exc: BaseException) -> None:
    """torchtrace's own failure is reported, never raised into the block."""
    rt = current.runtime(create=False)
    if rt is not None:
        rt.errors.report("step", exc)
    else:
        logger.warning("torchtrace: watching the block failed (%s: %s)", type(exc).__name__, exc)


__all__ = ["BlockTensors", "WatchedBlock", "level_block", "unwatch"]
