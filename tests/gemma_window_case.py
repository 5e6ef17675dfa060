"""One DECODE step of Gemma 3 270M's attention shape (Hq 4, Hkv 1, head_dim 256, window
512) over a 2-layer paged pool of random K/V, through the triton backend: layer 0 is a
local (sliding-window) layer, layer 1 a global one. Shared by the CPU (interpreter) and
GPU window tests."""

from __future__ import annotations

import torch

from attnserve.attention.backend_config import AttentionBackendConfig
from attnserve.attention.radix_attention import RadixAttention
from attnserve.attention.registry import create_attention_backend
from attnserve.forward_batch import ForwardBatch, ForwardMode
from attnserve.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool, TokenToKVPoolAllocator
from attnserve.model_loader.dummy import dummy_hf_config
from attnserve.model_loader.model_config import ModelConfig


def build_decode_case(bs: int, ctx: int, dtype, page_size: int = 1, seed: int = 0, device: str = "cuda") -> dict:
    """``bs`` requests of ``ctx`` tokens (the last is the new one); returns the backend,
    the batch, ``q`` ``[bs, Hq * D]``, the ``local``/``glob`` layers, the K/V buffers and
    each request's slots ``[bs, ctx]``."""
    mc = ModelConfig.from_hf_config(dummy_hf_config("gemma3-270m"))
    hq, hkv, d = mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim
    size = bs * (ctx + page_size)
    size -= size % page_size
    req_pool = ReqToTokenPool(bs + 1, ctx + 1, device)
    alloc = TokenToKVPoolAllocator(size, page_size)
    kv = MHATokenToKVPool(size, page_size, dtype, hkv, d, 2, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for buf in kv.k_buffer + kv.v_buffer:
        buf.normal_(generator=gen)
    rows = req_pool.alloc(bs)
    slots = alloc.alloc_extend([0] * bs, [ctx] * bs, [0] * bs)
    for i, r in enumerate(rows):
        req_pool.write(r, 0, slots[i * ctx:(i + 1) * ctx])
    out_loc = slots.view(bs, ctx)[:, -1].contiguous()
    config = AttentionBackendConfig.from_pools(req_pool, kv, hq, layer_windows=(mc.sliding_window_size, -1))
    backend = create_attention_backend("triton", config)
    fb = ForwardBatch.init_new(ForwardMode.DECODE, [0] * bs, rows, [ctx - 1] * bs, [1] * bs, out_loc, req_pool, kv,
                               backend, device)
    backend.init_forward_metadata(fb)
    scale = float(mc.hf_config.query_pre_attn_scalar) ** -0.5
    local = RadixAttention(hq, d, scale, hkv, layer_id=0, sliding_window_size=mc.sliding_window_size)
    glob = RadixAttention(hq, d, scale, hkv, layer_id=1, sliding_window_size=-1)
    q = torch.randn(bs, hq * d, generator=gen, device=device).to(dtype)
    return dict(backend=backend, fb=fb, q=q, local=local, glob=glob, k_buffers=kv.k_buffer, v_buffers=kv.v_buffer,
                rows=rows, slots=slots.view(bs, ctx), model_config=mc)


def decode_fn(case: dict, layer):
    """A closure running the layer's decode attention (no KV write)."""
    backend, fb, q = case["backend"], case["fb"], case["q"]
    return lambda: backend.forward_decode(q, None, None, layer, fb, save_kv_cache=False)


def graph_us(fn, calls: int = 50, replays: int = 10) -> float:
    """Median µs per call of ``fn`` captured ``calls`` times in one CUDA graph."""
    import statistics

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(times)
