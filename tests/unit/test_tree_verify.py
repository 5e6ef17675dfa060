"""Speculative TARGET_VERIFY with tree masks through the attention backends.

Random draft trees (``parents[i]`` uniform in ``[0, i)``, 1..8 nodes, ragged cached prefixes
of 0..40 tokens, 1..4 requests) go through `build_verify_input` into ``fb.spec_info``, and
the layer's output from ``torch_native`` and ``triton`` (CPU: Triton interpreter) is checked
against a float64 reference in which node ``i`` of request ``r`` sees every cached key of
``r`` and the keys of its ancestors (itself included); the ancestor sets are recomputed here
from ``parents``, independently of `DraftTree.ancestor_mask`. Also:

* the mask layout `build_verify_input` produces (blocks, ``mask_indptr``, positions);
* ``mask_indptr`` with ``bs + 1`` entries (what `build_verify_input` gives) and with only
  the ``bs`` entries the backends read;
* every pool slot no request owns holds NaN (nothing outside the requests is read);
* a chain tree gives the output of a plain causal EXTEND of the same tokens;
* MLA: the latent layer of ``torch_native`` and ``triton_mla`` with a tree mask.
"""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
import torch

from attention_harness import backend_config, make_batch, naive_reference
from attnserve.attention.radix_attention import RadixAttention
from attnserve.attention.torch_native import TorchNativeAttnBackend
from attnserve.engine.speculative.tree import DraftTree, build_verify_input
from attnserve.forward_batch import ForwardBatch, ForwardMode
from attnserve.mem_cache.memory_pool import MLATokenToKVPool, ReqToTokenPool, TokenToKVPoolAllocator

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # Triton runs interpreted on the CPU
HAS_TRITON = DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs CUDA or TRITON_INTERPRET=1")
BACKENDS = ["torch_native", pytest.param("triton", marks=needs_triton)]

# fp32 inputs, fp32 accumulation in both backends (IEEE dots in Triton; exp2 with the scale
# folded in, tanh soft cap in fp32): the error vs float64 is below 1e-6 at these sizes
# (scores of O(1), at most 48 keys; measured max 5e-7); 2e-4 leaves a wide margin without hiding a wrong key
# set, which moves outputs by O(0.1).
ATOL = RTOL = 2e-4


def random_trees(rnd: random.Random, bs: int, max_nodes: int = 8):
    """``bs`` random trees of 1..max_nodes nodes, ``parents[i]`` uniform in ``[0, i)``."""
    trees = []
    for _ in range(bs):
        n = rnd.randint(1, max_nodes)
        parents = [-1] + [rnd.randint(0, i - 1) for i in range(1, n)]
        trees.append(DraftTree(tuple(rnd.randrange(1000) for _ in range(n)), tuple(parents)))
    return trees


def ancestors(parents, i):
    """``{i}`` and every ancestor of node ``i``, by walking ``parents``."""
    out = set()
    while i >= 0:
        out.add(i)
        i = parents[i]
    return out


def expected_block(tree: DraftTree, p: int) -> torch.Tensor:
    """bool ``[n, p + n]``: every prefix key, then the node's ancestors (itself included)."""
    n = tree.size
    m = torch.zeros(n, p + n, dtype=torch.bool)
    m[:, :p] = True
    for i in range(n):
        for j in ancestors(tree.parents, i):
            m[i, p + j] = True
    return m


def make_backend(name, case):
    if name == "torch_native":
        return TorchNativeAttnBackend(backend_config(case))
    from attnserve.attention.triton_backend import TritonAttnBackend

    return TritonAttnBackend(backend_config(case))


def run_layer(case, backend):
    case.fb.attn_backend = backend
    backend.init_forward_metadata(case.fb)
    t = case.q.shape[0]
    out = case.layer(case.q.reshape(t, -1), case.k.reshape(t, -1), case.v.reshape(t, -1), case.fb)
    return out.view(t, case.layer.tp_q_head_num, case.layer.v_head_dim)


