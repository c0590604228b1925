"""Peak dense FLOP/s of known accelerators, by device name and math precision.

The values are the vendors' published peaks for dense math (NVIDIA publishes tensor-core
peaks "with sparsity", twice the dense value: the table holds half of those). The
precision is the one the step's matrix products run in:

- ``bf16``, ``fp16``: tensor-core math with FP32 accumulation (autocast or half weights);
- ``tf32``: FP32 tensors with TF32 matrix math allowed
  (``torch.backends.cuda.matmul.fp32_precision = "tf32"`` or
  ``torch.set_float32_matmul_precision("high")``);
- ``fp32``: FP32 without TF32 (PyTorch's default).

A precision the device has no fast path for is listed at the rate it actually runs at
(TF32 on Volta and Turing is plain FP32) or left out when PyTorch emulates it (bf16 on
V100 and T4): a missing entry means "no peak", never a guess. A MIG slice is a fraction of
its GPU: its peak is unknown. The sources are named in docs/throughput.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

import torch

T = 1e12
PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
_ALIASES = {"float32": "fp32", "fp32": "fp32", "tf32": "tf32", "bfloat16": "bf16", "bf16": "bf16",
            "float16": "fp16", "fp16": "fp16", "half": "fp16"}


@dataclass(frozen=True)
class Accelerator:
    """One row of the table: a product, how its device name reads, its peaks and their source."""

    product: str
    pattern: str  # regular expression over the normalised name (lower case, '-'/'_' as spaces)
    flops: Mapping[str, float]  # precision -> peak dense FLOP/s
    source: str


def _row(product: str, pattern: str, fp32: float, tf32: float, bf16: float | None, fp16: float,
         source: str) -> Accelerator:
    flops = {"fp32": fp32 * T, "tf32": tf32 * T, "fp16": fp16 * T}
    if bf16 is not None:
        flops["bf16"] = bf16 * T
    return Accelerator(product, pattern, flops, source)


_A100 = "NVIDIA A100 Tensor Core GPU datasheet"
_H100 = "NVIDIA H100 Tensor Core GPU datasheet (with-sparsity figures halved)"
_H200 = "NVIDIA H200 Tensor Core GPU datasheet (with-sparsity figures halved)"
_MI300 = "AMD Instinct MI300X / MI325X accelerator datasheets (dense)"

_BLACKWELL = "NVIDIA Blackwell architecture technical brief (with-sparsity figures halved)"

#: The table, most specific pattern first: the first row whose pattern matches wins.
ACCELERATORS: tuple[Accelerator, ...] = (
    _row("GB200", r"\bgb200\b", 90, 1250, 2500, 2500, _BLACKWELL + ", GB200 (a GPU at 1,200 W)"),
    _row("B200", r"\bb200\b", 80, 1100, 2250, 2250, _BLACKWELL + ", HGX B200 (1,000 W)"),
    _row("GH200", r"\bgh200\b", 67, 494.5, 989.5, 989.5, "NVIDIA GH200 Grace Hopper Superchip datasheet"),
    _row("H200 NVL", r"\bh200 nvl\b", 60, 417.5, 835.5, 835.5, _H200),
    _row("H200 SXM", r"\bh200\b", 67, 494.5, 989.5, 989.5, _H200),
    _row("H100 NVL", r"\bh100 nvl\b", 60, 417.5, 835.5, 835.5, _H100),
    _row("H100 PCIe", r"\bh100\b.*\b(pcie|hbm2e)\b", 51, 378, 756.5, 756.5, _H100),
    _row("H100 SXM", r"\bh100\b", 67, 494.5, 989.5, 989.5, _H100),
    _row("A100 PCIe", r"\ba100\b.*\bpcie\b", 19.5, 156, 312, 312, _A100),
    _row("A100 SXM", r"\ba100\b", 19.5, 156, 312, 312, _A100),
    _row("A10G", r"\ba10g\b", 35, 35, 70, 70,
         "derived: 80 SMs at 1710 MHz boost, GA102 tensor cores at FP32-accumulate rate (no NVIDIA datasheet)"),
    _row("A10", r"\ba10\b", 31.2, 62.5, 125, 125, "NVIDIA A10 Tensor Core GPU datasheet"),
    _row("L40S", r"\bl40s\b", 91.6, 183, 362.05, 362.05, "NVIDIA L40S datasheet (with-sparsity figures halved)"),
    _row("L4", r"\bl4\b", 30.3, 60, 121, 121, "NVIDIA L4 Tensor Core GPU datasheet (with-sparsity figures halved)"),
    _row("RTX 4090", r"\brtx 4090\b(?! d\b| laptop)", 82.6, 82.6, 165.2, 165.2,
         "NVIDIA Ada GPU architecture whitepaper, GeForce RTX 4090 (FP32 accumulate, dense)"),
    _row("V100S PCIe", r"\bv100s\b", 16.4, 16.4, None, 130, "NVIDIA V100 Tensor Core GPU datasheet"),
    _row("V100 PCIe", r"\bv100\b.*\bpcie\b", 14, 14, None, 112, "NVIDIA V100 Tensor Core GPU datasheet"),
    _row("V100 SXM2", r"\bv100\b", 15.7, 15.7, None, 125, "NVIDIA V100 Tensor Core GPU datasheet"),
    _row("T4", r"\bt4\b", 8.1, 8.1, None, 65, "NVIDIA T4 Tensor Core GPU datasheet"),
    _row("MI325X", r"\bmi325x\b", 163.4, 653.7, 1307.4, 1307.4, _MI300),
    _row("MI300X", r"\bmi300x\b", 163.4, 653.7, 1307.4, 1307.4, _MI300),
    _row("MI250X", r"\bmi250x\b", 95.7, 95.7, 383, 383, "AMD Instinct MI250X accelerator datasheet (FP32 matrix)"),
)


def normalise(name: str) -> str:
    """Lower case, ``-`` and ``_`` as spaces, runs of spaces as one.

    >>> normalise("NVIDIA A100-SXM4-80GB")
    'nvidia a100 sxm4 80gb'
    """
    return " ".join(re.sub(r"[-_]", " ", name.lower()).split())


def find_accelerator(name: str) -> Accelerator | None:
    """The table's row for a device name as ``torch.cuda.get_device_name`` reports it.

    >>> find_accelerator("NVIDIA H100 80GB HBM3").product
    'H100 SXM'
    >>> find_accelerator("NVIDIA A100-SXM4-40GB MIG 1g.5gb") is None
    True
    """
    key = normalise(name)
    if re.search(r"\bmig\b", key):
        return None
    for row in ACCELERATORS:
        if re.search(row.pattern, key):
            return row
    return None


def tf32_enabled() -> bool:
    """Whether FP32 matrix products on CUDA may use TF32 (either of PyTorch's switches)."""
    try:
        precision = torch.backends.cuda.matmul.fp32_precision
        if precision in ("tf32", "ieee"):
            return precision == "tf32"
    except (AttributeError, RuntimeError):
        pass
    try:
        return bool(torch.backends.cuda.matmul.allow_tf32)
    except (AttributeError, RuntimeError):
        return False


def precision_key(dtype: torch.dtype | str | None, tf32: bool | None = None) -> str | None:
    """The table's precision for a compute dtype: ``fp32``, ``tf32``, ``bf16``, ``fp16`` or None.

    ``torch.float32`` reads as ``tf32`` when ``tf32`` is true (None: PyTorch's current
    setting, :func:`tf32_enabled`). Strings name a precision directly.

    >>> import torch
    >>> precision_key(torch.bfloat16), precision_key(torch.float32, tf32=False), precision_key("tf32")
    ('bf16', 'fp32', 'tf32')
    >>> precision_key(torch.float64) is None
    True
    """
    if isinstance(dtype, str):
        return _ALIASES.get(dtype.strip().lower())
    if dtype == torch.bfloat16:
        return "bf16"
    if dtype == torch.float16:
        return "fp16"
    if dtype == torch.float32:
        return "tf32" if (tf32_enabled() if tf32 is None else tf32) else "fp32"
    return None


def device_name(device: torch.device | int | str | None) -> str | None:
    """The accelerator's name for a device (``"cuda:0"``, ``torch.device``, an index) or a name.

    CPU, meta and other non-CUDA devices give None; so does a CUDA device when CUDA is not
    available. A string that is not a device is taken to be a name already.
    """
    if isinstance(device, int) and not isinstance(device, bool):
        device = torch.device("cuda", device)
    elif isinstance(device, str):
        try:
            device = torch.device(device)
        except RuntimeError:
            return device  # type: ignore[return-value]  # (still the string: it names no device)
    if not isinstance(device, torch.device) or device.type != "cuda":
        return None
    try:
        return torch.cuda.get_device_name(device) if torch.cuda.is_available() else None
    except (RuntimeError, AssertionError):
        return None


def peak_flops(device: torch.device | int | str | None, dtype: torch.dtype | str | None,
               override: float | None = None) -> float | None:
    """Peak dense FLOP/s of ``device`` at ``dtype``'s precision; None when unknown.

    ``override`` (the ``peak_flops`` setting) wins over the table, on any device, CPU
    included. Without it a CPU, an unknown accelerator or a precision the table has no
    entry for gives None: no MFU, and no error.

    >>> import torch
    >>> peak_flops("NVIDIA H100 80GB HBM3", torch.bfloat16)
    989500000000000.0
    >>> peak_flops("cpu", torch.float32) is None, peak_flops("cpu", torch.float32, override=2e12)
    (True, 2000000000000.0)
    """
    if override is not None:
        return float(override)
    name = device_name(device)
    if name is None:
        return None
    row = find_accelerator(name)
    precision = precision_key(dtype)
    if row is None or precision is None:
        return None
    return row.flops.get(precision)


def model_peak(model: torch.nn.Module | None, dtype: torch.dtype | None,
               cache: dict[str, float | None]) -> float | None:
    """The peak FLOP/s of ``model``'s device in ``dtype`` (None: an autocast around the whole
    step, else the weights' dtype); looked up once per device and dtype in ``cache``."""
    if model is None:
        return None
    try:
        param = next(model.parameters())
    except StopIteration:
        return None
    if dtype is None:
        dtype = torch.get_autocast_dtype(param.device.type) if torch.is_autocast_enabled(param.device.type) \
            else param.dtype
    key = f"{param.device}/{dtype}"
    if key not in cache:
        cache[key] = peak_flops(param.device, dtype)
    return cache[key]
