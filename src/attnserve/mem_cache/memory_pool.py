"""Two-level paged KV cache (SGLang ``mem_cache/memory_pool.py`` design).

* `ReqToTokenPool` maps (request row, token position) -> KV slot.
* `TokenToKVPoolAllocator` hands out KV slots in pages of ``page_size`` tokens.
* `MHATokenToKVPool` / `MLATokenToKVPool` own the physical K/V (or MLA latent) storage.

Slot layout: the physical buffers have ``size + page_size`` rows; page 0 (slots
``0 .. page_size-1``) is never handed out, so slot 0 is a safe dummy target for padded
writes (CUDA-graph padding rows write there). Usable slots are
``page_size .. page_size + size - 1``.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Union

import torch

from attnserve.mem_cache.store_kv import KVStoreTarget, fused_kernels_enabled, store_kv


class ReqToTokenPool:
    """``req_to_token`` int32 ``[size, max_context_len]``: row r holds the KV slot of each
    token of the request that owns row r.

    Args:
        size: maximum number of concurrently running requests (rows).
        max_context_len: maximum tokens per request (columns).
        device: where ``req_to_token`` lives (the attention kernels read it there).
    """

    def __init__(self, size: int, max_context_len: int, device: Union[str, torch.device]):
        if size < 1 or max_context_len < 1:
            raise ValueError(f"ReqToTokenPool needs size >= 1 and max_context_len >= 1, got {size}, {max_context_len}")
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int32, device=self.device)
        self._free_rows: List[int] = list(range(size))
        self._in_use = [False] * size

    def available_size(self) -> int:
        return len(self._free_rows)

    def alloc(self, need_size: int = 1) -> Optional[List[int]]:
        """Return ``need_size`` free rows, or None (nothing taken) when too few are free."""
        if need_size > len(self._free_rows):
            return None
        rows, self._free_rows = self._free_rows[:need_size], self._free_rows[need_size:]
        for r in rows:
            self._in_use[r] = True
        return rows

    def free(self, rows: Union[int, Sequence[int]]) -> None:
        """Give rows back. Raises ValueError on a row that is not in use (double free)."""
        rows = [rows] if isinstance(rows, int) else list(rows)
        for r in rows:
            if not (0 <= r < self.size) or not self._in_use[r]:
                raise ValueError(f"ReqToTokenPool.free: row {r} is not allocated")
            self._in_use[r] = False
            self._free_rows.append(r)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """``req_to_token[row, start:start+len(slots)] = slots``."""
        self.req_to_token[row, start : start + slots.numel()] = slots.to(self.device, torch.int32)

    def clear(self) -> None:
        self._free_rows = list(range(self.size))
        self._in_use = [False] * self.size


class TokenToKVPoolAllocator:
    """Hands out KV slots in pages of ``page_size`` tokens; page 0 is reserved.

    A request's tokens fill its pages in order: a new token goes to the slot after the
    request's last one while that page has room, and opens a fresh page otherwise
    (`alloc_extend`). Bookkeeping lives on the host; returned slot tensors are int64 on
    the host (callers move them to the device once per step).

    Args:
        size: usable token slots; rounded down to a multiple of ``page_size``.
        page_size: tokens per page (>= 1).
    """

    def __init__(self, size: int, page_size: int = 1):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.num_pages = size // page_size
        if self.num_pages < 1:
            raise ValueError(f"KV pool of {size} tokens holds no page of {page_size} tokens")
        self.size = self.num_pages * page_size
        self.clear()

    def clear(self) -> None:
        self._free_pages: List[int] = list(range(1, self.num_pages + 1))
        self._page_free = [False] + [True] * self.num_pages

    def available_size(self) -> int:
        """Free token slots (whole free pages only)."""
        return len(self._free_pages) * self.page_size

    def num_free_pages(self) -> int:
        return len(self._free_pages)

    def _take_pages(self, n: int) -> Optional[List[int]]:
        if n > len(self._free_pages):
            return None
        pages, self._free_pages = self._free_pages[:n], self._free_pages[n:]
        for p in pages:
            self._page_free[p] = False
        return pages

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        """Slots for ``need_size`` tokens on fresh pages, or None when the pool is too full.

        With ``page_size > 1`` the last page may be partly used; its unused slots stay with
        the caller until `free`.
        """
        if need_size < 0:
            raise ValueError(f"need_size must be >= 0, got {need_size}")
        num_pages = -(-need_size // self.page_size)
        pages = self._take_pages(num_pages)
        if pages is None:
            return None
        if not pages:
            return torch.empty(0, dtype=torch.int64)
        page_t = torch.tensor(pages, dtype=torch.int64)
        slots = (page_t[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)
        return slots[:need_size]

    def pages_needed(self, prefix_len: int, seq_len: int) -> int:
        """Fresh pages a request needs to grow from ``prefix_len`` to ``seq_len`` tokens."""
        ps = self.page_size
        return -(-seq_len // ps) - (-(-prefix_len // ps))

    def alloc_extend(
        self, prefix_lens: Sequence[int], seq_lens: Sequence[int], last_loc: Sequence[int]
    ) -> Optional[torch.Tensor]:
        """Slots for the new tokens ``prefix_lens[i] .. seq_lens[i]-1`` of each request.

        Args:
            prefix_lens: tokens each request already has in the cache.
            seq_lens: tokens each request will have after this step.
            last_loc: slot of each request's last cached token (ignored when its
                ``prefix_len`` is 0).

        Returns:
            int64 ``[sum(seq_lens - prefix_lens)]`` slots in batch order, or None (nothing
            taken) when the pool lacks pages.
        """
        ps = self.page_size
        need = sum(self.pages_needed(p, s) for p, s in zip(prefix_lens, seq_lens))
        pages = self._take_pages(need)
        if pages is None:
            return None
        out: List[int] = []
        it = iter(pages)
        for p, s, last in zip(prefix_lens, seq_lens, last_loc):
            nxt = int(last) + 1 if p % ps else None
            for pos in range(p, s):
                if pos % ps == 0:
                    nxt = next(it) * ps
                out.append(nxt)
                nxt += 1
        return torch.tensor(out, dtype=torch.int64)

    def alloc_decode(self, seq_lens: Sequence[int], last_loc: Sequence[int]) -> Optional[torch.Tensor]:
        """One new slot per request whose length grows from ``seq_lens[i]-1`` to ``seq_lens[i]``."""
        return self.alloc_extend([s - 1 for s in seq_lens], seq_lens, last_loc)

    def free(self, slots: torch.Tensor) -> None:
        """Return the pages that hold ``slots`` (all slots of the freed requests).

        Raises:
            ValueError: on a slot of the reserved page 0 or of a page that is already free.
        """
        if slots.numel() == 0:
            return
        pages = torch.unique(slots.detach().to("cpu", torch.int64) // self.page_size).tolist()
        for p in pages:
            if p < 1 or p > self.num_pages or self._page_free[p]:
                raise ValueError(f"TokenToKVPoolAllocator.free: page {p} is not allocated")
        for p in pages:
            self._page_free[p] = True
        self._free_pages.extend(pages)


class KVCache:
    """Physical KV storage shared by all layers. Subclasses define the buffers."""

    size: int
    page_size: int
    layer_num: int
    dtype: torch.dtype
    device: torch.device

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        raise NotImplementedError

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        raise NotImplementedError

    def get_kv_buffer(self, layer_id: int):
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def set_kv_buffer(self, layer, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor) -> None:
        raise NotImplementedError

    def paged_view(self, buffer: torch.Tensor) -> torch.Tensor:
        """``[slots, H, D]`` -> ``[num_pages + 1, page_size, H, D]`` (a view, never a copy)."""
        return buffer.view(-1, self.page_size, *buffer.shape[1:])

    def mem_bytes(self) -> int:
        raise NotImplementedError


class MHATokenToKVPool(KVCache):
    """Per-layer ``k_buffer[l]`` ``[size + page_size, head_num, head_dim]`` and ``v_buffer[l]``
    ``[size + page_size, head_num, v_head_dim]``.

    Args:
        size: usable token slots (same as the allocator's).
        page_size: tokens per page.
        dtype: storage dtype (float32/float16/bfloat16).
        head_num: KV heads per layer (after tensor parallelism).
        head_dim / v_head_dim: K and V head sizes (``v_head_dim`` defaults to ``head_dim``).
        layer_num: number of attention layers.

    On a CUDA pool `set_kv_buffer` writes K and V with one Triton launch (`store_kv`) unless
    ``ATTNSERVE_DISABLE_FUSED`` was set at construction; elsewhere it uses ``index_put``.
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        device: Union[str, torch.device],
        v_head_dim: Optional[int] = None,
    ):
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        self.head_num = head_num
        self.head_dim = head_dim
        self.v_head_dim = head_dim if v_head_dim is None else v_head_dim
        self.layer_num = layer_num
        self.device = torch.device(device)
        rows = size + page_size
        self.k_buffer = [torch.zeros((rows, head_num, head_dim), dtype=dtype, device=self.device) for _ in range(layer_num)]
        self.v_buffer = [
            torch.zeros((rows, head_num, self.v_head_dim), dtype=dtype, device=self.device) for _ in range(layer_num)
        ]
        self.use_fused_store = self.device.type == "cuda" and fused_kernels_enabled()

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def fused_store_target(self, layer_id: int, loc: torch.Tensor, value: torch.Tensor) -> Optional[KVStoreTarget]:
        """The layer's K/V buffers as a `KVStoreTarget` for a kernel that writes the cache
        itself (RoPE + KV store in one launch), or None when this pool writes through
        `set_kv_buffer` only (CPU pool, fused kernels disabled, ``loc`` not on a GPU). ``value``: ``[n, head_num * v_head_dim]`` or ``[n, head_num, v_head_dim]``."""
        if not self.use_fused_store or not loc.is_cuda or loc.dtype not in (torch.int64, torch.int32):
            return None
        return KVStoreTarget(self.k_buffer[layer_id], self.v_buffer[layer_id], loc, value)

    def set_kv_buffer(self, layer, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor) -> None:
        """Write ``cache_k``/``cache_v`` ``[n, head_num, D]`` into rows ``loc`` (int64 ``[n]``)
        of ``layer.layer_id``'s buffers, casting to the pool dtype."""
        lid = layer.layer_id
        if (
            self.use_fused_store
            and cache_k.is_cuda
            and loc.is_cuda
            and loc.dtype in (torch.int64, torch.int32)
            and cache_k.stride(-1) == 1
            and cache_v.stride(-1) == 1
        ):
            store_kv(self.k_buffer[lid], self.v_buffer[lid], loc, cache_k, cache_v)
            return
        self.k_buffer[lid][loc] = cache_k.to(self.dtype)
        self.v_buffer[lid][loc] = cache_v.to(self.dtype)

    def mem_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.k_buffer + self.v_buffer)


