"""Producer-fused activation quantisation for W8A8 FP8 linears (on by default;
``ATTNSERVE_FP8_FUSED_PRODUCERS=0`` turns it off; issue 37).

A W8A8 linear (`Fp8LinearMethod` on the ``_scaled_mm`` path, batches of more than
`fp8_linear.w8a16_max_m` rows) quantises its 16-bit input per token in a launch of its own,
which reads the activation its producer has just written. Here the producer emits the
e4m3 values and scales itself, as an `Fp8Activation`, and the linear takes them as they are:

* a Llama-form decoder layer's ``post_attention_layernorm`` / ``input_layernorm`` (fused
  add-RMSNorm, with a residual) -> `fp8_kernels.fused_add_rmsnorm_quant_fp8`, for
  ``gate_up_proj`` / ``qkv_proj``;
* the ``gate_up_proj`` (its SiLU-and-mul) -> `fp8_kernels.silu_and_mul_quant_fp8`, for
  ``down_proj``, which is marked ``fp8_folded_max_m``: at decode batches it runs the
  tensor-wise GEMM and applies the scales after it (`fp8_linear.Fp8LinearMethod._folded_down`).

The attention's ``o_proj`` (its input is the attention output, 16-bit) is marked
``fp8_folded_max_m`` too: it quantises its input as before, then takes the same route
(``ATTNSERVE_FP8_FOLDED_O_SCALES=0``, read at load, leaves it unmarked).

**Lazy scales** (``ATTNSERVE_FP8_LAZY_SCALES=0``, read at load, turns them off): a folded
``o_proj`` / ``down_proj`` at tp 1 whose output goes straight into a fused add-RMSNorm
(`lazy_scale_consumers` checks who reads it) is also marked ``fp8_lazy_output``: its folded
route returns the unscaled product and its scales as a `ScaledProduct` instead of launching
`fp8_kernels.scale_rows_cols`, and the norm (`norm.RMSNorm.forward`) applies them in its own
kernel (`fp8_kernels.fused_add_rmsnorm_quant_fp8` with ``row_scale`` / ``col_scale``), bit
for bit as the two launches did; a norm that does not quantise (the final one) calls
`ScaledProduct.materialize` first. Two launches fewer a layer.

`enable_fused_producers` marks the producers whose every consumer qualifies (decoder
layers, attention and MLP that keep Llama's ``forward``, so Qwen2 / Qwen3 / Mistral too;
dynamic per-token activations, per-channel or per-tensor weights). At run time a marked
producer emits FP8 only for CUDA inputs of more than ``w8a16_max_m()`` rows with fused
kernels on; otherwise it returns the 16-bit tensor as before, so decode batches keep the
W8A16 kernel. The results are those of the unfused path (same roundings; the quantisers
agree up to rare ties).

Measured on an H100 (``benchmarks/fp8_bench.py``, 2026-11-27, Llama-3-8B shape, µs per
call at 8192 rows): add-RMSNorm + quantise 126.9 -> 81.4, SiLU-and-mul + quantise 386.8 ->
288.0; one 8192-token prefill 160.1 -> 155.9 ms. At 64 rows the two differ by ~1 µs each
way (norm 3.78 -> 2.75, SiLU 5.48 -> 7.67), so decode steps are unchanged.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from attnserve.env_options import env_flag


@dataclass
class Fp8Activation:
    """A linear's input quantised by its producer.

    Attributes:
        q: e4m3 ``[M, K]``.
        scale: float32 ``[M, 1]`` (per token), ``x ~= q * scale``.
        dtype: the 16-bit dtype of the activations (the linear's output dtype).
    """

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


@dataclass
class ScaledProduct:
    """A folded FP8 linear's output whose row and column scales are still to be applied
    (marked ``fp8_lazy_output``, see the module doc); its value is `materialize` ().

    Attributes:
        raw: ``[M, N]`` unscaled product ``q_x @ q_w^T`` (float32).
        row_scale: float32 ``[M, 1]`` (the input's per-token scales).
        col_scale: float32 ``[N]`` (the weight's per-channel scales).
        dtype: the 16-bit dtype of the value.
    """

    raw: torch.Tensor
    row_scale: torch.Tensor
    col_scale: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.raw.shape

    def materialize(self) -> torch.Tensor:
        """``raw * (row_scale[m] * col_scale[n])`` in float32, rounded once to ``dtype``
        (`fp8_kernels.scale_rows_cols`)."""
        from attnserve.models.layers.quantization.fp8_kernels import scale_rows_cols

        return scale_rows_cols(self.raw, self.row_scale, self.col_scale, self.dtype)


def fused_producers_requested() -> bool:
    """True unless ``ATTNSERVE_FP8_FUSED_PRODUCERS=0`` (read when a model is loaded)."""
    return os.environ.get("ATTNSERVE_FP8_FUSED_PRODUCERS", "1").strip() != "0"


def emits_fp8(x: torch.Tensor, enabled: bool) -> bool:
    """Whether a marked producer (``enabled``) quantises its output for ``x [M, K]``."""
    if not (enabled and x.is_cuda and x.dim() == 2):
        return False
    from attnserve.models.layers.quantization.fp8_linear import w8a16_max_m
    from attnserve.models.layers.quantization.fp8_mid_gemm import MAX_MID_M, fp8_mid_gemm_mode

    if x.shape[0] <= MAX_MID_M and fp8_mid_gemm_mode() == "w8a16":  # the mid kernel takes 16-bit rows
        return False
    return x.shape[0] > w8a16_max_m()


def _w8a8_per_token(linear: nn.Module, allow_bias: bool = False) -> bool:
    """A linear on `Fp8LinearMethod` with dynamic per-token activation scales (a bias only
    with ``allow_bias``: the pre-quantised path adds it as the plain path does)."""
    from attnserve.models.layers.quantization.fp8_linear import Fp8LinearMethod

    method = getattr(linear, "quant_method", None)
    return (isinstance(method, Fp8LinearMethod) and method.config.activation_scheme == "dynamic"
            and getattr(linear, "input_scale", None) is None and (allow_bias or linear.bias is None))


def _keeps_forward(module: nn.Module, base: type, forwards) -> bool:
    """Whether ``module`` is a ``base`` whose class runs one of ``forwards`` (its own
    ``forward`` is not overridden by anything else)."""
    return isinstance(module, base) and type(module).forward in forwards


def enable_fused_producers(model: nn.Module) -> int:
    """Mark the producers of `Fp8Activation` in ``model`` (see the module doc); returns
    how many were marked (0 for models without Llama-form layers or FP8 linears).

    A layer qualifies by what its ``forward`` does, not by its exact class: a
    `LlamaDecoderLayer` subclass that keeps Llama's ``forward`` (Qwen2, Qwen3, Mistral,
    Mixtral, Qwen3-MoE, DeepSeek's dense layers) passes ``input_layernorm``'s output to its
    attention and ``post_attention_layernorm``'s to its MLP and nowhere else. The attention
    qualifies when its ``forward`` is `LlamaAttention`'s or `Qwen3Attention`'s (both hand
    their input to ``qkv_proj`` alone), the MLP when it is a `LlamaMLP` that keeps
    ``forward``. MoE blocks and MLA are not marked; nor are linears with a static input
    scale or block-scaled weights, nor an MLP with biases (`_w8a8_per_token`; a biased
    ``qkv_proj``, as Qwen2's, is).
    """
    from attnserve.models.layers.quantization.fp8_linear import FOLDED_DOWN_MAX_M, FOLDED_O_MAX_M, FOLDED_O_SCALES_ENV
    from attnserve.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP
    from attnserve.models.qwen3 import Qwen3Attention

    attention_forwards = (LlamaAttention.forward, Qwen3Attention.forward)
    count = 0
    for layer in model.modules():
        if not _keeps_forward(layer, LlamaDecoderLayer, (LlamaDecoderLayer.forward,)):
            continue
        attn, mlp = layer.self_attn, layer.mlp
        if _keeps_forward(attn, LlamaAttention, attention_forwards):
            if _w8a8_per_token(attn.qkv_proj, allow_bias=True):
                layer.input_layernorm.fp8_output = True
                count += 1
            if _w8a8_per_token(attn.o_proj) and env_flag(FOLDED_O_SCALES_ENV):
                attn.o_proj.fp8_folded_max_m = FOLDED_O_MAX_M  # quantised, then the folded route
                count += 1
        if _keeps_forward(mlp, LlamaMLP, (LlamaMLP.forward,)) and _w8a8_per_token(mlp.gate_up_proj):
            layer.post_attention_layernorm.fp8_output = True
            count += 1
            if _w8a8_per_token(mlp.down_proj):
                mlp.gate_up_proj.fp8_output = True
                mlp.down_proj.fp8_folded_max_m = FOLDED_DOWN_MAX_M  # its scales after a tensor-wise GEMM
                count += 1
    if env_flag(LAZY_SCALES_ENV):
        for linear in lazy_scale_consumers(model):
            linear.fp8_lazy_output = True
    return count


#: environment switch of the lazy scales (read at load; ``0`` leaves every linear unmarked)
LAZY_SCALES_ENV = "ATTNSERVE_FP8_LAZY_SCALES"


def _plain_norm(norm: nn.Module) -> bool:
    """An `RMSNorm` that keeps its class's ``forward`` (which takes a `ScaledProduct`)."""
    from attnserve.models.layers.norm import RMSNorm

    return isinstance(norm, RMSNorm) and type(norm).forward is RMSNorm.forward


def lazy_scale_consumers(model: nn.Module) -> list:
    """The folded linears of ``model`` (``fp8_folded_max_m`` set) whose output may stay a
    `ScaledProduct`: at tp 1, in a decoder layer that keeps `LlamaDecoderLayer`'s ``forward``
    with plain `RMSNorm` s, ``o_proj`` (read by that layer's ``post_attention_layernorm``)
    and ``down_proj`` when what reads the block output is known: the next layer's
    ``input_layernorm`` (a layer of the same kind) or, after the last layer, the final norm
    of a model that keeps `DecoderModel`'s ``forward``. Anything else keeps its tensor."""
    from attnserve.models.base import DecoderModel
    from attnserve.models.llama import LlamaDecoderLayer

    def llama_form(layer) -> bool:
        return (_keeps_forward(layer, LlamaDecoderLayer, (LlamaDecoderLayer.forward,))
                and not (layer.input_partial or layer.attn_output_partial or layer.mlp_output_partial)
                and _plain_norm(layer.input_layernorm) and _plain_norm(layer.post_attention_layernorm))

    def folded_tp1(linear) -> bool:
        tp = getattr(linear, "tp", None)
        return bool(getattr(linear, "fp8_folded_max_m", 0)) and (tp is None or tp.size == 1)

    out = []
    for dm in model.modules():
        if not isinstance(dm, DecoderModel):
            continue
        layers = list(dm.layers)
        last_ok = type(dm).forward is DecoderModel.forward and _plain_norm(dm.norm)
        for i, layer in enumerate(layers):
            if not llama_form(layer):
                continue
            o_proj, down = getattr(layer.self_attn, "o_proj", None), getattr(layer.mlp, "down_proj", None)
            if folded_tp1(o_proj):
                out.append(o_proj)
            reader_ok = llama_form(layers[i + 1]) if i + 1 < len(layers) else last_ok
            if reader_ok and folded_tp1(down):
                out.append(down)
    return out
