"""DeepSeek-V2 / V3 decoder with multi-head latent attention (MLA), dense or mixture-of-experts MLPs.

MLA (DeepSeek-V2, arXiv:2405.04434, section 2.1). Per token ``x`` and head ``h``:

* query: ``q = q_b_proj(rms(q_a_proj(x)))`` (or ``q_proj(x)`` without ``q_lora_rank``),
  split per head into ``q_nope`` (``qk_nope_head_dim``) and ``q_pe`` (``qk_rope_head_dim``);
* latent: ``kv_a_proj_with_mqa(x) = [c_kv (kv_lora_rank) | k_pe (qk_rope_head_dim)]``,
  ``c_kv = rms(c_kv)``; ``k_pe`` is one rotary key shared by all heads;
* up-projection ``kv_b_proj.weight`` ``[H * (nope + v_head_dim), kv_lora_rank]`` holds per
  head ``W_UK`` ``[nope, kv_lora_rank]`` then ``W_UV`` ``[v_head_dim, kv_lora_rank]``:
  ``k_nope = W_UK c_kv``, ``v = W_UV c_kv``;
* RoPE on ``q_pe`` and ``k_pe`` only; scores use ``[q_nope | q_pe] . [k_nope | k_pe]``
  scaled by ``(nope + rope) ** -0.5`` times YaRN's ``mscale ** 2`` when configured.

The KV cache (`MLATokenToKVPool`) stores only ``[c_kv | k_pe]`` (kv_lora_rank + rope per
token, 576 for the real models). Two ways to attend (`attnserve.attention.mla_paths`; the
choice is SGLang's for its Triton MLA backend):

* **Absorbed** (decode, and extends with cached prefixes that the expanded form below does
  not take):
  ``W_UK`` is folded into the query (``q_nope W_UK`` -> ``[T, H, kv_lora_rank]``) and
  ``W_UV`` into the output, so attention runs directly on the latent cache: the layer
  ``attn_mqa`` has one KV head of width ``kv_lora_rank + rope``, values = its first
  ``kv_lora_rank`` columns (the FlashMLA layout). The model passes the new tokens' latent
  as ``k``; the backend stores it and finds the cached prefix itself.
* **Expanded** (a prefill without cached prefixes): per-head K/V of the new tokens are
  up-projected from this step's ``c_kv`` and attended with ``Dk = nope + rope``, ``Dv =
  v_head_dim`` through ``attn_mha`` (smaller head dims than the absorbed form); the model
  stores the latent itself (``set_mla_kv_buffer``) and calls with ``save_kv_cache=False``.
  Extend steps with cached prefixes take it too where `mla_expanded_prefix`'s cost rule
  says so (chunked prefill of many prompts, long prompts after a cache hit): the prefixes'
  latent rows are up-projected as well and passed as ``prefix_kv``.

RoPE layout (checked against transformers 5's modeling_deepseek_v2/_v3): DeepSeek rotates
interleaved channel pairs ``(2i, 2i+1)`` (GPT-J style, ``is_neox_style=False``). V2 keeps
the interleaved output; V3 with ``rope_interleave=True`` (the default) writes the rotated
pairs de-interleaved (evens then odds), a fixed permutation applied to both ``q_pe`` and
``k_pe`` that leaves every score unchanged, so we keep the interleaved output for both;
V3 with ``rope_interleave=False`` rotates halves (neox style). YaRN's cos/sin attention
factor and the softmax ``mscale ** 2`` come from `attnserve.models.layers.rotary`.

Feed-forward: layer ``i`` is a mixture of experts (`SparseMoeBlock`: routed experts chosen
by the router of `routing_config_from_hf`, plus ``n_shared_experts`` shared ones) when
``n_routed_experts`` is set, ``i >= first_k_dense_replace`` and ``i % moe_layer_freq == 0``
(HF's rule is the first two; every released config has ``moe_layer_freq`` 1), else a dense
SwiGLU MLP of ``intermediate_size``. Routers take their logits in float32 (HF
``DeepseekV2TopkRouter`` / ``DeepseekV3TopkRouter``); V3's add ``e_score_correction_bias``.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import nn

from attnserve.attention.radix_attention import RadixAttention
from attnserve.distributed.group import TPGroup
from attnserve.distributed.partition import q_head_range
from attnserve.forward_batch import ForwardBatch, ForwardMode
from attnserve.models.base import CausalLM, DecoderModel
from attnserve.models.layers.linear import Linear
from attnserve.models.layers.parallel import ColumnParallelLinear, RowParallelLinear
from attnserve.models.layers.norm import RMSNorm
from attnserve.models.layers.rotary import RotaryEmbedding, get_rope, rope_parameters_from_config, yarn_softmax_mscale
from attnserve.models.layers.moe.routing import routing_config_from_hf
from attnserve.models.layers.moe.sparse_block import SparseMoeBlock
from attnserve.models.llama import LlamaDecoderLayer


def layer_is_moe(config: Any, layer_id: int) -> bool:
    """Whether layer ``layer_id`` has routed experts (see the module docstring)."""
    if not getattr(config, "n_routed_experts", None):
        return False
    first_dense = int(getattr(config, "first_k_dense_replace", 0) or 0)
    freq = int(getattr(config, "moe_layer_freq", 1) or 1)
    return layer_id >= first_dense and layer_id % freq == 0


def deepseek_moe_block(config: Any, dtype: torch.dtype, tp: Optional[TPGroup]) -> SparseMoeBlock:
    """The MoE feed-forward of a DeepSeek-V2/V3 layer (HF ``DeepseekV2Moe`` / ``DeepseekV3MoE``).

    Raises:
        ValueError: an unsupported routing method or a ``--tp-size`` that does not divide
            ``moe_intermediate_size``.
    """
    v3 = getattr(config, "model_type", "") == "deepseek_v3"
    inter = int(config.moe_intermediate_size)
    return SparseMoeBlock(config.hidden_size, int(config.n_routed_experts), inter, routing_config_from_hf(config),
                          dtype, tp, shared_intermediate_size=inter * int(getattr(config, "n_shared_experts", 0) or 0),
                          correction_bias=v3, float32_logits=True)


class DeepseekV2AttentionMLA(nn.Module):
    """MLA block (see the module docstring). Parameter names are HF's.

    Shapes: ``positions`` int64 ``[T]``, ``hidden_states`` ``[T, hidden]`` -> ``[T, hidden]``.

    Attributes:
        attn_mha: `RadixAttention` of the extend path: ``H`` query and KV heads,
            ``head_dim = nope + rope``, ``v_head_dim``.
        attn_mqa: `RadixAttention` of the decode path over the latent cache: ``H`` query
            heads, one KV head, ``head_dim = kv_lora_rank + rope``, ``v_head_dim =
            kv_lora_rank``. Both share ``layer_id`` (one latent buffer per layer).
    """

    def __init__(self, config: Any, layer_id: int, rotary_emb: RotaryEmbedding, dtype: torch.dtype,
                 tp: Optional[TPGroup] = None):
        super().__init__()
        tp = tp or TPGroup.single()
        hidden = config.hidden_size
        # tensor parallelism splits the query heads; the latent (one "KV head") is replicated
        heads = q_head_range(config.num_attention_heads, tp.size, tp.rank)
        self.num_heads = heads.count
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        self.kv_lora_rank = int(config.kv_lora_rank)
        self.qk_nope_head_dim = int(config.qk_nope_head_dim)
        self.qk_rope_head_dim = int(config.qk_rope_head_dim)
        self.v_head_dim = int(config.v_head_dim)
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        bias = bool(getattr(config, "attention_bias", False))
        h, nope, rope, r = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank
        # HF builds both low-rank norms (q_a, kv_a) with eps 1e-6, not rms_norm_eps
        if self.q_lora_rank:
            self.q_a_proj = Linear(hidden, self.q_lora_rank, bias=bias, dtype=dtype)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, 1e-6, dtype=dtype)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, [(heads, self.qk_head_dim)], dtype=dtype)
        else:
            self.q_proj = ColumnParallelLinear(hidden, [(heads, self.qk_head_dim)], dtype=dtype)
        self.kv_a_proj_with_mqa = Linear(hidden, r + rope, bias=bias, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(r, 1e-6, dtype=dtype)
        self.kv_b_proj = ColumnParallelLinear(r, [(heads, nope + self.v_head_dim)], dtype=dtype)
        self.o_proj = RowParallelLinear([(heads, self.v_head_dim)], hidden, tp, bias=bias, dtype=dtype)
        self.rotary_emb = rotary_emb
        self.scaling = self.qk_head_dim**-0.5 * yarn_softmax_mscale(rope_parameters_from_config(config))
        self.attn_mha = RadixAttention(h, self.qk_head_dim, self.scaling, num_kv_heads=h, layer_id=layer_id,
                                       v_head_dim=self.v_head_dim)
        self.attn_mqa = RadixAttention(h, r + rope, self.scaling, num_kv_heads=1, layer_id=layer_id, v_head_dim=r)

    # ---- helpers --------------------------------------------------------------------------
    def _w_uk_uv(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """Views of ``kv_b_proj.weight``: ``W_UK`` ``[H, nope, r]`` and ``W_UV`` ``[H, v, r]``."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim :]

    def _expand(self, c_kv: torch.Tensor, k_pe: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Latent -> per-head K/V: ``c_kv`` ``[N, r]``, ``k_pe`` ``[N, rope]`` (rotated) ->
        ``k`` ``[N, H, nope + rope]`` (contiguous) and ``v`` ``[N, H, v_head_dim]`` (a view)."""
        n, h = c_kv.shape[0], self.num_heads
        kv = self.kv_b_proj(c_kv).view(n, h, self.qk_nope_head_dim + self.v_head_dim)
        k = kv.new_empty(n, h, self.qk_head_dim)
        k[..., : self.qk_nope_head_dim] = kv[..., : self.qk_nope_head_dim]
        k[..., self.qk_nope_head_dim :] = k_pe.unsqueeze(1)
        return k, kv[..., self.qk_nope_head_dim :]

    # ---- forward --------------------------------------------------------------------------
    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch: ForwardBatch):
        fb = forward_batch
        t, h = hidden_states.shape[0], self.num_heads
        nope, r = self.qk_nope_head_dim, self.kv_lora_rank
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        else:
            q = self.q_proj(hidden_states)
        q = q.view(t, h, self.qk_head_dim)
        latent = self.kv_a_proj_with_mqa(hidden_states)
        c_kv = self.kv_a_layernorm(latent[:, :r])
        q_pe, k_pe = self.rotary_emb(positions, q[..., nope:], latent[:, r:])  # [T, H, rope], [T, rope]
        expanded, prefix = not fb.forward_mode.is_decode_or_idle(), None
        if expanded and any(fb.extend_prefix_lens_cpu):  # cached prefixes: expanded only where they pay
            plan = self._prefix_plan(fb)
            expanded = plan is not None
            prefix = self._expanded_prefix(plan, fb) if expanded else None
        if expanded:
            out = self._expanded(q[..., :nope], q_pe, c_kv, k_pe, fb, prefix)
        else:
            out = self._absorbed(q[..., :nope], q_pe, torch.cat([c_kv, k_pe], dim=-1), fb)
        return self.o_proj(out)

    def _prefix_plan(self, fb: ForwardBatch):
        """The step's `ExpandedPrefixPlan` when its cached prefixes go the expanded way
        (`mla_expanded_prefix`: plain EXTEND steps where the cost rule says so), else None;
        decided by the first MLA layer and cached on ``fb`` for the others."""
        from attnserve.attention.mla_expanded_prefix import expanded_prefix_worthwhile, plan_expanded_prefix

        if fb.mla_prefix_plan is None:
            ok = (fb.forward_mode == ForwardMode.EXTEND and fb.spec_info is None and fb.req_to_token_pool is not None
                  and expanded_prefix_worthwhile(fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu, self.num_heads,
                                                 self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim,
                                                 self.v_head_dim, self.kv_b_proj.weight.element_size()))
            fb.mla_prefix_plan = (plan_expanded_prefix(fb.extend_prefix_lens_cpu, fb.req_pool_indices,
                                                       fb.req_to_token_pool.req_to_token, fb.extend_prefix_lens)
                                  if ok else False)
        return fb.mla_prefix_plan or None

    def _expanded_prefix(self, plan, fb: ForwardBatch):
        """Per-head K / V of the cached prefixes (`mla_expanded_prefix.ExpandedPrefix`)."""
        from attnserve.attention.mla_expanded_prefix import ExpandedPrefix, gather_prefix_latent

        latent = gather_prefix_latent(fb.token_to_kv_pool.get_key_buffer(self.attn_mqa.layer_id), plan,
                                      self.attn_mqa.k_scale, self.kv_b_proj.weight.dtype)
        k, v = self._expand(latent[:, : self.kv_lora_rank], latent[:, self.kv_lora_rank :])
        return ExpandedPrefix(k, v, plan)

    def _absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """Attention over the latent cache (decode, and extend with cached prefixes): the
        backend stores ``latent`` ``[T, kv_lora_rank + rope]``; returns ``[T, H * v_head_dim]``."""
        t, h, r = q_nope.shape[0], self.num_heads, self.kv_lora_rank
        w_uk, w_uv = self._w_uk_uv()
        q = q_nope.new_empty(t, h, r + self.qk_rope_head_dim)
        q[..., :r] = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [H, T, nope] x [H, nope, r]
        q[..., r:] = q_pe
        o = self.attn_mqa(q.view(t, -1), latent, None, fb).view(t, h, r)
        out = torch.bmm(o.transpose(0, 1), w_uv.transpose(1, 2))  # [H, T, r] x [H, r, v] -> [H, T, v]
        return out.transpose(0, 1).reshape(t, h * self.v_head_dim)

    def _expanded(self, q_nope, q_pe, c_kv, k_pe, fb: ForwardBatch, prefix=None) -> torch.Tensor:
        """Per-head K/V of the new tokens (cheaper head dims than the absorbed form) and,
        with ``prefix`` (`ExpandedPrefix`), of the cached prefixes; the latent is stored
        here. ``[T, H * v_head_dim]``."""
        t, h = q_nope.shape[0], self.num_heads
        fb.token_to_kv_pool.set_mla_kv_buffer(self.attn_mqa, fb.out_cache_loc, c_kv.unsqueeze(1), k_pe.unsqueeze(1))
        q = torch.cat([q_nope, q_pe], dim=-1)
        k, v = self._expand(c_kv, k_pe)
        kwargs = {} if prefix is None else {"prefix_kv": prefix}
        o = self.attn_mha(q.view(t, -1), k, v, fb, save_kv_cache=False, **kwargs)
        return o.view(t, h * self.v_head_dim)


class DeepseekV2DecoderLayer(LlamaDecoderLayer):
    """Pre-norm block: MLA then a dense SwiGLU MLP or a `SparseMoeBlock` (``forward`` and
    the norms are Llama's)."""

    def _make_attention(self, config: Any, layer_id: int, rotary_emb: RotaryEmbedding, dtype: torch.dtype,
                        tp: Optional[TPGroup]) -> nn.Module:
        return DeepseekV2AttentionMLA(config, layer_id, rotary_emb, dtype, tp)

    def _make_mlp(self, config: Any, layer_id: int, dtype: torch.dtype, tp: Optional[TPGroup]) -> nn.Module:
        if layer_is_moe(config, layer_id):
            return deepseek_moe_block(config, dtype, tp)
        return super()._make_mlp(config, layer_id, dtype, tp)


class DeepseekV2Model(DecoderModel):
    """Embedding, decoder layers, final norm (HF prefix ``model.``); one shared RoPE table
    over the ``qk_rope_head_dim`` channels, interleaved pairs (see the module docstring)."""

    decoder_layer_cls = DeepseekV2DecoderLayer

    def _neox_rope(self, config: Any) -> bool:
        return False

    def _init_rope(self, config: Any, dtype: torch.dtype) -> None:
        rope = int(config.qk_rope_head_dim)
        self.rotary_emb = get_rope(rope, int(getattr(config, "max_position_embeddings", 4096)),
                                   rope_parameters_from_config(config), rotary_dim=rope,
                                   is_neox_style=self._neox_rope(config))


class DeepseekV3Model(DeepseekV2Model):
    """V3's body: ``rope_interleave=False`` selects half-split (neox) rotation, the default
    ``True`` interleaved pairs."""

    def _neox_rope(self, config: Any) -> bool:
        return getattr(config, "rope_interleave", True) is False


class DeepseekV2ForCausalLM(CausalLM):
    """DeepSeek-V2 causal LM for the engine.

    Args:
        config: HF ``DeepseekV2Config``-like: ``hidden_size``, ``intermediate_size``,
            ``num_hidden_layers``, ``num_attention_heads``, ``q_lora_rank`` (None: plain
            ``q_proj``), ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``,
            ``v_head_dim``, ``rms_norm_eps``, ``rope_parameters`` / ``rope_theta`` +
            ``rope_scaling`` (default or yarn), ``max_position_embeddings``,
            ``vocab_size``, ``tie_word_embeddings``, ``attention_bias``, ``mlp_bias``,
            ``hidden_act`` (silu), MoE fields (``n_routed_experts``, ``num_experts_per_tok``,
            ``moe_intermediate_size``, ``n_shared_experts``, ``first_k_dense_replace``,
            ``moe_layer_freq``, ``topk_method``, ``n_group``, ``topk_group``,
            ``norm_topk_prob``, ``routed_scaling_factor``).
        dtype: parameter dtype (parameters are uninitialised until `load_weights` or
            `init_dummy_weights`; built on the current default device).

    Raises:
        ValueError: an unsupported routing method, a ``--tp-size`` that does not divide an
            intermediate size, or an activation other than silu.

    The KV cache is an `MLATokenToKVPool` of ``kv_lora_rank + qk_rope_head_dim`` per token
    and layer (`ModelConfig` reports ``attention_arch == "mla"``).
    """

    model_cls = DeepseekV2Model
    #: MLA's projections are not fused; only the dense and shared-expert MLPs are
    packed_modules_mapping = {"gate_up_proj": (("gate_proj", 0), ("up_proj", 1))}
    #: V3 checkpoints carry a multi-token-prediction layer past ``num_hidden_layers``
    skip_extra_layers = True

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32, tp: Optional[TPGroup] = None):
        act = getattr(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"DeepSeek MLP activation {act!r} is not supported (only silu)")
        super().__init__(config, dtype, tp)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 layout: same MLA as V2, sigmoid routing with a correction bias; ``rope_interleave=False``
    selects half-split (neox) rotation, the default ``True`` interleaved pairs."""

    model_cls = DeepseekV3Model


EntryClass = [DeepseekV2ForCausalLM, DeepseekV3ForCausalLM]
