"""Fused Triton kernels on a GPU: the checks of ``tests/models/test_fused_kernels.py`` in
bfloat16 (and float16/float32) at model-sized shapes, the pool's fused K/V write, and a
whole SmolLM2-shaped step (dummy weights, bfloat16) with the fused kernels on vs
``--disable-fused-kernels`` (`set_fused_kernels`): same logits (rel. error <= 2e-2, same argmax wherever the
reference's top-2 gap exceeds twice the largest logit difference), a CUDA-graph capture of
the fused decode step that replays to the eager result, and the device-kernel count of one
decode step printed for both (run with ``-s`` to see it).
"""

from types import SimpleNamespace

import pytest
import torch

import fused_kernel_checks as C
import qk_norm_rope_checks as Q
from attnserve.forward_batch import ForwardBatch, ForwardMode
from attnserve.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool, TokenToKVPoolAllocator
from attnserve.models.layers import fused_kernels as fk
from attnserve.models.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.cuda
DEV = "cuda"
MODEL = "smollm2-135m"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens,hidden", [(1, 576), (37, 4096), (300, 576), (3, 8192), (5, 80)])
@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
def test_rmsnorm_gpu(dtype, tokens, hidden, gemma):
    C.check_rmsnorm(DEV, dtype, tokens, hidden, gemma, "contiguous", seed=tokens + hidden)
    C.check_fused_add_rmsnorm(DEV, dtype, tokens, hidden, gemma, "contiguous", seed=tokens * 3 + hidden)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["strided", "heads3d"])
def test_rmsnorm_views_gpu(dtype, layout):
    C.check_rmsnorm(DEV, dtype, 17, 128, False, layout, seed=1)
    C.check_fused_add_rmsnorm(DEV, dtype, 9, 256, True, layout, seed=2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim,tokens,heads", [(64, 1001, 3), (128, 1001, 16), (128, 1, 8), (256, 333, 5),
                                              (512, 77, 3)])
@pytest.mark.parametrize("layout", ["strided2d", "heads3d", "padded3d"])
def test_norm_short_rows_gpu(dtype, dim, tokens, heads, layout):
    """Several short rows per program (Qwen3's per-head q/k norm: 16 heads of 128 over
    1001 tokens, and decode's single token), the last program partly masked."""
    C.check_norm_short_rows(DEV, dtype, tokens, heads, dim, layout, gemma=dim == 256, seed=dim + tokens + heads)


