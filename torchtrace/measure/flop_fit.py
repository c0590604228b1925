"""FLOPs of shapes never counted, from the counts of shapes that differ in one length only.

A loop that pads each batch to its longest sequence (the default of most collators) gives
every step a new shape: counted one shape at a time, each first step of a length runs under
the FLOP counter (several times slower) until the table is full, and every step after that
has no FLOPs, so no FLOP/s and no MFU. But a model's counted FLOPs are a polynomial of such a
length: linear layers are linear in it, attention is quadratic. :class:`FlopFits` finds
counted shapes that differ only in one length (the same value at every position where they
differ: a sequence length that the ids, the mask and the labels share), fits FLOPs as a
quadratic of that length through three counts, and trusts the fit only once further counts
match it exactly (FLOP counts are integers; a quadratic that three of them fix and two more
confirm is the model's, not a coincidence). From then on a shape of that family gets its
FLOPs from the fit, without the counter, except, while the table has room, lengths further
from those counted than their span (a quadratic found on short sequences need not hold for
far longer ones: a sliding attention window; a history that keeps growing is counted at
about every doubling) and the 8th, 16th, 32nd, ... new length, which are counted all the
same; a count that disagrees with a fit ends it for good.

Shapes whose counts no quadratic matches exactly (a strided convolution: its FLOPs are a step
function of the image size) are counted while the table has room; once it is full, a
least-squares quadratic through the counts gives their FLOPs when it is within 2 % of every
count (else they have none, as before).

Shapes that differ in two lengths at once (token-budget batching, where the batch size and
the length both change; an epoch's last batch, smaller and of another length) are fitted as
the batch size times a quadratic of the length: the FLOPs per sample, fitted and confirmed
the same way. A model with work across the batch (a contrastive loss's batch-by-batch
similarities) matches no such fit exactly and is counted as before.

>>> import torch
>>> fits = FlopFits()
>>> def key(n): return ("step", ((torch.Size([8, n]), torch.int64),))
>>> for n in (10, 20, 30, 40, 50):
...     fits.add(key(n), 8 * (6 * n + n * n), torch.float32)
>>> fits.predict(key(64)) == 8 * (6 * 64 + 64 * 64)
True
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any, Hashable

import torch

MAX_STRUCTURES = 64  # shapes of different structure (tensors, ranks, dtypes) with counts kept
MAX_POINTS = 64  # counts kept per structure
MAX_FAMILIES = 16  # families tried per structure
FIT_POINTS = 3  # counts a quadratic is fitted through
CONFIRM_POINTS = 2  # further counts it must match exactly before it is used
APPROXIMATE = 0.02  # a least-squares quadratic within 2 % of every count stands in when no exact one fits
SPOT_CHECK = 8  # the 8th, 16th, 32nd, ... length a fit is asked for is counted all the same (room permitting)
MAX_ASKED = 1024  # lengths remembered per family (past that many, no more spot checks)

_SIZE = torch.Size


def split_key(key: Hashable) -> tuple[Hashable, tuple[int, ...]] | None:
    """``(structure, lengths)``: the key with every tensor dimension replaced by a mark, and
    the dimensions in order. None for a key without a tensor dimension."""
    dims: list[int] = []
    structure = _walk(key, dims)
    return (structure, tuple(dims)) if dims else None


# Any: a shape key's part; the checks by exact type (``kind is tuple``) are not ones mypy narrows by.
def _walk(value: Any, dims: list[int]) -> Hashable:
    kind = type(value)
    if kind is _SIZE:
        dims.extend(value)
        return ("dims", len(value))
    if kind is tuple:
        return tuple([_walk(v, dims) for v in value])
    return value


class _Family:
    """Counts whose lengths are fixed outside ``positions`` and share one value inside them."""

    __slots__ = ("positions", "fixed", "points", "dtype", "coefficients", "inexact", "approximate", "dead",
                 "asked", "exact_only")

    def __init__(self, positions: frozenset[int], fixed: tuple[int, ...], dtype: torch.dtype | None,
                 exact_only: bool = False) -> None:
        self.exact_only = exact_only  # no least-squares stand-in (a length's counts may differ: see _Scaled)
        self.positions = positions
        self.fixed = fixed  # the lengths outside ``positions``, in order
        # The shared length -> counted FLOPs (per sample, a Fraction, under _Scaled).
        self.points: dict[int, int | Fraction] = {}
        self.dtype = dtype
        self.coefficients: tuple[Fraction, Fraction, Fraction] | None = None  # a0 + a1 n + a2 n^2, once trusted
        self.inexact = False  # no quadratic matches every count exactly
        self.approximate: tuple[float, float, float] | None = None  # then: least squares, within APPROXIMATE
        self.dead = False  # counts in two dtypes: never used
        self.asked: dict[int, bool] = {}  # lengths the fit was asked for -> counted all the same (spot check)

    def length_of(self, dims: tuple[int, ...]) -> int | None:
        """The shared length of ``dims`` when they belong here, else None."""
        shared = None
        outside = []
        for i, d in enumerate(dims):
            if i in self.positions:
                if shared is None:
                    shared = d
                elif d != shared:
                    return None
            else:
                outside.append(d)
        return shared if tuple(outside) == self.fixed else None

    def add(self, n: int, flops: int | Fraction, dtype: torch.dtype | None) -> None:
        if self.dead:
            return
        if dtype != self.dtype:
            self.dead = True
            return
        exact = self.coefficients
        if self.points.get(n, flops) != flops or (exact is not None and _poly(exact, n) != flops):
            self.coefficients, self.inexact = None, True
        if len(self.points) < MAX_POINTS:
            self.points[n] = flops
        if len(self.points) >= FIT_POINTS + CONFIRM_POINTS:
            if not self.inexact and self.coefficients is None:
                self._fit()
            if self.inexact and not self.exact_only:
                self.approximate = _least_squares(self.points)

    def _fit(self) -> None:
        (x0, y0), (x1, y1), (x2, y2) = sorted(self.points.items())[:FIT_POINTS]
        # Newton's divided differences: exact over the rationals.
        d01 = Fraction(y1 - y0, x1 - x0)
        d12 = Fraction(y2 - y1, x2 - x1)
        a2 = (d12 - d01) / (x2 - x0)
        a1 = d01 - a2 * (x0 + x1)
        a0 = y0 - a1 * x0 - a2 * x0 * x0
        coefficients = (Fraction(a0), a1, a2)
        if all(_poly(coefficients, n) == f for n, f in self.points.items()):
            self.coefficients = coefficients
        else:
            self.inexact = True

    def value(self, n: int, spot_check: bool = False, scale: int = 1) -> int | None:
        """FLOPs at length ``n`` (times ``scale``: a batch size, see :class:`_Scaled`): counted,
        or from the exact fit; with ``spot_check`` (room to
        count), None further from the counted lengths than their span and for the spot checks
        (:func:`_spot_check`, always the same lengths): those steps are counted, and a count
        that disagrees ends the exact fit (a model whose FLOPs only looked quadratic on the
        first lengths, a strided convolution's at sizes of another parity). Without an exact
        fit, the approximate one, but only without ``spot_check`` (no room to count)."""
        if self.dead:
            return None
        if n in self.points:
            return _whole(self.points[n] * scale)
        if self.coefficients is None:
            if self.approximate is None or spot_check:
                return None
            v = round(_poly(self.approximate, n) * scale)
            return v if v > 0 else None
        lo, hi = min(self.points), max(self.points)
        if spot_check and not lo - (hi - lo) <= n <= hi + (hi - lo):
            return None  # far beyond the lengths counted, where a quadratic may stop holding: counted
        check = self.asked.get(n)
        if check is None and len(self.asked) < MAX_ASKED:
            check = self.asked[n] = _spot_check(len(self.asked) + 1)
        if check and spot_check:
            return None
        return _whole(_poly(self.coefficients, n) * scale)


def _spot_check(i: int) -> bool:
    """Whether the ``i``-th length a fit is asked for (from 1) is counted all the same: the
    SPOT_CHECK-th and every doubling of it (8, 16, 32, ...), so that a fit that keeps holding
    costs fewer counts the longer it holds."""
    return i >= SPOT_CHECK and i % SPOT_CHECK == 0 and (i // SPOT_CHECK) & (i // SPOT_CHECK - 1) == 0


def _whole(v: int | Fraction) -> int | None:
    """``v`` (an int or a Fraction) as FLOPs: a positive whole number, else None."""
    return int(v) if v > 0 and (type(v) is int or v.denominator == 1) else None


class _Scaled:
    """Counts whose lengths are fixed outside two sets of positions, each sharing one value: a
    batch size ``b`` and a length ``n``; their FLOPs divided by ``b`` (per sample) make a
    :class:`_Family` in ``n``, so the fit is ``b`` times a quadratic of ``n``."""

    __slots__ = ("batch", "per_sample")

    def __init__(self, batch: frozenset[int], positions: frozenset[int], fixed: tuple[int, ...],
                 dtype: torch.dtype | None) -> None:
        self.batch = batch
        # Exact fits only: the per-sample FLOPs of one length at two batch sizes may differ
        # (work across the batch), and a least-squares quadratic through some of them says nothing.
        self.per_sample = _Family(positions, fixed, dtype, exact_only=True)

    @property
    def positions(self) -> frozenset[int]:
        return self.per_sample.positions

    @property
    def fixed(self) -> tuple[int, ...]:
        return self.per_sample.fixed

    @property
    def coefficients(self) -> Any:
        return self.per_sample.coefficients

    @property
    def approximate(self) -> Any:
        return self.per_sample.approximate

    @property
    def dead(self) -> bool:
        return self.per_sample.dead

    @property
    def dtype(self) -> torch.dtype | None:
        return self.per_sample.dtype

    def length_of(self, dims: tuple[int, ...]) -> tuple[int, int] | None:
        """``(batch size, length)`` of ``dims`` when they belong here, else None."""
        b = None
        for i in self.batch:
            if b is None:
                b = dims[i]
            elif dims[i] != b:
                return None
        if not b:
            return None
        n = self.per_sample.length_of(tuple(d for i, d in enumerate(dims) if i not in self.batch))
        return (b, n) if n is not None else None

    def add(self, where: tuple[int, int], flops: int, dtype: torch.dtype | None) -> None:
        self.per_sample.add(where[1], Fraction(flops, where[0]), dtype)

    def value(self, where: tuple[int, int], spot_check: bool = False) -> int | None:
        return self.per_sample.value(where[1], spot_check, where[0])


def _outside(dims: tuple[int, ...], positions: frozenset[int]) -> tuple[int, ...]:
    return tuple(d for i, d in enumerate(dims) if i not in positions)


def _poly(c: tuple, n: int) -> Any:
    return c[0] + c[1] * n + c[2] * n * n


def _least_squares(points: dict[int, int | Fraction]) -> tuple[float, float, float] | None:
    """The quadratic nearest the counts (least squares, float64), when it is within
    APPROXIMATE of every one of them; else None."""
    xs = list(points)
    scale = max(xs)  # lengths scaled to at most 1: the normal equations stay well conditioned
    rows = [(1.0, x / scale, (x / scale) ** 2) for x in xs]
    ys = [float(points[x]) for x in xs]
    ata = [[sum(r[i] * r[j] for r in rows) for j in range(3)] for i in range(3)]
    aty = [sum(r[i] * y for r, y in zip(rows, ys)) for i in range(3)]
    solved = _solve3(ata, aty)
    if solved is None:
        return None
    c = (solved[0], solved[1] / scale, solved[2] / scale ** 2)
    if all(abs(_poly(c, x) - y) <= APPROXIMATE * y for x, y in zip(xs, ys)):
        return c
    return None


def _solve3(m: list[list[float]], v: list[float]) -> list[float] | None:
    """``m x = v`` for a 3 x 3 ``m`` (Cramer's rule); None when ``m`` is singular."""
    def det(a: list[list[float]]) -> float:
        return (a[0][0] * (a[1][1] * a[2][2] - a[1][2] * a[2][1]) - a[0][1] * (a[1][0] * a[2][2] - a[1][2] * a[2][0])
                + a[0][2] * (a[1][0] * a[2][1] - a[1][1] * a[2][0]))
    d = det(m)
    if d == 0.0:
        return None
    return [det([[v[r] if c == k else m[r][c] for c in range(3)] for r in range(3)]) / d for k in range(3)]


class FlopFits:
    """Counted FLOPs by key structure, and the quadratic families found among them (see the module).

    Not thread-safe: one per :class:`~torchtrace.measure.flops.StepFlops`.
    """

    def __init__(self) -> None:
        # structure -> (counted lengths -> (FLOPs, dtype)), and the families found in them
        self._points: dict[Hashable, dict[tuple[int, ...], tuple[int, torch.dtype | None]]] = {}
        self._families: dict[Hashable, list[Any]] = {}  # _Family and _Scaled
        self.ended = 0  # exact fits a count disagreed with: FLOPs given from them before may be off

    def add(self, key: Hashable, flops: int, dtype: torch.dtype | None) -> None:
        """A count: ``key``'s FLOPs (and the dtype most of them ran in)."""
        split = split_key(key)
        if split is None:
            return
        structure, dims = split
        points = self._points.get(structure)
        if points is None:
            if len(self._points) >= MAX_STRUCTURES:
                return
            points = self._points[structure] = {}
        families = self._families.setdefault(structure, [])
        existing = list(families)
        if len(points) < MAX_POINTS:
            points[dims] = (flops, dtype)
        for family in existing:
            n = family.length_of(dims)
            if n is not None:
                trusted = family.coefficients is not None
                family.add(n, flops, dtype)
                if trusted and family.coefficients is None:
                    self.ended += 1
        for other in list(points):
            if other != dims:
                self._found(structure, families, dims, other)

    def _found(self, structure: Hashable, families: list[Any], dims: tuple[int, ...],
               other: tuple[int, ...]) -> None:
        """A family of ``dims`` and an earlier count ``other``, if they make a new one."""
        if len(dims) != len(other) or len(families) >= MAX_FAMILIES:
            return
        groups: dict[tuple[int, int], set[int]] = {}  # positions by (value here, value there)
        for i, (a, b) in enumerate(zip(dims, other)):
            if a != b:
                groups.setdefault((a, b), set()).add(i)
        dtype = self._points[structure][other][1]
        if len(groups) == 1:
            positions = frozenset(next(iter(groups.values())))
            self._new(structure, families, _Family(positions, _outside(dims, positions), dtype))
        elif len(groups) == 2:  # a batch size and a length: either may be the batch size
            one, two = (frozenset(g) for g in groups.values())
            for batch, length in ((one, two), (two, one)):
                rest = [i for i in range(len(dims)) if i not in batch]  # positions once the batch's are taken out
                positions = frozenset(rest.index(i) for i in length)
                fixed = tuple(dims[i] for i in rest if i not in length)
                self._new(structure, families, _Scaled(batch, positions, fixed, dtype))

    def _new(self, structure: Hashable, families: list[Any], family: Any) -> None:
        """Add ``family`` unless it is known, with every count that belongs to it."""
        if len(families) >= MAX_FAMILIES or any(
                type(f) is type(family) and f.positions == family.positions and f.fixed == family.fixed
                and getattr(f, "batch", None) == getattr(family, "batch", None) for f in families):
            return
        families.append(family)
        for counted, (flops, dtype) in self._points[structure].items():  # every count that belongs, this one too
            where = family.length_of(counted)
            if where is not None:
                family.add(where, flops, dtype)

    def forget(self, operation: str) -> None:
        """Drop the counts and families of ``operation``'s keys (``(operation, shapes)``)."""
        for structure in [s for s in self._points if type(s) is tuple and s and s[0] == operation]:
            del self._points[structure]
            self._families.pop(structure, None)

    def predict(self, key: Hashable, spot_check: bool = False) -> int | None:
        """``key``'s FLOPs from a trusted family, or None (with ``spot_check``: also None for
        the lengths kept for a spot check; see :meth:`_Family.value`)."""
        hit = self._family_of(key)
        return hit[0].value(hit[1], spot_check) if hit is not None else None

    def dtype(self, key: Hashable) -> torch.dtype | None:
        """The dtype of the counts behind ``key``'s prediction, or None."""
        hit = self._family_of(key)
        return hit[0].dtype if hit is not None else None

    def _family_of(self, key: Hashable) -> tuple[Any, Any] | None:
        if not self._families:
            return None
        split = split_key(key)
        if split is None:
            return None
        for family in self._families.get(split[0], ()):
            if (family.coefficients is not None or family.approximate is not None) and not family.dead:
                n = family.length_of(split[1])
                if n is not None:
                    return family, n
        return None
