"""Per-layer output statistics through forward hooks, kept on the device until one host read.

Each hooked call stacks ``tensor_stats`` of the layer's (first floating) output: mean, std,
min, max over finite values and NaN/Inf counts. Only these six numbers per call are kept,
never the activation itself. Hooks are removed by :meth:`LayerHooks.remove` (also on error).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Iterable

import torch

from torchtrace.measure.tensors import STAT_NAMES, fast_raw_stats, finish_fast_stats, tensor_stats

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

MAX_LAYER_CALLS = 512  # per step: hooks past this many calls record nothing


def first_tensor(output: object) -> torch.Tensor | None:
    """The first floating-point tensor in a module's output (tensor, tuple/list, dict, dataclass-like)."""
    if isinstance(output, torch.Tensor):
        return output if output.is_floating_point() or output.is_complex() else None
    if isinstance(output, (tuple, list)):
        for item in output:
            t = first_tensor(item)
            if t is not None:
                return t
        return None
    if isinstance(output, dict):
        return first_tensor(list(output.values()))
    for attr in ("last_hidden_state", "logits"):
        value = getattr(output, attr, None)
        if isinstance(value, torch.Tensor):
            return first_tensor(value)
    return None


def layer_modules(model: torch.nn.Module, leaves_only: bool = True) -> list[tuple[str, torch.nn.Module]]:
    """Named submodules to hook: the leaves (default) or every module but the root."""
    out = []
    for name, mod in model.named_modules():
        if not name:
            continue
        if leaves_only and any(True for _ in mod.children()):
            continue
        out.append((name, mod))
    if not out:
        out.append((type(model).__name__, model))
    return out


