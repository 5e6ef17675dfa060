"""OpenAI gpt-oss decoder (OpenAI, "gpt-oss-120b & gpt-oss-20b Model Card", arXiv:2508.10925).

Serves HF architecture ``GptOssForCausalLM`` (``model_type`` ``gpt_oss``; gpt-oss-20b: 24
layers, 32 experts, 4 chosen per token; gpt-oss-120b: 36 layers, 128 experts). What differs
from the Llama block (`attnserve.models.llama`), read from transformers'
``models/gpt_oss/modeling_gpt_oss.py``:

* attention: 64 query heads and 8 KV heads of 64, biased q/k/v/o projections, YaRN RoPE
  (`get_rope`), local and global layers in turn (``config.layer_types``; local layers see the
  last ``sliding_window`` = 128 tokens including themselves), and a learned **sink** logit a
  query head (``self_attn.sinks``, float32 here): an extra softmax column whose value vector
  is zero, so a head can attend to nothing. The backends add it (`RadixAttention.sinks`).
* feed-forward: a `SparseMoeBlock` whose router (HF ``mlp.router``, held as ``mlp.gate``)
  has a bias and takes the softmax of the top-k logits (the same weights as a softmax over
  all experts renormalised over the top k), and whose experts have biases and OpenAI's
  clamped SwiGLU (``activation="swigluoai"``: ``gate`` clamped above at ``swiglu_limit``,
  ``up`` to ``[-limit, limit]``, ``(up + 1) * gate * sigmoid(swiglu_alpha * gate)``).

Checkpoint layouts (`GptOssForCausalLM.load_weights` turns both into per-expert tensors):

* bf16 (transformers' own layout): ``mlp.experts.gate_up_proj`` ``[E, H, 2I]`` with gate and
  up *interleaved* along the last dim (gate at even columns), ``gate_up_proj_bias``
  ``[E, 2I]`` likewise, ``down_proj`` ``[E, I, H]``, ``down_proj_bias`` ``[E, H]``;
* MXFP4 (the published checkpoints, ``quantization_config.quant_method: "mxfp4"``): each
  expert matrix as ``*_blocks`` ``[E, rows, cols / 32, 16]`` uint8 (two e2m1 values a byte,
  low nibble first) and ``*_scales`` ``[E, rows, cols / 32]`` uint8 (e8m0: ``2 ** (s - 127)``
  for each 32 values), rows being the output features (gate/up interleaved by row). They
  are dequantised at load (`dequantize_mxfp4`) to the model dtype: the experts then take
  bf16 bytes (about 4x the file's); there is no MXFP4 kernel.
"""

from __future__ import annotations

import re
from typing import Any, Dict, Iterable, Iterator, Optional, Set, Tuple

import torch
from torch import nn

from attnserve.distributed.group import TPGroup
from attnserve.distributed.partition import q_head_range
from attnserve.models.gemma2 import gemma2_layer_types
from attnserve.models.gemma3 import SLIDING
from attnserve.models.layers.moe.routing import RoutingConfig
from attnserve.models.layers.moe.sparse_block import SparseMoeBlock
from attnserve.models.layers.parallel import head_shard_spec
from attnserve.models.layers.rotary import RotaryEmbedding
from attnserve.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel

#: e2m1 code -> value (OCP Microscaling Formats v1.0, section 5.3.3: 1 sign, 2 exponent, 1 mantissa bit)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
#: MXFP4 block size: values sharing one e8m0 scale (OCP MX v1.0, section 5.1)
MXFP4_BLOCK = 32
_EXPERT_TENSOR = re.compile(r"^(?P<layer>model\.layers\.\d+)\.mlp\.experts\.(?P<proj>gate_up_proj|down_proj)"
                            r"(?P<kind>|_bias|_blocks|_scales)$")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """MXFP4 -> ``dtype`` (OCP Microscaling Formats v1.0; the layout of the gpt-oss releases).

    Args:
        blocks: uint8 ``[..., G, 16]``: 32 e2m1 codes in each row of 16 bytes, element ``2j``
            in the low nibble of byte ``j`` and ``2j + 1`` in the high one.
        scales: uint8 ``[..., G]``: e8m0 exponents, ``value = code * 2 ** (scale - 127)``.
        dtype: output dtype (exact in bf16 / float32 for every finite scale the releases use).

    Returns:
        ``[..., G * 32]``.

    Raises:
        ValueError: ``blocks`` not uint8 ``[..., G, 16]`` or ``scales`` not its ``[..., G]``.
    """
    if blocks.dtype != torch.uint8 or blocks.dim() < 2 or blocks.shape[-1] != MXFP4_BLOCK // 2:
        raise ValueError(f"MXFP4 blocks must be uint8 [..., G, {MXFP4_BLOCK // 2}], got {blocks.dtype} "
                         f"{tuple(blocks.shape)}")
    if tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ValueError(f"MXFP4 scales of shape {tuple(scales.shape)} do not fit blocks {tuple(blocks.shape)} "
                         f"(expected {tuple(blocks.shape[:-1])})")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    lo = lut[(blocks & 0x0F).long()]
    hi = lut[(blocks >> 4).long()]
    values = torch.stack((lo, hi), dim=-1).flatten(-2)  # [..., G, 32]
    exp = scales.to(torch.int32) - 127
    out = torch.ldexp(values, exp.unsqueeze(-1).to(torch.float32))
    return out.flatten(-2).to(dtype)


