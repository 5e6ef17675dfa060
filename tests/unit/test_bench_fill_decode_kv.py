"""`bench.offline.fill_decode_kv` (the cache contents of the engine-loop and step benchmarks)
on the CPU, with a 16-bit and an fp8 pool: every layer's buffers hold N(0, 1) values rounded
to the pool's dtype, and the requests' rows point at distinct slots plus one decode slot."""

import pytest
import torch

from attnserve.bench.offline import fill_decode_kv
from attnserve.engine.llm import LLM
from attnserve.forward_batch import ForwardMode


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_fill_decode_kv_fills_every_layer(kv_cache_dtype):
    llm = LLM("llama-tiny", load_format="dummy", device="cpu", max_total_tokens=512, kv_cache_dtype=kv_cache_dtype)
    runner = llm.engine.model_runner
    free_before = runner.token_to_kv_pool_allocator.available_size()
    bs, ctx = 3, 40
    rows, slots, out_loc, fb = fill_decode_kv(runner, bs, ctx)
    assert fb.forward_mode == ForwardMode.DECODE and len(rows) == bs
    assert torch.cat([slots, out_loc]).unique().numel() == bs * (ctx + 1)
    assert runner.token_to_kv_pool_allocator.available_size() == free_before - bs * (ctx + 1)
    pool = runner.token_to_kv_pool
    for layer in range(runner.model_config.num_hidden_layers):
        for buf in (pool.get_key_buffer(layer), pool.get_value_buffer(layer)):
            assert buf.dtype == pool.dtype
            x = buf.float()
            assert torch.isfinite(x).all()
            assert 0.8 < x.std().item() < 1.2 and abs(x.mean().item()) < 0.1  # N(0, 1), not zeros
    for i, r in enumerate(rows):
        assert runner.req_to_token_pool.slots_of(r, ctx + 1).to(torch.int64).tolist() == \
            slots[i * ctx:(i + 1) * ctx].tolist() + [int(out_loc[i])]