class LayerHooks:
    """Forward hooks that record per-call output statistics (device tensors) and, optionally, time.

    >>> m = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU())
    >>> hooks = LayerHooks(m)
    >>> _ = m(torch.ones(1, 2)); hooks.remove()
    >>> hooks.names
    ['0', '1']
    """

    def __init__(self, model: torch.nn.Module, leaves_only: bool = True, timing: bool = False,
                 modules: Iterable[tuple[str, torch.nn.Module]] | None = None, fast: bool = False,
                 active: bool = True) -> None:
        # fast: the per-step statistics (fast_raw_stats); else the exact ones over finite values.
        # active: hooks record only while True (hooks kept on a model across steps are
        # switched off between them, which costs one attribute check per module call).
        self.fast = fast
        self.active = active
        self.names: list[str] = []
        self.stats: list[Any] = []  # fast: (sum, sumsq, min, max) 0-d tensors per call; else tensor_stats rows
        self._counts: list[int] = []  # fast: element counts of the rows in ``stats``
        # Per call: the output's (shape, dtype, device) and the module's class name.
        self.meta: list[tuple[torch.Size, torch.dtype, torch.device, str]] = []
        self.times: list[float] = []
        self.timing = timing
        self._starts: dict[int, list[float]] = {}
        self._handles: list[RemovableHandle] = []
        self._calls: dict[str, int] = {}
        self._dtype: torch.dtype | None = None  # fast: the first row's dtype and device
        self._device: torch.device | None = None
        self._mixed = False
        # Fast rows: the (dtype, device) strings of each meta.
        self._meta_cache: dict[tuple[torch.Size, torch.dtype, torch.device, str], tuple[str, str]] = {}
        try:
            for name, mod in (modules if modules is not None else layer_modules(model, leaves_only)):
                if timing:
                    self._handles.append(mod.register_forward_pre_hook(self._pre(mod)))
                self._handles.append(mod.register_forward_hook(self._post(name, mod)))
        except Exception:
            self.remove()
            raise

    # The hooks close over the module's id, not the module: a module would hold a hook holding
    # itself, a cycle that keeps a dropped model's memory until a full garbage collection.
    def _pre(self, mod):
        key = id(mod)

        def hook(_module, _inputs):
            self._starts.setdefault(key, []).append(time.perf_counter())
        return hook

    def _post(self, name: str, mod):
        key = id(mod)

        def hook(_module, _inputs, output):
            if not self.active:
                return None
            elapsed = None
            if self.timing:
                starts = self._starts.get(key)
                if starts:
                    elapsed = time.perf_counter() - starts.pop()
            if len(self.stats) >= MAX_LAYER_CALLS:
                return None
            t = first_tensor(output)
            if t is None:
                return None
            n = self._calls.get(name, 0)
            self._calls[name] = n + 1
            if self.fast:  # works on a detached view: no autograd graph, no no_grad() needed
                raw, count = fast_raw_stats(t)
                if self.stats and (raw[0].dtype is not self._dtype or raw[0].device != self._device):
                    self._mixed = True
                elif not self.stats:
                    self._dtype, self._device, self._mixed = raw[0].dtype, raw[0].device, False
                self.stats.append(raw)
                self._counts.append(count)
            else:
                with torch.no_grad():
                    self.stats.append(tensor_stats(t))
            self.names.append(name if n == 0 else f"{name}#{n}")
            # Raw objects now, strings only when rows() is asked for (off the step's path).
            self.meta.append((t.shape, t.dtype, t.device, type(_module).__name__))
            self.times.append(elapsed if elapsed is not None else float("nan"))
            return None
        return hook

    def stacked(self) -> torch.Tensor | None:
        """All recorded values as one float64 tensor on the first call's device: a row per call,
        ``(sum, sum of squares, min, max)`` when ``fast`` (statistics are finished on the host,
        in :meth:`rows`), else :func:`tensor_stats`' six values."""
        if not self.stats:
            return None
        if self.fast:
            flat = [x for row in self.stats for x in row]
            if self._mixed:  # rows of several dtypes or devices (set by the hook)
                flat = [x.to(device=self._device, dtype=torch.float64) for x in flat]
            return torch.stack(flat).reshape(-1, 4).to(torch.float64)
        dev = self.stats[0].device
        return torch.stack([s if s.device == dev else s.to(dev) for s in self.stats])

    def take(self) -> "LayerHooks":
        """This step's calls as a separate object (for :meth:`stacked` and :meth:`rows`, which
        may run after the next step has begun); the hooks stay and start an empty step."""
        snap = object.__new__(LayerHooks)
        snap.__dict__.update(self.__dict__)
        snap._handles = []
        snap.active = False
        self.names, self.stats, self._counts, self.meta, self.times = [], [], [], [], []
        self._calls, self._starts, self._mixed = {}, {}, False
        return snap

    def _fast_rows(self, values: list[float]) -> list[dict[str, Any]]:
        """:meth:`rows` for the per-step statistics: one dict literal per call ("nonfinite" is a
        flag, 1 when the layer's output held NaN/Inf)."""
        cache, counts, meta, times = self._meta_cache, self._counts, self.meta, self.times
        out = []
        for i, name in enumerate(self.names):
            mean, std, mn, mx, flag = finish_fast_stats(values[4 * i:4 * i + 4], counts[i])
            key = meta[i]
            strings = cache.get(key)
            if strings is None:
                if len(cache) >= 1024:  # shapes that vary every step (sequence lengths)
                    cache.clear()
                strings = cache[key] = (str(key[1]).replace("torch.", ""), str(key[2]))
            out.append({"name": name, "shape": list(key[0]), "dtype": strings[0], "device": strings[1],
                        "module": key[3], "mean": mean, "std": std, "min": mn, "max": mx, "nonfinite": flag,
                        "time_s": times[i]})
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._starts.clear()

    def rows(self, values: list[float]) -> list[dict[str, Any]]:
        """Per-call dictionaries from the host values of :meth:`stacked`."""
        if self.fast:
            return self._fast_rows(values)
        names = STAT_NAMES
        w = len(names)
        out = []
        for i, name in enumerate(self.names):
            row = dict(zip(names, values[i * w:(i + 1) * w]))
            row["nan_count"] = int(row["nan_count"])
            row["inf_count"] = int(row["inf_count"])
            row["nonfinite_count"] = row["nan_count"] + row["inf_count"]
            shape, dtype, device, module = self.meta[i]
            out.append({"name": name, "shape": list(shape), "dtype": str(dtype).replace("torch.", ""),
                        "device": str(device), "module": module, **row, "time_s": self.times[i]})
        return out
