"""Phi-3 / Phi-3.5 / Phi-4 (dense) decoder (Abdin et al., "Phi-3 Technical Report",
arXiv:2404.14219; Phi-4-mini, arXiv:2503.01743).

Serves HF architecture ``Phi3ForCausalLM`` (``model_type`` ``phi3``). The block is Mistral's
(`attnserve.models.mistral`: Llama's pre-norm block, no biases, every layer windowed by
``config.sliding_window`` when set -- 2047 in Phi-3-mini-4k), with:

* fused checkpoint tensors: ``self_attn.qkv_proj`` ``[q | k | v]`` rows and
  ``mlp.gate_up_proj`` ``[gate | up]`` rows (HF ``Phi3MLP`` chunks the output in two, gate
  first). `Phi3ForCausalLM.load_weights` splits each into its parts (views, no copy) and
  loads them as separate q/k/v and gate/up tensors load (`CausalLM.load_weights`), so under tensor
  parallelism every rank keeps its heads of q, k and v and its rows of gate and up.
  Checkpoints with separate tensors (GGUF ``attn_q``/``attn_k``/``attn_v``) load as they are.
* RoPE: ``default`` or ``longrope`` (Phi-3-mini-128k, Phi-3.5, Phi-4-mini:
  `attnserve.models.layers.rotary.LongRoPERotaryEmbedding`, long or short factors per
  request by sequence length, as HF does); legacy ``su`` / ``yarn`` types are read as
  ``longrope``, as transformers' ``Phi3Config`` does. ``original_max_position_embeddings``
  at the top of the config takes precedence over the one in ``rope_scaling`` (transformers'
  rule). ``partial_rotary_factor`` (Phi-4-mini: 0.75) rotates the leading
  ``head_dim * factor`` channels of each head (neox pairing) and passes the rest through.
  Any other rope type is refused by `get_rope`.

Where this engine's LongRoPE differs from HF ``generate`` (the model forward itself matches
HF's, which picks the factors per forward by its sequence length):

* crossing during decode: when a sequence reaches ``original_max_position_embeddings + 1``
  tokens, HF's ``Phi3ForCausalLM.prepare_inputs_for_generation`` drops the KV cache and
  recomputes the whole sequence with the long factors. Here the cached keys keep the short
  rotation (as HF's model does when driven step by step on its cache; vLLM and SGLang do not
  recompute either); matching ``generate`` would take a scheduler-side re-prefill.
* chunked prefill: each chunk chooses by the tokens cached after it, so a prompt that
  crosses the boundary inside a later chunk has its first chunks short-rotated (HF's single
  forward rotates the whole prompt with the long factors).
* prefix cache: KV of a shared prefix computed by a request below the boundary (short) is
  reused by one above it (HF: long), and the reverse.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Iterator, Optional, Set, Tuple

import torch

from attnserve.distributed.group import TPGroup
from attnserve.forward_batch import ForwardBatch
from attnserve.models.base import attention_head_dim
from attnserve.models.layers.rotary import LongRoPERotaryEmbedding, get_rope, rope_parameters_from_config
from attnserve.models.llama import LlamaForCausalLM, LlamaModel
from attnserve.models.mistral import MistralDecoderLayer, require_silu

#: legacy Phi-3 rope types that transformers' Phi3Config reads as longrope
_LONGROPE_ALIASES = ("su", "yarn")


def phi3_rope_parameters(config: Any) -> Dict[str, Any]:
    """Flat RoPE parameters of a Phi-3 config (`rope_parameters_from_config`) with
    transformers' Phi-3 rules applied: ``su``/``yarn`` -> ``longrope``; the config's top-level
    ``original_max_position_embeddings`` and ``partial_rotary_factor`` override the rope
    dict's."""
    params = rope_parameters_from_config(config)
    if params["rope_type"] in _LONGROPE_ALIASES:
        params["rope_type"] = "longrope"
    if getattr(config, "original_max_position_embeddings", None):
        params["original_max_position_embeddings"] = int(config.original_max_position_embeddings)
    if getattr(config, "partial_rotary_factor", None) is not None:
        params["partial_rotary_factor"] = float(config.partial_rotary_factor)
    return params


