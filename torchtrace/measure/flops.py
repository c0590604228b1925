"""Model FLOPs of a step, counted once per input shape, and the peak FLOP/s of known accelerators.

A step's FLOPs are counted with :class:`torch.utils.flop_counter.FlopCounterMode` while the
step runs (forward, backward and optimizer; the optimizer's element-wise ops have no FLOP
formula and count zero). Counting slows that one step down, so it runs once per distinct
input-shape key (:func:`shape_key`) and that step's time is left out of throughput.

What FlopCounterMode cannot see is not counted: ops without a registered formula (only
matrix products, convolutions and attention have one), custom kernels and extensions, and
ops inside compiled regions it does not trace. Recomputation under activation checkpointing
runs the forward again inside backward and is counted again: the count is what ran, not the
model's nominal FLOPs. Under sharding (FSDP, tensor parallel) the count is this rank's.

>>> import torch
>>> cache = StepFlops()
>>> model, x = torch.nn.Linear(64, 32), torch.randn(8, 64, requires_grad=True)
>>> key = shape_key((x,), {})
>>> with cache.counting(key):
...     model(x).sum().backward()
>>> cache.lookup(key) == 3 * 2 * 8 * 64 * 32
True
"""

from __future__ import annotations

import contextlib
from typing import Callable, Hashable, Iterator, TypeVar

import torch
from torch.utils.flop_counter import FlopCounterMode

from torchtrace.measure import peaks
from torchtrace.measure.flop_fit import FlopFits
from torchtrace.measure.flop_modes import (
    _Counter,
    drop_counter,
    eager_for_now,
    leave_counter,
    profiler_running,
    release_counter,
)
from torchtrace.measure.flop_rules import RULES
from torchtrace.measure.shape_keys import KEY_MAX_DEPTH, KEY_MAX_ITEMS, LOOSE, NESTED, countable, grown, shape_key

#: How many distinct shape keys one counter counts per operation (keys ``(operation, shapes)``).
#: Past it, a step of that operation with a new shape gets no FLOP count (its throughput still
#: counts samples and tokens): a job whose every batch has a new shape must not pay for a
#: counted step every step. An operation's shapes never take another's room: an evaluation
#: that starts after a training run of many shapes is counted all the same.
DEFAULT_MAX_SHAPES = 32
MAX_KEYS = 256  # keys of all operations together

peak_flops = peaks.peak_flops
precision_key = peaks.precision_key
MAX_LOOSE_OPERATIONS = 64  # operations whose loose arguments are kept


