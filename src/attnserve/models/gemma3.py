"""Gemma 3 text decoder (Gemma Team, "Gemma 3 Technical Report", arXiv:2503.19786).

Serves HF architecture ``Gemma3ForCausalLM`` (``model_type`` ``gemma3_text``), e.g. the
packaged ``gemma3-270m`` GGUF. What differs from Llama (`attnserve.models.llama`):

* interleaved local/global attention: ``config.layer_types`` (transformers >= 5) or, for
  older configs, every ``sliding_window_pattern``-th layer (default 6) is global
  (``full_attention``) and the rest are local (``sliding_attention``). Local layers attend
  to the last ``sliding_window`` tokens including the query itself -- HF's mask is
  ``q - sliding_window < k <= q`` -- so they pass ``sliding_window - 1`` to `RadixAttention`
  (whose window ``w`` shows keys ``q - w .. q``); global layers pass -1.
* RoPE per layer type: ``rope_parameters["sliding_attention"]`` (base 1e4) on local layers,
  ``rope_parameters["full_attention"]`` (base 1e6, possibly scaled) on global ones.
* RMSNorm in the ``x * (1 + w)`` form (`GemmaRMSNorm`), also per head on q and k (QK-norm
  before RoPE), and four norms per block: before and after attention, before and after the
  feed-forward (the post-norms are applied to the block output before the residual add).
* softmax scale ``query_pre_attn_scalar ** -0.5`` instead of ``head_dim ** -0.5``.
* embeddings multiplied by ``sqrt(hidden_size)`` rounded to the model dtype (as HF does).
* GeGLU feed-forward with the tanh GELU (``gelu_pytorch_tanh``).
* tied output embeddings; optional ``final_logit_softcapping`` (``c * tanh(logits / c)``).
  ``attn_logit_softcapping`` is ignored, as HF transformers' Gemma 3 ignores it (its
  attention call passes no soft cap): Gemma 3 replaced Gemma 2's attention soft-capping by
  QK-norm (technical report, section 2). A config that sets it gets a warning.

Weights use HF names; q/k/v and gate/up are fused like Llama's (`CausalLM.load_weights`).
The body, LM head and loading are `attnserve.models.base`'s; the attention is Qwen3's
QK-normed one (`Qwen3Attention`) with Gemma's norms, scale and windows. The forward has no
host synchronisation and no data-dependent Python branching, so decode steps can be
captured in CUDA graphs.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
from torch import nn

from attnserve.distributed.group import TPGroup
from attnserve.forward_batch import ForwardBatch
from attnserve.models.base import CausalLM, DecoderModel, attention_head_dim
from attnserve.models.layers.activation import GeluAndMul
from attnserve.models.layers.norm import GemmaRMSNorm
from attnserve.models.layers.rotary import RotaryEmbedding, get_rope, rope_parameters_from_config
from attnserve.models.llama import parallel_gate_up_down
from attnserve.models.qwen3 import Qwen3Attention

logger = logging.getLogger(__name__)

SLIDING, FULL = "sliding_attention", "full_attention"
_GELU_APPROXIMATION = {"gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu_fast": "tanh", "gelu": "none"}


def gemma3_layer_types(config: Any) -> List[str]:
    """``"sliding_attention"`` / ``"full_attention"`` per layer.

    ``config.layer_types`` when present; otherwise layer ``i`` is global iff
    ``(i + 1) % sliding_window_pattern == 0`` (pattern 6: layers 5, 11, 17, ... global).
    """
    types = getattr(config, "layer_types", None)
    n = config.num_hidden_layers
    if types:
        if len(types) != n:
            raise ValueError(f"config.layer_types has {len(types)} entries for {n} layers")
        return list(types)
    pattern = getattr(config, "sliding_window_pattern", None) or getattr(config, "_sliding_window_pattern", None) or 6
    return [FULL if (i + 1) % int(pattern) == 0 else SLIDING for i in range(n)]


def gemma3_rope_parameters(config: Any, layer_type: str) -> Dict[str, Any]:
    """Flat RoPE parameters of one layer type (see `rope_parameters_from_config`).

    transformers >= 5 keys ``rope_parameters`` by layer type; older configs have
    ``rope_theta`` (+ ``rope_scaling``) for global layers and ``rope_local_base_freq``
    (default 1e4, unscaled) for local ones.
    """
    params = getattr(config, "rope_parameters", None)
    if params and all(isinstance(v, Mapping) for v in params.values()):
        return rope_parameters_from_config(config, layer_type)
    if layer_type == SLIDING:
        return {"rope_type": "default", "rope_theta": float(getattr(config, "rope_local_base_freq", None) or 1e4)}
    out = rope_parameters_from_config(config)
    if getattr(config, "rope_theta", None) is None and "rope_theta" not in (params or {}):
        out["rope_theta"] = 1e6
    return out


class Gemma3Attention(Qwen3Attention):
    """QK-normed grouped-query attention (`GemmaRMSNorm` per head), local (windowed) or
    global, scaled by ``query_pre_attn_scalar ** -0.5``.

    Args:
        config: Gemma 3 text config.
        layer_id: layer index (KV pool slot).
        layer_type: ``"sliding_attention"`` or ``"full_attention"``.
        rotary_emb: the RoPE table of this layer type (shared between layers).
        dtype: parameter dtype.

    Shapes: ``positions`` int64 ``[T]``, ``hidden_states`` ``[T, hidden]`` -> ``[T, hidden]``.
    """

    qk_norm_cls = GemmaRMSNorm

    def __init__(self, config: Any, layer_id: int, layer_type: str, rotary_emb: RotaryEmbedding, dtype: torch.dtype,
                 tp: Optional[TPGroup] = None):
        sliding = layer_type == SLIDING
        window = int(config.sliding_window) - 1 if sliding and config.sliding_window else -1
        scalar = getattr(config, "query_pre_attn_scalar", None) or attention_head_dim(config)
        # logit_cap 0: Gemma 3 uses QK-norm instead of attention soft-capping (see module doc)
        super().__init__(config, layer_id, rotary_emb, dtype, tp=tp, sliding_window_size=window,
                         scaling=float(scalar) ** -0.5, logit_cap=0.0)
        self.is_sliding = sliding


class Gemma3MLP(nn.Module):
    """GeGLU feed-forward ``down(gelu_tanh(gate(x)) * up(x))`` with fused ``gate_up_proj``."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str, dtype: torch.dtype,
                 tp: Optional[TPGroup] = None):
        super().__init__()
        if activation not in _GELU_APPROXIMATION:
            raise ValueError(f"unsupported Gemma activation {activation!r}; supported: {', '.join(_GELU_APPROXIMATION)}")
        self.gate_up_proj, self.down_proj = parallel_gate_up_down(hidden_size, intermediate_size, False, dtype,
                                                                  tp or TPGroup.single())
        self.act_fn = GeluAndMul(_GELU_APPROXIMATION[activation])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act_fn.approximate == "tanh":  # projection and gate in one kernel for decode batches
            return self.down_proj.forward(self.gate_up_proj.forward_gated(x, "gelu_tanh"))
        return self.down_proj.forward(self.act_fn.forward(self.gate_up_proj.forward(x)))


