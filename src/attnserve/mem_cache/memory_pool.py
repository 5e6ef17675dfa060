"""Two-level paged KV cache (SGLang ``mem_cache/memory_pool.py`` design).

* `ReqToTokenPool` maps (request row, token position) -> KV slot.
* `TokenToKVPoolAllocator` (``allocator.py``, re-exported here) hands out KV slots in
  pages of ``page_size`` tokens.
* `MHATokenToKVPool` / `MLATokenToKVPool` own the physical K/V (or MLA latent) storage.

Slot layout: the physical buffers have ``size + page_size`` rows; page 0 (slots
``0 .. page_size-1``) is never handed out, so slot 0 is a safe dummy target for padded
writes (CUDA-graph padding rows write there). Usable slots are
``page_size .. page_size + size - 1``.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Union

import torch

from attnserve.mem_cache.allocator import TokenToKVPoolAllocator  # noqa: F401 (re-export)
from attnserve.mem_cache.kv_quant import is_fp8, quantize_kv
from attnserve.mem_cache.store_kv import KVStoreTarget, fused_kernels_available, store_kv
from attnserve.mem_cache.zeroed_memory import zeroed


class ReqToTokenPool:
    """``req_to_token`` int32 ``[size, max_context_len]``: row r holds the KV slot of each
    token of the request that owns row r.

    On a GPU the table lives on the device (the attention kernels read it there) and a host
    mirror ``req_to_token_host`` holds the same values, so the scheduler can find a request's
    slots (to free them, or the last one to continue a page) without reading the device. On
    the CPU both names are the same tensor. Writes go to both: a step passes its
    (row, position, slot) triples once, as host tensors plus the device copies of
    them that travel in the step's packed input buffer (`write_host` as soon as the slots
    are allocated, `write_device` once the step's inputs are on the device).

    Args:
        size: maximum number of concurrently running requests (rows).
        max_context_len: maximum tokens per request (columns).
        device: where ``req_to_token`` lives.

    Raises:
        ValueError: ``size`` or ``max_context_len`` below 1.
    """

    def __init__(self, size: int, max_context_len: int, device: Union[str, torch.device]):
        if size < 1 or max_context_len < 1:
            raise ValueError(f"ReqToTokenPool needs size >= 1 and max_context_len >= 1, got {size}, {max_context_len}")
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int32, device=self.device)
        if self.device.type == "cpu":
            self.req_to_token_host = self.req_to_token
        else:
            self.req_to_token_host = torch.zeros((size, max_context_len), dtype=torch.int32)
        self._free_rows: List[int] = list(range(size))
        self._in_use = [False] * size
        #: when a list: every `write` is also appended here as ``(row, start, slots)`` (rank 0
        #: of a tensor-parallel group sends them to the other ranks with the next step)
        self.write_log: Optional[list] = None

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
        """``req_to_token[row, start:start+len(slots)] = slots`` (one request; tests and
        benchmarks; the scheduler uses `write_host` + `write_device`)."""
        n = slots.numel()
        if self.write_log is not None:
            self.write_log.append((int(row), int(start), slots.to("cpu", torch.int32).clone()))
        self.req_to_token[row, start : start + n] = slots.to(self.device, torch.int32)
        if self.req_to_token_host is not self.req_to_token:
            self.req_to_token_host[row, start : start + n] = slots.to("cpu", torch.int32)

    def write_host(self, rows: torch.Tensor, cols: torch.Tensor, slots: torch.Tensor) -> None:
        """The host mirror's part of a batched write (on the CPU, the table itself).

        Args:
            rows / cols: int64 ``[n]`` host tensors; slots: int32 or int64 ``[n]`` host.
        """
        self.req_to_token_host[rows, cols] = slots.to(torch.int32)

    def write_device(
        self, rows: torch.Tensor, cols: torch.Tensor, slots: torch.Tensor,
        rows_dev: Optional[torch.Tensor] = None, cols_dev: Optional[torch.Tensor] = None,
        slots_dev: Optional[torch.Tensor] = None,
    ) -> None:
        """The device table's part of a batched write, in one indexed write (nothing to do
        on the CPU, where `write_host` wrote the table).

        Args:
            rows / cols / slots: the host tensors of `write_host`.
            rows_dev / cols_dev / slots_dev: the same values already on the device (int64,
                int64, int32); when given, the table is written from them (no copy of its
                own); otherwise the host tensors are copied over.
        """
        if self.req_to_token_host is self.req_to_token:
            return
        if rows_dev is None:
            rows_dev, cols_dev = rows.to(self.device), cols.to(self.device)
            slots_dev = slots.to(self.device, torch.int32)
        self.req_to_token.index_put_((rows_dev, cols_dev), slots_dev)

    def slots_of(self, row: int, length: int) -> torch.Tensor:
        """Host int32 view of the first ``length`` slots of ``row``."""
        return self.req_to_token_host[row, :length]

    def clear(self) -> None:
        self._free_rows = list(range(self.size))
        self._in_use = [False] * self.size


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

    def buffers(self) -> list:
        """Every per-layer storage tensor (rows are slots)."""
        raise NotImplementedError

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the K/V of slots ``src`` to slots ``dst`` (int64 ``[n]`` on the pool's
        device) in every layer; every source is read before any destination is written, so
        the two may overlap. Used to move an accepted draft path into place."""
        if src.numel():
            for buf in self.buffers():
                raw = buf.view(torch.uint8) if is_fp8(buf.dtype) else buf  # byte copy: no fp8 kernels needed
                raw[dst] = raw[src]

    def mem_bytes(self) -> int:
        raise NotImplementedError


