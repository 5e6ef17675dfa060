"""The small-batch decode rule on a GPU (issues 37/38): one-tile splits, the vectorised
merge and programmatic dependent launch of both stages, against float64.

``pytest tests/gpu/test_decode_small_batch_gpu.py -k small``. Every test is marked
``cuda`` and skipped without a GPU. The PDL test captures decode steps in a CUDA graph in
which each layer's q comes from a PDL GEMV that lets its dependents launch at once and
each layer's new K/V is written just before the attention: a stage that read q, K/V or the
metadata before its ``gdc_wait`` would see the previous replay's values, an O(1) error
(request 0 has one key, so its output is that key's V row).
"""

from __future__ import annotations

import math

import pytest
import torch

from attnserve.attention.triton_ops.decode_attention import decode_attention_fwd, decode_config
from attnserve.attention.triton_ops.decode_splits import SMALL_SPLIT_TOKENS, compute_num_kv_splits
from attnserve.attention.triton_ops.decode_tuning import SMALL_BATCH_ENV
from attnserve.attention.triton_ops.kv_indices import compute_kv_indptr, create_kv_indices

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
DEV = "cuda"
D = 128
MAX_SPLITS = 32  # the engine's default (backend_config.DEFAULT_NUM_KV_SPLITS)
SHAPES = {"llama-tp1": (32, 8), "llama-tp4": (8, 2), "qwen3-0.6b": (16, 8)}
ATOL = RTOL = 2e-2  # bf16 outputs