def _gpu_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def test_qk_norm_streams_at_copy_rate_gpu():
    """The per-head q norm of a Qwen3-0.6B prefill chunk (16384 tokens, 16 heads of 128, a
    view of the bf16 qkv output) against the strided copy of the same bytes and the
    one-row-per-program launch of the same kernel (the layout before multi-row programs).
    Prints the times and the achieved GB/s (run with ``-s``)."""
    from attnserve.models.layers.fused_kernels_triton import _rmsnorm_kernel

    t, hq, hkv, d = 16384, 16, 8, 128
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device=DEV, dtype=torch.bfloat16)
    q = qkv[:, : hq * d].view(t, hq, d)
    w = torch.rand(d, device=DEV, dtype=torch.bfloat16) + 0.5
    out = torch.empty(q.shape, device=DEV, dtype=q.dtype)
    rows = t * hq
    new_ms = _gpu_ms(lambda: fk.rmsnorm(q, w, 1e-6, out=out))
    copy_ms = _gpu_ms(lambda: out.copy_(q))
    old_ms = _gpu_ms(lambda: _rmsnorm_kernel[(rows,)](q, q.stride(0), q.stride(1), hq, w, out, d, d, 1e-6, 0.0,
                                                       BLOCK=d, num_warps=1, **fk._pdl_args(q.device)))
    ref = fk.rmsnorm(q, w, 1e-6)
    qf = q.float()
    C.close(ref, qf * torch.rsqrt(qf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float(), torch.bfloat16)
    gbs = 2 * q.numel() * q.element_size() / (new_ms * 1e-3) / 1e9
    print(f"q norm [{t}, {hq}, {d}] bf16: multi-row {new_ms * 1e3:.1f} us ({gbs:.0f} GB/s), strided copy "
          f"{copy_ms * 1e3:.1f} us, one row per program {old_ms * 1e3:.1f} us; multi-row / copy "
          f"{new_ms / copy_ms:.2f}, one-row / multi-row {old_ms / new_ms:.2f}")
    assert new_ms <= 2.0 * copy_ms, (new_ms, copy_ms)  # one row per program: ~3.5x its bytes at 3 TB/s (H100 profile, 2026-11-27)
    assert new_ms < old_ms, (new_ms, old_ms)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize(
    "tokens,hq,hk,head_dim,rotary_dim",
    [(1, 9, 3, 64, 64), (1, 32, 8, 128, 128), (200, 32, 8, 128, 128), (7, 16, 2, 128, 64), (5, 8, 1, 80, 40)],
)
def test_rope_gpu(dtype, neox, tokens, hq, hk, head_dim, rotary_dim):
    C.check_rope(DEV, dtype, tokens, hq, hk, head_dim, rotary_dim, neox, "qkv", seed=tokens + hq)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
def test_rope_other_layouts_gpu(dtype, neox):
    C.check_rope(DEV, dtype, 6, 16, 1, 64, 64, neox, "mla", seed=3)
    C.check_rope(DEV, dtype, 4, 8, None, 64, 32, neox, "qkv", seed=4)
    C.check_rope(DEV, dtype, 4, 8, 8, 64, 64, neox, "contiguous", cos_sin_scale=1.3, seed=5)


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens,hq,hk,head_dim,rotary_dim", [(1, 9, 3, 64, 64), (1, 32, 8, 128, 128),
                                                              (300, 32, 8, 128, 128), (7, 8, 1, 256, 256),
                                                              (5, 16, 2, 128, 64)])
def test_rope_with_kv_store_gpu(neox, dtype, tokens, hq, hk, head_dim, rotary_dim):
    C.check_rope_store_kv(DEV, dtype, dtype, tokens, hq, hk, head_dim, rotary_dim, neox, seed=tokens + hq)


@pytest.mark.parametrize("buf_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("tokens,hq,hk,head_dim,rotary_dim", [(1, 32, 8, 128, 128), (300, 32, 8, 128, 128),
                                                              (7, 8, 1, 256, 256), (5, 16, 2, 128, 64)])
def test_rope_with_fp8_kv_store_gpu(buf_dtype, neox, tokens, hq, hk, head_dim, rotary_dim):
    C.check_rope_store_kv_fp8(DEV, torch.bfloat16, buf_dtype, tokens, hq, hk, head_dim, rotary_dim, neox,
                              k_scale=0.04, v_scale=0.25, seed=tokens + hq)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("tokens,inter,strided", [(1, 1536, False), (1, 14336, False), (64, 2048, True), (3, 80, True)])
def test_act_and_mul_gpu(dtype, kind, tokens, inter, strided):
    C.check_act_and_mul(DEV, dtype, kind, tokens, inter, strided, seed=tokens + inter)


@pytest.mark.parametrize(
    "src_dtype,buf_dtype",
    [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16), (torch.float16, torch.float32)],
    ids=["bf16-bf16", "f32-bf16", "f16-f32"],
)
@pytest.mark.parametrize("tokens,heads,dk,dv,strided", [(1, 3, 64, 64, True), (1, 8, 128, 128, True),
                                                        (300, 8, 128, 128, False), (9, 1, 192, 128, False)])
def test_store_kv_gpu(src_dtype, buf_dtype, tokens, heads, dk, dv, strided):
    C.check_store_kv(DEV, src_dtype, buf_dtype, tokens, heads, dk, dv, strided, seed=tokens + heads)


