"""`torch_native`: the reference attention backend in plain PyTorch (CPU and CUDA).

Per request it gathers K/V through ``req_to_token`` from the paged pool (no private copy
of the cache), computes ``softmax(q kᵀ · sm_scale [soft-capped] + mask) v`` in float32
and writes the result in the query dtype. It is the correctness oracle of the other
backends and the default on CPU; it cannot be captured in CUDA graphs.

Masking: query at absolute position ``p`` sees key positions ``k`` with ``k <= p`` and,
when ``layer.sliding_window_size > 0``, ``k >= p - sliding_window_size``; keys older than
the earliest visible one are never gathered. ``spec_info.custom_mask`` (flat bool, per
request ``[extend_len, seq_len]`` at ``spec_info.mask_indptr[i]``) replaces the causal mask
for TARGET_VERIFY steps.

Attention sinks (`RadixAttention.sinks`, gpt-oss; `attnserve.attention.sinks`): one more
score column per query head, ``sinks[h]`` (never soft-capped), joins the softmax and is
dropped after it (HF transformers' gpt_oss ``eager_attention_forward``), in decode and in
every extend mode. Layers without sinks compute exactly what they did before.

MLA models (`attnserve.attention.mla_paths`): the latent layer goes through the generic
path (one KV head of ``kv_lora_rank + rope`` in the latent pool, values = its first
``kv_lora_rank`` columns), in decode and in extend; the expanded layer of a prefix-free
extend attends over the new tokens' per-head K/V only (`_run_new_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from attnserve.attention.backend_config import AttentionBackendConfig, normalize_window
from attnserve.attention.base import AttentionBackend
from attnserve.attention.mla_paths import check_prefix_free, is_latent_layer
from attnserve.attention.registry import register_attention_backend
from attnserve.attention.sinks import layer_sinks, refuse_sinks, softmax_with_sinks
from attnserve.forward_batch import ForwardBatch
from attnserve.mem_cache.kv_quant import dequantize_kv


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    sm_scale: float,
    logit_cap: float = 0.0,
    sliding_window_size: int = -1,
    custom_mask: Optional[torch.Tensor] = None,
    compute_dtype: torch.dtype = torch.float32,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Dense masked attention of one request.

    Args:
        q: ``[Lq, Hq, Dk]``; k: ``[Lk, Hkv, Dk]``; v: ``[Lk, Hkv, Dv]`` with ``Hq % Hkv == 0``
            (query head h uses KV head ``h // (Hq // Hkv)``).
        q_positions / k_positions: int ``[Lq]`` / ``[Lk]`` absolute positions.
        sm_scale: softmax scale; logit_cap: tanh soft cap if > 0.
        sliding_window_size: see module doc (-1 or None: none; 0 is a ValueError).
        custom_mask: bool ``[Lq, Lk]`` (True = visible) replacing the causal mask.
        compute_dtype: float32 (engine) or float64 (tests).
        sinks: None, or ``[Hq]`` per-head sink logits (units of the scaled scores, not
            capped): one extra softmax column of value 0 (`attnserve.attention.sinks`).

    Returns:
        ``[Lq, Hq, Dv]`` in ``compute_dtype``; rows with no visible key are 0.
    """
    group = q.shape[1] // k.shape[1]
    qf = q.to(compute_dtype).transpose(0, 1)  # [Hq, Lq, D]
    kf = k.to(compute_dtype).repeat_interleave(group, dim=1).transpose(0, 1)
    vf = v.to(compute_dtype).repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * sm_scale  # [Hq, Lq, Lk]
    if logit_cap and logit_cap > 0:
        scores = logit_cap * torch.tanh(scores / logit_cap)
    if custom_mask is not None:
        visible = custom_mask.to(torch.bool)
    else:
        visible = k_positions[None, :] <= q_positions[:, None]
    window = normalize_window(sliding_window_size)
    if window > 0:
        visible = visible & (k_positions[None, :] >= q_positions[:, None] - window)
    scores = scores.masked_fill(~visible[None], float("-inf"))
    if sinks is not None:
        probs = softmax_with_sinks(scores, sinks.to(compute_dtype).view(-1, 1, 1))
    else:
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all-masked rows -> 0
    return torch.matmul(probs, vf).transpose(0, 1)


