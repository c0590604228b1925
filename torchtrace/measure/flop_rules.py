"""FLOP rules FlopCounterMode lacks (torch 2.13): recurrent layers and attention kernels.

PyTorch's counter has formulas for matrix products, convolutions and most attention
kernels. A recurrent layer that runs as one fused kernel counted nothing: ``nn.LSTM`` on a
CPU runs ``aten.mkldnn_rnn_layer`` (one per layer and direction), on a GPU
``aten._cudnn_rnn`` (``aten.miopen_rnn`` on ROCm), and the word-language model's LSTM read
72 % low. Nor did ``scaled_dot_product_attention`` on a CPU, which runs
``aten._scaled_dot_product_flash_attention_for_cpu`` (and other backends'
``_scaled_dot_product_fused_attention_overrideable``). The rules here count them as
:data:`RULES` says, and :class:`~torchtrace.measure.flop_modes._Counter` adds them to the
counter's own. (``nn.GRU`` and ``nn.RNN`` on a CPU run as matrix products the counter
already sees; on a GPU they run the cuDNN kernel, counted here.)

The conventions, those of the rest of the count (matrix products only, 2 FLOPs a
multiply-add; element-wise gate arithmetic counts nothing):

- a recurrent layer: every 2-d weight (input-to-hidden ``(G*H, I)``, hidden-to-hidden
  ``(G*H, H)``, an LSTM's projection) is applied once per time step and sequence:
  forward ``2 * T * B * sum(weight sizes)``, with ``G`` gates (4 LSTM, 3 GRU, 1 RNN);
  the backward twice that (the gradients of the inputs and of the weights);
- attention, on every backend: ``Q @ K^T`` and ``P @ V``, forward ``4 * B * heads * S_q *
  S_k * d`` (torch's formula), the backward twice that: PaLM's convention (its MFU's
  ``12 * layers * heads * d * T`` a token). A causal mask does not halve it, as PaLM does not.
  torch's own rules for the GPU kernels' backward add the scores' recomputation (2.5 times the
  forward); they are replaced here for dense ``(B, heads, S, d)`` inputs, so that every
  backend counts alike (variable-length packs keep torch's rule).

>>> import torch
>>> from torchtrace.measure.flops import count_flops
>>> lstm, x = torch.nn.LSTM(8, 16), torch.randn(5, 3, 8)
>>> _, flops = count_flops(lstm, x)  # forward only: 2 * T * B * 4H * (I + H)
>>> flops == 2 * 5 * 3 * 4 * 16 * (8 + 16)
True
"""

from __future__ import annotations

from math import prod
from typing import TYPE_CHECKING, Callable

import torch
from torch.utils import flop_counter

if TYPE_CHECKING:
    from collections.abc import Sequence

    from torch._ops import OpOverloadPacket

Shape = tuple[int, ...]
_aten = torch.ops.aten


def _rows(input_shape: Shape, batch_sizes: object) -> int:
    """Time steps times sequences of a recurrent layer's input: a packed input's rows (its
    ``batch_sizes`` are given), else every dimension but the features."""
    if batch_sizes:
        return int(input_shape[0])
    return prod(input_shape[:-1]) if len(input_shape) > 1 else 1


def _weights(shapes: Sequence[object]) -> int:
    """The elements of the 2-d weights among ``shapes`` (the biases are not products)."""
    return sum(prod(s) for s in shapes if isinstance(s, torch.Size) and len(s) == 2)


def recurrent_flops(input_shape: Shape, weight_shapes: Sequence[object],
                    batch_sizes: object = None) -> int:
    """Forward FLOPs of recurrent layers: ``2 * rows * sum(2-d weight sizes)`` (see the module).

    >>> recurrent_flops(torch.Size([5, 3, 8]), [torch.Size([64, 8]), torch.Size([64, 16]), torch.Size([64])])
    46080
    """
    return 2 * _rows(input_shape, batch_sizes) * _weights(weight_shapes)


def _mkldnn_layer(input: Shape, weight0: Shape, weight1: Shape, *args: object, out_shape: object = None,
                  **kwargs: object) -> int:
    # (input, weight0, weight1, weight2, weight3, hx, cx, reverse, batch_sizes, mode, ...)
    batch_sizes = args[5] if len(args) > 5 else kwargs.get("batch_sizes")
    return recurrent_flops(input, [weight0, weight1], batch_sizes)


def _mkldnn_layer_backward(input: Shape, weight1: Shape, weight2: Shape, *args: object, out_shape: object = None,
                           **kwargs: object) -> int:
    # (input, weight1, weight2, weight3, weight4, hx, cx, output, hy, cy, grad_output, grad_hy,
    #  grad_cy, reverse, mode, hidden_size, num_layers, has_biases, train, bidirectional, batch_sizes, ...)
    batch_sizes = args[17] if len(args) > 17 else kwargs.get("batch_sizes")
    return 2 * recurrent_flops(input, [weight1, weight2], batch_sizes)