def test_pool_uses_store_kv_on_cuda():
    fused = MHATokenToKVPool(64, 1, torch.bfloat16, 2, 64, 2, DEV)
    plain = MHATokenToKVPool(64, 1, torch.bfloat16, 2, 64, 2, DEV, use_fused_store=False)
    assert fused.use_fused_store and not plain.use_fused_store
    qkv = torch.randn(5, 6 * 64, device=DEV)  # float32, cast to the bf16 pool
    k, v = qkv[:, 2 * 64 : 4 * 64].view(5, 2, 64), qkv[:, 4 * 64 :].view(5, 2, 64)
    loc = torch.tensor([9, 3, 40, 1, 22], device=DEV)
    layer = SimpleNamespace(layer_id=1, k_scale=1.0, v_scale=1.0)
    for pool in (fused, plain):
        pool.set_kv_buffer(layer, loc, k, v)
    assert torch.equal(fused.k_buffer[1], plain.k_buffer[1]) and torch.equal(fused.v_buffer[1], plain.v_buffer[1])
    assert not fused.k_buffer[0].any()


# ---- whole model ----------------------------------------------------------------------------
class _Run:
    """A SmolLM2-shaped Llama (dummy bf16 weights) + paged KV + triton backend on the GPU."""

    def __init__(self, disable_fused: bool, weights=None, kv_dtype=torch.bfloat16, kv_scales=(1.0, 1.0)):
        from attnserve.attention.backend_config import AttentionBackendConfig
        from attnserve.attention.triton_backend import TritonAttnBackend
        from attnserve.model_loader.loader import load_model

        loaded = load_model(MODEL, load_format="dummy", device=DEV, dtype=torch.bfloat16,
                            load_tokenizer=False, progress=False)
        self.model, mc = loaded.model, loaded.model_config
        fk.set_fused_kernels(self.model, not disable_fused)
        if weights is not None:
            self.model.load_state_dict(weights)
        self.req_pool = ReqToTokenPool(4, 512, DEV)
        self.alloc = TokenToKVPoolAllocator(4096, 1)
        self.kv = MHATokenToKVPool(4096, 1, kv_dtype, mc.num_key_value_heads, mc.head_dim,
                                   mc.num_hidden_layers, DEV, use_fused_store=not disable_fused)
        for layer in self.model.model.layers:
            layer.self_attn.attn.set_kv_scales(*kv_scales)
        self.backend = TritonAttnBackend(AttentionBackendConfig.from_pools(
            self.req_pool, self.kv, mc.num_attention_heads, deterministic=True))
        self.num_layers = mc.num_hidden_layers
        self.rows = self.req_pool.alloc(2)
        self.lens = {r: 0 for r in self.rows}

    def batch(self, mode, ids_per_req):
        prefix = [self.lens[r] for r in self.rows]
        ext = [len(ids) for ids in ids_per_req]
        seq = [p + e for p, e in zip(prefix, ext)]
        last = [int(self.req_pool.req_to_token[r, p - 1]) if p else 0 for r, p in zip(self.rows, prefix)]
        loc = self.alloc.alloc_extend(prefix, seq, last)
        start = 0
        for r, p, e in zip(self.rows, prefix, ext):
            self.req_pool.write(r, p, loc[start : start + e])
            start += e
        for r, s in zip(self.rows, seq):
            self.lens[r] = s
        fb = ForwardBatch.init_new(mode, [t for ids in ids_per_req for t in ids], self.rows, prefix, ext, loc,
                                   self.req_pool, self.kv, self.backend, DEV)
        self.backend.init_forward_metadata(fb)
        return fb

    def forward(self, fb):
        return self.model(fb.input_ids, fb.positions, fb)


