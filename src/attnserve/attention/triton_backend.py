"""`triton`: the portable GPU backend (paged split-K decode, extend with prefix and masks).

Per step, `init_forward_metadata` builds CSR indices on the device from ``req_to_token``:

* DECODE: ``kv_indptr``/``kv_indices`` over each request's whole sequence and a
  per-request ``num_kv_splits``; the kernel is two-stage flash-decoding
  (`decode_attention_fwd`).
* EXTEND / MIXED / TARGET_VERIFY / DRAFT_EXTEND: ``kv_indptr``/``kv_indices`` over the
  cached prefix only, ``qo_indptr`` over the new tokens, and for TARGET_VERIFY the
  ``custom_mask`` of the speculative tree; one kernel attends to prefix and new tokens
  with an online softmax (`extend_attention_fwd`).

Sliding-window layers get their own indices that start at the window (keys no query can
see are never read): for decode ``window+1`` keys, for extend the prefix from
``prefix_len - window``; one set per distinct window of ``config.layer_windows``, so a
layer whose window is not listed there is a clear error.

Attention sinks (`RadixAttention.sinks`, gpt-oss): the layer's tensor is passed to both
kernels at every forward (decode, extend and the speculative modes, which run the extend
kernel), so a captured decode graph reads it by pointer; see `attnserve.attention.sinks`.
Extend launches with sinks never take the Gluon prefill kernels.

MLA models use ``triton_mla`` (`attnserve.attention.triton_mla_backend`), which reuses
the extend path here over the latent pool.

CUDA graphs: `init_cuda_graph_state` allocates fixed buffers sized for ``max_bs``; the
capture/replay hooks refill them in place (no allocation, no host synchronisation), and
padded rows use ``seq_len`` 1 (`get_cuda_graph_seq_len_fill_value`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

import torch

from attnserve.attention.backend_config import AttentionBackendConfig
from attnserve.attention.base import AttentionBackend
from attnserve.attention.registry import register_attention_backend
from attnserve.attention.sinks import layer_sinks
from attnserve.forward_batch import ForwardBatch, ForwardMode
from attnserve.mem_cache.kv_quant import is_fp8

@dataclass
class WindowIndices:
    """Indices of the layers with one sliding window: keys start at ``kv_start`` (int32
    ``[bs]``); decode splits (``num_kv_splits``) are sized for the window, not the sequence."""

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_start: torch.Tensor
    num_kv_splits: Optional[torch.Tensor] = None


@dataclass
class TritonForwardMetadata:
    """Per-step metadata of the triton backend (tensors on the device).

    Attributes:
        kv_indptr / kv_indices: int32 CSR over KV slots (decode: whole sequence; extend:
            cached prefix only).
        qo_indptr: int32 ``[bs+1]`` offsets of each request's new tokens (extend).
        num_kv_splits: int32 ``[bs]`` split-K partitions per request (decode).
        attn_logits / attn_lse: float32 split scratch (decode).
        max_extend_len: longest new-token run (extend grid size).
        has_prefix: some request of the extend batch has a cached prefix (host flag:
            the extend kernel's tiles).
        custom_mask / mask_indptr: speculative tree masks (TARGET_VERIFY) or None.
        windows: window size -> its indices, one entry per distinct window of the model.
    """

    kv_indptr: Optional[torch.Tensor]
    kv_indices: Optional[torch.Tensor]
    qo_indptr: Optional[torch.Tensor] = None
    num_kv_splits: Optional[torch.Tensor] = None
    attn_logits: Optional[torch.Tensor] = None
    attn_lse: Optional[torch.Tensor] = None
    max_extend_len: int = 0
    has_prefix: bool = True
    custom_mask: Optional[torch.Tensor] = None
    mask_indptr: Optional[torch.Tensor] = None
    mask_covers_prefix: bool = True
    windows: Dict[int, WindowIndices] = field(default_factory=dict)


@dataclass
class WindowGraphBuffers:
    """Fixed decode buffers of one window size (CUDA graphs)."""

    kv_indptr: torch.Tensor  # int32 [max_bs + 1]
    kv_indices: torch.Tensor  # int32 [max_bs * (window + 1)]
    kv_start: torch.Tensor  # int32 [max_bs]
    num_kv_splits: torch.Tensor  # int32 [max_bs]


@dataclass
class TritonGraphBuffers:
    """Fixed decode metadata buffers that captured graphs read (sized for ``max_bs``)."""

    kv_indptr: torch.Tensor  # int32 [max_bs + 1]
    kv_indices: torch.Tensor  # int32 [pool slots + max_bs * page_size]
    num_kv_splits: torch.Tensor  # int32 [max_bs]
    attn_logits: torch.Tensor  # float32 [max_bs, Hq, num_kv_splits, Dv]
    attn_lse: torch.Tensor  # float32 [max_bs, Hq, num_kv_splits]
    qo_indptr: torch.Tensor  # int32 [max_bs + 1] (TARGET_VERIFY: multiples of the node count)
    arange: torch.Tensor  # int32 [max_bs + 1] = 0, 1, 2, ...
    windows: Dict[int, WindowGraphBuffers] = field(default_factory=dict)


def _cumsum_indptr(lens: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    from attnserve.attention.triton_ops.kv_indices import compute_kv_indptr

    return compute_kv_indptr(lens, out)


def kv_scales(layer, k_buffer: torch.Tensor) -> dict:
    """The layer's ``k_scale`` / ``v_scale`` for the kernels when the cache is FP8; 1.0 for a
    16/32-bit cache, which stores true values (`RadixAttention` attributes)."""
    if is_fp8(k_buffer.dtype):
        return {"k_scale": layer.k_scale, "v_scale": layer.v_scale}
    return {"k_scale": 1.0, "v_scale": 1.0}


def missing_window_error(layer, windows) -> ValueError:
    """The error of a layer whose sliding window the backend has no indices for."""
    known = ", ".join(map(str, windows)) or "none"
    return ValueError(
        f"layer {layer.layer_id} has sliding window {layer.sliding_window_size} but the attention backend was "
        f"built for windows [{known}]; AttentionBackendConfig.layer_windows must list every layer's window"
    )


def require_triton(config: AttentionBackendConfig, name: str) -> None:
    """Raise RuntimeError unless Triton is importable and the device can run it."""
    from attnserve.triton_env import triton_interpreting

    import importlib.util

    if importlib.util.find_spec("triton") is None:  # pragma: no cover - depends on the install  # pragma: no cover - depends on the install
        raise RuntimeError(f"the '{name}' attention backend needs the triton package: pip install triton")
    if config.device.type != "cuda" and not triton_interpreting():
        raise RuntimeError(f"the '{name}' attention backend needs a CUDA GPU (or TRITON_INTERPRET=1 for tests)")


@register_attention_backend("triton")
class TritonAttnBackend(AttentionBackend):
    """Triton paged-attention backend (MHA/GQA/MQA models).

    Args:
        config: `AttentionBackendConfig` with pools attached.

    Raises:
        RuntimeError: Triton is not importable, or the device is not a GPU and the Triton
            interpreter (``TRITON_INTERPRET=1``) is not enabled.
        ValueError: an MLA model (use ``triton_mla``).
    """

    supports_cuda_graph = True
    supports_verify_cuda_graph = True
    supports_fp8_kv = True
    #: the replay hook launches only index kernels on fixed buffers (no host reads, no
    #: allocation outside the graph pool), so `CudaGraphRunner` records it in the graph
    replay_hook_is_capturable = True

    def __init__(self, config: AttentionBackendConfig):
        super().__init__(config)
        self.check_config()
        require_triton(config, self.name)
        self.device = config.device
        self.num_q_heads = config.num_q_heads
        self.num_kv_heads = config.num_kv_heads
        self.v_head_dim = config.v_head_dim
        self.window_sizes = config.window_sizes
        self.req_to_token = config.req_to_token_pool.req_to_token
        self.page_size = config.page_size
        self.deterministic = config.deterministic
        self.max_kv_splits = config.num_kv_splits
        self.split_tile_size = config.split_tile_size
        self.num_sms = config.resolved_num_sms()
        from attnserve.attention.triton_ops.decode_splits import ragged_factor_from_env

        self.ragged_factor = ragged_factor_from_env()
        self.max_total_num_tokens = config.max_total_num_tokens
        self.forward_metadata: Optional[TritonForwardMetadata] = None
        self.graph: Optional[TritonGraphBuffers] = None

    # ---- metadata ----------------------------------------------------------------------
    def _num_kv_splits(self, seq_lens: torch.Tensor, out: torch.Tensor) -> None:
        from attnserve.attention.triton_ops.decode_splits import SMALL_SPLIT_TOKENS, compute_num_kv_splits
        from attnserve.attention.triton_ops.decode_tuning import small_batch_rule_enabled

        small = SMALL_SPLIT_TOKENS if small_batch_rule_enabled() and not self.deterministic else 0
        compute_num_kv_splits(seq_lens, out, self.max_kv_splits, self.num_sms, self.num_kv_heads,
                              deterministic=self.deterministic, split_tile_size=self.split_tile_size,
                              small_split_tokens=small, ragged_factor=self.ragged_factor)

    def _build_indices(self, req_pool_indices, lens, start=None, indptr_out=None, indices_out=None, total=None):
        from attnserve.attention.triton_ops.kv_indices import create_kv_indices

        kv_indptr = _cumsum_indptr(lens, indptr_out)
        if indices_out is None:
            indices_out = torch.empty(total, dtype=torch.int32, device=self.device)
        create_kv_indices(self.req_to_token, req_pool_indices, lens, kv_indptr, start, indices_out)
        return kv_indptr, indices_out

    def _window_decode(self, w: int, req_pool_indices, seq_lens, out: Optional[WindowGraphBuffers] = None,
                       total: int = 0) -> WindowIndices:
        win_lens = torch.clamp(seq_lens, max=w + 1)
        start = (seq_lens - win_lens).to(torch.int32)
        n = seq_lens.numel()
        if out is not None:
            out.kv_start[:n].copy_(start)
            start = out.kv_start[:n]
        indptr, indices = self._build_indices(
            req_pool_indices, win_lens.to(torch.int32), start,
            indptr_out=None if out is None else out.kv_indptr[: n + 1],
            indices_out=None if out is None else out.kv_indices, total=total,
        )
        splits = torch.empty(n, dtype=torch.int32, device=self.device) if out is None else out.num_kv_splits[:n]
        self._num_kv_splits(win_lens.to(torch.int32), splits)
        return WindowIndices(indptr, indices, start, splits)

    def _init_decode_metadata(self, fb: ForwardBatch, rows, seq_lens) -> TritonForwardMetadata:
        bs = fb.batch_size
        kv_indptr, kv_indices = self._build_indices(rows, seq_lens, total=fb.seq_lens_sum)
        num_kv_splits = torch.empty(bs, dtype=torch.int32, device=self.device)
        self._num_kv_splits(seq_lens, num_kv_splits)
        md = TritonForwardMetadata(
            kv_indptr, kv_indices, num_kv_splits=num_kv_splits,
            attn_logits=torch.empty(bs, self.num_q_heads, self.max_kv_splits, self.v_head_dim,
                                    dtype=torch.float32, device=self.device),
            attn_lse=torch.empty(bs, self.num_q_heads, self.max_kv_splits, dtype=torch.float32, device=self.device),
        )
        if self.window_sizes:
            host_lens = fb.seq_lens_cpu.tolist()
            for w in self.window_sizes:
                total = sum(min(s, w + 1) for s in host_lens)
                md.windows[w] = self._window_decode(w, rows, seq_lens, total=total)
        return md

    def _init_extend_metadata(self, fb: ForwardBatch, rows) -> TritonForwardMetadata:
        prefix = fb.extend_prefix_lens.to(torch.int32)
        kv_indptr, kv_indices = self._build_indices(rows, prefix, total=sum(fb.extend_prefix_lens_cpu))
        qo_indptr = _cumsum_indptr(fb.extend_seq_lens.to(torch.int32))
        md = TritonForwardMetadata(kv_indptr, kv_indices, qo_indptr=qo_indptr,
                                   max_extend_len=max(fb.extend_seq_lens_cpu),
                                   has_prefix=any(fb.extend_prefix_lens_cpu))
        spec = fb.spec_info
        if spec is not None and spec.custom_mask is not None:
            md.custom_mask = spec.custom_mask
            md.mask_indptr = spec.mask_indptr.to(device=self.device, dtype=torch.int64)
            md.mask_covers_prefix = spec.mask_covers_prefix
        for w in self.window_sizes:
            start = torch.clamp(prefix - w, min=0).to(torch.int32)
            win_prefix = (prefix - start).to(torch.int32)
            total = sum(p - max(0, p - w) for p in fb.extend_prefix_lens_cpu)
            indptr, indices = self._build_indices(rows, win_prefix, start, total=total)
            md.windows[w] = WindowIndices(indptr, indices, start)
        return md

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        if fb.forward_mode.is_idle():
            self.forward_metadata = None
            return
        rows = fb.req_pool_indices
        if fb.forward_mode.is_decode():
            self.forward_metadata = self._init_decode_metadata(fb, rows, fb.seq_lens.to(torch.int32))
        else:  # extend-like modes: prefix through the cache, new tokens directly
            self.forward_metadata = self._init_extend_metadata(fb, rows)

    def _window_of(self, layer, md: TritonForwardMetadata) -> Optional[WindowIndices]:
        """The layer's window indices, or None for a full-attention layer.

        Raises:
            ValueError: a window layer the backend was not configured for.
        """
        w = layer.sliding_window_size
        if w < 0:
            return None
        win = md.windows.get(w)
        if win is None:
            raise missing_window_error(layer, self.window_sizes)
        return win

    # ---- kernels -----------------------------------------------------------------------
    def forward_extend(self, q, k, v, layer, forward_batch: ForwardBatch, save_kv_cache: bool = True, **kwargs):
        fb = forward_batch
        pool = fb.token_to_kv_pool
        if save_kv_cache and k is not None:
            pool.set_kv_buffer(layer, fb.out_cache_loc, k, v)
        return self._extend(q, k, v, layer, pool.get_key_buffer(layer.layer_id),
                            pool.get_value_buffer(layer.layer_id), self.forward_metadata)

    def _extend(self, q, k, v, layer, k_buffer, v_buffer, md: TritonForwardMetadata,
                kv_indices: Optional[torch.Tensor] = None, kv_indptr: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Run the extend kernel: new tokens ``k``/``v`` ``[T, Hkv, D]``, prefix from the
        buffers through the step's (or the given) CSR; ``[T, Hq * Dv]``."""
        from attnserve.attention.triton_ops.extend_attention import extend_attention_fwd

        hq, dv = layer.tp_q_head_num, layer.v_head_dim
        q3 = q.view(-1, hq, layer.qk_head_dim)
        o = q.new_empty(q3.shape[0], hq, dv)
        kv_indptr, start = (md.kv_indptr if kv_indptr is None else kv_indptr), None
        kv_indices = md.kv_indices if kv_indices is None else kv_indices
        win = self._window_of(layer, md)
        if win is not None:
            kv_indptr, kv_indices, start = win.kv_indptr, win.kv_indices, win.kv_start
        extend_attention_fwd(
            q3, k.view(-1, layer.tp_k_head_num, layer.qk_head_dim), v.view(-1, layer.tp_v_head_num, dv), o,
            k_buffer, v_buffer, md.qo_indptr, kv_indptr, kv_indices, md.custom_mask, md.custom_mask is None,
            md.mask_indptr, md.max_extend_len, layer.scaling, logit_cap=layer.logit_cap,
            sliding_window_size=layer.sliding_window_size, prefix_kv_start=start,
            mask_covers_prefix=md.mask_covers_prefix, has_prefix=md.has_prefix, batch_invariant=self.deterministic,
            sinks=layer_sinks(layer), **kv_scales(layer, k_buffer),
        )
        return o.view(-1, hq * dv)

    def forward_decode(self, q, k, v, layer, forward_batch: ForwardBatch, save_kv_cache: bool = True, **kwargs):
        from attnserve.attention.triton_ops.decode_attention import decode_attention_fwd

        fb = forward_batch
        pool = fb.token_to_kv_pool
        if save_kv_cache and k is not None:
            pool.set_kv_buffer(layer, fb.out_cache_loc, k, v)
        md = self.forward_metadata
        hq, dv = layer.tp_q_head_num, layer.v_head_dim
        q3 = q.view(-1, hq, layer.qk_head_dim)
        o = q.new_empty(q3.shape[0], hq, dv)
        kv_indptr, kv_indices, num_kv_splits = md.kv_indptr, md.kv_indices, md.num_kv_splits
        win = self._window_of(layer, md)
        if win is not None:
            kv_indptr, kv_indices, num_kv_splits = win.kv_indptr, win.kv_indices, win.num_kv_splits
        k_buffer = pool.get_key_buffer(layer.layer_id)
        decode_attention_fwd(
            q3, k_buffer, pool.get_value_buffer(layer.layer_id), o, kv_indptr,
            kv_indices, md.attn_logits, md.attn_lse, num_kv_splits, self.max_kv_splits, layer.scaling,
            logit_cap=layer.logit_cap, batch_invariant=self.deterministic, sinks=layer_sinks(layer),
            **kv_scales(layer, k_buffer),
        )
        return o.view(-1, hq * dv)

    # ---- CUDA graphs -------------------------------------------------------------------
    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        dev = self.device
        cap = self.max_total_num_tokens + max_bs * self.page_size

        def i32(n, fill=0):
            return torch.full((n,), fill, dtype=torch.int32, device=dev)

        self.graph = TritonGraphBuffers(
            kv_indptr=i32(max_bs + 1), kv_indices=i32(cap), num_kv_splits=i32(max_bs, 1),
            attn_logits=torch.zeros(max_bs, self.num_q_heads, self.max_kv_splits, self.v_head_dim,
                                    dtype=torch.float32, device=dev),
            attn_lse=torch.zeros(max_bs, self.num_q_heads, self.max_kv_splits, dtype=torch.float32, device=dev),
            qo_indptr=i32(max_bs + 1), arange=torch.arange(max_bs + 1, dtype=torch.int32, device=dev),
            windows={w: WindowGraphBuffers(i32(max_bs + 1), i32(max_bs * (w + 1)), i32(max_bs), i32(max_bs, 1))
                     for w in self.window_sizes},
        )

    def _graph_metadata(self, bs: int, req_pool_indices, seq_lens) -> None:
        g = self.graph
        seq_lens = seq_lens[:bs].to(torch.int32)
        rows = req_pool_indices[:bs]
        kv_indptr, kv_indices = self._build_indices(rows, seq_lens, indptr_out=g.kv_indptr[: bs + 1],
                                                    indices_out=g.kv_indices)
        num_kv_splits = g.num_kv_splits[:bs]
        self._num_kv_splits(seq_lens, num_kv_splits)
        md = TritonForwardMetadata(kv_indptr, kv_indices, num_kv_splits=num_kv_splits,
                                   attn_logits=g.attn_logits[:bs], attn_lse=g.attn_lse[:bs])
        for w, buffers in g.windows.items():
            md.windows[w] = self._window_decode(w, rows, seq_lens, out=buffers)
        self.forward_metadata = md

    def _graph_verify_metadata(self, bs: int, req_pool_indices, prefix_lens, spec_info) -> None:
        """TARGET_VERIFY over ``spec_info.draft_token_num[0]`` nodes per request, masks in
        the node-only layout (``mask_covers_prefix`` False): the prefix indices go into the
        decode buffers, ``qo_indptr`` is ``n * arange``; the mask tensors are the caller's
        fixed buffers."""
        if spec_info is None or spec_info.mask_covers_prefix or len(set(spec_info.draft_token_num)) != 1:
            raise ValueError("TARGET_VERIFY graphs need a VerifyInput with the node-only mask layout "
                             "(mask_covers_prefix=False) and the same node count for every request")
        g = self.graph
        n = int(spec_info.draft_token_num[0])
        prefix = prefix_lens[:bs].to(torch.int32)
        rows = req_pool_indices[:bs]
        kv_indptr, kv_indices = self._build_indices(rows, prefix, indptr_out=g.kv_indptr[: bs + 1],
                                                    indices_out=g.kv_indices)
        qo_indptr = g.qo_indptr[: bs + 1]
        torch.mul(g.arange[: bs + 1], n, out=qo_indptr)
        md = TritonForwardMetadata(kv_indptr, kv_indices, qo_indptr=qo_indptr, max_extend_len=n,
                                   custom_mask=spec_info.custom_mask, mask_indptr=spec_info.mask_indptr,
                                   mask_covers_prefix=False)
        for w, buffers in g.windows.items():
            start = buffers.kv_start[:bs]
            torch.clamp(prefix - w, min=0, out=start)
            indptr, indices = self._build_indices(rows, prefix - start, start, indptr_out=buffers.kv_indptr[: bs + 1],
                                                  indices_out=buffers.kv_indices)
            md.windows[w] = WindowIndices(indptr, indices, start)
        self.forward_metadata = md

    def init_forward_metadata_capture_cuda_graph(self, bs, num_tokens, req_pool_indices, seq_lens, encoder_lens,
                                                 forward_mode: ForwardMode, spec_info) -> None:
        """DECODE (``seq_lens``: tokens after the step) or TARGET_VERIFY (``seq_lens``: the
        cached prefix lengths, as SGLang passes them; `_graph_verify_metadata`)."""
        if forward_mode.is_target_verify():
            self._graph_verify_metadata(bs, req_pool_indices, seq_lens, spec_info)
            return
        if not forward_mode.is_decode_or_idle():
            raise NotImplementedError(f"{self.name} backend captures DECODE and TARGET_VERIFY graphs, "
                                      f"not {forward_mode.name}")
        self._graph_metadata(bs, req_pool_indices, seq_lens)

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, seq_lens_sum, encoder_lens,
                                                forward_mode: ForwardMode, spec_info, seq_lens_cpu) -> None:
        if forward_mode.is_target_verify():
            self._graph_verify_metadata(bs, req_pool_indices, seq_lens, spec_info)
            return
        self._graph_metadata(bs, req_pool_indices, seq_lens)
