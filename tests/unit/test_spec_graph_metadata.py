"""The metadata paths speculative CUDA graphs use, checked eagerly (CPU: Triton interpreter;
GPU: the real kernels):

* `TritonMultiStepDraftBackend`: every draft step's decode output, from metadata computed
  once for all steps, equals a float64 reference and the per-step metadata path; ragged
  step limits (requests that stop growing), windows, pages, deterministic splits;
* the TARGET_VERIFY graph hooks of the triton backend with `pack_verify_inputs`' padded
  node-only layout: each real node's output equals the float64 tree reference, whatever
  the padding nodes hold.
"""

from __future__ import annotations

import math
import os
import random

import pytest
import torch

from attention_harness import backend_config, make_batch
from attnserve.engine.speculative.verify_graph import pack_verify_inputs
from attnserve.forward_batch import ForwardBatch, ForwardMode, VerifyInput

from test_tree_verify import prefix_kv_of, random_trees, tree_reference64

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs CUDA or TRITON_INTERPRET=1")


def _decode_reference64(case, rows, lens, q):
    """float64 decode of ``q`` ``[bs, Hq, D]`` over each row's first ``lens[i]`` slots."""
    layer = case.layer
    kb, vb = case.pool.get_key_buffer(0).double().cpu(), case.pool.get_value_buffer(0).double().cpu()
    group = layer.tp_q_head_num // layer.tp_k_head_num
    w = layer.sliding_window_size
    outs = []
    for i, (row, n) in enumerate(zip(rows, lens)):
        slots = case.req_to_token[row, :n].long().cpu()
        if w >= 0:
            slots = slots[max(0, n - w - 1):]
        k = kb[slots].repeat_interleave(group, dim=1)
        v = vb[slots].repeat_interleave(group, dim=1)
        s = torch.einsum("hd,khd->hk", q[i].double().cpu(), k) * layer.scaling
        if layer.logit_cap > 0:
            s = layer.logit_cap * torch.tanh(s / layer.logit_cap)
        outs.append(torch.einsum("hk,khd->hd", torch.softmax(s, -1), v))
    return torch.stack(outs)


@pytest.mark.parametrize("page_size,hq,hkv,window,deterministic", [
    (1, 4, 2, -1, False), (16, 4, 1, 3, False), (4, 6, 2, -1, True), (4, 4, 4, 6, True)])
def test_multi_step_metadata_matches_reference(page_size, hq, hkv, window, deterministic):
    from attnserve.attention.multi_step_draft import TritonMultiStepDraftBackend
    from attnserve.attention.triton_backend import TritonAttnBackend

    steps, d = 4, 16
    prefix = [3, 0, 21, 9]
    case = make_batch(ForwardMode.EXTEND, prefix, [steps + 2] * len(prefix), hq, hkv, d, page_size, window=window,
                      seed=page_size + hq, device=DEVICE)
    g = torch.Generator().manual_seed(7)
    for row, p in zip(case.rows, prefix):  # K/V everywhere a step may look
        slots = case.req_to_token[row, :p + steps + 2].long()
        case.pool.set_kv_buffer(case.layer, slots, torch.randn(len(slots), hkv, d, generator=g).to(DEVICE),
                                torch.randn(len(slots), hkv, d, generator=g).to(DEVICE))
    bs = len(prefix)
    cfg = backend_config(case, deterministic=deterministic)
    multi = TritonMultiStepDraftBackend(cfg, steps, max_bs=8)
    rows = torch.tensor(case.rows, dtype=torch.int64, device=DEVICE)
    seq_lens = torch.tensor([p + 2 for p in prefix], dtype=torch.int32, device=DEVICE)
    limits = torch.tensor([steps, 1, -1, 2], dtype=torch.int32, device=DEVICE)  # ragged growth
    multi.init_forward_metadata(bs, rows, seq_lens, limits)
    for j in range(steps):
        lens = [p + 2 + min(j, int(lim)) for p, lim in zip(prefix, limits.tolist())]
        q = torch.randn(bs, hq, d, generator=g).to(DEVICE)
        fb = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=rows, positions=rows,
                          req_pool_indices=rows, seq_lens=torch.tensor(lens, dtype=torch.int32, device=DEVICE),
                          out_cache_loc=rows, seq_lens_cpu=torch.tensor(lens, dtype=torch.int32),
                          seq_lens_sum=sum(lens), req_to_token_pool=case.fb.req_to_token_pool,
                          token_to_kv_pool=case.pool)
        fb.attn_backend = multi.backends[j]
        out = multi.backends[j].forward_decode(q.view(bs, -1), None, None, case.layer, fb, save_kv_cache=False)
        single = TritonAttnBackend(cfg)
        fb.attn_backend = single
        single.init_forward_metadata(fb)
        out_single = single.forward_decode(q.view(bs, -1), None, None, case.layer, fb, save_kv_cache=False)
        ref = _decode_reference64(case, case.rows, lens, q)
        torch.testing.assert_close(out.view(bs, hq, d).double().cpu(), ref, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(out, out_single, atol=2e-5, rtol=2e-5)
        assert multi.backends[j].forward_metadata.kv_indptr.numel() == bs + 1


def test_multi_step_refuses_bad_sizes():
    from attnserve.attention.multi_step_draft import TritonMultiStepDraftBackend

    case = make_batch(ForwardMode.DECODE, [3], [1], 2, 2, 16, 1, device=DEVICE)
    with pytest.raises(ValueError, match="num_steps must be >= 1"):
        TritonMultiStepDraftBackend(backend_config(case), 0, 4)
    multi = TritonMultiStepDraftBackend(backend_config(case), 2, 1)
    rows = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="above the multi-step draft backend's max_bs 1"):
        multi.init_forward_metadata(2, rows, rows.to(torch.int32) + 1)


