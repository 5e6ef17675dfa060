"""Attention sinks (gpt-oss, `RadixAttention.sinks`) on a GPU at gpt-oss shapes: 64 query heads,
8 KV heads, head dim 64, sliding window 128 (``w = 127``) on some cases, bf16.

Against the float64 reference of HF transformers' gpt_oss formula
(`attention_harness.sink_reference`, on the GPU) and against `torch_native`:

* `triton` decode: ragged lengths up to 8K (several splits, stage-2 merge), page sizes 1 and
  16, full and windowed layers, deterministic split tiles; a large batch through the
  head-block stage 2; an FP8 (e4m3 / e5m2) KV cache, with the opt-in Gluon fp8 stage 1
  switched on (a call with sinks must keep the Triton stage 1, which implements them);
* `triton` extend over cached prefixes (windowed and full), and TARGET_VERIFY tree masks;
* the Gluon prefill decision on sm_90 (head dim 128): a launch with sinks runs the Triton
  extend kernel (and matches the reference), the same launch without sinks the Gluon one;
* a CUDA-graph decode (metadata hook and kernels captured): replays read the sinks by
  pointer, so values updated in place after the capture are used.

Every check asserts that the sinks move the reference well beyond the tolerance, so none can
pass with the sinks ignored. Skipped without CUDA; a minute or two on an H200 (mostly Triton
compilation).
"""

from __future__ import annotations

import pytest
import torch
from attention_harness import backend_config, make_batch, sink_reference
from call_spy import LaunchSpy

from attnserve.forward_batch import ForwardMode, VerifyInput

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("no_tf32"),
]

DEV = "cuda"
HQ, HKV, D = 64, 8, 64  # gpt-oss (20b and 120b) attention at TP 1
WINDOW = 127  # HF sliding_window 128 -> RadixAttention's w = W - 1
REL_TOL = 1e-2  # bf16 queries / cache / output against float64
DECODE_PREFIX = [0, 1, 126, 127, 128, 1000, 4095, 8191, 300, 33]  # + 1 new token each
EXT_PREFIX, EXT_NEW = [0, 300, 1200, 4000], [700, 129, 64, 1]