@dataclass
class DecodeGatherPlan:
    """Which pool rows a decode step gathers, shared by every layer of one window size.

    Attributes:
        width: ``W``, the longest visible span of the batch.
        flat: int64 ``[bs * W]`` slots, request-major. Padding re-reads the request's
            newest slot (written this step, so finite), never the dummy slot 0, which may
            hold anything: masked scores then never meet a NaN value row.
        score_mask: bool ``[bs, 1, 1, W]``, True where the gathered key is visible;
        attn_bias: float32 ``[bs, 1, 1, W]``, 0 where visible and -inf elsewhere (SDPA's
            additive mask, built once a step instead of converted from the bool mask in
            every layer).
    """

    width: int
    flat: torch.Tensor
    score_mask: torch.Tensor
    attn_bias: torch.Tensor

    @classmethod
    def build(cls, fb: ForwardBatch, window: int, device) -> "DecodeGatherPlan":
        seq_lens_cpu = fb.seq_lens_cpu if fb.seq_lens_cpu is not None else fb.seq_lens.cpu()
        first_cpu = torch.clamp(seq_lens_cpu - 1 - window, min=0) if window >= 0 else torch.zeros_like(seq_lens_cpu)
        width = int((seq_lens_cpu - first_cpu).max())
        first = first_cpu.to(device=device, dtype=torch.int64)
        pos = first[:, None] + torch.arange(width, device=device)[None, :]  # [bs, W]
        valid = pos < fb.seq_lens.to(torch.int64)[:, None]
        r2t = fb.req_to_token_pool.req_to_token
        slots = r2t[fb.req_pool_indices[:, None], pos.clamp(max=r2t.shape[1] - 1)].to(torch.int64)
        newest = r2t[fb.req_pool_indices, fb.seq_lens.to(torch.int64) - 1].to(torch.int64)
        flat = torch.where(valid, slots, newest[:, None]).flatten()
        score_mask = valid[:, None, None, :]
        attn_bias = torch.zeros(score_mask.shape, dtype=torch.float32, device=device).masked_fill_(
            ~score_mask, float("-inf"))
        return cls(width, flat, score_mask, attn_bias)