class MHATokenToKVPool(KVCache):
    """Per-layer ``k_buffer[l]`` ``[size + page_size, head_num, head_dim]`` and ``v_buffer[l]``
    ``[size + page_size, head_num, v_head_dim]``.

    Args:
        size: usable token slots (same as the allocator's).
        page_size: tokens per page.
        dtype: storage dtype (float32/float16/bfloat16, or float8_e4m3fn/float8_e5m2 for an
            FP8 cache: writes store ``saturate(x / layer.k_scale)`` etc., `kv_quant`).
        head_num: KV heads per layer (after tensor parallelism).
        head_dim / v_head_dim: K and V head sizes (``v_head_dim`` defaults to ``head_dim``).
        layer_num: number of attention layers.

        use_fused_store: False keeps the ``index_put`` write on CUDA too
            (``--disable-fused-kernels``).

    On a CUDA pool `set_kv_buffer` writes K and V with one Triton launch (`store_kv`) when
    ``use_fused_store`` and Triton is installed; elsewhere it uses ``index_put``.
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
        use_fused_store: bool = True,
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
        # zero-filled (a padded or masked read must not meet NaN garbage); on the CPU lazily (`zeroed`)
        self.k_buffer = [zeroed((rows, head_num, head_dim), dtype, self.device) for _ in range(layer_num)]
        self.v_buffer = [zeroed((rows, head_num, self.v_head_dim), dtype, self.device) for _ in range(layer_num)]
        self.use_fused_store = bool(use_fused_store) and self.device.type == "cuda" and fused_kernels_available()

    def buffers(self) -> list:
        return [*self.k_buffer, *self.v_buffer]

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def fused_store_target(
        self, layer_id: int, loc: torch.Tensor, value: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0
    ) -> Optional[KVStoreTarget]:
        """The layer's K/V buffers as a `KVStoreTarget` for a kernel that writes the cache
        itself (RoPE + KV store in one launch; an FP8 pool is quantised there with
        ``k_scale`` / ``v_scale``), or None when this pool writes through `set_kv_buffer`
        only (CPU pool, fused kernels disabled, ``loc`` not on a GPU). ``value``: ``[n,
        head_num * v_head_dim]`` or ``[n, head_num, v_head_dim]``."""
        if not self.use_fused_store or not loc.is_cuda or loc.dtype not in (torch.int64, torch.int32):
            return None
        return KVStoreTarget(self.k_buffer[layer_id], self.v_buffer[layer_id], loc, value, k_scale, v_scale)

    def set_kv_buffer(self, layer, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor) -> None:
        """Write ``cache_k``/``cache_v`` ``[n, head_num, D]`` into rows ``loc`` (int64 ``[n]``)
        of ``layer.layer_id``'s buffers, casting to the pool dtype (an FP8 pool quantizes
        with ``layer.k_scale`` / ``layer.v_scale``)."""
        lid = layer.layer_id
        if (
            self.use_fused_store
            and cache_k.is_cuda
            and loc.is_cuda
            and loc.dtype in (torch.int64, torch.int32)
            and cache_k.stride(-1) == 1
            and cache_v.stride(-1) == 1
        ):
            store_kv(self.k_buffer[lid], self.v_buffer[lid], loc, cache_k, cache_v, layer.k_scale, layer.v_scale)
            return
        self.k_buffer[lid][loc] = quantize_kv(cache_k, layer.k_scale, self.dtype)
        self.v_buffer[lid][loc] = quantize_kv(cache_v, layer.v_scale, self.dtype)

    def mem_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.k_buffer + self.v_buffer)


class MLATokenToKVPool(KVCache):
    """Per-layer latent cache ``kv_buffer[l]`` ``[size + page_size, 1, kv_lora_rank +
    qk_rope_head_dim]`` (576 for DeepSeek-V2/V3): the compressed KV ``c_kv`` followed by the
    shared rotary key ``k_pe`` (DeepSeek-V2 paper, arXiv:2405.04434, section 2.1).

    ``get_key_buffer`` returns the whole 576-wide row, ``get_value_buffer`` its first
    ``kv_lora_rank`` columns (a view).

    Writes on CUDA go through `store_kv` (one Triton launch for both parts, quantising an FP8
    pool) when ``use_fused_store`` and Triton is installed; elsewhere through ``index_put``.
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
        use_fused_store: bool = True,
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
        self.kv_buffer = [zeroed((rows, 1, self.head_dim), dtype, self.device) for _ in range(layer_num)]
        self.use_fused_store = bool(use_fused_store) and self.device.type == "cuda" and fused_kernels_available()

    def buffers(self) -> list:
        return list(self.kv_buffer)

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.kv_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.kv_buffer[layer_id][..., : self.kv_lora_rank]

    def set_kv_buffer(self, layer, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: Optional[torch.Tensor] = None) -> None:
        """Write full latent rows ``cache_k`` ``[n, 1, kv_lora_rank + rope]`` (``cache_v``
        ignored); an FP8 pool quantizes with ``layer.k_scale`` (the latent row is key and
        value, so one scale)."""
        r = self.kv_lora_rank
        if not self._store_fused(layer, loc, cache_k[..., :r], cache_k[..., r:]):
            self.kv_buffer[layer.layer_id][loc] = quantize_kv(cache_k, layer.k_scale, self.dtype)

    def fused_store_target(self, layer_id: int, loc: torch.Tensor, value: torch.Tensor, k_scale: float = 1.0,
                           v_scale: float = 1.0) -> None:
        """None: the latent pool has no fused RoPE + store (the layer stores the latent)."""
        return None

    def set_mla_kv_buffer(self, layer, loc: torch.Tensor, cache_k_nope: torch.Tensor, cache_k_rope: torch.Tensor) -> None:
        """Write ``c_kv`` ``[n, 1, kv_lora_rank]`` and ``k_pe`` ``[n, 1, rope]`` into rows ``loc``
        (an FP8 pool quantizes both with ``layer.k_scale``)."""
        if self._store_fused(layer, loc, cache_k_nope, cache_k_rope):
            return
        buf = self.kv_buffer[layer.layer_id]
        buf[loc, :, : self.kv_lora_rank] = quantize_kv(cache_k_nope, layer.k_scale, self.dtype)
        buf[loc, :, self.kv_lora_rank :] = quantize_kv(cache_k_rope, layer.k_scale, self.dtype)

    def _store_fused(self, layer, loc: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor) -> bool:
        """Write the two parts of the rows ``loc`` with one `store_kv` launch (the row's
        ``c_kv`` and ``k_pe`` columns as its K and V buffers, both scaled by
        ``layer.k_scale``); False, writing nothing, where it does not apply (CPU, fused
        stores off, a non-contiguous last dim)."""
        if not (self.use_fused_store and loc.is_cuda and loc.dtype in (torch.int64, torch.int32)
                and c_kv.is_cuda and c_kv.stride(-1) == 1 and k_pe.stride(-1) == 1):
            return False
        buf = self.kv_buffer[layer.layer_id]
        r = self.kv_lora_rank
        store_kv(buf[..., :r], buf[..., r:], loc, c_kv.reshape(-1, 1, r), k_pe.reshape(-1, 1, self.qk_rope_head_dim),
                 layer.k_scale, layer.k_scale)
        return True

    def mem_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.kv_buffer)
