"""Llama decoder (Touvron et al., arXiv:2302.13971; Llama 2/3 with grouped-query attention).

Also serves SmolLM2 and other checkpoints of HF architecture ``LlamaForCausalLM``.
Parameter names follow HF's, except that q/k/v are fused into ``qkv_proj`` and gate/up
into ``gate_up_proj`` (`LlamaForCausalLM.load_weights` maps HF names onto the fused
shards). Attention itself is `RadixAttention`, computed by the step's attention backend.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Optional, Set, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from attnserve.attention.radix_attention import RadixAttention
from attnserve.forward_batch import ForwardBatch
from attnserve.models.layers.linear import Embedding, Linear
from attnserve.models.layers.norm import RMSNorm
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
    q, k = rotary_emb(positions, q, k, kv_store=target)
    return attn(q, k, v, forward_batch, save_kv_cache=target is None)


class LlamaAttention(nn.Module):
    """Self-attention block: fused QKV projection, RoPE, paged attention, output projection.

    Shapes: ``positions`` int64 ``[T]``, ``hidden_states`` ``[T, hidden]`` -> ``[T, hidden]``.
    """

    def __init__(self, config: Any, layer_id: int, rotary_emb: RotaryEmbedding, dtype: torch.dtype,
                 sliding_window_size: int = -1):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = _head_dim(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias, dtype=dtype)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=bias, dtype=dtype)
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
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.o_proj(rope_then_attention(self.rotary_emb, self.attn, positions, q, k, v, forward_batch))


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))`` with fused ``gate_up_proj``."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias, dtype=dtype)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # gate_up projection and SiLU-and-mul: one kernel for decode-sized CUDA batches
        return self.down_proj(self.gate_up_proj.forward_gated(x, "silu"))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm decoder block; carries the residual stream separately (see `RMSNorm`)."""

    def __init__(self, config: Any, layer_id: int, rotary_emb: RotaryEmbedding, dtype: torch.dtype):
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = LlamaAttention(config, layer_id, rotary_emb, dtype)
        self.mlp = LlamaMLP(
            config.hidden_size, config.intermediate_size, bool(getattr(config, "mlp_bias", False)), dtype
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
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, forward_batch)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (HF prefix ``model.``). Subclasses change
    the block by setting ``decoder_layer_cls``."""

    decoder_layer_cls: Any = None  # None: LlamaDecoderLayer

    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        # one cos/sin table shared by every layer
        self.rotary_emb = get_rope(
            _head_dim(config),
            int(getattr(config, "max_position_embeddings", 8192)),
            rope_parameters_from_config(config),
        )
        self.layers = nn.ModuleList(
            (self.decoder_layer_cls or LlamaDecoderLayer)(config, i, self.rotary_emb, dtype)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch,
                num_layers: Optional[int] = None) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers[:num_layers]:
            hidden_states, residual = layer(positions, hidden_states, forward_batch, residual)
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

    The KV cache holds ``num_key_value_heads`` heads of ``head_dim`` per layer.
    """

    #: fused parameter -> HF shards it is built from, as (HF module name, shard id)
    packed_modules_mapping: Dict[str, Tuple[Tuple[str, Any], ...]] = {
        "qkv_proj": (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")),
        "gate_up_proj": (("gate_proj", 0), ("up_proj", 1)),
    }
    #: HF checkpoint tensors that have no parameter here (recomputed buffers)
    ignored_weight_suffixes: Tuple[str, ...] = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.model = LlamaModel(config, dtype)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)

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
        """``[vocab_size, hidden_size]``: the embedding matrix when tied."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @torch.no_grad()
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[N, hidden_size]`` -> float32 ``[N, vocab_size]`` logits."""
        return F.linear(hidden_states, self.lm_head_weight).float()

    # ---- weights ------------------------------------------------------------------------
    def _shard_slice(self, fused: str, shard_id: Any) -> Tuple[int, int]:
        """(row offset, rows) of one HF shard inside a fused weight."""
        cfg = self.config
        if fused == "qkv_proj":
            hd = _head_dim(cfg)
            q = cfg.num_attention_heads * hd
            kv = (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) * hd
            return {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
        inter = cfg.intermediate_size
        return (shard_id * inter, inter)

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
                    param = self._param(params, target, name)
                    start, size = self._shard_slice(fused, shard)
                    self._copy(param.narrow(0, start, size), tensor, name)
                    loaded.add(f"{target}#{shard}")
                    loaded.add(target)
                    break
            else:
                param = self._param(params, name, name)
                self._copy(param, tensor, name)
                loaded.add(name)
        self._check_complete(params, loaded)
        return {n for n in loaded if "#" not in n}

    @staticmethod
    def _param(params: Dict[str, nn.Parameter], target: str, source: str) -> nn.Parameter:
        if target not in params:
            raise KeyError(f"checkpoint tensor {source!r} matches no parameter of LlamaForCausalLM")
        return params[target]

    @staticmethod
    def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
        if tuple(dst.shape) != tuple(src.shape):
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
        dst.copy_(src.to(device=dst.device, dtype=dst.dtype))

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