def _compare(fused: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    fused, ref = fused.double(), ref.double()
    rel = ((fused - ref).norm() / ref.norm()).item()
    dmax = (fused - ref).abs().max().item()
    top2 = ref.topk(2, dim=-1).values
    decided = (top2[:, 0] - top2[:, 1]) > 2 * dmax
    same = fused.argmax(-1) == ref.argmax(-1)
    print(f"{what}: rel err {rel:.2e}, max |diff| {dmax:.3e}, argmax equal {int(same.sum())}/{len(same)} "
          f"({int(decided.sum())} rows decided beyond the error)")
    assert rel <= 2e-2, (what, rel)
    assert same[decided].all(), what


def _device_ops(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def test_llama_step_fused_matches_unfused():
    ref = _Run(disable_fused=True)
    fused = _Run(disable_fused=False, weights=ref.model.state_dict())
    assert not ref.kv.use_fused_store and fused.kv.use_fused_store
    assert not ref.model.model.layers[0].input_layernorm.use_fused
    assert fused.model.model.layers[0].input_layernorm.use_fused

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 49000, (n,), generator=gen).tolist() for n in (23, 41)]
    logits = {}
    for name, run in (("ref", ref), ("fused", fused)):
        fb = run.batch(ForwardMode.EXTEND, prompts)
        logits[name] = run.model.compute_logits(run.forward(fb))
    _compare(logits["fused"], logits["ref"], "prefill logits")
    last = torch.tensor([22, 63], device=DEV)
    next_ids = logits["ref"][last].argmax(-1).tolist()

    decode = {}
    for name, run in (("ref", ref), ("fused", fused)):
        fb = run.batch(ForwardMode.DECODE, [[t] for t in next_ids])
        decode[name] = (run, fb, run.model.compute_logits(run.forward(fb)))
    _compare(decode["fused"][2], decode["ref"][2], "decode logits")

    # kernels of one decode step (model forward only; the same step re-run writes the same KV slots)
    counts = {name: _device_ops(lambda r=r, fb=fb: r.forward(fb)) for name, (r, fb, _) in decode.items()}
    layers = fused.num_layers
    print(f"device kernels per decode step (model forward, {layers} layers): "
          f"unfused {counts['ref']} (~{counts['ref'] / layers:.1f}/layer), "
          f"fused {counts['fused']} (~{counts['fused'] / layers:.1f}/layer)")
    assert counts["fused"] < counts["ref"]
    assert counts["fused"] <= 12 * layers + 4

    # the fused decode step is CUDA-graph capturable and replays to the eager result
    run, fb, eager_logits = decode["fused"]
    eager = run.forward(fb)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            run.forward(fb)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = run.forward(fb)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    print(f"graph replay bit-identical to eager: {torch.equal(out, eager)}")
    torch.testing.assert_close(out.float(), eager.float(), rtol=1e-2, atol=1e-2)


def test_llama_fp8_cache_fused_store_matches_unfused():
    """An FP8 (e4m3) cache with scales != 1 written by the fused RoPE + quantising store gives
    the logits of the un-fused path (RoPE, then `store_kv`), and its decode step launches as
    many kernels as the fused bf16 cache's (no separate store)."""
    scales = (0.05, 0.3)
    ref = _Run(disable_fused=True, kv_dtype=torch.float8_e4m3fn, kv_scales=scales)
    weights = ref.model.state_dict()
    fused = _Run(disable_fused=False, weights=weights, kv_dtype=torch.float8_e4m3fn, kv_scales=scales)
    bf16 = _Run(disable_fused=False, weights=weights)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, 49000, (n,), generator=gen).tolist() for n in (37, 18)]
    logits = {}
    for name, run in (("ref", ref), ("fused", fused), ("bf16", bf16)):
        logits[name] = run.model.compute_logits(run.forward(run.batch(ForwardMode.EXTEND, prompts)))
    _compare(logits["fused"], logits["ref"], "fp8 prefill logits")
    next_ids = logits["ref"][torch.tensor([36, 54], device=DEV)].argmax(-1).tolist()
    steps = {}
    for name, run in (("ref", ref), ("fused", fused), ("bf16", bf16)):
        fb = run.batch(ForwardMode.DECODE, [[t] for t in next_ids])
        steps[name] = (run, fb, run.model.compute_logits(run.forward(fb)))
    _compare(steps["fused"][2], steps["ref"][2], "fp8 decode logits")
    counts = {name: _device_ops(lambda r=r, fb=fb: r.forward(fb)) for name, (r, fb, _) in steps.items()}
    print(f"device kernels per decode step: fp8 unfused {counts['ref']}, fp8 fused {counts['fused']}, "
          f"bf16 fused {counts['bf16']}")
    assert counts["fused"] == counts["bf16"] < counts["ref"]


# ---- per-head q/k RMSNorm folded into the RoPE (+ KV store) launch -----------------------------
QWEN3_06B = dict(hq=16, hk=8, head_dim=128)  # Qwen3-0.6B attention: 16 q heads, 8 KV heads of 128