def gpt_oss_routing(config: Any) -> RoutingConfig:
    """HF ``GptOssTopKRouter``: softmax over the top-k logits, i.e. softmax over all experts
    renormalised over the k chosen (the same weights)."""
    cfg = RoutingConfig(top_k=int(config.num_experts_per_tok), renormalize=True)
    cfg.check_num_experts(int(config.num_local_experts))
    return cfg


class GptOssAttention(LlamaAttention):
    """Llama's attention with biased q/k/v/o (``attention_bias``), a window on sliding layers and
    one sink logit a query head (``sinks``: float32 ``[local q heads]``, this rank's heads under
    tensor parallelism; HF ``self_attn.sinks``), handed to `RadixAttention`.

    Shapes: ``positions`` int64 ``[T]``, ``hidden_states`` ``[T, hidden]`` -> ``[T, hidden]``.
    """

    def __init__(self, config: Any, layer_id: int, layer_type: str, rotary_emb: RotaryEmbedding, dtype: torch.dtype,
                 tp: Optional[TPGroup] = None):
        tp = tp or TPGroup.single()
        window = int(config.sliding_window) - 1 if layer_type == SLIDING and config.sliding_window else -1
        super().__init__(config, layer_id, rotary_emb, dtype, sliding_window_size=window, tp=tp)
        q_rng = q_head_range(config.num_attention_heads, tp.size, tp.rank)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32), requires_grad=False)
        self.sinks.tp_shard = head_shard_spec(0, [(q_rng, 1)])
        self.attn.sinks = self.sinks


class GptOssDecoderLayer(LlamaDecoderLayer):
    """Pre-norm block: `GptOssAttention`, then the biased, clamped-SwiGLU `SparseMoeBlock`."""

    def __init__(self, config: Any, layer_id: int, layer_type: str, rotary_emb: RotaryEmbedding, dtype: torch.dtype,
                 tp: Optional[TPGroup] = None):
        self._layer_type = layer_type
        super().__init__(config, layer_id, rotary_emb, dtype, tp)

    def _make_attention(self, config: Any, layer_id: int, rotary_emb: RotaryEmbedding, dtype: torch.dtype,
                        tp: Optional[TPGroup]) -> nn.Module:
        return GptOssAttention(config, layer_id, self._layer_type, rotary_emb, dtype, tp)

    def _make_mlp(self, config: Any, layer_id: int, dtype: torch.dtype, tp: Optional[TPGroup]) -> nn.Module:
        return SparseMoeBlock(config.hidden_size, int(config.num_local_experts), int(config.intermediate_size),
                              gpt_oss_routing(config), dtype, tp, router_bias=True, expert_bias=True,
                              activation="swigluoai", swiglu_alpha=float(getattr(config, "swiglu_alpha", 1.702)),
                              swiglu_limit=float(getattr(config, "swiglu_limit", 7.0)))


class GptOssModel(LlamaModel):
    """Embedding, `GptOssDecoderLayer` stack (local / global by ``config.layer_types``) and final
    norm (HF prefix ``model.``), one YaRN RoPE table."""

    decoder_layer_cls = GptOssDecoderLayer

    def _init_rope(self, config: Any, dtype: torch.dtype) -> None:
        self.layer_types = gemma2_layer_types(config)
        super()._init_rope(config, dtype)

    def _make_layer(self, config: Any, layer_id: int, dtype: torch.dtype, tp: TPGroup) -> nn.Module:
        return self.decoder_layer_cls(config, layer_id, self.layer_types[layer_id], self.rotary_emb, dtype, tp)


