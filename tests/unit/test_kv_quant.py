"""FP8 KV cache on the CPU: formats and scales (`kv_quant`), the pools' quantizing writes,
`torch_native` attention over an FP8 cache against a float64 reference computed on the
fp8-rounded K/V, checkpoint scales, and the start-up errors."""

from __future__ import annotations

import pytest
import torch

from attention_harness import backend_config, make_batch, naive_reference
from attnserve.attention.radix_attention import RadixAttention
from attnserve.attention.torch_native import TorchNativeAttnBackend
from attnserve.forward_batch import ForwardMode
from attnserve.mem_cache.kv_quant import (
    check_scale,
    dequantize_kv,
    fp8_max,
    quantize_kv,
    resolve_kv_cache_dtype,
)
from attnserve.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from attnserve.model_loader.kv_scales import KVScaleCollector
from attnserve.server_args import ServerArgs

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("dtype", FP8)
def test_quantize_saturates_and_round_trips(dtype):
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 3
    x[:4] = torch.tensor([1e9, -1e9, float(fp8_max(dtype)) * 0.5 * 0.1, 0.0])
    scale = 0.1
    q = quantize_kv(x, scale, dtype)
    assert q.dtype == dtype
    back = dequantize_kv(q, scale)
    assert torch.isfinite(back).all()
    assert back[0] == fp8_max(dtype) * scale and back[1] == -fp8_max(dtype) * scale  # saturated, not inf
    e4m3 = dtype == torch.float8_e4m3fn
    rel = 2.0 ** -(4 if e4m3 else 3)  # half an ulp of the mantissa, relative (normal numbers)
    sub = 2.0 ** -(10 if e4m3 else 17) * scale  # half the smallest subnormal step, absolute
    ok = x.abs() < fp8_max(dtype) * scale
    assert ((back - x).abs()[ok] <= rel * x.abs()[ok] + sub).all()
    assert quantize_kv(x, 5.0, torch.float32).equal(x)  # 16/32-bit caches ignore the scale


def test_kv_cache_dtype_names_and_scales():
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.float32) == torch.float8_e4m3fn
    assert resolve_kv_cache_dtype("fp8_e5m2", torch.float32) == torch.float8_e5m2
    with pytest.raises(ValueError, match="auto, fp8_e4m3, fp8_e5m2"):
        resolve_kv_cache_dtype("int8", torch.float32)
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of auto, fp8_e4m3, fp8_e5m2"):
        ServerArgs(kv_cache_dtype="fp4", device="cpu").check()
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="finite number > 0"):
            check_scale("k_scale", bad)
    layer = RadixAttention(4, 8, 0.3, 2, layer_id=3)
    with pytest.raises(ValueError, match="layer 3 v_scale must be a finite number > 0"):
        layer.set_kv_scales(1.0, -2.0)
    assert (layer.k_scale, layer.v_scale) == (1.0, 1.0)


def test_fp8_pool_holds_twice_bf16_and_four_times_fp32():
    from attnserve.model_loader.dummy import dummy_hf_config
    from attnserve.model_loader.model_config import ModelConfig

    for shape in ("smollm2-135m", "llama-3-8b"):
        mc = ModelConfig.from_hf_config(dummy_hf_config(shape))
        fp8 = mc.kv_cache_bytes_per_token(torch.float8_e4m3fn)
        assert mc.kv_cache_bytes_per_token(torch.bfloat16) == 2 * fp8
        assert mc.kv_cache_bytes_per_token(torch.float32) == 4 * fp8
    pool8 = MHATokenToKVPool(64, 16, torch.float8_e5m2, 2, 8, 3, "cpu")
    pool16 = MHATokenToKVPool(64, 16, torch.bfloat16, 2, 8, 3, "cpu")
    assert pool16.mem_bytes() == 2 * pool8.mem_bytes()