class Phi3Model(LlamaModel):
    """Embedding, `MistralDecoderLayer` stack (one RoPE table shared) and final norm (HF
    prefix ``model.``). With longrope, the step's positions are mapped to rows of the
    two-part table once per step (`LongRoPERotaryEmbedding.table_positions`) before the
    layers run."""

    decoder_layer_cls = MistralDecoderLayer

    def _init_rope(self, config: Any, dtype: torch.dtype) -> None:
        self.rotary_emb = get_rope(attention_head_dim(config), int(getattr(config, "max_position_embeddings", 4096)),
                                   phi3_rope_parameters(config))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch,
                num_layers: Optional[int] = None) -> torch.Tensor:
        if isinstance(self.rotary_emb, LongRoPERotaryEmbedding):
            # the layers use positions only for RoPE: hand them the table rows
            positions = self.rotary_emb.table_positions(positions, forward_batch)
        return super().forward(input_ids, positions, forward_batch, num_layers)


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 causal LM for the engine.

    Args:
        config: HF ``Phi3Config``-like object: the `LlamaForCausalLM` fields plus
            ``sliding_window``, ``original_max_position_embeddings``, ``rope_parameters``
            (or ``rope_scaling``) with ``short_factor`` / ``long_factor`` for longrope, and
            ``partial_rotary_factor``.
        dtype: parameter dtype (parameters uninitialised until loaded; norms are ones).
        tp: this rank's group (q/k/v heads and gate/up rows split as in Llama).

    Raises:
        ValueError: ``hidden_act`` other than ``silu``; a rope type other than
            default/longrope (named in the message); longrope factors missing or of the
            wrong length.
    """

    model_cls = Phi3Model

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32, tp: Optional[TPGroup] = None):
        require_silu(config, "Phi-3")
        super().__init__(config, dtype, tp)

    def _split_fused(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Iterator[Tuple[str, torch.Tensor]]:
        """HF ``qkv_proj`` -> ``q_proj``/``k_proj``/``v_proj`` rows and ``gate_up_proj`` ->
        ``gate_proj``/``up_proj`` halves (views); other tensors pass through.

        Raises:
            ValueError: a fused tensor whose row count is not the config's
                ``(heads + 2 * kv_heads) * head_dim`` or ``2 * intermediate_size``.
        """
        cfg = self.config
        head_dim = attention_head_dim(cfg)
        q = cfg.num_attention_heads * head_dim
        kv = (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) * head_dim
        inter = cfg.intermediate_size
        for name, tensor in weights:
            if ".self_attn.qkv_proj." in name:
                if tensor.shape[0] != q + 2 * kv:
                    raise ValueError(f"checkpoint tensor {name!r} has {tensor.shape[0]} rows; the config's q/k/v "
                                     f"need {q} + 2 x {kv} = {q + 2 * kv}")
                for part, rows in zip(("q_proj", "k_proj", "v_proj"), tensor.split([q, kv, kv])):
                    yield name.replace(".qkv_proj.", f".{part}."), rows
            elif ".mlp.gate_up_proj." in name:
                if tensor.shape[0] != 2 * inter:
                    raise ValueError(f"checkpoint tensor {name!r} has {tensor.shape[0]} rows; the config's gate/up "
                                     f"need 2 x {inter} = {2 * inter}")
                gate, up = tensor.split([inter, inter])
                yield name.replace(".gate_up_proj.", ".gate_proj."), gate
                yield name.replace(".gate_up_proj.", ".up_proj."), up
            else:
                yield name, tensor

    @torch.no_grad()
    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Set[str]:
        """`CausalLM.load_weights` after splitting Phi-3's fused tensors
        (`_split_fused`); same arguments, result and errors."""
        return super().load_weights(self._split_fused(weights))


EntryClass = Phi3ForCausalLM