def _sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def _paged_slots(lens, page_size, gen):
    """Per request its KV slots: whole pages drawn without replacement from pages 1.. (slot
    0 stays the padding slot). Returns (list of int64 slot tensors, number of slots)."""
    pages = [-(-n // page_size) for n in lens]
    order = (torch.randperm(sum(pages) + 1, generator=gen) + 1).tolist()
    out, pos = [], 0
    for n, p in zip(lens, pages):
        own = torch.tensor(order[pos: pos + p], dtype=torch.int64)
        pos += p
        t = torch.arange(n)
        out.append(own[t // page_size] * page_size + t % page_size)
    return out, (sum(pages) + 2) * page_size


def _reference(q, kb, vb, slots, k_scale=1.0, v_scale=1.0):
    """float64 softmax(q K^T / sqrt(d)) V per request (q [bs, Hq, D] on the GPU)."""
    bs, hq, d = q.shape
    group = hq // kb.shape[1]
    out = torch.zeros(bs, hq, vb.shape[2], dtype=torch.float64, device=q.device)
    for i, s in enumerate(slots):
        if s.numel() == 0:
            continue
        s = s.to(q.device)
        k = kb[s].double().repeat_interleave(group, dim=1) * k_scale
        v = vb[s].double().repeat_interleave(group, dim=1) * v_scale
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[i].double(), k) / math.sqrt(d), dim=-1)
        out[i] = torch.einsum("hn,nhd->hd", p, v)
    return out


def _lens(bs, ctx):
    if bs == 1:
        return [ctx]
    if bs == 2:
        return [ctx, 1]
    return ([0, 1, ctx, ctx // 3, 17, ctx - 1, 128, 129] * bs)[:bs]


def _decode(q, kb, vb, lens, slots, small, k_scale=1.0, v_scale=1.0):
    bs, hq, _ = q.shape
    seq = torch.tensor(lens, dtype=torch.int32, device=DEV)
    indptr = compute_kv_indptr(seq)
    idx = torch.cat([s for s in slots] + [torch.zeros(1, dtype=torch.int64)]).to(DEV, torch.int32)
    ns = torch.empty(bs, dtype=torch.int32, device=DEV)
    compute_num_kv_splits(seq, ns, MAX_SPLITS, _sms(), kb.shape[1],
                          small_split_tokens=SMALL_SPLIT_TOKENS if small else 0)
    o = torch.full((bs, hq, vb.shape[2]), float("nan"), dtype=q.dtype, device=DEV)
    logits = torch.full((bs, hq, MAX_SPLITS, vb.shape[2]), float("nan"), device=DEV)
    lse = torch.full((bs, hq, MAX_SPLITS), float("nan"), device=DEV)
    decode_attention_fwd(q, kb, vb, o, indptr, idx, logits, lse, ns, MAX_SPLITS, D ** -0.5,
                         k_scale=k_scale, v_scale=v_scale)
    torch.cuda.synchronize()
    return o, ns


@pytest.mark.parametrize("rule", ["on", "off"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("bs", [1, 2, 8])
@pytest.mark.parametrize("ctx", [128, 576, 2048, 8192])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_small_batch_decode_matches_float64(shape, ctx, bs, page_size, rule, monkeypatch):
    """bf16 KV, ragged batches with 0- and 1-key requests, the rule on (one-tile splits,
    32-split merge, PDL at these batch sizes) and off (the launch before the rule)."""
    monkeypatch.setenv(SMALL_BATCH_ENV, "1" if rule == "on" else "0")
    hq, hkv = SHAPES[shape]
    gen = torch.Generator().manual_seed(ctx * 31 + bs * 7 + page_size + hq)
    lens = _lens(bs, ctx)
    slots, num_slots = _paged_slots(lens, page_size, gen)
    kb = torch.randn(num_slots, hkv, D, generator=gen).to(DEV, torch.bfloat16)
    vb = torch.randn(num_slots, hkv, D, generator=gen).to(DEV, torch.bfloat16)
    q = torch.randn(bs, hq, D, generator=gen).to(DEV, torch.bfloat16)
    o, ns = _decode(q, kb, vb, lens, slots, small=rule == "on")
    assert not torch.isnan(o).any(), "an output element was not written"
    if rule == "on" and bs == 1 and -(-ctx // SMALL_SPLIT_TOKENS) <= min(_sms() // hkv, MAX_SPLITS):
        assert ns.item() == -(-ctx // SMALL_SPLIT_TOKENS), "one-tile splits expected at this size"
    torch.testing.assert_close(o.double(), _reference(q, kb, vb, slots), atol=ATOL, rtol=RTOL)
    assert all((o[i] == 0).all() for i, n in enumerate(lens) if n == 0)


@pytest.mark.parametrize("bs,ctx", [(1, 576), (8, 2048)])
def test_small_batch_decode_fp8_matches_float64(bs, ctx, monkeypatch):
    """e4m3 KV with per-tensor scales (V pairs on an H100 / H200), Llama-3-8B heads."""
    monkeypatch.setenv(SMALL_BATCH_ENV, "1")
    hq, hkv = SHAPES["llama-tp1"]
    gen = torch.Generator().manual_seed(ctx + bs)
    lens = _lens(bs, ctx)
    slots, num_slots = _paged_slots(lens, 1, gen)
    kb = torch.randn(num_slots, hkv, D, generator=gen).to(DEV).to(torch.float8_e4m3fn)
    vb = torch.randn(num_slots, hkv, D, generator=gen).to(DEV).to(torch.float8_e4m3fn)
    q = torch.randn(bs, hq, D, generator=gen).to(DEV, torch.bfloat16)
    o, _ = _decode(q, kb, vb, lens, slots, small=True, k_scale=0.5, v_scale=2.0)
    ref = _reference(q, kb, vb, slots, k_scale=0.5, v_scale=2.0)
    torch.testing.assert_close(o.double(), ref, atol=4 * ATOL, rtol=RTOL)


def test_small_batch_pdl_graph_replay(monkeypatch):
    """Three decode layers in one CUDA graph, each: write the new token's K/V (index_copy),
    q = PDL skinny GEMV of a fresh input (4096 -> 32 x 128), decode attention (rule on: PDL
    stages at bs 4). Metadata (indptr, indices, split counts) is rebuilt in the graph from
    fresh lengths every replay. Each replay is checked against float64 attention over the
    same q (an eager GEMV) and the updated buffers."""
    from attnserve.pdl import pdl_enabled
    from attnserve.models.layers.skinny_gemm import skinny_linear

    monkeypatch.setenv(SMALL_BATCH_ENV, "1")
    monkeypatch.setenv("ATTNSERVE_PDL", "1")
    hq, hkv = SHAPES["llama-tp1"]
    bs, hin, layers, cap = 4, 4096, 3, 640
    props = torch.cuda.get_device_properties(0)
    cfg = decode_config(D, hq // hkv, torch.bfloat16, max_shared_mem=props.shared_memory_per_block_optin,
                        device_name=torch.cuda.get_device_name(), batch_size=bs, num_kv_heads=hkv, num_sms=_sms())
    assert cfg.pdl, "bs 4 x 8 KV heads must take the PDL launch"
    pdl_on = pdl_enabled(torch.device(DEV))
    g = torch.Generator(device=DEV).manual_seed(5)
    w = (torch.randn(hq * D, hin, device=DEV, generator=g) / math.sqrt(hin)).to(torch.bfloat16)
    r2t = (torch.arange(bs * cap, device=DEV, dtype=torch.int32) + 1).view(bs, cap)  # request i: its own slots
    rows = torch.arange(bs, device=DEV, dtype=torch.int32)
    kbs = [torch.randn(bs * cap + 1, hkv, D, device=DEV, generator=g).to(torch.bfloat16) for _ in range(layers)]
    vbs = [torch.randn(bs * cap + 1, hkv, D, device=DEV, generator=g).to(torch.bfloat16) for _ in range(layers)]
    seq_s = torch.full((bs,), cap // 2, dtype=torch.int32, device=DEV)
    x_s = torch.randn(bs, hin, device=DEV, generator=g).to(torch.bfloat16)
    knew_s = torch.randn(layers, bs, hkv, D, device=DEV, generator=g).to(torch.bfloat16)
    vnew_s = torch.randn(layers, bs, hkv, D, device=DEV, generator=g).to(torch.bfloat16)
    indptr_s = torch.zeros(bs + 1, dtype=torch.int32, device=DEV)
    indices_s = torch.zeros(bs * cap, dtype=torch.int32, device=DEV)
    ns_s = torch.ones(bs, dtype=torch.int32, device=DEV)
    logits = torch.zeros(bs, hq, MAX_SPLITS, D, device=DEV)
    lse = torch.zeros(bs, hq, MAX_SPLITS, device=DEV)
    outs = [torch.zeros(bs, hq, D, device=DEV, dtype=torch.bfloat16) for _ in range(layers)]

    def step():
        compute_kv_indptr(seq_s, indptr_s)
        create_kv_indices(r2t, rows, seq_s, indptr_s, None, indices_s)
        compute_num_kv_splits(seq_s, ns_s, MAX_SPLITS, _sms(), hkv, small_split_tokens=SMALL_SPLIT_TOKENS)
        loc = r2t[rows.long(), (seq_s - 1).long()].long()
        for layer in range(layers):
            kbs[layer].index_copy_(0, loc, knew_s[layer])
            vbs[layer].index_copy_(0, loc, vnew_s[layer])
            q = skinny_linear(x_s, w).view(bs, hq, D)
            decode_attention_fwd(q, kbs[layer], vbs[layer], outs[layer], indptr_s, indices_s, logits, lse, ns_s,
                                 MAX_SPLITS, D ** -0.5)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile outside the capture
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        step()
    gl = torch.Generator().manual_seed(9)
    for replay in range(5):
        lens = [1] + torch.randint(2, cap + 1, (bs - 1,), generator=gl).tolist()
        seq_s.copy_(torch.tensor(lens, dtype=torch.int32))
        x_s.copy_(torch.randn(bs, hin, generator=gl).to(torch.bfloat16))
        knew_s.copy_(torch.randn(layers, bs, hkv, D, generator=gl).to(torch.bfloat16))
        vnew_s.copy_(3 * torch.randn(layers, bs, hkv, D, generator=gl).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        monkeypatch.setenv("ATTNSERVE_PDL", "0")
        q_ref = skinny_linear(x_s, w).view(bs, hq, D)
        monkeypatch.setenv("ATTNSERVE_PDL", "1")
        slots = [r2t[i, :n].long() for i, n in enumerate(lens)]
        for layer in range(layers):
            ref = _reference(q_ref, kbs[layer], vbs[layer], slots)
            assert torch.isfinite(outs[layer].float()).all()
            torch.testing.assert_close(outs[layer].double(), ref, atol=ATOL, rtol=RTOL,
                                       msg=lambda m: f"replay {replay} layer {layer} (PDL {pdl_on}): {m}")
