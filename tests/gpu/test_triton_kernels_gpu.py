"""GPU checks of the Triton attention kernels at serving shapes (bf16, long ragged batches).

Every test is marked ``cuda`` and skipped without a GPU. References are float64 on the
GPU; the check is ``||out - ref|| / ||ref|| <= 1e-2`` with no NaN, on outputs poisoned
with NaN beforehand. Shapes are chosen to keep the whole file around a minute on an H100
(most of it is Triton compilation).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
DTYPE = torch.bfloat16
REL_TOL = 1e-2

# lengths 1..8192 mixed in one batch (tile / page boundaries included)
DECODE_LENS = [1, 2, 15, 16, 17, 63, 64, 65, 127, 129, 1000, 2047, 2048, 4095, 4096, 5000, 8191, 8192, 300, 33]


def _gen(seed):
    g = torch.Generator(device=DEV)
    g.manual_seed(seed)
    return g


def _paged(lens, page_size, g):
    """req_to_token whose requests own randomly permuted pages (page 0 reserved)."""
    pages = [-(-n // page_size) for n in lens]
    num_pages = 1 + sum(pages)
    perm = torch.randperm(num_pages - 1, generator=g, device=DEV) + 1
    bs = len(lens)
    rows = torch.randperm(bs + 3, generator=g, device=DEV)[:bs].to(torch.int32)
    r2t = torch.zeros(bs + 3, max(lens) + 8, dtype=torch.int32, device=DEV)
    off = 0
    for i, n in enumerate(lens):
        t = torch.arange(n, device=DEV)
        mine = perm[off : off + pages[i]]
        off += pages[i]
        r2t[rows[i], :n] = (mine[t // page_size] * page_size + t % page_size).to(torch.int32)
    return r2t, rows, num_pages * page_size


def _rel_err(out, ref):
    assert not torch.isnan(out).any(), "NaN in the output (unwritten or bad math)"
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _attend(q, k, v, sm_scale, cap, vis=None):
    """float64 attention: q [Hkv, G, M, D], k/v [n, Hkv, D] -> [M, Hkv*G, Dv]."""
    s = torch.einsum("hgmd,nhd->hgmn", q.double(), k.double()) * sm_scale
    if cap > 0:
        s = cap * torch.tanh(s / cap)
    if vis is not None:
        s = s.masked_fill(~vis, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    o = torch.einsum("hgmn,nhd->mhgd", p, v.double())
    return o.reshape(o.shape[0], -1, o.shape[-1])


# ----------------------------------------------------------------------------------- decode
def _decode(lens, page_size, hq, hkv, dk, dv, seed, logit_cap=0.0, window=-1, max_kv_splits=16,
            deterministic=False, shared_kv=False):
    from attnserve.attention.triton_ops.decode_attention import compute_num_kv_splits, decode_attention_fwd
    from attnserve.attention.triton_ops.kv_indices import compute_kv_indptr, create_kv_indices

    g = _gen(seed)
    bs = len(lens)
    r2t, rows, slots = _paged(lens, page_size, g)
    kb = torch.randn(slots, hkv, dk, generator=g, device=DEV).to(DTYPE)
    vb = kb[..., :dv] if shared_kv else torch.randn(slots, hkv, dv, generator=g, device=DEV).to(DTYPE)
    q = torch.randn(bs, hq, dk, generator=g, device=DEV).to(DTYPE)
    seq = torch.tensor(lens, dtype=torch.int32, device=DEV)
    start = (seq - window - 1).clamp_min(0) if window >= 0 else torch.zeros_like(seq)
    n = seq - start
    indptr = compute_kv_indptr(n)
    idx = torch.empty(sum(lens), dtype=torch.int32, device=DEV)
    create_kv_indices(r2t, rows, n, indptr, start if window >= 0 else None, idx)
    ns = torch.empty(bs, dtype=torch.int32, device=DEV)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    compute_num_kv_splits(n, ns, max_kv_splits, num_sms, hkv, deterministic=deterministic)
    o = torch.full((bs, hq, dv), float("nan"), dtype=DTYPE, device=DEV)
    logits = torch.full((bs, hq, max_kv_splits, dv), float("nan"), device=DEV)
    lse = torch.full((bs, hq, max_kv_splits), float("nan"), device=DEV)
    decode_attention_fwd(q, kb, vb, o, indptr, idx, logits, lse, ns, max_kv_splits, dk ** -0.5, logit_cap)
    return o, (q, kb, vb, r2t, rows, start.tolist(), lens)


def _decode_ref(q, kb, vb, r2t, rows, start, lens, logit_cap):
    bs, hq, dk = q.shape
    hkv = kb.shape[1]
    out = torch.empty(bs, hq, vb.shape[2], dtype=torch.float64, device=DEV)
    for i in range(bs):
        s = r2t[rows[i], start[i] : lens[i]].long()
        qi = q[i].view(hkv, hq // hkv, 1, dk)
        out[i] = _attend(qi, kb[s], vb[s], dk ** -0.5, logit_cap)[0]
    return out


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("hq,hkv,d", [(32, 32, 128), (32, 8, 128), (32, 4, 64), (16, 4, 256)])
def test_decode_ragged_bf16(page_size, hq, hkv, d):
    o, args = _decode(DECODE_LENS, page_size, hq, hkv, d, d, seed=page_size * 1000 + hq + hkv + d)
    assert _rel_err(o, _decode_ref(*args, 0.0)) <= REL_TOL


@pytest.mark.parametrize("window,logit_cap", [(511, 0.0), (-1, 30.0), (127, 50.0)])
def test_decode_window_and_logit_cap(window, logit_cap):
    o, args = _decode(DECODE_LENS, 16, 32, 8, 128, 128, seed=7 + window, logit_cap=logit_cap, window=window)
    assert _rel_err(o, _decode_ref(*args, logit_cap)) <= REL_TOL


def test_decode_mla_shapes():
    o, args = _decode([1, 70, 1500, 4100], 64, 16, 1, 576, 512, seed=11, shared_kv=True)
    assert _rel_err(o, _decode_ref(*args, 0.0)) <= REL_TOL


def test_decode_deterministic_batch_invariance():
    """The same request gives bitwise-identical output alone and batched with 159 others
    (``batch_invariant``: 160 x 8 programs would otherwise take the batch tiles)."""
    from attnserve.attention.triton_ops.decode_attention import compute_num_kv_splits, decode_attention_fwd
    from attnserve.attention.triton_ops.kv_indices import compute_kv_indptr, create_kv_indices

    g = _gen(5)
    hq, hkv, d, max_splits = 32, 8, 128, 32  # 32 * 256 >= 8192 tokens
    lens = torch.randint(1, 8193, (160,), generator=g, device=DEV).tolist()
    lens[17] = 5000
    r2t, rows, slots = _paged(lens, 16, g)
    kb = torch.randn(slots, hkv, d, generator=g, device=DEV).to(DTYPE)
    vb = torch.randn(slots, hkv, d, generator=g, device=DEV).to(DTYPE)
    q = torch.randn(160, hq, d, generator=g, device=DEV).to(DTYPE)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count

    def run(sel, batch_invariant=True):
        seq = torch.tensor([lens[i] for i in sel], dtype=torch.int32, device=DEV)
        indptr = compute_kv_indptr(seq)
        idx = torch.empty(int(sum(lens[i] for i in sel)), dtype=torch.int32, device=DEV)
        create_kv_indices(r2t, rows[sel], seq, indptr, None, idx)
        ns = torch.empty(len(sel), dtype=torch.int32, device=DEV)
        compute_num_kv_splits(seq, ns, max_splits, num_sms, hkv, deterministic=True)
        o = torch.full((len(sel), hq, d), float("nan"), dtype=DTYPE, device=DEV)
        logits = torch.empty(len(sel), hq, max_splits, d, device=DEV)
        lse = torch.empty(len(sel), hq, max_splits, device=DEV)
        decode_attention_fwd(q[sel], kb, vb, o, indptr, idx, logits, lse, ns, max_splits, d ** -0.5,
                             batch_invariant=batch_invariant)
        return o

    alone = run([17])[0]
    batched = run(list(range(160)))[17]
    assert torch.equal(alone, batched)
    ref = _decode_ref(q[17:18], kb, vb, r2t, rows[17:18], [0], [5000], 0.0)
    assert _rel_err(alone[None], ref) <= REL_TOL
    # the same batch on the batch tiles (not batch-invariant) is still right
    free = run(list(range(160)), batch_invariant=False)
    assert _rel_err(free[17:18], ref) <= REL_TOL


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_decode_batch_tiles_match_reference(kv_dtype):
    """A batch of >= BATCH_PROGRAMS_PER_SM stage-1 programs per SM (the batch tiles of
    `decode_config`) against the float64 reference, bf16 and e4m3 caches, ragged lengths."""
    from attnserve.attention.triton_ops.decode_attention import (BATCH_PROGRAMS_PER_SM, compute_num_kv_splits,
                                                                 decode_attention_fwd)
    from attnserve.attention.triton_ops.kv_indices import compute_kv_indptr, create_kv_indices

    g = _gen(21)
    hq, hkv, d, max_splits = 16, 8, 128, 16
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    bs = BATCH_PROGRAMS_PER_SM * num_sms // hkv + 3
    lens = torch.randint(1, 1500, (bs,), generator=g, device=DEV).tolist()
    r2t, rows, slots = _paged(lens, 1, g)
    kb = torch.randn(slots, hkv, d, generator=g, device=DEV).to(DTYPE)
    vb = torch.randn(slots, hkv, d, generator=g, device=DEV).to(DTYPE)
    q = torch.randn(bs, hq, d, generator=g, device=DEV).to(DTYPE)
    if kv_dtype != DTYPE:  # the reference reads the rounded values
        kb, vb = kb.to(kv_dtype), vb.to(kv_dtype)
    seq = torch.tensor(lens, dtype=torch.int32, device=DEV)
    indptr = compute_kv_indptr(seq)
    idx = torch.empty(int(sum(lens)), dtype=torch.int32, device=DEV)
    create_kv_indices(r2t, rows, seq, indptr, None, idx)
    ns = torch.empty(bs, dtype=torch.int32, device=DEV)
    compute_num_kv_splits(seq, ns, max_splits, num_sms, hkv)
    o = torch.full((bs, hq, d), float("nan"), dtype=DTYPE, device=DEV)
    logits = torch.empty(bs, hq, max_splits, d, device=DEV)
    lse = torch.empty(bs, hq, max_splits, device=DEV)
    decode_attention_fwd(q, kb, vb, o, indptr, idx, logits, lse, ns, max_splits, d ** -0.5)
    ref = _decode_ref(q, kb.to(DTYPE), vb.to(DTYPE), r2t, rows, [0] * bs, lens, 0.0)
    assert _rel_err(o, ref) <= REL_TOL


def test_decode_cuda_graph_replay():
    """Index build + split counts + decode captured once, replayed with new lengths."""
    from attnserve.attention.triton_ops.decode_attention import compute_num_kv_splits, decode_attention_fwd
    from attnserve.attention.triton_ops.kv_indices import compute_kv_indptr, create_kv_indices

    g = _gen(9)
    bs, hq, hkv, d, max_splits, max_len = 8, 32, 8, 128, 16, 4096
    lens_a = torch.randint(1, max_len + 1, (bs,), generator=g, device=DEV).tolist()
    lens_b = torch.randint(1, max_len + 1, (bs,), generator=g, device=DEV).tolist()
    r2t, rows, slots = _paged([max_len] * bs, 16, g)
    kb = torch.randn(slots, hkv, d, generator=g, device=DEV).to(DTYPE)
    vb = torch.randn(slots, hkv, d, generator=g, device=DEV).to(DTYPE)
    q = torch.randn(bs, hq, d, generator=g, device=DEV).to(DTYPE)
    seq = torch.tensor(lens_a, dtype=torch.int32, device=DEV)
    indptr = torch.empty(bs + 1, dtype=torch.int32, device=DEV)
    idx = torch.empty(bs * max_len, dtype=torch.int32, device=DEV)
    ns = torch.empty(bs, dtype=torch.int32, device=DEV)
    o = torch.empty(bs, hq, d, dtype=DTYPE, device=DEV)
    logits = torch.empty(bs, hq, max_splits, d, device=DEV)
    lse = torch.empty(bs, hq, max_splits, device=DEV)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count

    def step():
        compute_kv_indptr(seq, out=indptr)
        create_kv_indices(r2t, rows, seq, indptr, None, idx)
        compute_num_kv_splits(seq, ns, max_splits, num_sms, hkv)
        decode_attention_fwd(q, kb, vb, o, indptr, idx, logits, lse, ns, max_splits, d ** -0.5)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # compile / warm up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for lens in (lens_a, lens_b):
        seq.copy_(torch.tensor(lens, dtype=torch.int32))
        o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = _decode_ref(q, kb, vb, r2t, rows, [0] * bs, lens, 0.0)
        assert _rel_err(o, ref) <= REL_TOL



@pytest.mark.parametrize("bs,dist,grid_waves", [(64, "uniform", 4), (256, "uniform", 16), (64, "tail", 4),
                                                (64, "tail", 16), (256, "tail", 32)])
def test_decode_ragged_split_heuristic(bs, dist, grid_waves):
    """Serving-size ragged batches (lengths uniform in [128, 8192], or a log-normal tail with
    median 1K clipped to [1, 32768]; Hq 32, Hkv 8, D 128, page 1) with the ragged-aware split
    counts, at the default split grid and at larger ones: requests get different split
    counts (the longest as many as the grid axis allows, > 1 here; the shortest one) and the
    output matches float64."""
    from attnserve.attention.triton_ops.decode_attention import decode_attention_fwd
    from attnserve.attention.triton_ops.decode_splits import compute_num_kv_splits, decode_grid_splits
    from attnserve.attention.triton_ops.kv_indices import compute_kv_indptr, create_kv_indices

    g = _gen(bs * 7 + grid_waves + (1 if dist == "tail" else 0))
    hq, hkv, d, max_splits = 32, 8, 128, 32
    if dist == "uniform":
        lens = torch.randint(128, 8193, (bs,), generator=g, device=DEV).tolist()
    else:
        lens = torch.exp(torch.randn(bs, generator=g, device=DEV) + 6.93).clamp(1, 32768).long().tolist()
    r2t, rows, slots = _paged(lens, 1, g)
    kb = torch.randn(slots, hkv, d, generator=g, device=DEV).to(DTYPE)
    vb = torch.randn(slots, hkv, d, generator=g, device=DEV).to(DTYPE)
    q = torch.randn(bs, hq, d, generator=g, device=DEV).to(DTYPE)
    seq = torch.tensor(lens, dtype=torch.int32, device=DEV)
    indptr = compute_kv_indptr(seq)
    idx = torch.empty(sum(lens), dtype=torch.int32, device=DEV)
    create_kv_indices(r2t, rows, seq, indptr, None, idx)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    ns = torch.empty(bs, dtype=torch.int32, device=DEV)
    compute_num_kv_splits(seq, ns, max_splits, num_sms, hkv, grid_waves=grid_waves)
    grid = decode_grid_splits(bs, hkv, max_splits, num_sms, grid_waves)
    assert ns.min().item() == 1 and ns.max().item() == grid > 1
    o = torch.full((bs, hq, d), float("nan"), dtype=DTYPE, device=DEV)
    logits = torch.full((bs, hq, max_splits, d), float("nan"), device=DEV)
    lse = torch.full((bs, hq, max_splits), float("nan"), device=DEV)
    decode_attention_fwd(q, kb, vb, o, indptr, idx, logits, lse, ns, max_splits, d ** -0.5, grid_splits=grid)
    assert _rel_err(o, _decode_ref(q, kb, vb, r2t, rows, [0] * bs, lens, 0.0)) <= REL_TOL

# ----------------------------------------------------------------------------------- extend
def _extend(prefix, ext, page_size, hq, hkv, d, seed, is_causal=True, window=-1, logit_cap=0.0,
            prefix_start=None, mask=False, **kw):
    from attnserve.attention.triton_ops.extend_attention import extend_attention_fwd
    from attnserve.attention.triton_ops.kv_indices import compute_kv_indptr, create_kv_indices

    g = _gen(seed)
    bs = len(ext)
    r2t, rows, slots = _paged([max(p, 1) for p in prefix], page_size, g)
    kb = torch.randn(slots, hkv, d, generator=g, device=DEV).to(DTYPE)
    vb = torch.randn(slots, hkv, d, generator=g, device=DEV).to(DTYPE)
    t = sum(ext)
    q = torch.randn(t, hq, d, generator=g, device=DEV).to(DTYPE)
    ke = torch.randn(t, hkv, d, generator=g, device=DEV).to(DTYPE)
    ve = torch.randn(t, hkv, d, generator=g, device=DEV).to(DTYPE)
    qo = [0]
    for e in ext:
        qo.append(qo[-1] + e)
    pstart = prefix_start or [0] * bs
    masks = None
    if mask:  # speculative-tree style: prefix visible, random ancestors, self visible
        masks = []
        for i, e in enumerate(ext):
            plen = pstart[i] + prefix[i]
            m = torch.ones(e, plen + e, dtype=torch.bool, device=DEV)
            m[:, plen:] = (torch.rand(e, e, generator=g, device=DEV) < 0.5).tril() | torch.eye(e, dtype=torch.bool, device=DEV)
            masks.append(m)
    plens = torch.tensor(prefix, dtype=torch.int32, device=DEV)
    kv_indptr = compute_kv_indptr(plens)
    kv_indices = torch.empty(sum(prefix) + 1, dtype=torch.int32, device=DEV)
    create_kv_indices(r2t, rows, plens, kv_indptr, None, kv_indices)
    mask_flat = torch.cat([m.reshape(-1) for m in masks]) if masks else None
    mask_indptr = None
    if masks:
        mask_indptr = torch.tensor([0] + [m.numel() for m in masks[:-1]], device=DEV).cumsum(0)
    o = torch.full((t, hq, d), float("nan"), dtype=DTYPE, device=DEV)
    extend_attention_fwd(
        q, ke, ve, o, kb, vb, torch.tensor(qo, dtype=torch.int32, device=DEV), kv_indptr, kv_indices,
        mask_flat, is_causal, mask_indptr, max(ext), d ** -0.5, logit_cap, window,
        torch.tensor(pstart, dtype=torch.int32, device=DEV) if prefix_start else None, **kw,
    )
    # float64 reference
    ref = torch.empty(t, hq, d, dtype=torch.float64, device=DEV)
    for i in range(bs):
        a, b = qo[i], qo[i + 1]
        sl = r2t[rows[i], : prefix[i]].long()
        k = torch.cat([kb[sl], ke[a:b]])
        v = torch.cat([vb[sl], ve[a:b]])
        plen = pstart[i] + prefix[i]
        kpos = torch.cat([torch.arange(pstart[i], plen, device=DEV), torch.arange(plen, plen + ext[i], device=DEV)])
        qpos = torch.arange(plen, plen + ext[i], device=DEV)
        if masks is not None:
            vis = masks[i][:, kpos]
        elif is_causal:
            vis = kpos[None, :] <= qpos[:, None]
        else:
            vis = torch.ones(ext[i], kpos.numel(), dtype=torch.bool, device=DEV)
        if window >= 0:
            vis = vis & (kpos[None, :] >= qpos[:, None] - window)
        qi = q[a:b].view(b - a, hkv, hq // hkv, d).permute(1, 2, 0, 3)
        ref[a:b] = _attend(qi, k, v, d ** -0.5, logit_cap, vis)
    return o, ref


EXT_PREFIX = [0, 0, 100, 1000, 37, 2048]
EXT_LENS = [1, 700, 128, 513, 64, 1024]


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("hq,hkv,d", [(8, 8, 128), (32, 8, 128), (16, 2, 64), (8, 2, 256)])
def test_extend_ragged_bf16(page_size, hq, hkv, d):
    o, ref = _extend(EXT_PREFIX, EXT_LENS, page_size, hq, hkv, d, seed=page_size + 3 * hq + hkv + d)
    assert _rel_err(o, ref) <= REL_TOL


@pytest.mark.parametrize("window,logit_cap,trim", [(255, 0.0, False), (511, 30.0, True), (-1, 50.0, False)])
def test_extend_window_and_logit_cap(window, logit_cap, trim):
    prefix, pstart = EXT_PREFIX, None
    if trim:  # the caller keeps only the prefix keys that any new token can see
        pstart = [max(p - window, 0) for p in EXT_PREFIX]
        prefix = [p - s for p, s in zip(EXT_PREFIX, pstart)]
    o, ref = _extend(prefix, EXT_LENS, 16, 16, 4, 128, seed=window + 1, window=window, logit_cap=logit_cap,
                     prefix_start=pstart)
    assert _rel_err(o, ref) <= REL_TOL


def test_extend_custom_mask_and_non_causal():
    o, ref = _extend([500, 3000, 0, 64], [8, 64, 16, 33], 16, 32, 8, 128, seed=21, mask=True)
    assert _rel_err(o, ref) <= REL_TOL
    o, ref = _extend([0, 300], [1000, 77], 64, 16, 4, 128, seed=22, is_causal=False)
    assert _rel_err(o, ref) <= REL_TOL


def test_extend_has_prefix_hint():
    """``has_prefix=False`` (prefix stage compiled out, no separate prefix tile) on a plain
    prefill gives the same bits as the default kernel; with a window too. Batches with
    prefixes keep the default (True) and stay correct."""
    o_hint, ref = _extend([0, 0], [700, 129], 16, 32, 8, 128, seed=24, has_prefix=False)
    o_default, _ = _extend([0, 0], [700, 129], 16, 32, 8, 128, seed=24)
    assert _rel_err(o_hint, ref) <= REL_TOL and torch.equal(o_hint, o_default)
    o_hint, ref = _extend([0, 0, 0], [300, 1, 64], 16, 32, 8, 128, seed=26, has_prefix=False, window=100)
    o_default, _ = _extend([0, 0, 0], [300, 1, 64], 16, 32, 8, 128, seed=26, window=100)
    assert _rel_err(o_hint, ref) <= REL_TOL and torch.equal(o_hint, o_default)
    o, ref = _extend(EXT_PREFIX, EXT_LENS, 16, 32, 8, 128, seed=25, window=300)
    assert _rel_err(o, ref) <= REL_TOL


def test_extend_long_prefill():
    o, ref = _extend([0], [4096], 16, 8, 2, 128, seed=23)
    assert _rel_err(o, ref) <= REL_TOL


def test_merge_state_bf16():
    from attnserve.attention.triton_ops.merge_state import merge_state

    g = _gen(31)
    t, h, d = 1000, 32, 128
    va = torch.randn(t, h, d, generator=g, device=DEV).to(DTYPE)
    vb = torch.randn(t, h, d, generator=g, device=DEV).to(DTYPE)
    sa = torch.randn(t, h, generator=g, device=DEV) * 3
    sb = torch.randn(t, h, generator=g, device=DEV) * 3
    sa[::7] = float("-inf")
    vo = torch.full_like(va, float("nan"))
    so = torch.full_like(sa, float("nan"))
    merge_state(va, sa, vb, sb, vo, so)
    s = torch.logaddexp(sa.double(), sb.double())
    wa = torch.exp(sa.double() - s)[..., None]
    ref = wa * va.double() + (1 - wa) * vb.double()
    assert _rel_err(vo, ref) <= REL_TOL
    torch.testing.assert_close(so.double(), s, atol=1e-5, rtol=1e-5)