@pytest.mark.parametrize("tokens", [1, 144, 8192])
@pytest.mark.parametrize("buf_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16-cache", "fp8-cache"])
def test_qk_norm_rope_matches_unfused_qwen3_0_6b_gpu(tokens, buf_dtype):
    """Fused norm + rope + KV store on Qwen3-0.6B's shapes (decode 1 and 144 rows, an 8192
    prefill chunk), bf16: q, k and the cache rows ``torch.equal`` to `rmsnorm` on q and k
    then the rope launch with the store; within the float64 rounding bound. The FP8-store
    variant differed in ~0.02% of values on an H100 (2026-11-27), so the engine keeps the
    norms apart for FP8 caches (`rope_then_attention`) and this case checks the bound."""
    scales = (0.05, 0.3) if buf_dtype == torch.float8_e4m3fn else (1.0, 1.0)
    mism = Q.check_qk_norm_rope(DEV, torch.bfloat16, tokens, QWEN3_06B["hq"], QWEN3_06B["hk"],
                                QWEN3_06B["head_dim"], True, False, buf_dtype=buf_dtype, k_scale=scales[0],
                                v_scale=scales[1], seed=tokens, exact=buf_dtype != torch.float8_e4m3fn)
    print(f"qk-norm+rope T={tokens} {buf_dtype}: mismatches vs unfused {mism}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("tokens,hq,hk,head_dim,neox,gemma", [
    (37, 4, 1, 256, True, True),  # Gemma 3 270M: 4 q heads, 1 KV head of 256, (1 + w) gains
    (144, 8, 2, 64, True, False),  # head_dim 64: the row tile is widened to 1024 elements
    (19, 16, 8, 128, False, False),  # GPT-J pairing
    (5, 32, 4, 128, True, True),
])
def test_qk_norm_rope_other_shapes_gpu(dtype, tokens, hq, hk, head_dim, neox, gemma):
    Q.check_qk_norm_rope(DEV, dtype, tokens, hq, hk, head_dim, neox, gemma, buf_dtype=dtype, seed=tokens + hq)


def _qwen3_qk_case(tokens: int, gen: torch.Generator):
    """Static inputs of one Qwen3-0.6B attention block's norm + rope + store."""
    hq, hk, d = QWEN3_06B["hq"], QWEN3_06B["hk"], QWEN3_06B["head_dim"]
    q_norm, k_norm = Q.make_qk_norms(d, False, DEV, torch.bfloat16, gen)
    rope = RotaryEmbedding(d, d, Q.MAX_POS, 1e6).to(DEV)
    qkv = torch.empty(tokens, (hq + 2 * hk) * d, device=DEV, dtype=torch.bfloat16)
    positions = torch.empty(tokens, dtype=torch.int64, device=DEV)
    slots = 4 * tokens
    k_buf = torch.zeros(slots, hk, d, device=DEV, dtype=torch.bfloat16)
    v_buf = torch.zeros_like(k_buf)
    loc = torch.randperm(slots, generator=gen)[:tokens].to(DEV)
    return dict(hq=hq, hk=hk, d=d, q_norm=q_norm, k_norm=k_norm, rope=rope, qkv=qkv, positions=positions,
                k_buf=k_buf, v_buf=v_buf, loc=loc)


def _fused_launch(c, qkv, k_buf, v_buf):
    hq, hk, d = c["hq"], c["hk"], c["d"]
    fk.rotary_embedding_inplace(
        c["positions"], qkv[:, : hq * d], qkv[:, hq * d : (hq + hk) * d], c["rope"].cos_sin_cache, d, d, True,
        kv_store=fk.KVStoreTarget(k_buf, v_buf, c["loc"], qkv[:, (hq + hk) * d :]),
        q_norm_weight=c["q_norm"].weight, k_norm_weight=c["k_norm"].weight, eps=c["q_norm"].variance_epsilon)