class MLATokenToKVPool(KVCache):
    """Per-layer latent cache ``kv_buffer[l]`` ``[size + page_size, 1, kv_lora_rank +
    qk_rope_head_dim]`` (576 for DeepSeek-V2/V3): the compressed KV ``c_kv`` followed by the
    shared rotary key ``k_pe`` (DeepSeek-V2 paper, arXiv:2405.04434, section 2.1).

    ``get_key_buffer`` returns the whole 576-wide row, ``get_value_buffer`` its first
    ``kv_lora_rank`` columns (a view).
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        layer_num: int,
        device: Union[str, torch.device],
    ):
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.layer_num = layer_num
        self.device = torch.device(device)
        self.head_num = 1
        self.head_dim = kv_lora_rank + qk_rope_head_dim
        self.v_head_dim = kv_lora_rank
        rows = size + page_size
        self.kv_buffer = [
            torch.zeros((rows, 1, self.head_dim), dtype=dtype, device=self.device) for _ in range(layer_num)
        ]

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.kv_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.kv_buffer[layer_id][..., : self.kv_lora_rank]

    def set_kv_buffer(self, layer, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: Optional[torch.Tensor] = None) -> None:
        """Write full latent rows ``cache_k`` ``[n, 1, kv_lora_rank + rope]`` (``cache_v`` ignored)."""
        self.kv_buffer[layer.layer_id][loc] = cache_k.to(self.dtype)

    def set_mla_kv_buffer(self, layer, loc: torch.Tensor, cache_k_nope: torch.Tensor, cache_k_rope: torch.Tensor) -> None:
        """Write ``c_kv`` ``[n, 1, kv_lora_rank]`` and ``k_pe`` ``[n, 1, rope]`` into rows ``loc``."""
        buf = self.kv_buffer[layer.layer_id]
        buf[loc, :, : self.kv_lora_rank] = cache_k_nope.to(self.dtype)
        buf[loc, :, self.kv_lora_rank :] = cache_k_rope.to(self.dtype)

    def mem_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.kv_buffer)
