"""FP8 schemes emulated on a loaded model, for `fp8_accuracy.py --schemes` (issue 37).

A scheme says, per `Linear` of the model (by name), how its weight is quantised and whether
its input activations are: weight groups ``channel`` (one e4m3 scale per output row, as
``--quantization fp8``), ``group<G>`` (one per row and ``G``-wide run of ``K``),
``block`` (128 x 128, DeepSeek-V3) or ``bf16`` (the weight kept in the model dtype);
activations ``token`` (dynamic per-token e4m3), ``group`` (``1 x 128`` groups, the block
path's) or ``none`` (W8A16). `apply_scheme` attaches an `EmulatedFp8Method` to each selected
linear of a model loaded unquantised (so one load serves every scheme) and `clear_scheme`
removes it.

`EmulatedFp8Method` has the numerics of `Fp8LinearMethod._reference` /
`BlockFp8LinearMethod`'s CPU path (the dequantising reference: values rounded to e4m3 with
float32 scales, the product in float32, the result cast to the activation dtype), with the
weight quantised from the loaded (model-dtype) weight rather than from the checkpoint
tensor -- what ``--quantization fp8`` on a bf16 checkpoint does. FP8 numerics, not FP8
speed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch
from torch import nn

from attnserve.models.layers.activation import act_and_mul
from attnserve.models.layers.quantization.fp8_utils import (
    BLOCK_SIZE,
    cdiv,
    dequantize,
    quantize_per_block,
    quantize_per_group,
    quantize_per_row,
)

LINEAR_TYPES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
_LAYER_RE = re.compile(r"layers\.(\d+)\.")


def layer_index(name: str) -> int:
    """Decoder layer of a linear named ``model.layers.<i>.<...>``; -1 for any other."""
    m = _LAYER_RE.search(name)
    return int(m.group(1)) if m else -1


@dataclass(frozen=True)
class Scheme:
    """One emulated scheme.

    Attributes:
        name: row label.
        weight: ``channel``, ``group<G>`` or ``block`` for the quantised linears.
        activation: ``token``, ``group`` or ``none``.
        quantised: predicate on the linear's name; False keeps the weight in the model dtype.
        kernel: the GPU path that would run it (for the table; "" where none exists).
    """

    name: str
    weight: str
    activation: str
    quantised: Callable[[str], bool]
    kernel: str = ""


class EmulatedFp8Method:
    """A ``quant_method`` for a `Linear` (see the module doc); ``weight_f32`` ``[N, K]`` is
    the dequantised weight, ``scale_count`` the number of float32 scales stored."""

    def __init__(self, weight: torch.Tensor, strategy: str, activation: str):
        if strategy == "channel":
            q, s = quantize_per_row(weight)
            self.weight_f32 = dequantize(q, s)
        elif strategy.startswith("group"):
            g = int(strategy[len("group"):])
            q, s = quantize_per_block(weight, (1, g))
            self.weight_f32 = dequantize(q, s, block=(1, g))
        elif strategy == "block":
            q, s = quantize_per_block(weight)
            self.weight_f32 = dequantize(q, s, block=(BLOCK_SIZE, BLOCK_SIZE))
        elif strategy == "bf16":
            s = weight.new_empty(0)
            self.weight_f32 = weight.float()
        else:
            raise ValueError(f"unknown weight strategy {strategy!r}")
        if activation not in ("token", "group", "none"):
            raise ValueError(f"unknown activation scheme {activation!r}")
        self.activation = activation
        self.scale_count = s.numel()

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor],
              activation: Optional[str] = None) -> torch.Tensor:
        """``x [..., K]`` -> ``[..., N]`` (``[..., N / 2]`` gated) in ``x``'s dtype."""
        k = x.shape[-1]
        shape = x.shape[:-1]
        x2 = x.reshape(-1, k)
        if self.activation == "token":
            q, s = quantize_per_row(x2)
            xa = dequantize(q, s)
        elif self.activation == "group":
            q, s = quantize_per_group(x2, BLOCK_SIZE)
            xa = dequantize(q, s, block=(1, BLOCK_SIZE))
        else:
            xa = x2.float()
        y = xa @ self.weight_f32.t()
        if bias is not None:
            y = y + bias.float()
        y = y.to(x.dtype).reshape(*shape, y.shape[-1])
        if activation is not None:
            y = act_and_mul(y, activation, False)
        return y


def linears(model: nn.Module) -> Dict[str, nn.Module]:
    """The model's `Linear` layers by name (unquantised model)."""
    from attnserve.models.layers.linear import Linear

    return {n: m for n, m in model.named_modules() if isinstance(m, Linear)}