def _unfused_launches(c, qkv, k_buf, v_buf, q_out=None, k_out=None):
    hq, hk, d = c["hq"], c["hk"], c["d"]
    t = qkv.shape[0]
    q = fk.rmsnorm(qkv[:, : hq * d].view(t, hq, d), c["q_norm"].weight, c["q_norm"].variance_epsilon, out=q_out)
    k = fk.rmsnorm(qkv[:, hq * d : (hq + hk) * d].view(t, hk, d), c["k_norm"].weight, c["k_norm"].variance_epsilon,
                   out=k_out)
    q, k = q.view(t, -1), k.view(t, -1)
    fk.rotary_embedding_inplace(c["positions"], q, k, c["rope"].cos_sin_cache, d, d, True,
                                kv_store=fk.KVStoreTarget(k_buf, v_buf, c["loc"], qkv[:, (hq + hk) * d :]))
    return q, k


def test_qk_norm_rope_in_cuda_graph_gpu():
    """The fused launch captured in a CUDA graph (144 decode rows) replays, on fresh inputs
    copied into its static buffers, to exactly the eager un-fused kernels' q, k and cache."""
    gen = torch.Generator().manual_seed(11)
    c = _qwen3_qk_case(144, gen)
    hq, hk, d = c["hq"], c["hk"], c["d"]
    qkv, k_buf, v_buf = c["qkv"], c["k_buf"], c["v_buf"]
    qkv.copy_(torch.randn(qkv.shape, generator=gen).to(DEV, torch.bfloat16) * 3)
    c["positions"].copy_(torch.randint(0, Q.MAX_POS, (144,), generator=gen))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _fused_launch(c, qkv, k_buf, v_buf)  # compile + warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        _fused_launch(c, qkv, k_buf, v_buf)
    for round_ in range(2):
        fresh = torch.randn(qkv.shape, generator=gen).to(DEV, torch.bfloat16) * (3 + round_)
        qkv.copy_(fresh)
        c["positions"].copy_(torch.randint(0, Q.MAX_POS, (144,), generator=gen))
        k_buf.zero_()
        v_buf.zero_()
        graph.replay()
        torch.cuda.synchronize()
        ref_in = fresh.clone()
        k_ref, v_ref = torch.zeros_like(k_buf), torch.zeros_like(v_buf)
        q_ref, k_rot = _unfused_launches(c, ref_in, k_ref, v_ref)
        assert torch.equal(qkv[:, : hq * d], q_ref), int((qkv[:, : hq * d] != q_ref).sum())
        assert torch.equal(qkv[:, hq * d : (hq + hk) * d], k_rot)
        assert torch.equal(k_buf, k_ref) and torch.equal(v_buf, v_ref)
        assert torch.equal(qkv[:, (hq + hk) * d :], fresh[:, (hq + hk) * d :])
    print("qk-norm+rope CUDA graph replay == eager unfused kernels: True")