class GptOssForCausalLM(LlamaForCausalLM):
    """gpt-oss causal LM for the engine.

    Args:
        config: HF ``GptOssConfig``-like: the `LlamaForCausalLM` fields plus ``layer_types``,
            ``sliding_window``, ``num_local_experts``, ``num_experts_per_tok``,
            ``intermediate_size`` (each expert's), ``swiglu_alpha``, ``swiglu_limit``.
        dtype: parameter dtype (uninitialised until loaded).
        tp: this rank's group: heads (and their sinks) and every expert's intermediate rows
            are split over its ranks.

    Raises:
        ValueError: a ``--tp-size`` that does not divide ``intermediate_size`` or the heads; a
            rope type `get_rope` does not implement; ``layer_types`` of the wrong length.
    """

    model_cls = GptOssModel
    #: HF names the router ``mlp.router``; it is held as ``mlp.gate`` (`SparseMoeBlock`)
    weight_name_replacements = ((".mlp.router.", ".mlp.gate."),)
    #: ``quantization_config.quant_method`` values whose experts `load_weights` dequantises
    dequantized_quant_methods = ("mxfp4",)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Set[str]:
        """`CausalLM.load_weights` after turning the fused expert tensors and biases (bf16 or
        MXFP4, see the module docstring) into per-expert ``experts.{e}.{gate,up,down}_proj.weight``
        / ``.bias`` tensors.

        Raises:
            ValueError: an MXFP4 ``*_blocks`` tensor without its ``*_scales`` (or the reverse),
                expert tensors whose shapes do not fit the config, and what
                `CausalLM.load_weights` raises (missing expert weights or biases among them).
        """
        return super().load_weights(self._per_expert(weights))

    def _per_expert(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Iterator[Tuple[str, torch.Tensor]]:
        pending: Dict[Tuple[str, str, str], torch.Tensor] = {}  # MXFP4 halves waiting for their partner
        for name, tensor in weights:
            m = _EXPERT_TENSOR.match(name)
            if m is None:
                yield name, tensor
                continue
            layer, proj, kind = m["layer"], m["proj"], m["kind"]
            if kind == "_bias":  # [E, out], gate / up interleaved like the weights' rows
                yield from self._expert_rows(layer, proj, iter(tensor), tuple(tensor.shape), name, "bias")
                continue
            if kind in ("_blocks", "_scales"):
                other = "_scales" if kind == "_blocks" else "_blocks"
                partner = pending.pop((layer, proj, other), None)
                if partner is None:
                    pending[(layer, proj, kind)] = tensor
                    continue
                blocks, scales = (tensor, partner) if kind == "_blocks" else (partner, tensor)
                # one expert at a time: the float32 intermediate of a whole layer is GBs
                experts = (dequantize_mxfp4(blocks[e], scales[e], self.dtype) for e in range(blocks.shape[0]))
                shape = (blocks.shape[0], blocks.shape[1], blocks.shape[2] * MXFP4_BLOCK)
            else:
                t = tensor.transpose(1, 2)  # HF bf16 layout [E, in, out] -> [E, out, in]
                experts, shape = iter(t), tuple(t.shape)
            yield from self._expert_rows(layer, proj, experts, shape, name)
        if pending:
            (layer, proj, kind), _ = next(iter(pending.items()))
            missing = "_scales" if kind == "_blocks" else "_blocks"
            raise ValueError(f"checkpoint has {layer}.mlp.experts.{proj}{kind} but no {proj}{missing}")

    def _expert_rows(self, layer: str, proj: str, experts: Iterator[torch.Tensor], shape: Tuple[int, ...],
                     name: str, suffix: str = "weight") -> Iterator[Tuple[str, torch.Tensor]]:
        """Per-expert HF-style tensors ``...experts.{e}.{gate,up,down}_proj.{suffix}`` from
        ``experts`` (weights ``[out, in]`` or biases ``[out]`` each, gate / up interleaved by
        row; ``shape`` ``[E, out, in]`` / ``[E, out]`` of them all), which `CausalLM.load_weights`
        routes to the layer's `FusedMoE` like any per-expert checkpoint tensor."""
        e_count, h, inter = self.config.num_local_experts, self.config.hidden_size, self.config.intermediate_size
        want = (e_count, 2 * inter, h) if proj == "gate_up_proj" else (e_count, h, inter)
        layout = "[E, out, in]"
        if suffix == "bias":
            want, layout = want[:2], "[E, out]"
        if tuple(shape) != want:
            raise ValueError(f"checkpoint tensor {name!r} gives experts of shape {tuple(shape)} "
                             f"({layout}), expected {want}")
        for e, w in enumerate(experts):
            if proj == "gate_up_proj":
                yield f"{layer}.mlp.experts.{e}.gate_proj.{suffix}", w[0::2]
                yield f"{layer}.mlp.experts.{e}.up_proj.{suffix}", w[1::2]
            else:
                yield f"{layer}.mlp.experts.{e}.down_proj.{suffix}", w


EntryClass = GptOssForCausalLM
