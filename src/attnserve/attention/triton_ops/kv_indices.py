"""Index-building kernels: turn ``req_to_token`` rows into the metadata attention kernels read.

Formats (DESIGN.md section 4):

* CSR ``kv_indptr`` / ``kv_indices``: token-level KV slots of every request, concatenated
  (Triton and FlashInfer kernels). Token-level slots cover every ``page_size``.
* ``page_table`` ``[bs, max_pages]``: page ids (FlashAttention-style paged kernels).
* ``block_kv_indices`` ``[bs, width]``: page ids padded to a kernel's multiple (MLA kernels).

Every builder runs one Triton program per request and never synchronises with the host
(no ``.item()``, ``.tolist()`` or ``.cpu()``), so it can run inside a captured CUDA graph.
Host-side checks look at shapes and dtypes only.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

# Elements each program copies per loop iteration; a tuning constant, not state.
_COPY_BLOCK = 512


@triton.jit
def _create_kv_indices_kernel(
    req_to_token_ptr,
    req_pool_indices_ptr,
    page_kernel_lens_ptr,
    kv_indptr_ptr,
    kv_start_idx_ptr,
    kv_indices_ptr,
    req_to_token_stride,
    HAS_START: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    row = tl.load(req_pool_indices_ptr + pid).to(tl.int64)
    count = tl.load(page_kernel_lens_ptr + pid).to(tl.int32)
    out_start = tl.load(kv_indptr_ptr + pid).to(tl.int64)
    src_start = 0
    if HAS_START:
        src_start = tl.load(kv_start_idx_ptr + pid).to(tl.int32)
    src = req_to_token_ptr + row * req_to_token_stride + src_start
    dst = kv_indices_ptr + out_start
    offs = tl.arange(0, BLOCK)
    for base in range(0, count, BLOCK):
        idx = base + offs
        m = idx < count
        vals = tl.load(src + idx, mask=m)
        tl.store(dst + idx, vals, mask=m)


@triton.jit
def _create_page_table_kernel(
    req_to_token_ptr,
    req_pool_indices_ptr,
    seq_lens_ptr,
    page_table_ptr,
    req_to_token_stride,
    page_table_stride,
    width,
    page_size,
    pad_value,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    row = tl.load(req_pool_indices_ptr + pid).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + pid).to(tl.int32)
    num_pages = (seq_len + page_size - 1) // page_size
    src = req_to_token_ptr + row * req_to_token_stride
    dst = page_table_ptr + pid.to(tl.int64) * page_table_stride
    offs = tl.arange(0, BLOCK)
    for base in range(0, width, BLOCK):
        j = base + offs
        in_table = j < width
        used = j < num_pages
        first_slot = tl.load(src + j * page_size, mask=used & in_table, other=0)
        page = first_slot // page_size
        page = tl.where(used, page, pad_value)
        tl.store(dst + j, page.to(page_table_ptr.dtype.element_ty), mask=in_table)


def _check_common(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, lens: torch.Tensor, what: str):
    if req_to_token.dim() != 2 or req_to_token.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"req_to_token must be a 2-D int32/int64 tensor, got {tuple(req_to_token.shape)} {req_to_token.dtype}")
    if req_to_token.stride(1) != 1:
        raise ValueError("req_to_token rows must be contiguous (stride(1) == 1)")
    if req_pool_indices.dim() != 1 or lens.dim() != 1 or req_pool_indices.shape[0] != lens.shape[0]:
        raise ValueError(
            f"req_pool_indices and {what} must be 1-D of the same length, got "
            f"{tuple(req_pool_indices.shape)} and {tuple(lens.shape)}"
        )
    for name, t in (("req_pool_indices", req_pool_indices), (what, lens)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
        if t.device != req_to_token.device:
            raise ValueError(f"{name} is on {t.device} but req_to_token is on {req_to_token.device}")


def create_kv_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    page_kernel_lens: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_start_idx: Optional[torch.Tensor],
    kv_indices: torch.Tensor,
) -> torch.Tensor:
    """Gather each request's token slots into the CSR array ``kv_indices`` (in place).

    ``kv_indices[kv_indptr[i] : kv_indptr[i] + page_kernel_lens[i]] =
    req_to_token[req_pool_indices[i], s_i : s_i + page_kernel_lens[i]]`` with
    ``s_i = kv_start_idx[i]`` (0 when ``kv_start_idx`` is None). A sliding-window decode
    passes ``kv_start_idx = max(seq_len - window - 1, 0)`` so that keys outside the window
    are never read.

    Args:
        req_to_token: int32 ``[max_reqs, max_context_len]`` (rows contiguous).
        req_pool_indices: int32/int64 ``[bs]`` row of each request.
        page_kernel_lens: int32/int64 ``[bs]`` tokens to copy per request.
        kv_indptr: int32/int64 ``[bs + 1]`` output offsets, given by the caller (normally
            `compute_kv_indptr(page_kernel_lens)`).
        kv_start_idx: int32/int64 ``[bs]`` first token per request, or None.
        kv_indices: int32/int64 ``[>= sum(page_kernel_lens)]``, written.

    Returns:
        ``kv_indices``.

    Raises:
        ValueError: on wrong ranks, dtypes or devices (host-side checks only; the kernel
            trusts the values, so out-of-range lengths are the caller's bug).
    """
    _check_common(req_to_token, req_pool_indices, page_kernel_lens, "page_kernel_lens")
    bs = req_pool_indices.shape[0]
    if kv_indptr.dim() != 1 or kv_indptr.shape[0] < bs + 1:
        raise ValueError(f"kv_indptr must be 1-D with >= bs+1={bs + 1} entries, got {tuple(kv_indptr.shape)}")
    if kv_start_idx is not None and (kv_start_idx.dim() != 1 or kv_start_idx.shape[0] < bs):
        raise ValueError(f"kv_start_idx must be 1-D with >= bs={bs} entries, got {tuple(kv_start_idx.shape)}")
    if kv_indices.dim() != 1 or kv_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"kv_indices must be a 1-D int32/int64 tensor, got {tuple(kv_indices.shape)} {kv_indices.dtype}")
    if bs == 0:
        return kv_indices
    _create_kv_indices_kernel[(bs,)](
        req_to_token,
        req_pool_indices,
        page_kernel_lens,
        kv_indptr,
        kv_start_idx if kv_start_idx is not None else kv_indptr,  # dummy pointer when absent
        kv_indices,
        req_to_token.stride(0),
        HAS_START=kv_start_idx is not None,
        BLOCK=_COPY_BLOCK,
    )
    return kv_indices


def compute_kv_indptr(lens: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Exclusive prefix sum of ``lens`` on the device: ``out[0] = 0``, ``out[i+1] = sum(lens[:i+1])``.

    Args:
        lens: int32/int64 ``[bs]`` per-request token counts.
        out: optional int32 ``[>= bs + 1]`` buffer (a CUDA-graph buffer); its first
            ``bs + 1`` entries are written.

    Returns:
        int32 ``[bs + 1]`` (a view of ``out`` when given).
    """
    if lens.dim() != 1:
        raise ValueError(f"lens must be 1-D, got {tuple(lens.shape)}")
    bs = lens.shape[0]
    if out is None:
        out = torch.empty(bs + 1, dtype=torch.int32, device=lens.device)
    elif out.dim() != 1 or out.shape[0] < bs + 1 or out.dtype != torch.int32:
        raise ValueError(f"out must be int32 1-D with >= {bs + 1} entries, got {tuple(out.shape)} {out.dtype}")
    out = out[: bs + 1]
    out[:1].zero_()
    if bs:
        torch.cumsum(lens, dim=0, dtype=torch.int32, out=out[1:])
    return out


def create_page_table(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    page_table: torch.Tensor,
    pad_value: int = -1,
) -> torch.Tensor:
    """Fill a ``[bs, max_pages]`` page table (in place).

    ``page_table[i, j] = req_to_token[req_pool_indices[i], j * page_size] // page_size``
    for ``j < cdiv(seq_lens[i], page_size)``, ``pad_value`` for the other columns. Pages are
    contiguous slot ranges, so the first slot of a page determines the page id. Columns
    past ``page_table.shape[1]`` are not written (the caller sizes the table).

    Args:
        req_to_token: int32 ``[max_reqs, max_context_len]``.
        req_pool_indices: int32/int64 ``[bs]``.
        seq_lens: int32/int64 ``[bs]`` tokens per request.
        page_size: tokens per page (>= 1).
        page_table: int32/int64 ``[bs, max_pages]``, last dim contiguous; written.
        pad_value: value of unused columns.

    Returns:
        ``page_table``.

    Raises:
        ValueError: on wrong ranks, dtypes, devices or ``page_size < 1``.
    """
    _check_common(req_to_token, req_pool_indices, seq_lens, "seq_lens")
    if int(page_size) < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    bs = req_pool_indices.shape[0]
    if page_table.dim() != 2 or page_table.shape[0] < bs or page_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"page_table must be int32/int64 [>= bs={bs}, max_pages], got {tuple(page_table.shape)} {page_table.dtype}")
    if page_table.shape[1] and page_table.stride(1) != 1:
        raise ValueError("page_table rows must be contiguous")
    if bs == 0 or page_table.shape[1] == 0:
        return page_table
    width = page_table.shape[1]
    _create_page_table_kernel[(bs,)](
        req_to_token,
        req_pool_indices,
        seq_lens,
        page_table,
        req_to_token.stride(0),
        page_table.stride(0),
        width,
        int(page_size),
        int(pad_value),
        BLOCK=min(1024, triton.next_power_of_2(width)),
    )
    return page_table


def block_table_width(max_seq_len: int, page_size: int, multiple: int = 1) -> int:
    """Columns of a block table: ``cdiv(cdiv(max_seq_len, page_size), multiple) * multiple``.

    MLA kernels read whole groups of ``multiple`` pages, so the table is padded to that
    multiple (host ints; no device work).
    """
    if page_size < 1 or multiple < 1 or max_seq_len < 0:
        raise ValueError(f"need max_seq_len >= 0, page_size >= 1, multiple >= 1; got {max_seq_len}, {page_size}, {multiple}")
    pages = triton.cdiv(max_seq_len, page_size)
    return triton.cdiv(pages, multiple) * multiple


def create_block_kv_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    block_kv_indices: torch.Tensor,
    pad_value: int = -1,
) -> torch.Tensor:
    """MLA block table: page ids per request, ``pad_value`` past each request's last page.

    Same contract as `create_page_table`; size ``block_kv_indices`` with
    `block_table_width` (``[bs, block_table_width(max_seq_len, page_size, multiple)]``).
    """
    return create_page_table(req_to_token, req_pool_indices, seq_lens, page_size, block_kv_indices, pad_value)