def apply_scheme(lins: Dict[str, nn.Module], scheme: Scheme) -> Dict[str, float]:
    """Attach `EmulatedFp8Method` to every linear ``scheme.quantised`` selects; returns
    ``{"linear_bytes_rel", "quantised_params_share"}``: the linears' weight bytes (e4m3 + float32
    scales, or 2 bytes a weight kept in bf16) over their bf16 bytes, and the share of linear
    weights quantised."""
    fp8_bytes = total = quantised = 0
    for name, m in lins.items():
        n = m.weight.numel()
        total += n
        if scheme.quantised(name) and scheme.weight != "bf16":
            m.quant_method = EmulatedFp8Method(m.weight, scheme.weight, scheme.activation)
            fp8_bytes += n + 4 * m.quant_method.scale_count
            quantised += n
        else:
            if scheme.weight == "bf16":
                m.quant_method = EmulatedFp8Method(m.weight, "bf16", "none")
            fp8_bytes += 2 * n
    return {"linear_bytes_rel": fp8_bytes / (2 * total), "quantised_params_share": quantised / total}


def clear_scheme(lins: Dict[str, nn.Module]) -> None:
    for m in lins.values():
        m.quant_method = None


def model_bytes_rel(model: nn.Module, lins: Dict[str, nn.Module], linear_bytes_rel: float) -> float:
    """Whole-model weight bytes (embeddings, norms and LM head in bf16) over the bf16 model's."""
    lin = sum(m.weight.numel() for m in lins.values())
    total = sum(p.numel() for p in model.parameters())
    return (total - lin + lin * linear_bytes_rel) / total


def base_schemes(num_layers: int) -> Sequence[Scheme]:
    """The fixed table: uniform schemes, one linear type quantised alone, the first and last
    layers quantised alone or kept in bf16."""
    every = lambda n: True  # noqa: E731
    last = num_layers - 1
    rows = [
        Scheme("bf16 weights, reference GEMM", "bf16", "none", every, "(baseline's noise floor)"),
        Scheme("w8a8 channel/token (all)", "channel", "token", every, "_scaled_mm row-wise (M > 16)"),
        Scheme("w8a16 channel (all)", "channel", "none", every, "skinny_linear_fp8 (M <= 16)"),
        Scheme("w8a16 group128 (all)", "group128", "none", every,
               "none (scaled_fp8_gemm needs 1x128 scales)"),
        Scheme("w8a16 group32 (all)", "group32", "none", every, "none"),
        Scheme("w8a8 block128/group128 (all)", "block", "group", every, "scaled_fp8_gemm (Triton, block)"),
    ]
    for t in LINEAR_TYPES:
        rows.append(Scheme(f"w8a16 channel, only {t}", "channel", "none", lambda n, t=t: n.endswith(t),
                           "skinny_linear_fp8 + bf16"))
    rows.append(Scheme("w8a16 channel, only layers 0 and last", "channel", "none",
                       lambda n: layer_index(n) in (0, last), "skinny_linear_fp8 + bf16"))
    rows.append(Scheme("w8a16 channel, layers 0 and last bf16", "channel", "none",
                       lambda n: layer_index(n) not in (0, last), "skinny_linear_fp8 + bf16"))
    return rows


def greedy_schemes(order: Sequence[int], num_layers: int, counts: Sequence[int],
                   activation: str) -> Sequence[Scheme]:
    """Quantise the ``k`` least sensitive decoder layers (``order``: least sensitive first)
    for each ``k`` in ``counts``; the others stay bf16."""
    rows = []
    for k in counts:
        keep = frozenset(order[:k])
        bf16 = sorted(set(range(num_layers)) - keep)
        rows.append(Scheme(f"w8{'a8' if activation == 'token' else 'a16'} channel, {k}/{num_layers} layers "
                           f"(bf16: {bf16})", "channel", activation,
                           lambda n, keep=keep: layer_index(n) in keep, "per-layer: fp8 kernels + bf16"))
    return rows


def per_layer_schemes(num_layers: int) -> Sequence[Scheme]:
    """One decoder layer quantised (W8A16 channel) at a time: the sensitivity sweep."""
    return [Scheme(f"only layer {i}", "channel", "none", lambda n, i=i: layer_index(n) == i)
            for i in range(num_layers)]


def num_decoder_layers(lins: Dict[str, nn.Module]) -> int:
    return max(layer_index(n) for n in lins) + 1


__all__ = ["Scheme", "EmulatedFp8Method", "apply_scheme", "clear_scheme", "base_schemes", "greedy_schemes",
           "per_layer_schemes", "linears", "model_bytes_rel", "num_decoder_layers", "cdiv"]