class Gemma3DecoderLayer(nn.Module):
    """``h += post_attn_norm(attn(input_norm(h)))``; ``h += post_ffw_norm(mlp(pre_ffw_norm(h)))``.

    The residual stream is carried separately (as in `LlamaDecoderLayer`): the returned
    block output is added to it by the next norm that takes ``residual``. The attention is
    ``attention_cls(config, layer_id, layer_type, rotary_emb, dtype, tp)``.
    """

    attention_cls: Any = Gemma3Attention

    def __init__(self, config: Any, layer_id: int, layer_type: str, rotary_emb: RotaryEmbedding, dtype: torch.dtype,
                 tp: Optional[TPGroup] = None):
        super().__init__()
        eps, hidden = config.rms_norm_eps, config.hidden_size
        self.layer_type = layer_type
        self.self_attn = self.attention_cls(config, layer_id, layer_type, rotary_emb, dtype, tp)
        activation = getattr(config, "hidden_activation", None) or "gelu_pytorch_tanh"
        self.mlp = Gemma3MLP(hidden, config.intermediate_size, activation, dtype, tp)
        self.input_layernorm = GemmaRMSNorm(hidden, eps, dtype=dtype)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, dtype=dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype=dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype=dtype)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        forward_batch: ForwardBatch,
        residual: Optional[torch.Tensor],
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(block output, residual stream)``, both ``[T, hidden]``; their sum is the
        layer's output in HF's formulation."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm.forward(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm.forward(hidden_states, residual)
        hidden_states = self.self_attn.forward(positions, hidden_states, forward_batch)
        hidden_states = self.post_attention_layernorm.forward(hidden_states)
        hidden_states, residual = self.pre_feedforward_layernorm.forward(hidden_states, residual)
        hidden_states = self.post_feedforward_layernorm.forward(self.mlp.forward(hidden_states))
        return hidden_states, residual