@pytest.mark.parametrize("dtype", FP8)
def test_pools_quantize_with_the_layer_scales(dtype):
    layer = RadixAttention(4, 8, 0.3, 2, layer_id=1)
    layer.set_kv_scales(0.05, 0.5)
    pool = MHATokenToKVPool(32, 4, dtype, 2, 8, 2, "cpu")
    loc = torch.tensor([5, 9, 6])
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8) * 10
    pool.set_kv_buffer(layer, loc, k, v)
    kb, vb = pool.get_key_buffer(1), pool.get_value_buffer(1)
    assert kb.dtype == dtype
    assert torch.equal(kb[loc].view(torch.uint8), quantize_kv(k, 0.05, dtype).view(torch.uint8))
    assert torch.equal(vb[loc].view(torch.uint8), quantize_kv(v, 0.5, dtype).view(torch.uint8))
    pool.copy_slots(torch.tensor([5, 9]), torch.tensor([9, 20]))  # overlapping move, byte-exact
    assert torch.equal(kb[20].view(torch.uint8), quantize_kv(k[1], 0.05, dtype).view(torch.uint8))
    assert torch.equal(kb[9].view(torch.uint8), quantize_kv(k[0], 0.05, dtype).view(torch.uint8))
    mla = MLATokenToKVPool(32, 4, dtype, 16, 4, 1, "cpu")
    latent = RadixAttention(4, 20, 0.3, 1, layer_id=0, v_head_dim=16)
    latent.set_kv_scales(0.2, 0.2)
    nope, rope = torch.randn(3, 1, 16), torch.randn(3, 1, 4)
    mla.set_mla_kv_buffer(latent, loc, nope, rope)
    got = dequantize_kv(mla.get_key_buffer(0)[loc], 0.2)
    want = dequantize_kv(quantize_kv(torch.cat([nope, rope], -1), 0.2, dtype), 0.2)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("mode,prefix,ext,window,cap", [
    (ForwardMode.DECODE, [0, 9, 30, 3], [1, 1, 1, 1], -1, 0.0),
    (ForwardMode.DECODE, [5, 17], [1, 1], 4, 3.0),
    (ForwardMode.EXTEND, [0, 7, 20], [5, 3, 12], -1, 0.0),
    (ForwardMode.EXTEND, [11, 2], [6, 4], 5, 2.0),
])
def test_torch_native_reads_fp8_cache(dtype, mode, prefix, ext, window, cap):
    """torch_native over an FP8 pool equals float64 attention over the dequantized
    (fp8-rounded x scale) K/V; the new tokens go through the cache too."""
    case = make_batch(mode, prefix, ext, 6, 2, 16, 4, window=window, logit_cap=cap, seed=len(prefix) * 7 + len(ext))
    case.layer.set_kv_scales(0.07, 0.4)
    f32 = case.pool
    pool = MHATokenToKVPool(f32.size, f32.page_size, dtype, 2, 16, 1, "cpu")
    pool.set_kv_buffer(case.layer, torch.arange(f32.size + f32.page_size), f32.k_buffer[0], f32.v_buffer[0])
    case.fb.token_to_kv_pool = pool
    backend = TorchNativeAttnBackend(backend_config(case))
    case.fb.attn_backend = backend
    backend.init_forward_metadata(case.fb)
    t = case.q.shape[0]
    out = case.layer(case.q.reshape(t, -1), case.k.reshape(t, -1), case.v.reshape(t, -1), case.fb).view(t, 6, 16)
    # the reference reads a float32 pool holding exactly what the FP8 pool means
    f32.k_buffer[0].copy_(dequantize_kv(pool.k_buffer[0], 0.07))
    f32.v_buffer[0].copy_(dequantize_kv(pool.v_buffer[0], 0.4))
    case.pool = f32
    ref = naive_reference(case)
    err = (out.double() - ref).norm() / ref.norm()
    assert err < 1e-5, err