def poison_unowned_slots(case):
    """NaN in every K/V pool row that no request of the batch owns (slot 0 included)."""
    owned = set()
    for row, p, e in zip(case.rows, case.prefix_lens, case.extend_lens):
        owned |= set(case.req_to_token[row, :p + e].tolist())
    for buf in (case.pool.get_key_buffer(0), case.pool.get_value_buffer(0)):
        hidden = torch.tensor(sorted(set(range(buf.shape[0])) - owned), dtype=torch.int64, device=buf.device)
        buf[hidden] = float("nan")


def tree_reference64(layer, prefix_kv, q, k, v, trees, prefix_lens):
    """float64 tree attention from explicit tensors.

    ``prefix_kv[r]``: request r's cached ``(K, V)`` ``[p, Hkv, D]``; ``q``/``k``/``v``: the
    nodes' new rows, requests concatenated. Node i sees all p prefix keys and its ancestors.
    """
    hq, hkv = layer.tp_q_head_num, layer.tp_k_head_num
    group = hq // hkv
    outs, t0 = [], 0
    for (kp, vp), tree, p in zip(prefix_kv, trees, prefix_lens):
        n = tree.size
        K = torch.cat([kp, k[t0:t0 + n]]).double().cpu().repeat_interleave(group, dim=1)  # [p+n, Hq, D]
        V = torch.cat([vp, v[t0:t0 + n]]).double().cpu().repeat_interleave(group, dim=1)
        Q = q[t0:t0 + n].double().cpu()
        for i in range(n):
            vis = torch.zeros(p + n, dtype=torch.bool)
            vis[:p] = True
            vis[[p + j for j in ancestors(tree.parents, i)]] = True
            s = torch.einsum("hd,khd->hk", Q[i], K) * layer.scaling
            if layer.logit_cap > 0:
                s = layer.logit_cap * torch.tanh(s / layer.logit_cap)
            s = s.masked_fill(~vis[None], float("-inf"))
            outs.append(torch.einsum("hk,khd->hd", torch.softmax(s, dim=-1), V))
        t0 += n
    return torch.stack(outs)


def verify_case(trees, prefix_lens, hq, hkv, d, page_size, logit_cap=0.0, seed=0, bs_indptr=False,
                covers_prefix=True):
    """A TARGET_VERIFY batch over ``trees`` with ``fb.spec_info`` from `build_verify_input`
    (``covers_prefix=False``: the ``[n, n]`` node-only layout CUDA-graph verify uses)."""
    sizes = [t.size for t in trees]
    case = make_batch(ForwardMode.TARGET_VERIFY, prefix_lens, sizes, hq, hkv, d, page_size, logit_cap=logit_cap,
                      seed=seed, device=DEVICE)
    vi = build_verify_input(trees, prefix_lens, torch.device(DEVICE), covers_prefix=covers_prefix)
    if bs_indptr:  # the backends only read mask_indptr[:bs]
        vi = dataclasses.replace(vi, mask_indptr=vi.mask_indptr[:len(trees)].clone())
    case.fb.spec_info = vi
    case.fb.positions = vi.positions  # as SpecDecoder.verify does (RoPE positions; attention ignores them)
    return case, vi


def prefix_kv_of(case):
    kb, vb = case.pool.get_key_buffer(0), case.pool.get_value_buffer(0)
    out = []
    for row, p in zip(case.rows, case.prefix_lens):
        slots = case.req_to_token[row, :p].long()
        out.append((kb[slots].clone(), vb[slots].clone()))
    return out


def test_build_verify_input_layout():
    rnd = random.Random(123)
    for _ in range(20):
        bs = rnd.randint(1, 4)
        trees = random_trees(rnd, bs)
        prefix = [rnd.randint(0, 40) for _ in range(bs)]
        vi = build_verify_input(trees, prefix)
        assert vi.mask_indptr.dtype == torch.int64 and vi.positions.dtype == torch.int64
        assert vi.draft_token_num == [t.size for t in trees]
        assert vi.mask_indptr.tolist()[0] == 0 and vi.mask_indptr.numel() == bs + 1
        assert int(vi.mask_indptr[-1]) == vi.custom_mask.numel()
        pos = []
        for i, (t, p) in enumerate(zip(trees, prefix)):
            lo, hi = int(vi.mask_indptr[i]), int(vi.mask_indptr[i + 1])
            assert hi - lo == t.size * (p + t.size)
            assert torch.equal(vi.custom_mask[lo:hi].view(t.size, p + t.size), expected_block(t, p))
            pos += [p + len(ancestors(t.parents, j)) - 1 for j in range(t.size)]
        assert vi.positions.tolist() == pos