class Gemma3TextModel(DecoderModel):
    """Scaled embedding, decoder layers and final norm (HF prefix ``model.``).

    Buffer ``embed_scale``: ``sqrt(hidden_size)`` as a 0-d tensor in the model dtype
    (float32 value rounded once, e.g. 25.25 in bfloat16 for hidden 640, as HF rounds it).
    Layers are ``decoder_layer_cls(config, layer_id, layer_type, rotary_emb, dtype, tp)``.
    """

    decoder_layer_cls: Any = Gemma3DecoderLayer
    norm_cls = GemmaRMSNorm

    def _init_rope(self, config: Any, dtype: torch.dtype) -> None:
        self.layer_types = gemma3_layer_types(config)
        scale = torch.tensor(config.hidden_size**0.5, dtype=torch.float32).to(dtype)
        self.register_buffer("embed_scale", scale, persistent=False)
        head_dim = attention_head_dim(config)
        max_pos = int(getattr(config, "max_position_embeddings", 8192))
        # one cos/sin table per layer type, shared by the layers of that type
        self.rotary_emb_local = get_rope(head_dim, max_pos, gemma3_rope_parameters(config, SLIDING))
        self.rotary_emb_global = get_rope(head_dim, max_pos, gemma3_rope_parameters(config, FULL))

    def _make_layer(self, config: Any, layer_id: int, dtype: torch.dtype, tp: TPGroup) -> nn.Module:
        layer_type = self.layer_types[layer_id]
        rope = self.rotary_emb_local if layer_type == SLIDING else self.rotary_emb_global
        return self.decoder_layer_cls(config, layer_id, layer_type, rope, dtype, tp)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale


class Gemma3ForCausalLM(CausalLM):
    """Gemma 3 causal LM for the engine (text only).

    Args:
        config: HF ``Gemma3TextConfig``-like object: ``hidden_size``, ``intermediate_size``,
            ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``,
            ``head_dim``, ``rms_norm_eps``, ``sliding_window``, ``layer_types`` (or
            ``sliding_window_pattern``), ``rope_parameters`` per layer type (or
            ``rope_theta`` + ``rope_local_base_freq``), ``query_pre_attn_scalar``,
            ``hidden_activation``, ``final_logit_softcapping``,
            ``max_position_embeddings`` (RoPE table length), ``vocab_size``,
            ``tie_word_embeddings`` (default True).
        dtype: parameter dtype. Parameters are created on the current default device and
            left uninitialised (norm offsets are zeros) until `load_weights` or
            `init_dummy_weights` (which fills norms with ``dummy_norm_fill`` = 0) fills them.

    The KV cache holds ``num_key_value_heads`` heads of ``head_dim`` per layer for every
    layer; local layers read only the last ``sliding_window`` tokens of it.

    Raises:
        ValueError: for a bidirectional-attention config (not a causal LM) or an
            unsupported activation.
    """

    model_cls = Gemma3TextModel
    tie_word_embeddings_default = True
    #: Gemma norms are ``x * (1 + w)``: w = 0 is the identity scale
    dummy_norm_fill = 0.0
    #: the family in messages; whether ``attn_logit_softcapping`` is ignored (with a warning)
    family = "Gemma 3"
    ignores_attn_logit_softcapping = True

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32, tp: Optional[TPGroup] = None):
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError(f"{self.family} with use_bidirectional_attention is not a causal LM; not supported")
        if self.ignores_attn_logit_softcapping and getattr(config, "attn_logit_softcapping", None):
            logger.warning("Gemma 3: attn_logit_softcapping=%s is ignored (as in HF transformers; Gemma 3 uses "
                           "QK-norm instead)", config.attn_logit_softcapping)
        super().__init__(config, dtype, tp)
        self.final_logit_softcapping = float(getattr(config, "final_logit_softcapping", None) or 0.0)

    @torch.no_grad()
    def compute_logits(self, hidden_states: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[N, hidden_size]`` -> float32 ``[N, vocab_size]`` logits, soft-capped to
        ``(-c, c)`` by ``c * tanh(logits / c)`` when ``final_logit_softcapping`` is set
        (in place, so an ``out`` the base class wrote stays the result)."""
        logits = super().compute_logits(hidden_states, out=out)
        if self.final_logit_softcapping > 0:
            cap = self.final_logit_softcapping
            logits = logits.div_(cap).tanh_().mul_(cap)
        return logits


EntryClass = Gemma3ForCausalLM