def _fused_rnn(batch_at: int) -> Callable[..., int]:
    """The rule of cuDNN's or MIOpen's whole stack (``weight``: every layer's and direction's
    tensors), whose ``batch_sizes`` is the ``batch_at``-th argument after ``weight``."""

    def rule(input: Shape, weight: Sequence[object], *args: object, out_shape: object = None, **kwargs: object) -> int:
        batch_sizes = args[batch_at] if len(args) > batch_at else kwargs.get("batch_sizes")
        return recurrent_flops(input, weight, batch_sizes)

    return rule


def _fused_rnn_backward(batch_at: int, mask_at: int) -> Callable[..., int]:
    """The backward's rule: ``output_mask`` (input, hx, cx, weights) says what it computes;
    the data gradients and the weight gradients cost one forward's products each."""

    def rule(input: Shape, weight: Sequence[object], *args: object, out_shape: object = None, **kwargs: object) -> int:
        batch_sizes = args[batch_at] if len(args) > batch_at else kwargs.get("batch_sizes")
        mask = args[mask_at] if len(args) > mask_at else kwargs.get("output_mask")
        forward = recurrent_flops(input, weight, batch_sizes)
        if not isinstance(mask, (list, tuple)) or len(mask) != 4:
            return 2 * forward
        return forward * (int(any(mask[:3])) + int(bool(mask[3])))

    return rule


def _attention(query: Shape, key: Shape, value: Shape, *args: object, out_shape: object = None,
               **kwargs: object) -> int:
    return int(flop_counter.sdpa_flop_count(query, key, value))


def _attention_backward(grad_out: Shape, query: Shape, key: Shape, value: Shape, *args: object,
                        out_shape: object = None, **kwargs: object) -> int:
    # PaLM's convention: the backward's four products, twice the forward (torch's own rule
    # adds the scores' recomputation, a fifth: 2.5 times).
    return 2 * int(flop_counter.sdpa_flop_count(query, key, value))


def _palm_backward(original: Callable[..., int]) -> Callable[..., int]:
    """A GPU attention kernel's backward by :func:`_attention_backward` where its query, key
    and value are dense ``(batch, heads, length, dim)`` tensors; torch's rule (``original``)
    for anything else (variable-length packs)."""

    def rule(*args: object, out_val: object = None, **kwargs: object) -> int:
        grad_out, qkv = (args[0] if args else None), args[1:4]
        tensors = [t for t in qkv if isinstance(t, torch.Tensor) and t.dim() == 4]
        if isinstance(grad_out, torch.Tensor) and len(tensors) == 3:
            return _attention_backward(grad_out.shape, *(t.shape for t in tensors))
        return int(original(*args, out_val=out_val, **kwargs))

    rule._get_raw = True  # type: ignore[attr-defined]  # (FlopCounterMode: given the tensors, not shapes)
    return rule


def _rules() -> dict[OpOverloadPacket, Callable[..., int]]:
    """The rules this torch has ops for (an op a build lacks is left out)."""
    wanted: dict[str, Callable[..., int]] = {
        "mkldnn_rnn_layer": _mkldnn_layer,
        "mkldnn_rnn_layer_backward": _mkldnn_layer_backward,
        # (the argument positions after ``weight``: the ops' schemas in torch 2.13)
        "_cudnn_rnn": _fused_rnn(12),
        "_cudnn_rnn_backward": _fused_rnn_backward(16, 19),
        "miopen_rnn": _fused_rnn(10),
        "miopen_rnn_backward": _fused_rnn_backward(15, 18),
        "_scaled_dot_product_flash_attention_for_cpu": _attention,
        "_scaled_dot_product_flash_attention_for_cpu_backward": _attention_backward,
        "_scaled_dot_product_fused_attention_overrideable": _attention,
        "_scaled_dot_product_fused_attention_overrideable_backward": _attention_backward,
    }
    has_sdpa = hasattr(flop_counter, "sdpa_flop_count")  # (the formula the attention rules use)
    if not has_sdpa:
        wanted = {name: rule for name, rule in wanted.items() if "attention" not in name}
    rules: dict[OpOverloadPacket, Callable[..., int]] = {}
    for name, rule in wanted.items():
        packet = getattr(_aten, name, None)
        if packet is not None:
            rules[packet] = rule
    registry = getattr(flop_counter, "flop_registry", {})
    for name in _GPU_ATTENTION_BACKWARD:
        packet = getattr(_aten, name, None)
        if has_sdpa and packet is not None and packet in registry:
            rules[packet] = _palm_backward(registry[packet])
    return rules


#: torch's GPU attention backward ops whose rule counts the scores' recomputation.
_GPU_ATTENTION_BACKWARD = ("_scaled_dot_product_flash_attention_backward",
                           "_scaled_dot_product_efficient_attention_backward",
                           "_scaled_dot_product_cudnn_attention_backward")


#: The extra rules, by op packet (``custom_mapping`` of FlopCounterMode).
RULES: dict[OpOverloadPacket, Callable[..., int]] = _rules()

__all__ = ["RULES", "recurrent_flops"]