# (page_size, hq, hkv, head_dim, logit_cap): page sizes 1/16, head ratios 1 and 4, a soft cap
CONFIGS = [
    (1, 4, 4, 16, 0.0),
    (16, 8, 2, 32, 0.0),
    (16, 4, 4, 32, 0.0),
    (1, 8, 2, 16, 5.0),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size,hq,hkv,d,cap", CONFIGS)
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_random_trees_match_float64(backend, page_size, hq, hkv, d, cap, seed):
    rnd = random.Random(1000 * seed + 10 * page_size + hq + d)
    bs = rnd.randint(1, 4)
    trees = random_trees(rnd, bs)
    prefix = [rnd.randint(0, 40) for _ in range(bs)]
    case, vi = verify_case(trees, prefix, hq, hkv, d, page_size, logit_cap=cap, seed=seed,
                           bs_indptr=(seed % 2 == 1), covers_prefix=seed < 2)
    poison_unowned_slots(case)
    prefix_kv = prefix_kv_of(case)
    out = run_layer(case, make_backend(backend, case))
    assert out.shape == (sum(t.size for t in trees), hq, d)
    assert not torch.isnan(out).any()
    # the nodes' K/V were stored at their out_cache_loc slots
    loc = case.fb.out_cache_loc
    assert torch.equal(case.pool.get_key_buffer(0)[loc], case.k)
    assert torch.equal(case.pool.get_value_buffer(0)[loc], case.v)
    ref = tree_reference64(case.layer, prefix_kv, case.q, case.k, case.v, trees, prefix)
    torch.testing.assert_close(out.double().cpu(), ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_edge_trees_match_float64(backend):
    """Fixed shapes at the edges: a lone root without prefix, a star, a deep chain over a
    prefix that ends exactly at a page/tile boundary (16, 32), a prefix of 1."""
    trees = [
        DraftTree((5,), (-1,)),
        DraftTree(tuple(range(8)), (-1, 0, 0, 0, 0, 0, 0, 0)),  # star: every draft a child of the root
        DraftTree(tuple(range(8)), (-1, 0, 1, 2, 3, 4, 5, 6)),  # chain
        DraftTree(tuple(range(7)), (-1, 0, 0, 1, 1, 2, 5)),
    ]
    prefix = [0, 16, 32, 1]
    case, _ = verify_case(trees, prefix, 8, 2, 16, 16, seed=7)
    poison_unowned_slots(case)
    prefix_kv = prefix_kv_of(case)
    out = run_layer(case, make_backend(backend, case))
    assert not torch.isnan(out).any()
    ref = tree_reference64(case.layer, prefix_kv, case.q, case.k, case.v, trees, prefix)
    torch.testing.assert_close(out.double().cpu(), ref, atol=ATOL, rtol=RTOL)
    # the shared harness reference, fed the layout's blocks, agrees with the tree reference
    blocks = [expected_block(t, p) for t, p in zip(trees, prefix)]
    torch.testing.assert_close(naive_reference(case, custom_masks=blocks), ref, atol=1e-10, rtol=1e-10)
    # the root (node 0) sees only the prefix and itself: a star's leaves differ from each other
    star = out[1:9]
    assert not torch.allclose(star[1], star[2])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [1, 16])
def test_chain_tree_equals_causal_extend(backend, page_size):
    """A chain (parents -1, 0, 1, ...) under TARGET_VERIFY gives what a plain causal EXTEND
    of the same tokens over the same cache gives."""
    sizes, prefix = [4, 1, 8], [9, 0, 23]
    trees = [DraftTree.chain(1, range(2, 1 + n)) for n in sizes]
    assert [t.size for t in trees] == sizes
    verify, _ = verify_case(trees, prefix, 4, 2, 16, page_size, seed=31)
    extend = make_batch(ForwardMode.EXTEND, prefix, sizes, 4, 2, 16, page_size, seed=31, device=DEVICE)
    assert torch.equal(verify.q, extend.q) and torch.equal(verify.pool.get_key_buffer(0), extend.pool.get_key_buffer(0))
    out_v = run_layer(verify, make_backend(backend, verify))
    out_e = run_layer(extend, make_backend(backend, extend))
    # same numbers through the masked and the causal code paths: equal to fp32 rounding
    torch.testing.assert_close(out_v, out_e, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out_e.double().cpu(), naive_reference(extend), atol=ATOL, rtol=RTOL)


# ---- MLA: the latent layer (one KV head of kv_lora_rank + rope, values = first kv_lora_rank) ----
R, ROPE = 32, 16


def _mla_backend(name, pool, r2t, hq):
    from attnserve.attention.backend_config import AttentionBackendConfig

    cfg = AttentionBackendConfig.from_pools(r2t, pool, hq)
    if name == "torch_native":
        return TorchNativeAttnBackend(cfg)
    from attnserve.attention.triton_mla_backend import TritonMLAAttnBackend

    return TritonMLAAttnBackend(cfg)


@pytest.mark.parametrize("backend", ["torch_native", pytest.param("triton_mla", marks=needs_triton)])
@pytest.mark.parametrize("page_size", [1, 16])
def test_mla_latent_tree_verify(backend, page_size):
    rnd = random.Random(55 + page_size)
    g = torch.Generator().manual_seed(page_size)
    trees = random_trees(rnd, 3)
    trees[0] = DraftTree((1, 2, 3, 4, 5), (-1, 0, 0, 1, 2))
    prefix = [0, 21, 40]
    sizes = [t.size for t in trees]
    seq = [p + n for p, n in zip(prefix, sizes)]
    hq = 4
    alloc = TokenToKVPoolAllocator((sum(-(-s // page_size) for s in seq) + 4) * page_size, page_size)
    alloc.shuffle_free_pages(rnd)
    pool = MLATokenToKVPool(alloc.size, page_size, torch.float32, R, ROPE, 1, DEVICE)
    pool.kv_buffer[0].fill_(float("nan"))  # unowned rows: NaN
    r2t = ReqToTokenPool(len(trees) + 2, max(seq) + 1, DEVICE)
    rows = r2t.alloc(len(trees))
    rnd.shuffle(rows)
    layer = RadixAttention(hq, R + ROPE, 0.15, num_kv_heads=1, layer_id=0, v_head_dim=R)
    for row, p in zip(rows, prefix):
        if p:
            slots = alloc.alloc_extend([0], [p], [0])
            r2t.write(row, 0, slots)
            pool.kv_buffer[0][slots.to(DEVICE)] = torch.randn(p, 1, R + ROPE, generator=g).to(DEVICE)
    last = [int(r2t.req_to_token[row, p - 1]) if p else 0 for row, p in zip(rows, prefix)]
    loc = alloc.alloc_extend(prefix, seq, last)
    off = 0
    for row, p, n in zip(rows, prefix, sizes):
        r2t.write(row, p, loc[off:off + n])
        off += n
    loc = loc.to(DEVICE)
    t = sum(sizes)
    q = torch.randn(t, hq, R + ROPE, generator=g).to(DEVICE)
    latent = torch.randn(t, R + ROPE, generator=g).to(DEVICE)
    buf = pool.kv_buffer[0]
    prefix_kv = []
    for row, p in zip(rows, prefix):
        kp = buf[r2t.req_to_token[row, :p].long()].clone()
        prefix_kv.append((kp, kp[..., :R]))
    be = _mla_backend(backend, pool, r2t, hq)
    vi = build_verify_input(trees, prefix, torch.device(DEVICE))
    fb = ForwardBatch.init_new(ForwardMode.TARGET_VERIFY, [0] * t, rows, prefix, sizes, loc, r2t, pool, be, DEVICE,
                               spec_info=vi)
    be.init_forward_metadata(fb)
    out = layer(q.reshape(t, -1), latent, None, fb).view(t, hq, R)
    assert torch.equal(buf[loc, 0], latent)  # the backend stored the nodes' latent rows
    assert not torch.isnan(out).any()
    k_new = latent.view(t, 1, R + ROPE)
    ref = tree_reference64(layer, prefix_kv, q, k_new, k_new[..., :R], trees, prefix)
    torch.testing.assert_close(out.double().cpu(), ref, atol=ATOL, rtol=RTOL)
