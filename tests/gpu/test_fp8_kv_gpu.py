"""FP8 KV cache on a GPU: the store kernel's quantization, the triton backend over an FP8
pool against float64 attention on the dequantized cache, and the engine with graphs."""

import pytest
import torch

from attention_harness import backend_config, make_batch, naive_reference
from attnserve.forward_batch import ForwardMode
from attnserve.mem_cache.kv_quant import dequantize_kv, quantize_kv
from attnserve.mem_cache.memory_pool import MHATokenToKVPool
from attnserve.mem_cache.store_kv import store_kv

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("no_tf32")]
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("dtype", FP8)
def test_store_kv_quantizes_like_the_reference(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    kb = torch.zeros(64, 4, 32, dtype=dtype, device="cuda")
    vb = torch.zeros(64, 4, 16, dtype=dtype, device="cuda")
    k = torch.randn(10, 4, 32, device="cuda", generator=g, dtype=torch.bfloat16) * 30
    v = torch.randn(10, 4, 16, device="cuda", generator=g, dtype=torch.bfloat16)
    loc = torch.randperm(63, device="cuda", generator=g)[:10] + 1
    store_kv(kb, vb, loc, k, v, k_scale=0.03, v_scale=0.2)
    assert torch.equal(kb[loc].view(torch.uint8), quantize_kv(k, 0.03, dtype).view(torch.uint8))
    assert torch.equal(vb[loc].view(torch.uint8), quantize_kv(v, 0.2, dtype).view(torch.uint8))
    assert torch.isfinite(kb.float()).all()  # saturated, never inf/NaN


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("mode,prefix,ext,hq,hkv,window,cap", [
    (ForwardMode.DECODE, [0, 9, 300, 33], [1, 1, 1, 1], 8, 2, -1, 0.0),
    (ForwardMode.DECODE, [40, 170], [1, 1], 8, 8, 16, 5.0),
    (ForwardMode.EXTEND, [0, 70, 200], [5, 33, 12], 8, 1, -1, 0.0),
    (ForwardMode.EXTEND, [90, 20], [6, 40], 4, 2, 24, 3.0),
])
def test_triton_backend_over_fp8_pool(dtype, mode, prefix, ext, hq, hkv, window, cap):
    from attnserve.attention.triton_backend import TritonAttnBackend

    case = make_batch(mode, prefix, ext, hq, hkv, 64, 16, dtype=torch.bfloat16, window=window, logit_cap=cap,
                      seed=len(prefix) + hq, device="cuda")
    case.layer.set_kv_scales(0.05, 0.3)
    src = case.pool
    pool = MHATokenToKVPool(src.size, src.page_size, dtype, hkv, 64, 1, "cuda")
    pool.set_kv_buffer(case.layer, torch.arange(src.size + src.page_size, device="cuda"), src.k_buffer[0],
                       src.v_buffer[0])
    case.fb.token_to_kv_pool = pool
    backend = TritonAttnBackend(backend_config(case))
    case.fb.attn_backend = backend
    backend.init_forward_metadata(case.fb)
    t = case.q.shape[0]
    out = case.layer(case.q.reshape(t, -1), case.k.reshape(t, -1), case.v.reshape(t, -1), case.fb).view(t, hq, 64)
    assert not torch.isnan(out).any()
    ref_pool = MHATokenToKVPool(src.size, src.page_size, torch.float32, hkv, 64, 1, "cuda")
    ref_pool.k_buffer[0].copy_(dequantize_kv(pool.k_buffer[0], 0.05))
    ref_pool.v_buffer[0].copy_(dequantize_kv(pool.v_buffer[0], 0.3))
    if mode.is_extend():  # the extend kernel reads the step's own keys unquantized
        ref_pool.k_buffer[0][case.fb.out_cache_loc] = case.k.float()
        ref_pool.v_buffer[0][case.fb.out_cache_loc] = case.v.float()
    case.pool = ref_pool
    ref = naive_reference(case)
    err = (out.double().cpu() - ref).norm() / ref.norm()
    assert err < 1e-2, err  # bf16 queries and output


def test_engine_with_fp8_kv_and_graphs():
    from attnserve.engine.engine import Engine
    from attnserve.engine.sampling_params import SamplingParams
    from attnserve.server_args import ServerArgs

    outs = {}
    for name in ("auto", "fp8_e4m3", "fp8_e5m2"):
        engine = Engine(ServerArgs(model="smollm2-135m", load_format="dummy", device="cuda", kv_cache_dtype=name,
                                   max_total_tokens=20000, max_running_requests=8, context_length=1024,
                                   cuda_graph_max_bs=8))
        assert engine.model_runner.cuda_graph_runner is not None
        reqs = [engine.add_request(list(range(100 + i, 160 + 3 * i)),
                                   SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True))
                for i in range(5)]
        while engine.has_work():
            engine.step()
        outs[name] = [list(r.output_ids) for r in reqs]
        assert all(len(o) == 24 for o in outs[name])
        alloc = engine.model_runner.token_to_kv_pool_allocator
        assert alloc.available_size() + engine.scheduler.tree_cache.evictable_size() == alloc.size
        del engine
        torch.cuda.empty_cache()
    # the first generated token comes from the prefill, whose keys of the step itself are
    # unquantized in the triton extend: identical to the bf16 cache
    assert [o[0] for o in outs["fp8_e4m3"]] == [o[0] for o in outs["auto"]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, *FP8])
def test_mla_pool_fused_store_matches_index_put(dtype):
    """The latent pool's CUDA write (one `store_kv` launch for c_kv and k_pe, quantising an fp8
    pool with the layer's k_scale) leaves the bytes of its ``index_put`` path, for both
    `set_mla_kv_buffer` (the two parts as views of one projection output) and
    `set_kv_buffer` (whole rows)."""
    from types import SimpleNamespace

    from attnserve.mem_cache.memory_pool import MLATokenToKVPool

    g = torch.Generator(device="cuda").manual_seed(3)
    layer = SimpleNamespace(layer_id=1, k_scale=0.07, v_scale=0.07)
    fused = MLATokenToKVPool(128, 64, dtype, 512, 64, 2, "cuda")
    plain = MLATokenToKVPool(128, 64, dtype, 512, 64, 2, "cuda", use_fused_store=False)
    assert fused.use_fused_store and not plain.use_fused_store
    kv_a = torch.randn(9, 600, device="cuda", generator=g, dtype=torch.bfloat16) * 20  # some entries saturate
    c_kv, k_pe = kv_a[:, :512].unsqueeze(1), kv_a[:, 536:].unsqueeze(1)
    loc = torch.randperm(128, device="cuda", generator=g)[:9]
    rows = torch.randn(4, 1, 576, device="cuda", generator=g, dtype=torch.bfloat16)
    for pool in (fused, plain):
        pool.set_mla_kv_buffer(layer, loc, c_kv, k_pe)
        pool.set_kv_buffer(layer, loc[:4] + 0, rows.clone())
    for a, b in zip(fused.kv_buffer, plain.kv_buffer):
        assert torch.equal(a.view(torch.uint8) if dtype in FP8 else a, b.view(torch.uint8) if dtype in FP8 else b)
    assert fused.kv_buffer[1].float().abs().sum() > 0 and not fused.kv_buffer[0].float().any()