def test_qk_norm_rope_saves_launches_and_time_gpu():
    """GPU time of one Qwen3-0.6B block's fused norm + rope + store against the three
    launches it replaces (q norm, k norm, rope + store), at 144 decode rows and an 8192-token
    prefill chunk; prints the times and the projected saving over 28 layers (JSON under
    ``$OUT`` when set). The fused launch must be faster."""
    import json
    import os

    gen = torch.Generator().manual_seed(12)
    rows = []
    for tokens in (1, 144, 8192):
        c = _qwen3_qk_case(tokens, gen)
        hq, hk, d = c["hq"], c["hk"], c["d"]
        c["qkv"].copy_(torch.randn(c["qkv"].shape, generator=gen).to(DEV, torch.bfloat16))
        c["positions"].copy_(torch.randint(0, Q.MAX_POS, (tokens,), generator=gen))
        q_out = torch.empty(tokens, hq, d, device=DEV, dtype=torch.bfloat16)
        k_out = torch.empty(tokens, hk, d, device=DEV, dtype=torch.bfloat16)
        fused_ms = _gpu_ms(lambda: _fused_launch(c, c["qkv"], c["k_buf"], c["v_buf"]), reps=50)
        unfused_ms = _gpu_ms(lambda: _unfused_launches(c, c["qkv"], c["k_buf"], c["v_buf"], q_out, k_out), reps=50)
        norms_ms = _gpu_ms(lambda: (fk.rmsnorm(c["qkv"][:, : hq * d].view(tokens, hq, d), c["q_norm"].weight, 1e-6,
                                               out=q_out),
                                    fk.rmsnorm(c["qkv"][:, hq * d : (hq + hk) * d].view(tokens, hk, d),
                                               c["k_norm"].weight, 1e-6, out=k_out)), reps=50)
        row = dict(tokens=tokens, fused_us=fused_ms * 1e3, unfused_us=unfused_ms * 1e3, qk_norms_us=norms_ms * 1e3,
                   rope_store_us=(unfused_ms - norms_ms) * 1e3, saved_us_per_layer=(unfused_ms - fused_ms) * 1e3,
                   saved_us_28_layers=28 * (unfused_ms - fused_ms) * 1e3)
        rows.append(row)
        print(f"qk-norm+rope+store T={tokens}: fused {row['fused_us']:.1f} us, unfused {row['unfused_us']:.1f} us "
              f"(norms {row['qk_norms_us']:.1f} + rope/store {row['rope_store_us']:.1f}), saved "
              f"{row['saved_us_per_layer']:.1f} us/layer = {row['saved_us_28_layers']:.0f} us per 28-layer forward; "
              f"fused / rope alone {fused_ms / max(unfused_ms - norms_ms, 1e-9):.2f}")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "qk_norm_rope_timing.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "shape": QWEN3_06B, "rows": rows}, f, indent=1)
    for row in rows:
        assert row["fused_us"] < row["unfused_us"], row


def test_qwen3_0_6b_engine_greedy_tokens_fusion_on_vs_off(monkeypatch):
    """The dummy Qwen3-0.6B engine (bf16, CUDA graphs, default flags but a 2048 context):
    the same 24 greedy requests give the same tokens with the q/k-norm + rope fusion on and
    with ``ATTNSERVE_QK_NORM_ROPE_FUSION=0`` (read when the model is built); the on-engine's
    eager prefill takes the fused launch, the off-engine's never does."""
    from attnserve.engine.llm import LLM
    from attnserve.engine.sampling_params import SamplingParams
    from attnserve.models.layers import rotary

    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(10, 150000, (int(n),), generator=gen).tolist()
               for n in torch.randint(20, 700, (24,), generator=gen)]
    sp = SamplingParams(max_new_tokens=48, temperature=0.0, ignore_eos=True)
    launch = rotary.rotary_embedding_inplace
    tokens, fused_calls = {}, {}
    for setting in ("0", "1"):
        monkeypatch.setenv("ATTNSERVE_QK_NORM_ROPE_FUSION", setting)
        calls = []

        def spy(*args, _calls=calls, **kwargs):
            _calls.append(kwargs.get("q_norm_weight") is not None)
            return launch(*args, **kwargs)

        with LLM("qwen3-0.6b", load_format="dummy", device="cuda", dtype="bfloat16", context_length=2048) as llm:
            attn = llm.engine.model_runner.model.model.layers[0].self_attn
            assert attn.qk_norm_rope_fusion == (setting == "1") and attn.q_norm.use_fused
            assert llm.engine.model_runner.cuda_graph_runner is not None
            monkeypatch.setattr(rotary, "rotary_embedding_inplace", spy)
            outs = llm.generate(prompts, sp)
            monkeypatch.setattr(rotary, "rotary_embedding_inplace", launch)
        tokens[setting] = [o.token_ids for o in outs]
        fused_calls[setting] = sum(calls)
    first_diff = next(((i, j) for i, (a, b) in enumerate(zip(tokens["0"], tokens["1"]))
                       for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
    print(f"qwen3-0.6b greedy tokens, fusion on vs off: identical {tokens['0'] == tokens['1']} "
          f"(first difference (request, token): {first_diff}); fused launches in eager steps: "
          f"on {fused_calls['1']}, off {fused_calls['0']}")
    assert fused_calls["0"] == 0 and fused_calls["1"] > 0
    assert all(len(t) == 48 for t in tokens["1"])
    assert tokens["0"] == tokens["1"], first_diff
