"""Llama decoder (Touvron et al., arXiv:2302.13971; Llama 2/3 with grouped-query attention).

Also serves SmolLM2 and other checkpoints of HF architecture ``LlamaForCausalLM``.
Parameter names follow HF's, except that q/k/v are fused into ``qkv_proj`` and gate/up
into ``gate_up_proj`` (`LlamaForCausalLM.load_weights` maps HF names onto the fused
shards). Attention itself is `RadixAttention`, computed by the step's attention backend.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Optional, Set, Tuple

import torch
from torch import nn

from attnserve.attention.radix_attention import RadixAttention
from attnserve.distributed.group import TPGroup
from attnserve.distributed.partition import kv_head_range, q_head_range
from attnserve.forward_batch import ForwardBatch
from attnserve.models.layers import cpu_gemm
from attnserve.models.layers.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    even_parts,
    gather_logits,
    load_param,
)
from attnserve.models.layers.norm import RMSNorm
from attnserve.models.layers.skinny_gemm import skinny_gemm_supported, skinny_linear, skinny_rule
from attnserve.models.layers.rotary import RotaryEmbedding, get_rope, rope_parameters_from_config


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_then_attention(rotary_emb: RotaryEmbedding, attn: RadixAttention, positions: torch.Tensor,
                        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
    """RoPE on ``q`` ``[T, Hq*D]`` / ``k`` ``[T, Hkv*D]``, then paged attention -> ``[T, Hq*Dv]``.

    Where the KV pool allows it (`RadixAttention.kv_store_target`), the rotation kernel also
    writes the new K (rotated) and V into the cache, one launch instead of two, and the
    backend is told not to store them again (``save_kv_cache=False``).
    """
    target = attn.kv_store_target(forward_batch, v)
    q, k = rotary_emb.forward(positions, q, k, kv_store=target)
    return attn.forward(q, k, v, forward_batch, save_kv_cache=target is None)


def parallel_qkv_o(config: Any, head_dim: int, bias: bool, dtype: torch.dtype, tp: TPGroup):
    """``(qkv_proj, o_proj, local q heads, local KV heads)`` of a GQA block under ``tp``:
    QKV column-parallel by heads (KV heads replicated when fewer than ranks), O row-parallel."""
    total_q = config.num_attention_heads
    q_rng = q_head_range(total_q, tp.size, tp.rank)
    kv_rng = kv_head_range(getattr(config, "num_key_value_heads", None) or total_q, tp.size, tp.rank)
    qkv = ColumnParallelLinear(config.hidden_size, [(q_rng, head_dim), (kv_rng, head_dim), (kv_rng, head_dim)],
                               bias=bias, dtype=dtype)
    o = RowParallelLinear([(q_rng, head_dim)], config.hidden_size, tp, bias=bias, dtype=dtype)
    return qkv, o, q_rng.count, kv_rng.count


class LlamaAttention(nn.Module):
    """Self-attention block: fused QKV projection, RoPE, paged attention, output projection.

    Under tensor parallelism (``tp``) the block holds this rank's heads
    (``num_heads`` / ``num_kv_heads`` are the local counts) and its output is all-reduced.

    Shapes: ``positions`` int64 ``[T]``, ``hidden_states`` ``[T, hidden]`` -> ``[T, hidden]``.
    """

    def __init__(self, config: Any, layer_id: int, rotary_emb: RotaryEmbedding, dtype: torch.dtype,
                 sliding_window_size: int = -1, tp: Optional[TPGroup] = None):
        super().__init__()
        tp = tp or TPGroup.single()
        self.head_dim = _head_dim(config)
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj, self.o_proj, self.num_heads, self.num_kv_heads = parallel_qkv_o(
            config, self.head_dim, bias, dtype, tp)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.rotary_emb = rotary_emb
        self.attn = RadixAttention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            num_kv_heads=self.num_kv_heads,
            layer_id=layer_id,
            sliding_window_size=sliding_window_size,
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        qkv = self.qkv_proj.forward(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.o_proj.forward(rope_then_attention(self.rotary_emb, self.attn, positions, q, k, v, forward_batch))


def parallel_gate_up_down(hidden_size: int, intermediate_size: int, bias: bool, dtype: torch.dtype,
                          tp: TPGroup):
    """``(gate_up_proj, down_proj)`` of a gated MLP under ``tp``: gate|up column-parallel
    (each rank's rows of both halves), down row-parallel."""
    parts = even_parts(intermediate_size, tp)
    gate_up = ColumnParallelLinear(hidden_size, parts * 2, bias=bias, dtype=dtype)
    down = RowParallelLinear(parts, hidden_size, tp, bias=bias, dtype=dtype)
    return gate_up, down


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))`` with fused ``gate_up_proj``
    (this rank's intermediate rows under ``tp``; the output is all-reduced)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, dtype: torch.dtype,
                 tp: Optional[TPGroup] = None):
        super().__init__()
        self.gate_up_proj, self.down_proj = parallel_gate_up_down(hidden_size, intermediate_size, bias, dtype,
                                                                  tp or TPGroup.single())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # gate_up projection and SiLU-and-mul: one kernel for decode-sized CUDA batches
        return self.down_proj.forward(self.gate_up_proj.forward_gated(x, "silu"))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm decoder block; carries the residual stream separately (see `RMSNorm`)."""

    def __init__(self, config: Any, layer_id: int, rotary_emb: RotaryEmbedding, dtype: torch.dtype,
                 tp: Optional[TPGroup] = None):
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = LlamaAttention(config, layer_id, rotary_emb, dtype, tp=tp)
        self.mlp = LlamaMLP(
            config.hidden_size, config.intermediate_size, bool(getattr(config, "mlp_bias", False)), dtype, tp
        )
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype)

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
        hidden_states, residual = self.post_attention_layernorm.forward(hidden_states, residual)
        return self.mlp.forward(hidden_states), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (HF prefix ``model.``). Subclasses change
    the block by setting ``decoder_layer_cls``."""

    decoder_layer_cls: Any = None  # None: LlamaDecoderLayer

    def __init__(self, config: Any, dtype: torch.dtype, tp: Optional[TPGroup] = None):
        super().__init__()
        tp = tp or TPGroup.single()
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, dtype=dtype)
        # one cos/sin table shared by every layer
        self.rotary_emb = get_rope(
            _head_dim(config),
            int(getattr(config, "max_position_embeddings", 8192)),
            rope_parameters_from_config(config),
        )
        self.layers = nn.ModuleList(
            (self.decoder_layer_cls or LlamaDecoderLayer)(config, i, self.rotary_emb, dtype, tp=tp)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch,
                num_layers: Optional[int] = None) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers[:num_layers]:
            # direct ``forward`` calls on the per-layer path: no module hooks are used, and
            # ``nn.Module.__call__`` costs ~7 us a call, ~300 calls a step (~3% of a CPU step)
            hidden_states, residual = layer.forward(positions, hidden_states, forward_batch, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """Llama causal LM for the engine.

    Args:
        config: HF ``LlamaConfig``-like object: ``hidden_size``, ``intermediate_size``,
            ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``,
            ``head_dim`` (default ``hidden_size // num_attention_heads``), ``rms_norm_eps``,
            ``rope_parameters`` or ``rope_theta``/``rope_scaling``,
            ``max_position_embeddings`` (RoPE table length), ``vocab_size``,
            ``tie_word_embeddings``, ``attention_bias``, ``mlp_bias``.
        dtype: parameter dtype. Parameters are created on the current default device (use
            ``with torch.device(...)`` to build directly on a GPU or on ``meta``) and are
            left uninitialised (norms are ones) until `load_weights` or
            `attnserve.model_loader.dummy.init_dummy_weights` fills them.
        tp: this rank's `TPGroup` (default: one device). Heads, MLP rows and vocabulary
            rows are split over its ranks (`attnserve.models.layers.parallel`); the loaders
            give every rank full checkpoint tensors, one at a time, and keep its slice.

    The KV cache holds ``num_key_value_heads`` heads of ``head_dim`` per layer (this rank's
    heads under ``tp``).
    """

    #: fused parameter -> HF shards it is built from, as (HF module name, shard id)
    packed_modules_mapping: Dict[str, Tuple[Tuple[str, int], ...]] = {
        "qkv_proj": (("q_proj", 0), ("k_proj", 1), ("v_proj", 2)),
        "gate_up_proj": (("gate_proj", 0), ("up_proj", 1)),
    }
    #: HF checkpoint tensors that have no parameter here (recomputed buffers)
    ignored_weight_suffixes: Tuple[str, ...] = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32, tp: Optional[TPGroup] = None):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.tp = tp or TPGroup.single()
        self.model = LlamaModel(config, dtype, self.tp)
        self._init_lm_head(config, dtype, tie_default=False)

    def _init_lm_head(self, config: Any, dtype: torch.dtype, tie_default: bool) -> None:
        """``lm_head`` (vocabulary-parallel rows), or None when tied to the embeddings."""
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", tie_default))
        self.lm_head = None
        self.lm_head_packed = cpu_gemm.PackedCPUWeight()
        if not self.tie_word_embeddings:
            self.lm_head = VocabParallelEmbedding(config.vocab_size, config.hidden_size, self.tp, dtype=dtype)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch,
                num_layers: Optional[int] = None) -> torch.Tensor:
        """Run the decoder on the step's tokens.

        Args:
            input_ids: int64 ``[T]``.
            positions: int64 ``[T]`` absolute positions (< ``max_position_embeddings``).
            forward_batch: the step's `ForwardBatch` (attention backend and KV pools).

        Returns:
            ``[T, hidden_size]`` hidden states after the final norm, in the model dtype.
        """
        return self.model(input_ids, positions, forward_batch, num_layers)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """``[vocab rows of this rank, hidden_size]``: the embedding matrix when tied."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @torch.no_grad()
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[N, hidden_size]`` -> float32 ``[N, vocab_size]`` logits (every rank's vocabulary
        rows gathered under tensor parallelism). Decode-sized CUDA batches use the skinny
        GEMM while the model's fused kernels are on (Llama-3-8B at batch 1: 331 vs 367 µs
        for cuBLAS, benchmarks/NOTES.md, issue 33)."""
        w = self.lm_head_weight
        if (getattr(self.model.norm, "use_fused", False) and hidden_states.is_cuda and skinny_rule() == "v2"
                and skinny_gemm_supported(hidden_states, w)):
            local = skinny_linear(hidden_states, w)
        else:
            local = cpu_gemm.linear(hidden_states, w, None, self.lm_head_packed)
        return gather_logits(local, self.config.vocab_size, self.tp).float()

    # ---- weights ------------------------------------------------------------------------
    @torch.no_grad()
    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Set[str]:
        """Copy HF-named tensors into the parameters (casting to their dtype and device).

        Args:
            weights: ``(name, tensor)`` pairs with HF names, e.g.
                ``model.layers.3.self_attn.q_proj.weight``. ``lm_head.weight`` is skipped
                when the embeddings are tied.

        Returns:
            the names of this module's parameters that were written.

        Raises:
            KeyError: for a name that matches no parameter.
            ValueError: for a shape mismatch, or when some parameters received no weight.
        """
        params = dict(self.named_parameters())
        loaded: Set[str] = set()
        shard_map = {
            f".{hf}.": (fused, shard) for fused, shards in self.packed_modules_mapping.items() for hf, shard in shards
        }
        for name, tensor in weights:
            if name.endswith(self.ignored_weight_suffixes):
                continue
            if name.startswith("lm_head.") and self.tie_word_embeddings:
                continue
            for key, (fused, shard) in shard_map.items():
                if key in name:
                    target = name.replace(key, f".{fused}.")
                    load_param(self._param(params, target, name), tensor, name, part=shard)
                    loaded.add(f"{target}#{shard}")
                    loaded.add(target)
                    break
            else:
                load_param(self._param(params, name, name), tensor, name)
                loaded.add(name)
        self._check_complete(params, loaded)
        return {n for n in loaded if "#" not in n}

    @staticmethod
    def _param(params: Dict[str, nn.Parameter], target: str, source: str) -> nn.Parameter:
        if target not in params:
            raise KeyError(f"checkpoint tensor {source!r} matches no parameter of LlamaForCausalLM")
        return params[target]

    def _check_complete(self, params: Dict[str, nn.Parameter], loaded: Set[str]) -> None:
        missing = []
        for pname in params:
            fused = pname.split(".")[-2] if "." in pname else ""
            if fused in self.packed_modules_mapping:
                shards = self.packed_modules_mapping[fused]
                if any(f"{pname}#{shard}" not in loaded for _, shard in shards):
                    missing.append(pname)
            elif pname not in loaded:
                missing.append(pname)
        if missing:
            shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
            raise ValueError(f"checkpoint left {len(missing)} parameters unset: {shown}")


EntryClass = LlamaForCausalLM