class LateKey:
    """The key of a count whose shapes are known only when it ends (a step without inputs,
    keyed by its model's call): ``value`` is set before the count closes; None records nothing."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: Hashable | None = None


def _operation(key: Hashable) -> Hashable:
    """The operation of an ``(operation, shapes)`` key; None for a key of another form."""
    return key[0] if type(key) is tuple and len(key) == 2 and type(key[0]) is str else None


def _resolved(key: Hashable) -> Hashable | None:
    return key.value if type(key) is LateKey else key


class StepFlops:
    """FLOPs of a step per shape key: counted once each, at most ``max_shapes`` keys per
    operation (the first item of an ``(operation, shapes)`` key) and :data:`MAX_KEYS` in all.

    Key it by operation as well as shape (``(name, shape_key(args, kwargs))``) when several
    operations share one counter. Not thread-safe: use one per step thread.

    With keys of that form it learns which arguments do not decide an operation's FLOPs:
    when two counts give the same FLOPs and their keys differ only in some arguments (a
    list the step appends to, a history that grows), those arguments are left out of the
    operation's keys from then on. Without it, such a step was counted again every step until
    the table was full, and later steps had no FLOPs.

    >>> cache = StepFlops(max_shapes=1)
    >>> cache.needs_count("a"), cache.needs_count("b")
    (True, True)
    >>> cache.record("a", 100)
    >>> cache.lookup("a"), cache.needs_count("b")
    (100, False)
    """

    def __init__(self, max_shapes: int = DEFAULT_MAX_SHAPES) -> None:
        if max_shapes < 1:
            raise ValueError(f"max_shapes={max_shapes!r} is not valid; accepted values: an integer >= 1")
        self.max_shapes = max_shapes
        self._flops: dict[Hashable, int | None] = {}  # None: a key that is never counted
        self._per_operation: dict[Hashable, int] = {}  # keys held per operation
        self._dtypes: dict[Hashable, torch.dtype] = {}  # the dtype most of a count's FLOPs ran in
        self.counts = 0  # how many steps were counted
        self.failures = 0  # steps that raised in an op under the counter (their keys are skipped)
        self.loose: dict[Hashable, frozenset[int]] = {}  # operation -> key positions that do not decide FLOPs
        self.fits = FlopFits()  # FLOPs of shapes never counted, from counts differing in one or two lengths
        # Per operation: host seconds of its counted steps' ops with no FLOP rule, and of all
        # their ops (CPU counts only; see unruled_share).
        self._unruled: dict[Hashable, tuple[float, float]] = {}

    def unruled_share(self, operation: str) -> float | None:
        """The share of the operation's counted steps' op time spent in ops with no FLOP rule
        (element-wise work, normalisation, the optimizer's update, unknown kernels): what its
        FLOPs, and so its MFU, cannot see. None when no count of it ran on the CPU alone (a
        GPU op's host time is its launch, not its run).

        >>> import torch
        >>> flops, x = StepFlops(), torch.randn(256, 256)
        >>> with flops.counting(("step", 1)):
        ...     _ = (x @ x).relu().exp().sin().cos().tanh()
        >>> 0.0 < flops.unruled_share("step") < 1.0
        True
        """
        seen = self._unruled.get(operation)
        if seen is None or seen[1] <= 0.0:
            return None
        return seen[0] / seen[1]

    def _note_unruled(self, key: Hashable, mode: _Counter) -> None:
        operation = _operation(key)
        if mode.unruled_share() is None or (operation not in self._unruled and len(self._unruled) >= MAX_KEYS):
            return
        unruled, total = self._unruled.get(operation, (0.0, 0.0))
        self._unruled[operation] = (unruled + mode.unruled_s, total + mode.op_s)

    def table_key(self, key: Hashable) -> Hashable:
        """``key`` as the table holds it: an ``(operation, shape key)`` with the operation's
        loose arguments (see the class) replaced by :data:`LOOSE`."""
        if not self.loose or type(key) is not tuple or len(key) != 2 or type(key[1]) is not tuple:
            return key
        positions = self.loose.get(key[0])
        if positions is None:
            return key
        return key[0], tuple([LOOSE if i in positions else k for i, k in enumerate(key[1])])

    def lookup(self, key: Hashable) -> int | None:
        """The FLOPs recorded for ``key``, or those a trusted fit gives it (see
        :mod:`torchtrace.measure.flop_fit`), or None."""
        key = self.table_key(key)
        if key in self._flops:
            return self._flops[key]
        return self.fits.predict(key, spot_check=self._room(key))

    def compute_dtype(self, key: Hashable) -> torch.dtype | None:
        """The dtype most of ``key``'s counted FLOPs ran in (the operands' dtype: bfloat16 under a
        bfloat16 autocast), or that of the counts behind its fit; None when it was not counted."""
        key = self.table_key(key)
        dtype = self._dtypes.get(key)
        return dtype if dtype is not None or key in self._flops else self.fits.dtype(key)

    def needs_count(self, key: Hashable) -> bool:
        """True when ``key`` has no FLOPs yet, no fit gives it any, and there is room to count it."""
        key = self.table_key(key)
        return key not in self._flops and self._room(key) and \
            self.fits.predict(key, spot_check=True) is None

    def skip(self, key: Hashable) -> None:
        """Never count ``key`` (its lookups give None); room permitting, like a count."""
        key = self.table_key(key)
        if key not in self._flops and self._room(key):
            self._hold(key, None)

    def record(self, key: Hashable, flops: float) -> None:
        """Record FLOPs for ``key`` (a count, or FLOPs the user supplied); room permitting."""
        key = self.table_key(key)
        if key in self._flops:
            self._flops[key] = int(flops)
        elif self._room(key):
            self._hold(key, int(flops))

    def forget(self, operation: str) -> None:
        """Drop every count of ``operation`` (and the fits made of them): its steps are counted
        again, shape by shape (what it computes changed: parameters frozen or unfrozen)."""
        for key in [k for k in self._flops if _operation(k) == operation]:
            del self._flops[key]
            self._dtypes.pop(key, None)
        self._per_operation.pop(operation, None)
        self.fits.forget(operation)

    def _room(self, key: Hashable) -> bool:
        """True when ``key``'s operation may hold one more key (and the table one more)."""
        return len(self._flops) < MAX_KEYS and self._per_operation.get(_operation(key), 0) < self.max_shapes

    def _hold(self, key: Hashable, flops: int | None) -> None:
        self._flops[key] = flops
        operation = _operation(key)
        self._per_operation[operation] = self._per_operation.get(operation, 0) + 1

    def _learn(self, key: Hashable, flops: int) -> None:
        """Mark the arguments in which ``key`` differs from an earlier count of the same
        operation that gave the same FLOPs as not deciding them (see the class)."""
        key = self.table_key(key)
        if type(key) is not tuple or len(key) != 2 or type(key[1]) is not tuple:
            return
        name, inner = key
        known = self.loose.get(name, frozenset())
        if not known and len(self.loose) >= MAX_LOOSE_OPERATIONS:
            return
        for other, other_flops in list(self._flops.items()):  # (a copy: another step thread may count)
            if other_flops != flops or type(other) is not tuple or len(other) != 2 or other[0] != name \
                    or type(other[1]) is not tuple or len(other[1]) != len(inner):
                continue
            # (an entry counted before some positions were loose holds them as they were then)
            positions = frozenset(i for i, (a, b) in enumerate(zip(inner, other[1])) if a != b and i not in known)
            if positions and all(grown(inner[i], other[1][i]) for i in positions):
                self.loose[name] = known | positions
                return

    @contextlib.contextmanager
    def counting(self, key: Hashable) -> Iterator[_Counter]:
        """Count the FLOPs of the code inside and record them for ``key``.

        ``key`` may be a :class:`LateKey`, read when the code inside has run.
        The count is recorded only when the code inside finishes without an exception: a
        step that raised halfway would record a partial count for good. A count of zero is no
        count: the work ran in kernels the counter has no formula for (the fused inference path
        of ``nn.TransformerEncoder``, custom extensions), and the key gets no FLOPs. A count
        made void while it ran (:func:`~torchtrace.measure.flop_modes.release_counter`) records
        nothing either.
        """
        mode = _Counter(display=False)
        try:
            with mode:
                yield mode
        except BaseException:
            if mode.failed:  # an op raised under the counter: never run it there again
                if _resolved(key) is not None:
                    self.skip(_resolved(key))
                self.failures += 1
            raise
        if mode.void:
            return
        self.counts += 1
        key = _resolved(key)
        if key is None:
            return
        total = mode.get_total_flops()
        if total > 0 and not mode.incomplete:
            self._note_unruled(key, mode)
            self._learn(key, total)
            self.record(key, total)
            key, dtype = self.table_key(key), mode.compute_dtype()
            if dtype is not None and key in self._flops:
                self._dtypes[key] = dtype
            self.fits.add(key, total, dtype)
        else:
            self.skip(key)

    def begin(self, key: Hashable) -> contextlib.ExitStack | None:
        """A step's count for ``key``, entered (:meth:`counting`; ``torch.compile``d code runs
        eagerly inside, see :func:`eager_for_now`): its ``__exit__`` ends it. None while a
        profiler records (:func:`profiler_running`; the user's, or torchtrace's own window): it
        would see the step's every op twice and the counter's dispatch mode besides, so the key
        stays uncounted and a later step without a profiler counts it."""
        if profiler_running():
            return None
        counter = contextlib.ExitStack()
        try:
            counter.enter_context(eager_for_now())
            counter.mode = counter.enter_context(self.counting(key))  # type: ignore[attr-defined]
        except BaseException:
            counter.close()
            raise
        return counter

    def __len__(self) -> int:
        return len(self._flops)


_R = TypeVar("_R")


def count_flops(fn: Callable[..., _R], *args: object, **kwargs: object) -> tuple[_R, int]:
    """Run ``fn(*args, **kwargs)`` once under a FLOP counter: ``(its result, its FLOPs)``.

    >>> import torch
    >>> _, flops = count_flops(torch.mm, torch.ones(2, 3), torch.ones(3, 4))
    >>> flops == 2 * 2 * 3 * 4
    True
    """
    mode = FlopCounterMode(display=False, custom_mapping=RULES)  # (torch's rules and flop_rules')
    with mode:
        result = fn(*args, **kwargs)
    return result, int(mode.get_total_flops())


__all__ = ["DEFAULT_MAX_SHAPES", "KEY_MAX_DEPTH", "KEY_MAX_ITEMS", "LOOSE", "NESTED", "LateKey", "StepFlops",
           "count_flops", "countable", "drop_counter", "eager_for_now", "leave_counter", "peak_flops", "precision_key",
           "profiler_running", "release_counter", "shape_key"]
