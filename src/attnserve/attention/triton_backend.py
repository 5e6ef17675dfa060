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
``prefix_len - window``.

MLA models (latent pool; `attnserve.attention.mla_triton`): DECODE builds a block table and
per-request split counts and runs the MLA decode kernel (`TritonMLADecode`); extend steps
receive the prefix already expanded by the model (``k_prefix``/``v_prefix`` keyword
arguments) and run the regular extend kernel over it (`extend_dense_prefix`).

CUDA graphs: `init_cuda_graph_state` allocates fixed buffers sized for ``max_bs``; the
capture/replay hooks refill them in place (no allocation, no host synchronisation), and
padded rows use ``seq_len`` 1 (`get_cuda_graph_seq_len_fill_value`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from attnserve.attention.base import AttentionBackend
from attnserve.attention.registry import register_attention_backend
from attnserve.forward_batch import ForwardBatch, ForwardMode

#: split-K partitions per request at most (scratch is ``[bs, Hq, MAX_KV_SPLITS, Dv]`` fp32).
DEFAULT_MAX_KV_SPLITS = 32
#: tokens per split in deterministic mode (fixed, so results do not depend on the batch).
DETERMINISTIC_SPLIT_TILE = 256


@dataclass
class WindowIndices:
    """Indices of a sliding-window layer: keys start at ``kv_start`` (int32 ``[bs]``);
    decode splits (``num_kv_splits``) are sized for the window, not the whole sequence."""

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
        custom_mask / mask_indptr: speculative tree masks (TARGET_VERIFY) or None.
        window: indices for sliding-window layers or None.
        mla: MLA decode metadata (block table, lengths, splits) or None.
    """

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    qo_indptr: Optional[torch.Tensor] = None
    num_kv_splits: Optional[torch.Tensor] = None
    attn_logits: Optional[torch.Tensor] = None
    attn_lse: Optional[torch.Tensor] = None
    max_extend_len: int = 0
    custom_mask: Optional[torch.Tensor] = None
    mask_indptr: Optional[torch.Tensor] = None
    window: Optional[WindowIndices] = None
    mla: Optional["MLADecodeMetadata"] = None  # noqa: F821 (attnserve.attention.mla_triton)


def _cumsum_indptr(lens: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    from attnserve.attention.triton_ops.kv_indices import compute_kv_indptr

    return compute_kv_indptr(lens, out)


@register_attention_backend("triton")
class TritonAttnBackend(AttentionBackend):
    """Triton paged-attention backend.

    Args:
        model_runner: provides ``device``, ``model_config`` (heads, head dims, window,
            attention_arch), ``req_to_token_pool``, ``token_to_kv_pool``, ``server_args``
            (deterministic mode) and ``max_total_num_tokens``.

    Raises:
        RuntimeError: Triton is not importable, or the device is not a GPU and the Triton
            interpreter (``TRITON_INTERPRET=1``) is not enabled.
    """

    def __init__(self, model_runner):
        import os

        try:
            import triton  # noqa: F401
        except ImportError as e:  # pragma: no cover - depends on the install
            raise RuntimeError("the 'triton' attention backend needs the triton package: pip install triton") from e
        self.device = torch.device(model_runner.device)
        if self.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("the 'triton' attention backend needs a CUDA GPU (or TRITON_INTERPRET=1 for tests)")
        mc = model_runner.model_config
        self.num_q_heads = mc.num_attention_heads
        self.is_mla = getattr(mc, "attention_arch", "mha") == "mla"
        self.num_kv_heads = 1 if self.is_mla else mc.num_key_value_heads
        self.v_head_dim = mc.kv_lora_rank if self.is_mla else mc.v_head_dim
        self.sliding_window_size = getattr(mc, "sliding_window_size", -1)
        if self.sliding_window_size is None:
            self.sliding_window_size = -1
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.page_size = getattr(model_runner, "page_size", 1)
        args = getattr(model_runner, "server_args", None)
        self.deterministic = bool(getattr(args, "enable_deterministic_inference", False))
        self.max_kv_splits = DEFAULT_MAX_KV_SPLITS
        if self.device.type == "cuda":
            self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        else:
            self.num_sms = 8
        self.max_total_num_tokens = getattr(model_runner, "max_total_num_tokens", None)
        self.forward_metadata: Optional[TritonForwardMetadata] = None
        self.graph: Optional[dict] = None
        self.mla = None
        if self.is_mla:  # ---- MLA decode (attnserve.attention.mla_triton) ----
            from attnserve.attention.mla_triton import TritonMLADecode

            self.mla = TritonMLADecode(self.device, self.req_to_token, self.page_size, self.num_q_heads,
                                       mc.kv_lora_rank, self.max_kv_splits, self.num_sms, self.deterministic,
                                       DETERMINISTIC_SPLIT_TILE)

    # ---- metadata ----------------------------------------------------------------------
    def _num_kv_splits(self, seq_lens: torch.Tensor, out: torch.Tensor) -> None:
        from attnserve.attention.triton_ops.decode_attention import compute_num_kv_splits

        compute_num_kv_splits(seq_lens, out, self.max_kv_splits, self.num_sms, self.num_kv_heads,
                              deterministic=self.deterministic, split_tile_size=DETERMINISTIC_SPLIT_TILE)

    def _build_indices(self, req_pool_indices, lens, start=None, indptr_out=None, indices_out=None, total=None):
        from attnserve.attention.triton_ops.kv_indices import create_kv_indices

        kv_indptr = _cumsum_indptr(lens, indptr_out)
        if indices_out is None:
            indices_out = torch.empty(total, dtype=torch.int32, device=self.device)
        create_kv_indices(self.req_to_token, req_pool_indices, lens, kv_indptr, start, indices_out)
        return kv_indptr, indices_out

    def _window_decode(self, req_pool_indices, seq_lens, out: Optional[dict] = None, total: int = 0):
        w = self.sliding_window_size
        win_lens = torch.clamp(seq_lens, max=w + 1)
        start = (seq_lens - win_lens).to(torch.int32)
        if out is not None:
            out["win_start"][: start.numel()].copy_(start)
            start = out["win_start"][: start.numel()]
        indptr, indices = self._build_indices(
            req_pool_indices, win_lens.to(torch.int32), start,
            indptr_out=None if out is None else out["win_indptr"][: seq_lens.numel() + 1],
            indices_out=None if out is None else out["win_indices"], total=total,
        )
        n = seq_lens.numel()
        splits = torch.empty(n, dtype=torch.int32, device=self.device) if out is None else out["win_splits"][:n]
        self._num_kv_splits(win_lens.to(torch.int32), splits)
        return WindowIndices(indptr, indices, start, splits)

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        mode = fb.forward_mode
        bs = fb.batch_size
        if mode.is_idle():
            self.forward_metadata = None
            return
        seq_lens = fb.seq_lens.to(torch.int32)
        rows = fb.req_pool_indices
        if mode.is_decode() and self.mla is not None:  # ---- MLA decode: block table + splits only ----
            max_len = int(fb.seq_lens_cpu.max()) if fb.seq_lens_cpu is not None else int(seq_lens.max())
            self.forward_metadata = TritonForwardMetadata(None, None, mla=self.mla.metadata(rows, seq_lens, max_len))
            return
        if mode.is_decode():
            kv_indptr, kv_indices = self._build_indices(rows, seq_lens, total=fb.seq_lens_sum)
            num_kv_splits = torch.empty(bs, dtype=torch.int32, device=self.device)
            self._num_kv_splits(seq_lens, num_kv_splits)
            md = TritonForwardMetadata(
                kv_indptr, kv_indices, num_kv_splits=num_kv_splits,
                attn_logits=torch.empty(bs, self.num_q_heads, self.max_kv_splits, self.v_head_dim,
                                        dtype=torch.float32, device=self.device),
                attn_lse=torch.empty(bs, self.num_q_heads, self.max_kv_splits, dtype=torch.float32,
                                     device=self.device),
            )
            if self.sliding_window_size >= 0:
                w = self.sliding_window_size
                total = sum(min(s, w + 1) for s in fb.seq_lens_cpu.tolist())
                md.window = self._window_decode(rows, seq_lens, total=total)
            self.forward_metadata = md
            return
        # extend-like modes: prefix through the cache, new tokens directly
        prefix = fb.extend_prefix_lens.to(torch.int32)
        prefix_sum = sum(fb.extend_prefix_lens_cpu)
        kv_indptr, kv_indices = self._build_indices(rows, prefix, total=prefix_sum)
        qo_indptr = _cumsum_indptr(fb.extend_seq_lens.to(torch.int32))
        md = TritonForwardMetadata(kv_indptr, kv_indices, qo_indptr=qo_indptr,
                                   max_extend_len=max(fb.extend_seq_lens_cpu))
        spec = fb.spec_info
        if spec is not None and getattr(spec, "custom_mask", None) is not None:
            md.custom_mask = spec.custom_mask
            md.mask_indptr = spec.mask_indptr.to(device=self.device, dtype=torch.int64)
        if self.sliding_window_size >= 0:
            w = self.sliding_window_size
            start = torch.clamp(prefix - w, min=0).to(torch.int32)
            win_prefix = (prefix - start).to(torch.int32)
            total = sum(p - max(0, p - w) for p in fb.extend_prefix_lens_cpu)
            indptr, indices = self._build_indices(rows, win_prefix, start, total=total)
            md.window = WindowIndices(indptr, indices, start)
        self.forward_metadata = md

    # ---- kernels -----------------------------------------------------------------------
    def forward_extend(self, q, k, v, layer, forward_batch: ForwardBatch, save_kv_cache: bool = True, **kwargs):
        from attnserve.attention.triton_ops.extend_attention import extend_attention_fwd

        fb = forward_batch
        pool = fb.token_to_kv_pool
        if kwargs.get("k_prefix") is not None:  # ---- MLA extend: prefix expanded by the model ----
            from attnserve.attention.mla_triton import extend_dense_prefix

            return extend_dense_prefix(q, k, v, layer, self.forward_metadata, kwargs["k_prefix"], kwargs["v_prefix"])
        if save_kv_cache and k is not None:
            pool.set_kv_buffer(layer, fb.out_cache_loc, k, v)
        md = self.forward_metadata
        hq, dv = layer.tp_q_head_num, layer.v_head_dim
        q3 = q.view(-1, hq, layer.qk_head_dim)
        o = q.new_empty(q3.shape[0], hq, dv)
        kv_indptr, kv_indices, start = md.kv_indptr, md.kv_indices, None
        window = layer.sliding_window_size
        if window >= 0:
            if md.window is None or window != self.sliding_window_size:
                raise ValueError(
                    f"layer {layer.layer_id} has sliding window {window} but the model config says "
                    f"{self.sliding_window_size}; set ModelConfig.sliding_window_size"
                )
            kv_indptr, kv_indices, start = md.window.kv_indptr, md.window.kv_indices, md.window.kv_start
        extend_attention_fwd(
            q3, k.view(-1, layer.tp_k_head_num, layer.qk_head_dim), v.view(-1, layer.tp_v_head_num, dv), o,
            pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id),
            md.qo_indptr, kv_indptr, kv_indices, md.custom_mask, md.custom_mask is None, md.mask_indptr,
            md.max_extend_len, layer.scaling, logit_cap=layer.logit_cap, sliding_window_size=window,
            prefix_kv_start=start,
        )
        return o.view(-1, hq * dv)

    def forward_decode(self, q, k, v, layer, forward_batch: ForwardBatch, save_kv_cache: bool = True, **kwargs):
        from attnserve.attention.triton_ops.decode_attention import decode_attention_fwd

        fb = forward_batch
        pool = fb.token_to_kv_pool
        if save_kv_cache and k is not None:
            pool.set_kv_buffer(layer, fb.out_cache_loc, k, v)
        md = self.forward_metadata
        if md.mla is not None:  # ---- MLA decode kernel over the latent pool ----
            return self.mla.forward(q, layer, pool, md.mla)
        hq, dv = layer.tp_q_head_num, layer.v_head_dim
        q3 = q.view(-1, hq, layer.qk_head_dim)
        o = q.new_empty(q3.shape[0], hq, dv)
        kv_indptr, kv_indices, num_kv_splits = md.kv_indptr, md.kv_indices, md.num_kv_splits
        if layer.sliding_window_size >= 0:
            win = md.window
            kv_indptr, kv_indices, num_kv_splits = win.kv_indptr, win.kv_indices, win.num_kv_splits
        k_buf = pool.get_key_buffer(layer.layer_id)
        v_buf = pool.get_value_buffer(layer.layer_id)
        decode_attention_fwd(
            q3, k_buf, v_buf, o, kv_indptr, kv_indices, md.attn_logits, md.attn_lse, num_kv_splits,
            self.max_kv_splits, layer.scaling, logit_cap=layer.logit_cap,
        )
        return o.view(-1, hq * dv)

    # ---- CUDA graphs -------------------------------------------------------------------
    def supports_cuda_graph(self) -> bool:
        return True

    @property
    def replay_hook_is_capturable(self) -> bool:
        """The MHA replay hook launches only index kernels on fixed buffers (no host reads,
        no allocation outside the graph pool), so `CudaGraphRunner` records it in the graph."""
        return not self.is_mla

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        if self.mla is not None:  # ---- MLA: block table + splits (workspace allocated at init) ----
            self.mla.init_graph_state(max_bs)
            self.graph = {}
            return
        dev = self.device
        cap = (self.max_total_num_tokens or max_num_tokens * 8192) + max_bs * max(self.page_size, 1)
        g = {
            "kv_indptr": torch.zeros(max_bs + 1, dtype=torch.int32, device=dev),
            "kv_indices": torch.zeros(cap, dtype=torch.int32, device=dev),
            "num_kv_splits": torch.ones(max_bs, dtype=torch.int32, device=dev),
            "attn_logits": torch.zeros(max_bs, self.num_q_heads, self.max_kv_splits, self.v_head_dim,
                                       dtype=torch.float32, device=dev),
            "attn_lse": torch.zeros(max_bs, self.num_q_heads, self.max_kv_splits, dtype=torch.float32, device=dev),
        }
        if self.sliding_window_size >= 0:
            g["win_indptr"] = torch.zeros(max_bs + 1, dtype=torch.int32, device=dev)
            g["win_indices"] = torch.zeros(max_bs * (self.sliding_window_size + 1), dtype=torch.int32, device=dev)
            g["win_start"] = torch.zeros(max_bs, dtype=torch.int32, device=dev)
            g["win_splits"] = torch.ones(max_bs, dtype=torch.int32, device=dev)
        self.graph = g

    def _graph_metadata(self, bs: int, req_pool_indices, seq_lens) -> None:
        g = self.graph
        seq_lens = seq_lens[:bs].to(torch.int32)
        rows = req_pool_indices[:bs]
        if self.mla is not None:  # ---- MLA decode ----
            self.forward_metadata = TritonForwardMetadata(None, None, mla=self.mla.graph_metadata(bs, rows, seq_lens))
            return
        kv_indptr, kv_indices = self._build_indices(
            rows, seq_lens, indptr_out=g["kv_indptr"][: bs + 1], indices_out=g["kv_indices"]
        )
        num_kv_splits = g["num_kv_splits"][:bs]
        self._num_kv_splits(seq_lens, num_kv_splits)
        md = TritonForwardMetadata(kv_indptr, kv_indices, num_kv_splits=num_kv_splits,
                                   attn_logits=g["attn_logits"][:bs], attn_lse=g["attn_lse"][:bs])
        if self.sliding_window_size >= 0:
            md.window = self._window_decode(rows, seq_lens, out=g)
        self.forward_metadata = md

    def init_forward_metadata_capture_cuda_graph(self, bs, num_tokens, req_pool_indices, seq_lens, encoder_lens,
                                                 forward_mode: ForwardMode, spec_info) -> None:
        if not forward_mode.is_decode_or_idle():
            raise NotImplementedError(f"triton backend captures DECODE graphs only, not {forward_mode.name}")
        self._graph_metadata(bs, req_pool_indices, seq_lens)

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, seq_lens_sum, encoder_lens,
                                                forward_mode: ForwardMode, spec_info, seq_lens_cpu) -> None:
        self._graph_metadata(bs, req_pool_indices, seq_lens)