def gpt_oss_sinks(hq: int, seed: int) -> torch.Tensor:
    """float32 ``[hq]`` on the GPU: N(0, 2^2), with every 4th head +14 (dominant even over
    9K keys: e^14 ~ 1.2e6 against ~1.6 per key) and every 4th from 1 -30 (negligible)."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(hq, generator=g) * 2.0
    s[0::4] = 14.0
    s[1::4] = -30.0
    return s.to(DEV)


def _run(case, backend):
    case.fb.attn_backend = backend
    backend.init_forward_metadata(case.fb)
    t = case.q.shape[0]
    out = case.layer(case.q.reshape(t, -1), case.k.reshape(t, -1), case.v.reshape(t, -1), case.fb)
    return out.view(t, case.layer.tp_q_head_num, case.layer.v_head_dim)


def _rel(out, ref) -> float:
    assert not torch.isnan(out).any(), "NaN in the output"
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _check(out, ref, plain):
    """Within REL_TOL of the reference, which the sinks move by > 10x REL_TOL; dominant
    heads (0::4) shrink."""
    assert _rel(plain, ref) > 10 * REL_TOL, "the sinks should matter in this case"
    assert _rel(out, ref) <= REL_TOL, _rel(out, ref)
    assert out[:, 0::4].double().norm() < 0.1 * plain[:, 0::4].norm()


def _case(mode, prefix, new, page, window, seed, hq=HQ, hkv=HKV, d=D):
    case = make_batch(mode, prefix, new, hq, hkv, d, page, dtype=torch.bfloat16, window=window, seed=seed,
                      device=DEV)
    case.layer.sinks = gpt_oss_sinks(hq, seed)
    return case


@pytest.mark.parametrize("page,window,deterministic", [(1, -1, False), (16, WINDOW, False), (16, -1, True),
                                                       (1, WINDOW, True)])
def test_triton_decode_bf16(page, window, deterministic):
    from attnserve.attention.torch_native import TorchNativeAttnBackend
    from attnserve.attention.triton_backend import TritonAttnBackend

    case = _case(ForwardMode.DECODE, DECODE_PREFIX, [1] * len(DECODE_PREFIX), page, window, seed=page + window)
    out = _run(case, TritonAttnBackend(backend_config(case, deterministic=deterministic)))
    md = case.fb.attn_backend.forward_metadata
    if window < 0:
        assert int(md.num_kv_splits.max()) > 1  # the stage-2 merge runs
    ref = sink_reference(case, case.layer.sinks)
    _check(out, ref, sink_reference(case, None))
    native = _run(case, TorchNativeAttnBackend(backend_config(case)))  # K/V re-stored: same values
    assert _rel(native, ref) <= REL_TOL


def test_triton_decode_kernel_head_block_merge(monkeypatch):
    """The batch tiles' stage 2 (a block of 16 heads a program) with most requests of several
    splits, by forcing the config: 96 requests of 1..1500 keys."""
    import dataclasses

    from attnserve.attention.triton_ops import decode_attention as da
    from attnserve.attention.triton_ops import decode_merge
    from attnserve.attention.triton_ops.kv_indices import compute_kv_indptr, create_kv_indices

    g = torch.Generator().manual_seed(5)
    lens = torch.randint(1, 1500, (96,), generator=g).tolist()
    case = _case(ForwardMode.DECODE, [n - 1 for n in lens], [1] * len(lens), 16, -1, seed=5)
    case.pool.set_kv_buffer(case.layer, case.fb.out_cache_loc, case.k, case.v)
    spy = LaunchSpy(decode_merge._decode_stage2_heads_kernel)
    monkeypatch.setattr(decode_merge, "_decode_stage2_heads_kernel", spy)
    seq = case.fb.seq_lens.to(torch.int32)
    indptr = compute_kv_indptr(seq)
    idx = torch.empty(sum(lens), dtype=torch.int32, device=DEV)
    create_kv_indices(case.req_to_token, case.fb.req_pool_indices, seq, indptr, None, idx)
    splits = torch.clamp((seq + 127) // 128, max=8).to(torch.int32)
    cfg = dataclasses.replace(da.decode_config(D, HQ // HKV, torch.bfloat16), merge_heads=16, pdl=False)
    o = torch.full((len(lens), HQ, D), float("nan"), dtype=torch.bfloat16, device=DEV)
    logits = torch.empty(len(lens), HQ, 8, D, device=DEV)
    lse = torch.empty(len(lens), HQ, 8, device=DEV)
    da.decode_attention_fwd(case.q, case.pool.k_buffer[0], case.pool.v_buffer[0], o, indptr, idx, logits, lse, splits,
                            8, case.layer.scaling, config=cfg, sinks=case.layer.sinks)
    assert spy.launches and all(kw["HAS_SINK"] for kw in spy.launches)
    _check(o, sink_reference(case, case.layer.sinks), sink_reference(case, None))


@pytest.mark.parametrize("kv_dtype,head_dim,gluon", [(torch.float8_e4m3fn, D, "0"), (torch.float8_e5m2, D, "0"),
                                                      (torch.float8_e4m3fn, 128, "1")])
def test_triton_decode_fp8_kv(monkeypatch, kv_dtype, head_dim, gluon):
    """An FP8 pool (scales 0.05 / 0.3) against float64 on the dequantized cache. With
    ``ATTNSERVE_DECODE_FP8_GLUON=1`` (head dim 128, e4m3: the Gluon stage 1's domain) the call
    with sinks keeps the Triton stage 1; without sinks, on sm_90, the Gluon one runs."""
    from attnserve.attention.triton_backend import TritonAttnBackend
    from attnserve.attention.triton_ops import decode_fp8_gluon
    from attnserve.mem_cache.kv_quant import dequantize_kv
    from attnserve.mem_cache.memory_pool import MHATokenToKVPool

    monkeypatch.setenv(decode_fp8_gluon.FP8_GLUON_ENV, gluon)
    gluon_calls = []
    real = decode_fp8_gluon.gluon_fp8_decode_stage1
    monkeypatch.setattr(decode_fp8_gluon, "gluon_fp8_decode_stage1",
                        lambda *a, **k: gluon_calls.append(1) or real(*a, **k))
    outs = {}
    for with_sinks in (False, True):
        case = _case(ForwardMode.DECODE, DECODE_PREFIX, [1] * len(DECODE_PREFIX), 16, -1, seed=head_dim, d=head_dim)
        sinks = case.layer.sinks
        case.layer.sinks = sinks if with_sinks else None
        case.layer.set_kv_scales(0.05, 0.3)
        src = case.pool
        pool = MHATokenToKVPool(src.size, src.page_size, kv_dtype, HKV, head_dim, 1, DEV)
        pool.set_kv_buffer(case.layer, torch.arange(src.size + src.page_size, device=DEV), src.k_buffer[0],
                           src.v_buffer[0])
        case.fb.token_to_kv_pool = pool
        n_before = len(gluon_calls)
        outs[with_sinks] = _run(case, TritonAttnBackend(backend_config(case)))
        if with_sinks:
            assert len(gluon_calls) == n_before
        elif gluon == "1" and kv_dtype == torch.float8_e4m3fn and torch.cuda.get_device_capability()[0] == 9:
            assert len(gluon_calls) > n_before  # the switch works: the sink-free call took Gluon
        ref_pool = MHATokenToKVPool(src.size, src.page_size, torch.float32, HKV, head_dim, 1, DEV)
        ref_pool.k_buffer[0].copy_(dequantize_kv(pool.k_buffer[0], 0.05))
        ref_pool.v_buffer[0].copy_(dequantize_kv(pool.v_buffer[0], 0.3))
        case.pool = ref_pool
        if with_sinks:
            _check(outs[True], sink_reference(case, sinks), sink_reference(case, None))
        else:
            assert _rel(outs[False], sink_reference(case, None)) <= REL_TOL


@pytest.mark.parametrize("page,window", [(1, WINDOW), (16, -1), (16, WINDOW)])
def test_triton_extend_bf16(page, window):
    from attnserve.attention.torch_native import TorchNativeAttnBackend
    from attnserve.attention.triton_backend import TritonAttnBackend

    case = _case(ForwardMode.EXTEND, EXT_PREFIX, EXT_NEW, page, window, seed=31 * page + window)
    out = _run(case, TritonAttnBackend(backend_config(case)))
    ref = sink_reference(case, case.layer.sinks)
    _check(out, ref, sink_reference(case, None))
    native = _run(case, TorchNativeAttnBackend(backend_config(case)))
    assert _rel(native, ref) <= REL_TOL


@pytest.mark.parametrize("window", [-1, WINDOW])
def test_triton_target_verify_tree_mask(window):
    from attnserve.attention.triton_backend import TritonAttnBackend

    prefix, new = [5, 700, 3000, 130], [8, 8, 8, 8]
    case = _case(ForwardMode.TARGET_VERIFY, prefix, new, 16, window, seed=77 + window)
    g = torch.Generator().manual_seed(3)
    masks = []
    for p, e in zip(prefix, new):
        m = torch.zeros(e, p + e, dtype=torch.bool)
        m[:, :p] = True
        m[:, p:] = (torch.rand(e, e, generator=g) < 0.5).tril() | torch.eye(e, dtype=torch.bool)
        masks.append(m)
    offsets = torch.tensor([0] + [m.numel() for m in masks[:-1]]).cumsum(0)
    case.fb.spec_info = VerifyInput(torch.cat([m.flatten() for m in masks]).to(DEV), offsets.to(DEV),
                                    case.fb.positions, new)
    out = _run(case, TritonAttnBackend(backend_config(case)))
    _check(out, sink_reference(case, case.layer.sinks, masks), sink_reference(case, None, masks))


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0),
                    reason="the Gluon prefill runs on sm_90 only")
@pytest.mark.parametrize("has_prefix", [False, True])
def test_gluon_prefill_declines_sinks(monkeypatch, has_prefix):
    """Head dim 128, bf16, causal, 1,100-token prefills with ``ATTNSERVE_EXTEND_GLUON=1``:
    without sinks the Gluon kernel runs, with sinks the Triton extend kernel, and both
    match their references."""
    from attnserve.attention.triton_backend import TritonAttnBackend
    from attnserve.attention.triton_ops import extend_attention, prefill_gluon

    monkeypatch.setenv(prefill_gluon.GLUON_PREFILL_ENV, "1")
    calls = []
    real = prefill_gluon.gluon_prefill_fwd
    monkeypatch.setattr(prefill_gluon, "gluon_prefill_fwd", lambda *a, **k: calls.append(1) or real(*a, **k))
    prefix = [0, 300] if has_prefix else [0, 0]
    for with_sinks in (False, True):
        case = _case(ForwardMode.EXTEND, prefix, [1100, 1030], 16, -1, seed=9, hq=32, hkv=8, d=128)
        sinks = case.layer.sinks
        if not with_sinks:
            case.layer.sinks = None
        t = case.q.shape[0]
        o = case.q.new_empty(t, 32, 128)
        assert extend_attention._use_gluon_prefill(case.q, case.k, case.v, o, True, None, 0.0, -1, 1100,
                                                   has_prefix=has_prefix, k_buffer=case.pool.k_buffer[0],
                                                   v_buffer=case.pool.v_buffer[0],
                                                   sinks=case.layer.sinks) is not with_sinks
        n = len(calls)
        out = _run(case, TritonAttnBackend(backend_config(case)))
        assert len(calls) == n + (0 if with_sinks else 1)
        if with_sinks:
            _check(out, sink_reference(case, sinks), sink_reference(case, None))
        else:
            assert _rel(out, sink_reference(case, None)) <= REL_TOL


@pytest.mark.parametrize("window", [-1, WINDOW])
def test_cuda_graph_decode_reads_sinks_by_pointer(window):
    """The replay hook and the layer captured in one graph (the hook is capturable); the
    queries and the sinks are then changed in place and the graph replayed."""
    from attnserve.attention.triton_backend import TritonAttnBackend

    prefix = [0, 50, 1000, 3000, 127, 9000]
    bs = len(prefix)
    case = _case(ForwardMode.DECODE, prefix, [1] * bs, 16, window, seed=41 + window)
    layer, fb = case.layer, case.fb
    sinks = layer.sinks
    backend = TritonAttnBackend(backend_config(case))
    fb.attn_backend = backend
    case.pool.set_kv_buffer(layer, fb.out_cache_loc, case.k, case.v)  # stored once, outside the graph
    backend.init_cuda_graph_state(bs, bs)
    backend.init_forward_metadata_capture_cuda_graph(bs, bs, fb.req_pool_indices, fb.seq_lens, None,
                                                     ForwardMode.DECODE, None)
    q_static = case.q.reshape(bs, -1).clone()
    out_static = torch.empty(bs, HQ * D, dtype=torch.bfloat16, device=DEV)

    def step():
        backend.init_forward_metadata_replay_cuda_graph(bs, fb.req_pool_indices, fb.seq_lens, None, None,
                                                        ForwardMode.DECODE, None, None)
        out_static.copy_(layer(q_static, None, None, fb, save_kv_cache=False))

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    g = torch.Generator(device=DEV).manual_seed(7)
    for replay in range(2):
        case.q = torch.randn(bs, HQ, D, generator=g, device=DEV).to(torch.bfloat16)
        q_static.copy_(case.q.reshape(bs, -1))
        sinks.copy_(gpt_oss_sinks(HQ, 100 + replay))  # in place: the captured pointer
        out_static.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        out = out_static.view(bs, HQ, D)
        _check(out, sink_reference(case, sinks), sink_reference(case, None))