@pytest.mark.parametrize("page_size,hq,hkv,cap", [(1, 4, 2, 0.0), (16, 8, 8, 0.0), (4, 6, 3, 4.0)])
@pytest.mark.parametrize("seed", [0, 1])
def test_verify_graph_hooks_with_padded_nodes(page_size, hq, hkv, cap, seed):
    """`init_forward_metadata_capture_cuda_graph` in TARGET_VERIFY mode over a batch padded to
    ``n`` nodes per request plus one padded request, as `VerifyGraphRunner` replays it."""
    from attnserve.attention.triton_backend import TritonAttnBackend

    rnd = random.Random(seed * 31 + page_size)
    d, n = 16, 8
    bs = rnd.randint(1, 3)
    trees = random_trees(rnd, bs, max_nodes=n)
    prefix = [rnd.randint(1, 30) for _ in range(bs)]
    case = make_batch(ForwardMode.TARGET_VERIFY, prefix, [t.size for t in trees], hq, hkv, d, page_size,
                      logit_cap=cap, seed=seed, device=DEVICE)
    prefix_kv = prefix_kv_of(case)
    loc = case.fb.out_cache_loc.cpu()
    offs = [0] + [t.size for t in trees]
    slots = [loc[sum(offs[:i + 1]): sum(offs[:i + 1]) + t.size] for i, t in enumerate(trees)]
    packed = pack_verify_inputs(trees, prefix, case.rows, slots, n)
    t = bs * n
    parts = torch.split(packed, [bs, bs, t, t, t, t * n])
    assert parts[0].tolist() == list(case.rows) and parts[1].tolist() == prefix
    # one padded request after the real ones (row 0, prefix 1, dummy slot), as in a replay
    pb = bs + 1
    rows = torch.cat([parts[0], torch.zeros(1, dtype=torch.int64)]).to(DEVICE)
    prefix_lens = torch.cat([parts[1], torch.ones(1, dtype=torch.int64)]).to(torch.int32).to(DEVICE)
    out_loc = torch.cat([parts[4], torch.zeros(n, dtype=torch.int64)]).to(DEVICE)
    mask = torch.cat([parts[5], torch.eye(n, dtype=torch.int64).view(-1)]).bool().to(DEVICE)
    spec = VerifyInput(mask, torch.arange(pb + 1, dtype=torch.int64, device=DEVICE) * n * n, None, [n] * pb,
                       mask_covers_prefix=False)
    backend = TritonAttnBackend(backend_config(case))
    backend.init_cuda_graph_state(4, 4 * n)
    backend.init_forward_metadata_capture_cuda_graph(pb, pb * n, rows, prefix_lens, None, ForwardMode.TARGET_VERIFY,
                                                     spec)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(pb * n, hq, d, generator=g).to(DEVICE)
    k = torch.randn(pb * n, hkv, d, generator=g).to(DEVICE)
    v = torch.randn(pb * n, hkv, d, generator=g).to(DEVICE)
    real = torch.cat([torch.arange(i * n, i * n + tr.size) for i, tr in enumerate(trees)]).to(DEVICE)
    q[real], k[real], v[real] = case.q, case.k, case.v  # the real nodes' rows; padding stays random
    fb = ForwardBatch(forward_mode=ForwardMode.TARGET_VERIFY, batch_size=pb, input_ids=out_loc, positions=out_loc,
                      req_pool_indices=rows, seq_lens=prefix_lens, out_cache_loc=out_loc,
                      req_to_token_pool=case.fb.req_to_token_pool, token_to_kv_pool=case.pool, attn_backend=backend,
                      spec_info=spec)
    out = backend.forward_extend(q.view(pb * n, -1), k, v, case.layer, fb).view(pb * n, hq, d)
    assert not torch.isnan(out).any()
    ref = tree_reference64(case.layer, prefix_kv, case.q, case.k, case.v, trees, prefix)
    torch.testing.assert_close(out[real].double().cpu(), ref, atol=2e-4, rtol=2e-4)
    assert math.isfinite(float(out.abs().sum()))