def test_checkpoint_kv_scales_are_collected_and_applied():
    from attnserve.model_loader.dummy import dummy_hf_config
    from attnserve.models.llama import LlamaForCausalLM

    cfg = dummy_hf_config("llama-tiny")
    model = LlamaForCausalLM(cfg, dtype=torch.float32)
    collector = KVScaleCollector()
    stream = [("model.layers.0.self_attn.k_scale", torch.tensor(0.25)),
              ("model.layers.0.self_attn.v_scale", torch.tensor([0.5])),
              ("model.layers.1.self_attn.kv_scale", torch.tensor(2.0)),
              ("model.embed_tokens.weight", torch.zeros(1)),
              ("model.layers.2.self_attn.k_proj.output_scale", torch.tensor(4.0))]
    kept = list(collector.filter(stream))
    assert [n for n, _ in kept] == ["model.embed_tokens.weight"]
    assert collector.scales == {0: {"k": 0.25, "v": 0.5}, 1: {"k": 2.0, "v": 2.0}, 2: {"k": 4.0}}
    assert collector.apply(model) == min(3, cfg.num_hidden_layers)
    attn = [m for m in model.modules() if isinstance(m, RadixAttention)]
    assert (attn[0].k_scale, attn[0].v_scale) == (0.25, 0.5)
    assert (attn[1].k_scale, attn[1].v_scale) == (2.0, 2.0)
    if len(attn) > 2:
        assert (attn[2].k_scale, attn[2].v_scale) == (4.0, 1.0)
    bad = KVScaleCollector()
    list(bad.filter([("model.layers.0.self_attn.k_scale", torch.tensor(0.0))]))
    with pytest.raises(ValueError, match="layer 0 k_scale must be a finite number > 0"):
        bad.apply(model)
    with pytest.raises(ValueError, match="one element"):
        list(KVScaleCollector().filter([("model.layers.0.self_attn.v_scale", torch.ones(2))]))


def test_engine_generates_with_fp8_kv_and_sizes_the_pool_by_bytes():
    """Random-weight Llama on the CPU: an FP8 cache runs end to end; with no
    --max-total-tokens the pool gets the bytes of the float32 default, 4x the tokens."""
    from attnserve.engine.engine import Engine
    from attnserve.engine.sampling_params import SamplingParams

    outs = {}
    for name in ("auto", "fp8_e4m3"):
        engine = Engine(ServerArgs(model="llama-tiny", load_format="dummy", device="cpu", kv_cache_dtype=name,
                                   max_running_requests=4, context_length=256))
        runner = engine.model_runner
        outs[name] = (runner.token_to_kv_pool_allocator.size, runner.token_to_kv_pool.mem_bytes(),
                      runner.token_to_kv_pool.dtype)
        req = engine.add_request([5, 6, 7, 8, 9], SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True))
        while engine.has_work():
            engine.step()
        assert len(req.output_ids) == 8
        alloc = runner.token_to_kv_pool_allocator
        assert alloc.available_size() + engine.scheduler.tree_cache.evictable_size() == alloc.size
    assert outs["fp8_e4m3"][2] == torch.float8_e4m3fn
    assert outs["fp8_e4m3"][0] == 4 * outs["auto"][0]
    assert abs(outs["fp8_e4m3"][1] - outs["auto"][1]) < outs["auto"][1] / 1000  # same bytes (+ one dummy page)


def test_backend_without_fp8_support_is_refused_at_start_up(monkeypatch):
    from attnserve.engine.engine import Engine

    monkeypatch.setattr(TorchNativeAttnBackend, "supports_fp8_kv", False)
    with pytest.raises(ValueError, match="attention backend 'torch_native' cannot read an FP8 KV cache"):
        Engine(ServerArgs(model="llama-tiny", load_format="dummy", device="cpu", kv_cache_dtype="fp8_e5m2",
                          max_total_tokens=256, max_running_requests=2, context_length=64))
