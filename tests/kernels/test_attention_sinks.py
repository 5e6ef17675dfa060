"""Attention sinks (gpt-oss, `RadixAttention.sinks`) in the MHA attention paths, on CPU (Triton
interpreter) or on a GPU when there is one.

The reference (`attention_harness.sink_reference`) is HF transformers' gpt_oss
``eager_attention_forward`` written out in float64 (scores * scaling, logit cap, causal /
custom / window mask, one concatenated sink column, softmax, column dropped, times V),
independent of `attnserve.attention.sinks`. Sinks are
mixed per head: +8 (the sink takes nearly all the mass: output shrinks towards 0), -30 (no
visible effect) and moderate values, so every case checks both extremes; each case asserts
that the sinks move the reference by far more than the tolerance, so no check here can pass
with the sinks ignored.

* `torch_native` and `triton` backends: decode (one split, and several splits through the
  stage-2 merge with the deterministic split tiles), extend over cached prefixes, and
  TARGET_VERIFY (custom tree mask); page sizes 1 and 16, GQA 8/2 and MHA, windows on and
  off, a logit cap (applied to the scores, not the sink).
* the decode kernel with both stage-2 kernels (one head or a block of heads a program) and
  zero-key requests; stage 2 alone against a float64 log-sum-exp merge with the sink.
* layers without sinks launch the ``HAS_SINK=False`` kernels (the variants that existed
  before), and a sink of -1e4 gives exactly their bits (the sink terms underflow to 0).
* the API: validation, the model's Parameter not registered twice, the ``sinks`` keyword
  refused, MLA backends refusing a layer with sinks, the Gluon prefill declining.
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch
from attention_harness import backend_config, make_batch, sink_reference
from call_spy import LaunchSpy

from attnserve.attention.radix_attention import RadixAttention
from attnserve.attention.torch_native import TorchNativeAttnBackend
from attnserve.forward_batch import ForwardMode, VerifyInput

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                                  reason="needs CUDA or TRITON_INTERPRET=1")
DOMINANT, NONE = 8.0, -30.0  # sink logits: takes ~all the mass / no visible effect


def mixed_sinks(hq: int, gen: torch.Generator) -> torch.Tensor:
    """float32 ``[hq]``: heads 0, 3, 6, ... DOMINANT, 1, 4, ... NONE, the rest N(0, 1.5^2)."""
    s = torch.randn(hq, generator=gen) * 1.5
    s[0::3] = DOMINANT
    s[1::3] = NONE
    return s


def hf_reference(case, sinks, custom_masks=None) -> torch.Tensor:
    """`attention_harness.sink_reference` (HF's gpt-oss formula, float64) on the CPU."""
    return sink_reference(case, sinks, custom_masks).cpu()


def _run(case, backend):
    case.fb.attn_backend = backend
    backend.init_forward_metadata(case.fb)
    out = case.layer(case.q.reshape(case.q.shape[0], -1), case.k.reshape(case.k.shape[0], -1),
                     case.v.reshape(case.v.shape[0], -1), case.fb)
    return out.view(case.q.shape[0], case.layer.tp_q_head_num, case.layer.v_head_dim)


def _verify_input(case, gen):
    """A random tree mask ``[E, P + E]`` per request (prefix visible, the diagonal visible)."""
    masks = []
    for p, e in zip(case.prefix_lens, case.extend_lens):
        m = torch.rand(e, p + e, generator=gen) < 0.5
        m[:, :p] = True
        m[torch.arange(e), p + torch.arange(e)] = True
        m[:, p:] &= torch.ones(e, e, dtype=torch.bool).tril()
        masks.append(m)
    sizes = torch.tensor([0] + [m.numel() for m in masks[:-1]])
    spec = VerifyInput(torch.cat([m.flatten() for m in masks]).to(DEVICE), torch.cumsum(sizes, 0).to(DEVICE),
                       case.fb.positions, list(case.extend_lens))
    return spec, masks


# (page size, hq, hkv, window, logit cap)
SHAPES = {"p1-gqa4": (1, 8, 2, -1, 0.0), "p16-mha-window": (16, 4, 4, 5, 0.0), "p16-gqa4-window-cap": (16, 8, 2, 7, 4.0)}
MODES = {  # (mode, cached prefix lens, new tokens)
    "decode": (ForwardMode.DECODE, [0, 9, 40, 3], [1, 1, 1, 1]),
    "extend": (ForwardMode.EXTEND, [0, 7, 20], [5, 3, 12]),
    "verify": (ForwardMode.TARGET_VERIFY, [6, 17], [4, 3]),
}


@needs_triton
@pytest.mark.parametrize("backend", ["torch_native", "triton"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_backend_matches_hf_reference(backend, mode, shape):
    """Decode requests of 41 keys take three splits (deterministic tiles of 16: stage 2
    merges the sink), the others one (stage 1 applies it)."""
    from attnserve.attention.triton_backend import TritonAttnBackend

    page, hq, hkv, window, cap = SHAPES[shape]
    fmode, prefix, ext = MODES[mode]
    seed = 1000 * list(SHAPES).index(shape) + 10 * list(MODES).index(mode)
    case = make_batch(fmode, prefix, ext, hq, hkv, 16, page, window=window, logit_cap=cap, seed=seed, device=DEVICE)
    gen = torch.Generator().manual_seed(seed + 1)
    sinks = mixed_sinks(hq, gen)
    case.layer.sinks = sinks.to(DEVICE)
    masks = None
    if fmode == ForwardMode.TARGET_VERIFY:
        case.fb.spec_info, masks = _verify_input(case, gen)
    if backend == "triton":
        be = TritonAttnBackend(backend_config(case, deterministic=True, split_tile_size=16))
    else:
        be = TorchNativeAttnBackend(backend_config(case))
    out = _run(case, be).double().cpu()
    if backend == "triton" and fmode == ForwardMode.DECODE:
        assert be.forward_metadata.num_kv_splits.tolist() == [1, 1, 3, 1]
    ref = hf_reference(case, sinks, masks)
    plain = hf_reference(case, None, masks)
    assert not torch.isnan(out).any()
    assert (ref - plain).abs().max() > 0.05  # the sinks matter here ...
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)  # ... and are applied
    dom, none = slice(0, hq, 3), slice(1, hq, 3)
    assert out[:, dom].norm() < 0.1 * plain[:, dom].norm()  # a dominant sink shrinks the output
    torch.testing.assert_close(out[:, none], plain[:, none], atol=2e-5, rtol=1e-4)


def _decode_inputs(gen, lens, hq, hkv, d, page_size, paged):
    r2t, rows, num_slots = paged(lens, page_size, gen)
    k_buf = torch.randn(num_slots, hkv, d, generator=gen)
    v_buf = torch.randn(num_slots, hkv, d, generator=gen)
    q = torch.randn(len(lens), hq, d, generator=gen)
    return r2t, rows, k_buf, v_buf, q


def _decode_ref(q, k_buf, v_buf, r2t, rows, lens, sm_scale, sinks):
    """float64 HF formula per request over slots ``req_to_token[row, :len]``."""
    bs, hq, _ = q.shape
    group = hq // k_buf.shape[1]
    out = torch.zeros(bs, hq, v_buf.shape[2], dtype=torch.float64)
    for i in range(bs):
        slots = r2t[rows[i], : lens[i]].long()
        k = k_buf[slots].double().repeat_interleave(group, dim=1)
        v = v_buf[slots].double().repeat_interleave(group, dim=1)
        w = torch.einsum("hd,nhd->hn", q[i].double(), k) * sm_scale
        if sinks is not None:
            w = torch.cat([w, sinks.double()[:, None]], dim=1)
        p = torch.softmax(w, dim=1)[:, : lens[i]]
        out[i] = torch.einsum("hn,nhd->hd", p, v)
    return out


def _launch_decode(q, k_buf, v_buf, r2t, rows, lens, splits, sm_scale, sinks, config=None, max_splits=4):
    from attnserve.attention.triton_ops.decode_attention import decode_attention_fwd
    from attnserve.attention.triton_ops.kv_indices import compute_kv_indptr, create_kv_indices

    bs, hq, d = q.shape
    seq = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    kv_indptr = compute_kv_indptr(seq)
    kv_indices = torch.zeros(sum(lens) + 1, dtype=torch.int32, device=DEVICE)
    create_kv_indices(r2t.to(DEVICE), rows.to(DEVICE), seq, kv_indptr, None, kv_indices)
    o = torch.full((bs, hq, d), float("nan"), device=DEVICE)
    logits = torch.full((bs, hq, max_splits, d), float("nan"), device=DEVICE)
    lse = torch.full((bs, hq, max_splits), float("nan"), device=DEVICE)
    decode_attention_fwd(q.to(DEVICE), k_buf.to(DEVICE), v_buf.to(DEVICE), o, kv_indptr, kv_indices, logits, lse,
                         torch.tensor(splits, dtype=torch.int32, device=DEVICE), max_splits, sm_scale,
                         config=config, sinks=None if sinks is None else sinks.to(DEVICE))
    return o.cpu()


@needs_triton
@pytest.mark.parametrize("merge_heads,merge_block", [(1, 1), (8, 32)])
def test_decode_kernel_both_merges(gen, paged, merge_heads, merge_block):
    """Ragged requests (0 keys: zeros; one split; 2-4 splits of 16-key tiles) through the
    one-head stage 2 (one split a step) and the head-block stage 2."""
    from attnserve.attention.triton_ops.decode_attention import decode_config

    lens, splits = [0, 5, 33, 64, 50], [1, 1, 3, 4, 2]
    hq, hkv, d = 8, 2, 16
    r2t, rows, k_buf, v_buf, q = _decode_inputs(gen, lens, hq, hkv, d, 16, paged)
    sinks = mixed_sinks(hq, gen)
    cfg = dataclasses.replace(decode_config(d, hq // hkv, torch.float32), block_n=16, merge_heads=merge_heads,
                              merge_block=merge_block, pdl=False)
    out = _launch_decode(q, k_buf, v_buf, r2t, rows, lens, splits, d ** -0.5, sinks, cfg)
    ref = _decode_ref(q, k_buf, v_buf, r2t, rows, lens, d ** -0.5, sinks)
    plain = _decode_ref(q, k_buf, v_buf, r2t, rows, lens, d ** -0.5, None)
    assert (ref - plain).abs().max() > 0.05
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)


@needs_triton
@pytest.mark.parametrize("merge_heads", [1, 4])
def test_stage2_merges_sink_as_one_more_split(gen, merge_heads):
    """Stage 2 alone: softmax over (split LSEs, sink) in float64, the sink's output 0; requests
    of one split keep the sentinel (stage 1 writes them)."""
    from attnserve.attention.triton_ops.decode_merge import decode_stage2

    bs, hq, dv, max_splits = 4, 6, 16, 5
    splits = torch.tensor([1, 5, 2, 3], dtype=torch.int32)
    indptr = torch.zeros(bs + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(splits * 16 - 3, 0)
    logits = torch.randn(bs, hq, max_splits, dv, generator=gen)
    lse = torch.randn(bs, hq, max_splits, generator=gen) * 3
    sinks = torch.randn(hq, generator=gen) * 3
    sinks[0], sinks[1] = 40.0, -40.0
    want = torch.full((bs, hq, dv), -5.0, dtype=torch.float64)
    for b in range(1, bs):
        n = int(splits[b])
        w = torch.softmax(torch.cat([lse[b, :, :n].double(), sinks.double()[:, None]], 1), 1)[:, :n]
        want[b] = (w[:, :, None] * logits[b, :, :n].double()).sum(1)
    o = torch.full((bs, hq, dv), -5.0, device=DEVICE)
    decode_stage2(logits.to(DEVICE), lse.to(DEVICE), o, indptr.to(DEVICE), splits.to(DEVICE), max_splits,
                  split_align=16, merge_block=2, num_warps=2, merge_heads=merge_heads, sinks=sinks.to(DEVICE))
    assert (o.cpu().double() - want).abs().max().item() < 1e-5


def _spy(monkeypatch):
    from attnserve.attention.triton_ops import decode_attention, decode_merge, extend_attention

    spies = {}
    for mod, name in ((decode_attention, "_decode_stage1_kernel"), (decode_merge, "_decode_stage2_kernel"),
                      (decode_merge, "_decode_stage2_heads_kernel"), (extend_attention, "_extend_fwd_kernel")):
        spies[name] = LaunchSpy(getattr(mod, name))
        monkeypatch.setattr(mod, name, spies[name])
    return spies


@needs_triton
@pytest.mark.parametrize("mode", ["decode", "extend"])
def test_without_sinks_old_variants_and_negligible_sink_same_bits(monkeypatch, mode):
    """sinks=None launches every kernel with ``HAS_SINK=False`` (the kernels as they were);
    a sink of -1e4 adds terms that underflow to exactly 0 (stage 1: x / (1 + 0); stage 2:
    the sink's partial is rescaled by exp(-1e4 - m) = 0; extend: max(m, sink) = m and
    l + 0), so its outputs equal those bits; torch_native without sinks keeps SDPA."""
    from attnserve.attention.triton_backend import TritonAttnBackend

    fmode, prefix, ext = MODES[mode]
    outs = {}
    spies = _spy(monkeypatch)
    for sink in (None, -1e4):
        case = make_batch(fmode, prefix, ext, 8, 2, 16, 16, window=-1, seed=77, device=DEVICE)
        case.layer.sinks = None if sink is None else torch.full((8,), sink, device=DEVICE)
        for spy in spies.values():
            spy.launches.clear()
        outs[sink] = _run(case, TritonAttnBackend(backend_config(case, deterministic=True, split_tile_size=16)))
        launches = [kw for spy in spies.values() for kw in spy.launches]
        assert launches and all(kw["HAS_SINK"] is (sink is not None) for kw in launches)
        if mode == "decode":
            assert spies["_decode_stage2_kernel"].launches or spies["_decode_stage2_heads_kernel"].launches
    assert torch.equal(outs[None], outs[-1e4])

    calls = []
    real = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    for sink in (None, -1e4):
        case = make_batch(fmode, prefix, ext, 8, 2, 16, 16, window=-1, seed=77, device=DEVICE)
        case.layer.sinks = None if sink is None else torch.full((8,), sink, device=DEVICE)
        outs[sink] = _run(case, TorchNativeAttnBackend(backend_config(case)))
    assert len(calls) == (1 if mode == "decode" else 0)  # the sinks-free decode only
    torch.testing.assert_close(outs[None], outs[-1e4], atol=1e-6, rtol=1e-6)


# ---- API -----------------------------------------------------------------------------
def test_layer_holds_the_models_parameter_without_registering_it():
    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.sinks = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
            self.attn = RadixAttention(4, 8, 0.3, 2, 0, sinks=self.sinks)

    m = Attn()
    assert m.attn.sinks is m.sinks
    assert [n for n, _ in m.named_parameters(remove_duplicate=False)] == ["sinks"]
    assert list(m.state_dict()) == ["sinks"]
    m.attn.sinks = None
    m.attn.sinks = m.sinks  # later assignment: validated, still not registered
    assert list(m.state_dict()) == ["sinks"] and m.attn.sinks is m.sinks
    assert "sinks" in repr(m.attn)
    assert RadixAttention(4, 8, 0.3, 2, 0).sinks is None


@pytest.mark.parametrize("bad,match", [(torch.zeros(5), r"shape \[4\]"), (torch.zeros(4, 1), r"shape \[4\]"),
                                       (torch.zeros(4, dtype=torch.int32), "float32"),
                                       (torch.zeros(8)[::2], "contiguous"), ([0.0] * 4, "torch.Tensor")])
def test_invalid_sinks_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        RadixAttention(4, 8, 0.3, 2, 0, sinks=bad)
    layer = RadixAttention(4, 8, 0.3, 2, 0)
    with pytest.raises(ValueError, match=match):
        layer.sinks = bad


def test_sinks_keyword_is_refused():
    layer = RadixAttention(4, 8, 0.3, 2, 0)
    with pytest.raises(TypeError, match="sinks attribute"):
        layer(torch.zeros(1, 32), torch.zeros(1, 16), torch.zeros(1, 16), None, sinks=torch.zeros(4))


@needs_triton
def test_mla_backends_refuse_sinks():
    from attnserve.attention.backend_config import AttentionBackendConfig
    from attnserve.attention.triton_mla_backend import TritonMLAAttnBackend
    from attnserve.mem_cache.memory_pool import MLATokenToKVPool, ReqToTokenPool

    pool = MLATokenToKVPool(64, 1, torch.float32, 32, 16, 1, DEVICE)
    cfg = AttentionBackendConfig.from_pools(ReqToTokenPool(4, 32, DEVICE), pool, 4)
    layer = RadixAttention(4, 48, 0.1, num_kv_heads=1, layer_id=0, v_head_dim=32, sinks=torch.zeros(4))
    q, k = torch.zeros(1, 4 * 48), torch.zeros(1, 1, 48)
    for backend in (TorchNativeAttnBackend(cfg), TritonMLAAttnBackend(cfg)):
        for fwd in (backend.forward_decode, backend.forward_extend):
            with pytest.raises(ValueError, match="attention sinks"):
                fwd(q, k, None, layer, None)


def test_gluon_prefill_declines_sinks():
    from attnserve.attention.triton_ops.extend_attention import _use_gluon_prefill
    from attnserve.attention.triton_ops.prefill_gluon import gluon_prefill_supported

    q = torch.zeros(64, 8, 128, dtype=torch.bfloat16)
    kv = torch.zeros(64, 2, 128, dtype=torch.bfloat16)
    o = torch.empty_like(q)
    assert gluon_prefill_supported(q, kv, kv, o, capability=(9, 0))
    assert not gluon_prefill_supported(q, kv, kv, o, capability=(9, 0), sinks=torch.zeros(8))
    assert not _use_gluon_prefill(q, kv, kv, o, True, None, 0.0, -1, 4096, sinks=torch.zeros(8))


def test_sink_units_follow_sm_scale():
    """Sanity of the reference itself: one key of score z and a sink s give the weight
    e^z / (e^z + e^s) on its value (units after scaling)."""
    case = make_batch(ForwardMode.DECODE, [0], [1], 1, 1, 4, 1, seed=3, sm_scale=0.7)
    case.pool.set_kv_buffer(case.layer, case.fb.out_cache_loc, case.k, case.v)
    z = float((case.q[0, 0] @ case.k[0, 0]).double()) * 0.7
    s = torch.tensor([0.25])
    out = hf_reference(case, s)[0, 0]
    want = case.v[0, 0].double() * math.exp(z) / (math.exp(z) + math.exp(0.25))
    torch.testing.assert_close(out, want)
