"""`mem_cache.zeroed_memory.zeroed`: the KV pools' zero buffers (CPU buffers from a private
anonymous mapping, zero pages on first touch)."""

from __future__ import annotations

import ctypes
import gc
import mmap
import os

import pytest
import torch

from attnserve.mem_cache.memory_pool import MHATokenToKVPool
from attnserve.mem_cache.zeroed_memory import LAZY_MIN_BYTES, zeroed

LAZY = hasattr(mmap, "MAP_ANONYMOUS")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int32])
def test_large_cpu_buffer_is_zero_writable_and_its_own(dtype):
    shape = (LAZY_MIN_BYTES // dtype.itemsize // 64 + 3, 4, 16)  # just above the threshold
    t = zeroed(shape, dtype, "cpu")
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"
    assert not t.float().any()
    if LAZY:  # the storage is the mapping: page-aligned, not from the allocator
        assert t.data_ptr() % mmap.PAGESIZE == 0
    t[-1, 3, 15] = 2
    t[0, 0, 0] = 1
    gc.collect()  # the mapping lives as long as the tensor
    assert t.float().sum().item() == 3
    u = zeroed(shape, dtype, "cpu")  # a second buffer shares nothing with the first
    assert not u.float().any()


def test_small_and_non_cpu_buffers_are_plain_zeros():
    small = zeroed((3, 5), torch.float32, "cpu")
    assert small.shape == (3, 5) and not small.any()
    meta = zeroed((1 << 20, 8), torch.bfloat16, torch.device("meta"))
    assert meta.device.type == "meta" and meta.shape == (1 << 20, 8)
    assert zeroed((0, 8), torch.float32, "cpu").numel() == 0


@pytest.mark.skipif(not LAZY or not hasattr(os, "fork"), reason="needs MAP_ANONYMOUS and fork")
def test_a_forked_child_does_not_write_into_the_parents_buffer():
    t = zeroed((LAZY_MIN_BYTES // 4 + 1,), torch.float32, "cpu")
    pid = os.fork()
    if pid == 0:  # child: write through ctypes (no torch threads after fork), leave without cleanup
        ctypes.memset(t.data_ptr(), 0x7F, 4096)
        os._exit(0 if ctypes.string_at(t.data_ptr(), 1) == b"\x7f" else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert not t.any()  # MAP_PRIVATE: the child's pages were its own copies


def test_cpu_kv_pool_buffers_start_at_zero():
    pool = MHATokenToKVPool(size=8192, page_size=16, dtype=torch.float32, head_num=2, head_dim=64, layer_num=3,
                            device="cpu")
    for buf in pool.buffers():
        assert buf.shape == (8192 + 16, 2, 64) and not buf.any()
    if LAZY:
        assert all(b.data_ptr() % mmap.PAGESIZE == 0 for b in pool.buffers())
