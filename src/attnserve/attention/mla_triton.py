"""MLA (DeepSeek-V2/V3) parts of the `triton` backend.

Decode (absorbed; DeepSeek-V2, arXiv:2405.04434 §2.1, FlashMLA's cache layout): the model
hands ``q = [q_nope W_UK | q_pe]`` ``[bs, H, kv_lora_rank + rope]`` to a layer with one KV
head of width ``kv_lora_rank + rope`` (`RadixAttention` ``attn_mqa``); `TritonMLADecode`
runs the paged MLA kernel (`triton_ops.mla_decode.mla_decode_fwd`) over the latent pool
``[slots, 1, kv_lora_rank + rope]`` through a block table of page ids (``page_size`` of
the pool), with per-request split counts computed on the device and one float32 split
workspace allocated once at start-up, shared by eager steps and captured graphs.

Extend (non-absorbed): the model expands the cached prefix to per-head K/V itself and
passes it densely (`extend_dense_prefix`); the regular extend kernel then reads the
prefix from that dense tensor through ``kv_indices = arange(sum(prefix_lens))`` instead of
from the latent pool.

Split counts: the CUTLASS-MLA heuristic with the SMs per head tile (`mla_split_sm_count`)
shared among the requests by length (`mla_num_kv_splits_device`: equal lengths split as
CUTLASS does, a long request among short ones gets more splits). Below ``split_sm_count``
requests stage 1 is launched over a work list of (request, split) entries
(`TritonMLADecode.work_items`), so those splits cost no grid of empty programs. The counts
depend on the batch, so a request's float rounding may differ between batches; with
``--enable-deterministic-inference`` the count is ``cdiv(seq_len, split_tile)`` capped at
``max_kv_splits``, independent of the batch (and of CUDA-graph padding).

CUDA graphs: `init_graph_state` allocates the block table at its widest
(``cdiv(req_to_token columns, page_size)``) and the split counts for ``max_bs``;
`graph_metadata` refills them in place (no allocation, no host sync). Padded rows have
``seq_len`` 1 and request row 0, so they read one real slot and write nothing visible.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch


@dataclass
class MLADecodeMetadata:
    """Per-step MLA decode metadata (device tensors).

    Attributes:
        block_kv_indices: int32 ``[bs, width]`` page ids per request, -1 past its last page.
        seq_lens: int32 ``[bs]`` tokens per request (the kernel's lengths).
        num_kv_splits: int32 ``[bs]`` sequence splits per request.
        work: int32 ``[W]`` work list (one entry per request split, then -1) when the
            kernel is launched over work items (`TritonMLADecode.work_items`), else None.
    """

    block_kv_indices: torch.Tensor
    seq_lens: torch.Tensor
    num_kv_splits: torch.Tensor
    work: Optional[torch.Tensor] = None


class TritonMLADecode:
    """Block tables, split counts, workspace and the kernel call of MLA decode.

    Args:
        device: the backend's device.
        req_to_token: int32 ``[max_reqs, max_context_len]`` of the `ReqToTokenPool`; its
            row count bounds the batch size (workspace) and its width the block table.
        page_size: tokens per page of the latent pool.
        num_heads: query heads (``tp_q_head_num``).
        kv_lora_rank: latent width ``D_c`` (values and output per head).
        max_kv_splits: most splits per request (workspace size); stage 1 runs over the work
            list (`work_items`) or the grid `grid_splits` of the batch size.
        num_sms: streaming multiprocessors (split heuristic).
        deterministic: batch-invariant split counts (see module doc).
        split_tile: tokens per split in deterministic mode.

    The workspace is ``mla_workspace_size(.., max_reqs, max_kv_splits, num_heads,
    kv_lora_rank)`` bytes = ``4 * max_reqs * num_heads * max_kv_splits * (kv_lora_rank + 1)``
    (e.g. 546 MB for 128 heads x 512 x 32 splits x 65 rows).
    """

    def __init__(self, device, req_to_token: torch.Tensor, page_size: int, num_heads: int, kv_lora_rank: int,
                 max_kv_splits: int, num_sms: int, deterministic: bool, split_tile: int):
        from attnserve.attention.triton_ops.mla_decode import mla_workspace_size

        self.device = torch.device(device)
        self.req_to_token = req_to_token
        self.page_size = int(page_size)
        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.max_kv_splits = int(max_kv_splits)
        self.num_sms = int(num_sms)
        self.deterministic = deterministic
        self.split_tile = int(split_tile)
        max_bs = req_to_token.shape[0]
        size = mla_workspace_size(0, max_bs, self.max_kv_splits, num_heads, kv_lora_rank)
        self.workspace = torch.empty(size, dtype=torch.uint8, device=self.device)
        self.graph: Optional[Dict[str, torch.Tensor]] = None

    def grid_splits(self, bs: int) -> int:
        """The kernel's split grid for a batch of ``bs``: ``max_kv_splits``, or in the
        default (non-deterministic) mode the most splits the heuristic can give at this
        batch size, ``sms_per_batch = split_sm_count // bs``, rounded up to a power of two
        (fewer compiled variants). Smaller grids launch fewer empty programs, and at 1
        the seesaw kernel needs no merge launch (`mla_decode_fwd`). Depends on ``bs`` only, so a
        captured graph keeps it."""
        from attnserve.attention.triton_ops.mla_decode import mla_split_sm_count

        if self.deterministic:
            return self.max_kv_splits
        per_batch = max(1, mla_split_sm_count(self.num_sms, self.num_heads) // max(1, bs))
        return min(self.max_kv_splits, 1 << (per_batch - 1).bit_length())

    def work_items(self, bs: int) -> Optional[int]:
        """Length of the work list stage 1 is launched over for a batch of ``bs``, or None
        for the ``(head tiles, grid_splits(bs), bs)`` grid: in deterministic mode, and where
        every request gets one split anyway (``grid_splits(bs) == 1``; the seesaw kernel then
        needs no merge). The list (`mla_num_kv_splits_device`) holds each request's splits,
        which are sized by its share of the SMs, so a long request among short ones is
        spread over many programs without a grid of empty ones. Depends on ``bs`` only."""
        from attnserve.attention.triton_ops.mla_decode import (
            MLA_WORK_SPLIT_SPAN,
            mla_num_work_items,
            mla_split_sm_count,
        )

        if self.deterministic or self.grid_splits(bs) == 1 or self.max_kv_splits > MLA_WORK_SPLIT_SPAN:
            return None
        return mla_num_work_items(bs, mla_split_sm_count(self.num_sms, self.num_heads), self.max_kv_splits)

    # ---- metadata ----------------------------------------------------------------------
    def _splits(self, seq_lens: torch.Tensor, out: torch.Tensor, work: Optional[torch.Tensor]) -> torch.Tensor:
        from attnserve.attention.triton_ops.mla_decode import mla_num_kv_splits_device, mla_split_sm_count

        if self.deterministic:
            tiles = torch.div(seq_lens + (self.split_tile - 1), self.split_tile, rounding_mode="floor")
            out.copy_(torch.clamp(tiles, 1, self.max_kv_splits))
            return out
        return mla_num_kv_splits_device(seq_lens, mla_split_sm_count(self.num_sms, self.num_heads),
                                        self.max_kv_splits, out, work=work)

    def _build(self, rows, seq_lens, table: torch.Tensor, splits: torch.Tensor,
               work: Optional[torch.Tensor]) -> MLADecodeMetadata:
        from attnserve.attention.triton_ops.kv_indices import create_block_kv_indices

        create_block_kv_indices(self.req_to_token, rows, seq_lens, self.page_size, table)
        return MLADecodeMetadata(table, seq_lens, self._splits(seq_lens, splits, work), work)

    def metadata(self, rows: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int) -> MLADecodeMetadata:
        """Eager decode step: a block table just wide enough for ``max_seq_len`` (host int).

        Args:
            rows: int32/int64 ``[bs]`` ``req_to_token`` rows; seq_lens: int32 ``[bs]``.
        """
        from attnserve.attention.triton_ops.kv_indices import block_table_width

        bs = rows.numel()
        width = max(1, block_table_width(max_seq_len, self.page_size, 1))
        table = torch.empty(bs, width, dtype=torch.int32, device=self.device)
        splits = torch.empty(bs, dtype=torch.int32, device=self.device)
        n_work = self.work_items(bs)
        work = None if n_work is None else torch.empty(n_work, dtype=torch.int32, device=self.device)
        return self._build(rows, seq_lens, table, splits, work)

    def init_graph_state(self, max_bs: int) -> None:
        """Fixed buffers for captured decode graphs of up to ``max_bs`` requests."""
        from attnserve.attention.triton_ops.kv_indices import block_table_width

        if max_bs > self.req_to_token.shape[0]:
            raise ValueError(f"CUDA-graph batch {max_bs} exceeds the request pool ({self.req_to_token.shape[0]} rows)")
        width = block_table_width(self.req_to_token.shape[1], self.page_size, 1)
        n_work = max((self.work_items(bs) or 0) for bs in range(1, max_bs + 1))
        self.graph = {
            "block_kv_indices": torch.full((max_bs, width), -1, dtype=torch.int32, device=self.device),
            "num_kv_splits": torch.ones(max_bs, dtype=torch.int32, device=self.device),
            "work": torch.full((max(1, n_work),), -1, dtype=torch.int32, device=self.device),
        }

    def graph_metadata(self, bs: int, rows: torch.Tensor, seq_lens: torch.Tensor) -> MLADecodeMetadata:
        """Refill the fixed buffers for ``bs`` rows in place (capture and replay).

        ``seq_lens`` must be the graph runner's static int32 buffer (kept by reference)."""
        g = self.graph
        n_work = self.work_items(bs)
        work = None if n_work is None else g["work"][:n_work]
        return self._build(rows[:bs], seq_lens[:bs], g["block_kv_indices"][:bs], g["num_kv_splits"][:bs], work)

    # ---- kernel ------------------------------------------------------------------------
    def forward(self, q: torch.Tensor, layer, pool, md: MLADecodeMetadata) -> torch.Tensor:
        """Absorbed MLA decode of one layer.

        Args:
            q: ``[bs, H * (kv_lora_rank + rope)]`` (or ``[bs, H, kv_lora_rank + rope]``),
                ``[q_nope W_UK | q_pe]`` per head, in the pool's dtype.
            layer: `RadixAttention` with one KV head, ``qk_head_dim = kv_lora_rank +
                rope``, ``v_head_dim = kv_lora_rank``.
            pool: `MLATokenToKVPool`.

        Returns:
            ``[bs, H * kv_lora_rank]`` latent-space output (the model applies ``W_UV``).

        Raises:
            ValueError: a layer that is not the latent layer, or a logit cap.
        """
        from attnserve.attention.triton_ops.mla_decode import mla_decode_fwd

        r = layer.v_head_dim
        if layer.tp_k_head_num != 1 or r != self.kv_lora_rank or layer.logit_cap > 0:
            raise ValueError(
                f"MLA decode needs one KV head, v_head_dim = kv_lora_rank = {self.kv_lora_rank} and no logit cap; "
                f"layer {layer.layer_id} has {layer.tp_k_head_num} heads, v_head_dim {r}, logit_cap {layer.logit_cap}"
            )
        hq = layer.tp_q_head_num
        q3 = q.view(-1, hq, layer.qk_head_dim)
        o = q.new_empty(q3.shape[0], hq, r)
        mla_decode_fwd(
            q3[..., :r], q3[..., r:], pool.get_key_buffer(layer.layer_id), md.block_kv_indices, md.seq_lens,
            self.page_size, o, layer.scaling, md.num_kv_splits,
            self.grid_splits(q3.shape[0]) if md.work is None else self.max_kv_splits,
            workspace=self.workspace, work=md.work,
        )
        return o.view(-1, hq * r)


def extend_dense_prefix(q, k, v, layer, md, k_prefix: torch.Tensor, v_prefix: torch.Tensor) -> torch.Tensor:
    """Extend attention whose cached prefix is given densely (MLA's expanded prefix).

    Args:
        q: ``[T, Hq * Dk]``; k: ``[T, Hkv, Dk]``; v: ``[T, Hkv, Dv]`` (new tokens).
        layer: `RadixAttention` (``Dk = nope + rope``, ``Dv = v_head_dim`` for MLA).
        md: the step's `TritonForwardMetadata` (``kv_indptr`` over the prefix lengths,
            ``qo_indptr``, ``max_extend_len``, custom mask).
        k_prefix / v_prefix: ``[sum(prefix_lens), Hkv, Dk / Dv]`` in batch order.

    Returns:
        ``[T, Hq * Dv]`` in ``q``'s dtype.
    """
    from attnserve.attention.triton_ops.extend_attention import extend_attention_fwd

    hq, dv = layer.tp_q_head_num, layer.v_head_dim
    q3 = q.view(-1, hq, layer.qk_head_dim)
    o = q.new_empty(q3.shape[0], hq, dv)
    n = k_prefix.shape[0]
    if n == 0:  # nothing cached: a one-row dummy keeps every pointer valid (never read)
        k_prefix = k_prefix.new_zeros(1, *k_prefix.shape[1:])
        v_prefix = v_prefix.new_zeros(1, *v_prefix.shape[1:])
    indices = torch.arange(n, dtype=torch.int32, device=q.device)
    extend_attention_fwd(
        q3, k, v, o, k_prefix, v_prefix, md.qo_indptr, md.kv_indptr, indices, md.custom_mask,
        md.custom_mask is None, md.mask_indptr, md.max_extend_len, layer.scaling, logit_cap=layer.logit_cap,
        sliding_window_size=layer.sliding_window_size,
    )
    return o.view(-1, hq * dv)