@register_attention_backend("torch_native")
class TorchNativeAttnBackend(AttentionBackend):
    """Reference backend: loops over requests, dense math in float32 (MHA and MLA models).

    Args:
        config: `AttentionBackendConfig` (only ``attention_arch`` and ``head_dim`` /
            ``v_head_dim`` are read, to tell MLA's two layers apart).
    """

    supports_fp8_kv = True

    supported_archs = ("mha", "mla")
    supported_devices = ("cpu", "cuda")

    def __init__(self, config: AttentionBackendConfig):
        super().__init__(config)
        self.check_config()
        self._plans_for: Optional[ForwardBatch] = None
        self._plans: dict = {}

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Nothing to precompute eagerly; decode gather plans are built on first use per
        window size and shared by all layers of the step (`_decode_plan`)."""
        if forward_batch.seq_lens_cpu is None:
            forward_batch.seq_lens_cpu = forward_batch.seq_lens.cpu()
        self._plans_for = forward_batch
        self._plans = {}

    def _decode_plan(self, fb: ForwardBatch, window: int, device) -> "DecodeGatherPlan":
        """The step's gather plan for layers with sliding window ``window`` (-1: none)."""
        if self._plans_for is not fb:
            self._plans_for, self._plans = fb, {}
        plan = self._plans.get(window)
        if plan is None:
            plan = self._plans[window] = DecodeGatherPlan.build(fb, window, device)
        return plan

    def _run(self, q, k, v, layer, fb: ForwardBatch, save_kv_cache: bool) -> torch.Tensor:
        if save_kv_cache and k is not None:
            fb.token_to_kv_pool.set_kv_buffer(layer, fb.out_cache_loc, k, v)
        lid = layer.layer_id
        k_buf = fb.token_to_kv_pool.get_key_buffer(lid)
        v_buf = fb.token_to_kv_pool.get_value_buffer(lid)
        q = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        out = q.new_empty(q.shape[0], layer.tp_q_head_num, layer.v_head_dim)
        req_to_token = fb.req_to_token_pool.req_to_token
        seq_lens = fb.seq_lens_cpu.tolist() if fb.seq_lens_cpu is not None else fb.seq_lens.tolist()
        if fb.forward_mode.is_decode():
            extend_lens = [1] * fb.batch_size
        else:
            extend_lens = fb.extend_seq_lens_cpu
        rows = fb.req_pool_indices.tolist()
        spec = fb.spec_info
        custom_mask = spec.custom_mask if spec is not None else None
        window = layer.sliding_window_size
        sinks = layer_sinks(layer)
        start = 0
        for i, (row, seq_len, ext) in enumerate(zip(rows, seq_lens, extend_lens)):
            q_pos = torch.arange(seq_len - ext, seq_len, device=q.device)
            # Never gather keys that no query of this request can see.
            k_first = 0
            if window >= 0 and custom_mask is None:
                k_first = max(0, seq_len - ext - window)
            k_pos = torch.arange(k_first, seq_len, device=q.device)
            slots = req_to_token[row, k_first:seq_len].to(torch.int64)
            mask = None
            if custom_mask is not None:
                off = int(spec.mask_indptr[i])
                if spec.mask_covers_prefix:
                    mask = custom_mask[off : off + ext * seq_len].view(ext, seq_len)
                else:  # [ext, ext] over the new tokens; the prefix is visible
                    mask = torch.ones(ext, seq_len, dtype=torch.bool, device=q.device)
                    mask[:, seq_len - ext:] = custom_mask[off : off + ext * ext].view(ext, ext)
            o = attention_reference(
                q[start : start + ext],
                dequantize_kv(k_buf[slots], layer.k_scale),
                dequantize_kv(v_buf[slots], layer.v_scale),
                q_pos,
                k_pos,
                layer.scaling,
                layer.logit_cap,
                window,
                mask,
                sinks=sinks,
            )
            out[start : start + ext] = o.to(out.dtype)
            start += ext
        return out.view(-1, layer.tp_q_head_num * layer.v_head_dim)

    def forward_decode(self, q, k, v, layer, forward_batch: ForwardBatch, save_kv_cache: bool = True, **kwargs):
        fb = forward_batch
        if self.config.is_mla:
            refuse_sinks(layer, self.name)
        if fb.spec_info is not None and fb.spec_info.custom_mask is not None:
            return self._run(q, k, v, layer, fb, save_kv_cache)
        if save_kv_cache and k is not None:
            fb.token_to_kv_pool.set_kv_buffer(layer, fb.out_cache_loc, k, v)
        return self._decode_batched(q, layer, fb)

    def _decode_batched(self, q, layer, fb: ForwardBatch) -> torch.Tensor:
        """All decode queries at once: gather each request's visible keys into a padded
        ``[bs, W, Hkv, D]`` block (W = longest visible span, one ``index_select`` each for
        K and V) and attend in float32 over (request, KV head), the query heads of a group
        side by side as the query rows (no repeated K/V). Without a logit cap this is
        `torch.nn.functional.scaled_dot_product_attention` with the padding masked (on
        the CPU its fused kernel is ~4x the separate ops at batch 16); with one, the same
        math as `attention_reference` as batched matmuls (also with sinks: one more score
        column ``sinks[h]`` per query row, `softmax_with_sinks`)."""
        lid = layer.layer_id
        k_buf = fb.token_to_kv_pool.get_key_buffer(lid)
        v_buf = fb.token_to_kv_pool.get_value_buffer(lid)
        bs, hkv = fb.batch_size, layer.tp_k_head_num
        group = layer.tp_q_head_num // hkv
        plan = self._decode_plan(fb, layer.sliding_window_size, q.device)
        width = plan.width
        kf = dequantize_kv(k_buf.index_select(0, plan.flat), layer.k_scale, torch.float32).view(
            bs, width, hkv, -1)  # [bs, W, Hkv, Dk]
        vf = dequantize_kv(v_buf.index_select(0, plan.flat), layer.v_scale, torch.float32).view(bs, width, hkv, -1)
        qf = q.view(bs, hkv, group, layer.qk_head_dim).float()
        sinks = layer_sinks(layer)
        if not (layer.logit_cap and layer.logit_cap > 0) and sinks is None:
            out = torch.nn.functional.scaled_dot_product_attention(
                qf, kf.transpose(1, 2), vf.transpose(1, 2), attn_mask=plan.attn_bias, scale=layer.scaling)
            return out.reshape(bs, layer.tp_q_head_num * layer.v_head_dim).to(q.dtype)
        scores = torch.matmul(qf, kf.permute(0, 2, 3, 1)) * layer.scaling  # [bs, Hkv, group, W]
        if layer.logit_cap and layer.logit_cap > 0:
            scores = layer.logit_cap * torch.tanh(scores / layer.logit_cap)
        scores = torch.where(plan.score_mask, scores, float("-inf"))
        if sinks is not None:  # query head h = kv_head * group + g, as in qf's view
            probs = softmax_with_sinks(scores, sinks.float().view(1, hkv, group, 1))
        else:
            probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs, vf.transpose(1, 2))  # [bs, Hkv, group, Dv]
        return out.reshape(bs, layer.tp_q_head_num * layer.v_head_dim).to(q.dtype)

    def forward_extend(self, q, k, v, layer, forward_batch: ForwardBatch, save_kv_cache: bool = True,
                       prefix_kv=None, **kwargs):
        if self.config.is_mla:
            refuse_sinks(layer, self.name)
            if is_latent_layer(layer, self.config):
                k = k.view(-1, 1, layer.qk_head_dim)
                v = k[..., : layer.v_head_dim]
            else:
                if prefix_kv is None:
                    check_prefix_free(layer, forward_batch, self.name)
                return self._run_new_tokens(q, k, v, layer, forward_batch, prefix_kv)
        return self._run(q, k, v, layer, forward_batch, save_kv_cache)

    def _run_new_tokens(self, q, k, v, layer, fb: ForwardBatch, prefix_kv=None) -> torch.Tensor:
        """Extend whose keys are the step's new tokens and, with ``prefix_kv``
        (`mla_expanded_prefix.ExpandedPrefix`), the cached prefixes the model expanded (MLA's
        expanded layer; nothing is read from or written to the pool).

        Args:
            q: ``[T, Hq * Dk]``; k: ``[T, Hkv, Dk]``; v: ``[T, Hkv, Dv]``; ``prefix_kv.k`` /
            ``.v`` ``[P, Hkv, Dk / Dv]`` at offsets ``prefix_kv.plan.kv_indptr``.

        Returns:
            ``[T, Hq * Dv]`` in ``q``'s dtype; causal (or ``spec_info.custom_mask``),
            window and logit cap as in `_run`.
        """
        q = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        k = k.view(-1, layer.tp_k_head_num, layer.qk_head_dim)
        v = v.view(-1, layer.tp_v_head_num, layer.v_head_dim)
        out = q.new_empty(q.shape[0], layer.tp_q_head_num, layer.v_head_dim)
        spec = fb.spec_info
        custom_mask = spec.custom_mask if spec is not None else None
        bounds = prefix_kv.plan.kv_indptr.tolist() if prefix_kv is not None else None
        start = 0
        for i, ext in enumerate(fb.extend_seq_lens_cpu):
            sl = slice(start, start + ext)
            ki, vi, p = k[sl], v[sl], 0
            if bounds is not None and bounds[i + 1] > bounds[i]:
                rows = slice(bounds[i], bounds[i + 1])
                p = bounds[i + 1] - bounds[i]
                ki, vi = torch.cat([prefix_kv.k[rows], ki]), torch.cat([prefix_kv.v[rows], vi])
            q_pos = torch.arange(p, p + ext, device=q.device)
            mask = None
            if custom_mask is not None:
                off = int(spec.mask_indptr[i])
                mask = custom_mask[off : off + ext * ext].view(ext, ext)
            o = attention_reference(q[sl], ki, vi, q_pos, torch.arange(p + ext, device=q.device), layer.scaling,
                                    layer.logit_cap, layer.sliding_window_size, mask)
            out[sl] = o.to(out.dtype)
            start += ext
        return out.view(-1, layer.tp_q_head_num * layer.v_head_dim)
