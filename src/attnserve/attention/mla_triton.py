"""MLA (DeepSeek-V2/V3) decode of the `triton_mla` backend: block tables, splits, workspace.

Decode (absorbed; DeepSeek-V2, arXiv:2405.04434 §2.1, FlashMLA's cache layout): the model
hands ``q = [q_nope W_UK | q_pe]`` ``[bs, H, kv_lora_rank + rope]`` to a layer with one KV
head of width ``kv_lora_rank + rope`` (`RadixAttention` ``attn_mqa``); `TritonMLADecode`
runs the paged MLA kernel (`triton_ops.mla_decode.mla_decode_fwd`) over the latent pool
``[slots, 1, kv_lora_rank + rope]`` through a block table of page ids (``page_size`` of
the pool), with per-request split counts computed on the device and one float32 split
workspace allocated once at start-up, shared by eager steps and captured graphs.

Split counts: the CUTLASS-MLA heuristic with the SMs per head tile (`mla_split_sm_count`)
shared among the requests by length (`mla_num_kv_splits_device`: equal lengths split as
CUTLASS does, a long request among short ones gets more splits). Below ``split_sm_count``
requests stage 1 is launched over a work list of (request, split) entries
(`TritonMLADecode.work_items`), so those splits cost no grid of empty programs. The counts
depend on the batch, so a request's float rounding may differ between batches; with
``--enable-deterministic-inference`` the count is ``cdiv(seq_len, split_tile)`` capped at
``max_kv_splits``, independent of the batch (and of CUDA-graph padding).

Workspace: sized once for the largest batch that can run (``max_bs``, the
``--max-running-requests``), as the most (request, split) rows any batch size up to it
launches with (`TritonMLADecode.workspace_rows`), and counted in the memory budget before
the KV pool is sized (`TritonMLAAttnBackend.workspace_bytes`).

CUDA graphs: `init_graph_state` allocates the block table at its widest
(``cdiv(req_to_token columns, page_size)``) and the split counts for ``max_bs``;
`graph_metadata` refills them in place (no allocation, no host sync). Padded rows have
``seq_len`` 1 and request row 0, so they read one real slot and write nothing visible.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

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


@dataclass
class MLAGraphBuffers:
    """Fixed MLA decode buffers captured graphs read (sized for ``max_bs``)."""

    block_kv_indices: torch.Tensor  # int32 [max_bs, widest block table], -1 filled
    num_kv_splits: torch.Tensor  # int32 [max_bs]
    work: torch.Tensor  # int32 [most work items of any captured batch size], -1 filled


@dataclass(frozen=True)
class MLASplitPolicy:
    """How a decode batch is split (depends on the batch size only, so graphs keep it).

    Attributes:
        num_sms: streaming multiprocessors of the device.
        num_heads: query heads (``tp_q_head_num``).
        max_kv_splits: most splits per request.
        deterministic: batch-invariant split counts (grid of ``max_kv_splits``, no work list).
        kv_dtype: the latent cache's dtype (fp8 caches of few heads count two programs per
            SM, `mla_split_sm_count`); None: 16-bit.
    """

    num_sms: int
    num_heads: int
    max_kv_splits: int
    deterministic: bool
    kv_dtype: Optional[torch.dtype] = None

    def split_sm_count(self) -> int:
        """`mla_split_sm_count` of this device, head count and cache dtype."""
        from attnserve.attention.triton_ops.mla_decode import mla_split_sm_count

        return mla_split_sm_count(self.num_sms, self.num_heads, self.kv_dtype)

    def grid_splits(self, bs: int) -> int:
        """The kernel's split grid for a batch of ``bs``: ``max_kv_splits``, or in the
        default (non-deterministic) mode the most splits the heuristic can give at this
        batch size, ``sms_per_batch = split_sm_count // bs``, rounded up to a power of two
        (fewer compiled variants). Smaller grids launch fewer empty programs, and at 1
        the seesaw kernel needs no merge launch (`mla_decode_fwd`). Depends on ``bs`` only, so a
        captured graph keeps it."""
        if self.deterministic:
            return self.max_kv_splits
        per_batch = max(1, self.split_sm_count() // max(1, bs))
        return min(self.max_kv_splits, 1 << (per_batch - 1).bit_length())

    def work_items(self, bs: int) -> Optional[int]:
        """Length of the work list stage 1 is launched over for a batch of ``bs``, or None
        for the ``(head tiles, grid_splits(bs), bs)`` grid: in deterministic mode, and where
        every request gets one split anyway (``grid_splits(bs) == 1``; the seesaw kernel then
        needs no merge). The list (`mla_num_kv_splits_device`) holds each request's splits,
        which are sized by its share of the SMs, so a long request among short ones is
        spread over many programs without a grid of empty ones. Depends on ``bs`` only."""
        from attnserve.attention.triton_ops.mla_decode import MLA_WORK_SPLIT_SPAN, mla_num_work_items

        if self.deterministic or self.grid_splits(bs) == 1 or self.max_kv_splits > MLA_WORK_SPLIT_SPAN:
            return None
        return mla_num_work_items(bs, self.split_sm_count(), self.max_kv_splits)

    def split_stride(self, bs: int) -> int:
        """Splits per request the kernel is launched with for a batch of ``bs`` (the
        workspace's split stride): ``max_kv_splits`` with a work list, else `grid_splits`."""
        return self.max_kv_splits if self.work_items(bs) is not None else self.grid_splits(bs)

    def workspace_rows(self, max_bs: int) -> int:
        """Most (request, split) rows of float32 partials any batch of ``1..max_bs`` needs:
        ``max(bs * split_stride(bs))``. Far below ``max_bs * max_kv_splits`` for large
        batches, where each request gets one split."""
        return max(bs * self.split_stride(bs) for bs in range(1, max(1, max_bs) + 1))

    def workspace_bytes(self, max_bs: int, kv_lora_rank: int) -> int:
        """Bytes of the split workspace for batches up to ``max_bs`` (`mla_workspace_size`)."""
        from attnserve.attention.triton_ops.mla_decode import mla_workspace_size

        return mla_workspace_size(0, self.workspace_rows(max_bs), 1, self.num_heads, kv_lora_rank)


class TritonMLADecode:
    """Block tables, split counts, workspace and the kernel call of MLA decode.

    Args:
        device: the backend's device.
        req_to_token: int32 ``[max_reqs, max_context_len]`` of the `ReqToTokenPool`; its
            width bounds the block table.
        page_size: tokens per page of the latent pool.
        kv_lora_rank: latent width ``D_c`` (values and output per head).
        policy: `MLASplitPolicy` (heads, SMs, most splits, deterministic); stage 1 runs over
            the work list (`MLASplitPolicy.work_items`) or the grid `grid_splits` of the batch.
        split_tile: tokens per split in deterministic mode.

        max_bs: the largest batch that can run (sizes the workspace).

    The workspace is ``4 * policy.workspace_rows(max_bs) * num_heads * (kv_lora_rank + 1)`` bytes.
    """

    def __init__(self, device, req_to_token: torch.Tensor, page_size: int, kv_lora_rank: int,
                 policy: MLASplitPolicy, split_tile: int, max_bs: int):
        self.device = torch.device(device)
        self.req_to_token = req_to_token
        self.page_size = int(page_size)
        self.kv_lora_rank = kv_lora_rank
        self.policy = policy
        self.split_tile = int(split_tile)
        self.max_bs = int(max_bs)
        size = policy.workspace_bytes(self.max_bs, kv_lora_rank)
        self.workspace = torch.empty(size, dtype=torch.uint8, device=self.device)
        self.graph: Optional[MLAGraphBuffers] = None

    # ---- metadata ----------------------------------------------------------------------
    def _splits(self, seq_lens: torch.Tensor, out: torch.Tensor, work: Optional[torch.Tensor]) -> torch.Tensor:
        from attnserve.attention.triton_ops.mla_decode import mla_num_kv_splits_device

        if self.policy.deterministic:
            tiles = torch.div(seq_lens + (self.split_tile - 1), self.split_tile, rounding_mode="floor")
            out.copy_(torch.clamp(tiles, 1, self.policy.max_kv_splits))
            return out
        return mla_num_kv_splits_device(seq_lens, self.policy.split_sm_count(),
                                        self.policy.max_kv_splits, out, work=work)

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
        n_work = self.policy.work_items(bs)
        work = None if n_work is None else torch.empty(n_work, dtype=torch.int32, device=self.device)
        return self._build(rows, seq_lens, table, splits, work)

    def init_graph_state(self, max_bs: int) -> None:
        """Fixed buffers for captured decode graphs of up to ``max_bs`` requests."""
        from attnserve.attention.triton_ops.kv_indices import block_table_width

        if max_bs > self.max_bs:
            raise ValueError(f"CUDA-graph batch {max_bs} exceeds the largest batch the workspace holds ({self.max_bs})")
        width = block_table_width(self.req_to_token.shape[1], self.page_size, 1)
        n_work = max((self.policy.work_items(bs) or 0) for bs in range(1, max_bs + 1))
        self.graph = MLAGraphBuffers(
            block_kv_indices=torch.full((max_bs, width), -1, dtype=torch.int32, device=self.device),
            num_kv_splits=torch.ones(max_bs, dtype=torch.int32, device=self.device),
            work=torch.full((max(1, n_work),), -1, dtype=torch.int32, device=self.device),
        )

    def graph_metadata(self, bs: int, rows: torch.Tensor, seq_lens: torch.Tensor) -> MLADecodeMetadata:
        """Refill the fixed buffers for ``bs`` rows in place (capture and replay).

        ``seq_lens`` must be the graph runner's static int32 buffer (kept by reference)."""
        g = self.graph
        n_work = self.policy.work_items(bs)
        work = None if n_work is None else g.work[:n_work]
        return self._build(rows[:bs], seq_lens[:bs], g.block_kv_indices[:bs], g.num_kv_splits[:bs], work)

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
            self.page_size, o, layer.scaling, md.num_kv_splits, self.policy.split_stride(q3.shape[0]),
            workspace=self.workspace, work=md.work, kv_scale=layer.k_scale,
        )
        return o.view(-1, hq * r)
