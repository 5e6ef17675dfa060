"""MLA through the attention backends: `triton_mla` (CPU: Triton interpreter) vs `torch_native`.

* decode over the latent pool (one KV head of ``kv_lora_rank + rope``, values = the first
  ``kv_lora_rank`` columns): the triton_mla backend's MLA kernel path, eager and through the
  CUDA-graph metadata hooks (fixed buffers, padded rows), vs torch_native's generic path
  and a float64 reference;
* extend through the latent layer over a cached prefix (causal and with a speculative
  tree mask), and through the expanded layer without prefixes (a prefix is refused);
* the split policy and the workspace sized for the largest batch;
* the whole DeepSeek-V2 tiny model (dummy weights): chunked prefill then decode, triton vs
  torch_native.

Latent pools are filled through shuffled pages, with NaN in every slot no request owns.
"""

from __future__ import annotations

import os
import random
from types import SimpleNamespace

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from numeric_bounds import assert_within, forward_bound, mla_terms  # noqa: E402

from attnserve.attention.radix_attention import RadixAttention  # noqa: E402
from attnserve.attention.torch_native import TorchNativeAttnBackend, attention_reference  # noqa: E402
from attnserve.forward_batch import ForwardBatch, ForwardMode, VerifyInput  # noqa: E402
from attnserve.mem_cache.memory_pool import MLATokenToKVPool, ReqToTokenPool, TokenToKVPoolAllocator  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
R, ROPE = 64, 16  # small kv_lora_rank + qk_rope_head_dim


def _config(pool, r2t, num_heads, **kw):
    from attnserve.attention.backend_config import AttentionBackendConfig

    return AttentionBackendConfig.from_pools(r2t, pool, num_heads, **kw)


def _triton(pool, r2t, num_heads, deterministic=False, **kw):
    from attnserve.attention.triton_mla_backend import TritonMLAAttnBackend

    return TritonMLAAttnBackend(_config(pool, r2t, num_heads, deterministic=deterministic, **kw))


class LatentBatch:
    """A latent pool whose requests own shuffled pages; unowned slots hold NaN."""

    def __init__(self, cached_lens, page_size, num_layers=1, seed=0, max_reqs=8, r=R, rope=ROPE, room=16):
        rnd = random.Random(seed)
        self.g = torch.Generator().manual_seed(seed)
        self.page_size = page_size
        pages = sum(-(-(n + room) // page_size) for n in cached_lens) + 4
        self.alloc = TokenToKVPoolAllocator(pages * page_size, page_size)
        self.alloc.shuffle_free_pages(rnd)
        self.pool = MLATokenToKVPool(self.alloc.size, page_size, torch.float32, r, rope, num_layers, DEVICE)
        for buf in self.pool.kv_buffer:
            buf.fill_(float("nan"))
        self.r2t = ReqToTokenPool(max_reqs, max(cached_lens) + room, DEVICE)
        self.rows = self.r2t.alloc(len(cached_lens))
        rnd.shuffle(self.rows)
        self.lens = dict(zip(self.rows, [0] * len(self.rows)))
        self.grow(list(cached_lens), fill=True)

    def grow(self, new_lens, fill=False):
        """Allocate ``new_lens[i]`` more slots per request; returns int64 slots (batch order)."""
        prefix = [self.lens[r] for r in self.rows]
        seq = [p + n for p, n in zip(prefix, new_lens)]
        last = [int(self.r2t.req_to_token[r, p - 1]) if p else 0 for r, p in zip(self.rows, prefix)]
        loc = self.alloc.alloc_extend(prefix, seq, last)
        start = 0
        for r, p, n in zip(self.rows, prefix, new_lens):
            self.r2t.write(r, p, loc[start : start + n])
            start += n
            self.lens[r] = p + n
        loc = loc.to(DEVICE)
        if fill:
            for buf in self.pool.kv_buffer:
                buf[loc] = torch.randn(loc.numel(), 1, buf.shape[-1], generator=self.g).to(DEVICE)
        return loc, prefix

    def batch(self, mode, prefix, new_lens, loc, backend, spec_info=None):
        ids = [0] * sum(new_lens)
        return ForwardBatch.init_new(mode, ids, self.rows, prefix, new_lens, loc, self.r2t, self.pool, backend,
                                     DEVICE, spec_info=spec_info)


def _decode_ref64(case: LatentBatch, q, layer):
    """float64 per-request reference of absorbed MLA decode."""
    buf, q, r2t = case.pool.kv_buffer[0].double().cpu(), q.double().cpu(), case.r2t.req_to_token.cpu()
    out = []
    for i, row in enumerate(case.rows):
        n = case.lens[row]
        lat = buf[r2t[row, :n].long()]  # [n, 1, R + ROPE]
        pos = torch.arange(n)
        out.append(attention_reference(q[i : i + 1], lat, lat[..., : layer.v_head_dim], pos[-1:], pos,
                                       layer.scaling, compute_dtype=torch.float64))
    return torch.cat(out).reshape(len(case.rows), -1)


def _decode(backend, case, layer, q):
    loc, prefix = case.grow([1] * len(case.rows), fill=True)
    fb = case.batch(ForwardMode.DECODE, [p for p in prefix], [1] * len(case.rows), loc, backend)
    backend.init_forward_metadata(fb)
    return layer(q.reshape(q.shape[0], -1), None, None, fb, save_kv_cache=False)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("num_heads", [8, 16])
@pytest.mark.parametrize("deterministic", [False, True])
def test_triton_mla_decode_matches_torch_native(page_size, num_heads, deterministic):
    lens = [0, 37, 300, 5, 129]  # ragged, across tiles, pages and (>128) several splits
    case = LatentBatch(lens, page_size, seed=page_size * 100 + num_heads + deterministic)
    layer = RadixAttention(num_heads, R + ROPE, 0.11, num_kv_heads=1, layer_id=0, v_head_dim=R)
    q = torch.randn(len(lens), num_heads, R + ROPE, generator=case.g).to(DEVICE)
    # deterministic: small tiles give several splits per request under the interpreter too;
    # otherwise 64 SMs (the CPU stand-in count, 8, would give one split per request)
    tri = _triton(case.pool, case.r2t, num_heads, deterministic, split_tile_size=64, num_sms=64)
    out_tri = _decode(tri, case, layer, q)
    md = tri.forward_metadata
    assert md.block_kv_indices.dtype == torch.int32 and md.num_kv_splits.dtype == torch.int32
    if deterministic:
        assert md.num_kv_splits.tolist() == [max(1, -(-(n + 1) // 64)) for n in lens]
    else:
        assert int(md.num_kv_splits.max()) > 1
        # launched over the work list: every split of every request once, then -1
        splits = md.num_kv_splits.tolist()
        want = [b * 256 + s for b in range(len(lens)) for s in range(splits[b])]
        assert md.work.tolist() == want + [-1] * (md.work.numel() - len(want))
    tn = TorchNativeAttnBackend(_config(case.pool, case.r2t, num_heads))
    fb = case.batch(ForwardMode.DECODE, [n for n in lens], [1] * len(lens), torch.zeros(len(lens), dtype=torch.int64,
                                                                                        device=DEVICE), tn)
    tn.init_forward_metadata(fb)
    out_tn = layer(q.reshape(len(lens), -1), None, None, fb, save_kv_cache=False)
    assert not torch.isnan(out_tri).any()
    assert out_tri.shape == out_tn.shape == (len(lens), num_heads * R)
    assert (out_tri - out_tn).abs().max().item() < 2e-5
    assert (out_tri.double().cpu() - _decode_ref64(case, q, layer).cpu()).abs().max().item() < 2e-5


@pytest.mark.parametrize("num_heads,num_sms", [(128, 132), (128, 78), (16, 132), (8, 64)])
def test_triton_mla_grid_splits_bound_the_heuristic(num_heads, num_sms):
    """The per-batch split grid is never below what the heuristic gives a request of any
    length in a uniform batch of that size (so no request is clamped; ragged batches below
    ``split_sm_count`` requests run over the work list, `work_items`), never above max_kv_splits,
    a power of two or max_kv_splits; deterministic mode keeps max_kv_splits (its counts do
    not depend on the batch)."""
    from attnserve.attention.mla_triton import MLASplitPolicy
    from attnserve.attention.triton_ops.mla_decode import mla_num_kv_splits, mla_split_sm_count

    for deterministic in (False, True):
        policy = MLASplitPolicy(num_sms, num_heads, 32, deterministic)
        cap = policy.max_kv_splits
        grids = []
        for bs in range(1, 161):
            g = policy.grid_splits(bs)
            grids.append(g)
            if deterministic:
                assert g == cap
                continue
            most = max(min(cap, mla_num_kv_splits(n, bs, mla_split_sm_count(num_sms, num_heads)))
                       for n in (1, 127, 128, 129, 1000, 4096, 16384, 65536, 10**6))
            assert most <= g <= cap, (bs, most, g)
            assert g == cap or g & (g - 1) == 0, g
        if not deterministic:
            assert grids[0] == cap and min(grids) == 1  # large batches launch one program per head tile


@pytest.mark.parametrize("deterministic", [False, True])
def test_mla_workspace_sized_for_the_largest_batch(deterministic):
    """128 heads x 512 latent, 132 SMs, up to 1,024 running requests: the workspace holds
    the most (request, split) rows of any batch size (checked by brute force against what
    `mla_decode_fwd` is launched with), and in the default mode stays far below the old
    ``rows x 32 splits`` sizing (about 8.6 GB at 1,024 rows)."""
    from attnserve.attention.mla_triton import MLASplitPolicy
    from attnserve.attention.triton_ops.mla_decode import mla_workspace_size

    policy = MLASplitPolicy(132, 128, 32, deterministic)
    need = max(mla_workspace_size(0, bs, policy.split_stride(bs), 128, 512) for bs in range(1, 1025))
    got = policy.workspace_bytes(1024, 512)
    assert got == need
    old = mla_workspace_size(0, 1025, 32, 128, 512)
    if deterministic:
        assert got == mla_workspace_size(0, 1024, 32, 128, 512)
    else:
        assert got < old / 10, (got, old)


@pytest.mark.parametrize("page_size", [1, 16])
def test_triton_mla_graph_metadata_matches_eager(page_size):
    """Capture/replay hooks: fixed buffers refilled in place; padded rows (seq_len 1, row 0)
    leave the real rows' output unchanged; the workspace is the one allocated at start-up."""
    lens = [20, 3, 70]
    case = LatentBatch(lens, page_size, seed=5)
    layer = RadixAttention(8, R + ROPE, 0.2, num_kv_heads=1, layer_id=0, v_head_dim=R)
    tri = _triton(case.pool, case.r2t, 8, num_sms=64)
    workspace = tri.mla.workspace.data_ptr()
    q = torch.randn(4, 8, R + ROPE, generator=case.g).to(DEVICE)  # one padded row
    eager = _decode(tri, case, layer, q[:3])
    max_bs = 4
    rows = torch.zeros(max_bs, dtype=torch.int64, device=DEVICE)
    seq_lens = torch.ones(max_bs, dtype=torch.int32, device=DEVICE)
    tri.init_cuda_graph_state(max_bs, max_bs)
    tri.init_forward_metadata_capture_cuda_graph(max_bs, max_bs, rows, seq_lens, None, ForwardMode.DECODE, None)
    table_ptr = tri.forward_metadata.block_kv_indices.data_ptr()
    rows[:3] = torch.tensor(case.rows, device=DEVICE)
    seq_lens[:3] = torch.tensor([case.lens[r] for r in case.rows], dtype=torch.int32, device=DEVICE)
    tri.init_forward_metadata_replay_cuda_graph(max_bs, rows, seq_lens, int(seq_lens.sum()), None,
                                                ForwardMode.DECODE, None, None)
    md = tri.forward_metadata
    assert md.block_kv_indices.data_ptr() == table_ptr and md.seq_lens.data_ptr() == seq_lens.data_ptr()
    assert md.work is not None and md.work.data_ptr() == tri.mla.graph.work.data_ptr()  # refilled in place
    fb = SimpleNamespace(forward_mode=ForwardMode.DECODE, token_to_kv_pool=case.pool, out_cache_loc=None)
    graphed = tri.forward_decode(q.reshape(max_bs, -1), None, None, layer, fb, save_kv_cache=False)
    assert tri.mla.workspace.data_ptr() == workspace
    assert not torch.isnan(graphed[:3]).any()
    assert (graphed[:3] - eager).abs().max().item() < 2e-5


def _tree_mask(prefix_lens, extend_lens, g):
    """A random tree mask over [prefix | new] that keeps the diagonal, as a spec_info."""
    blocks = []
    for p, e in zip(prefix_lens, extend_lens):
        m = torch.rand(e, p + e, generator=g) < 0.6
        m[torch.arange(e), p + torch.arange(e)] = True
        blocks.append(m.reshape(-1))
    sizes = [e * (p + e) for p, e in zip(prefix_lens, extend_lens)]
    indptr = torch.tensor([0] + sizes[:-1], dtype=torch.int64).cumsum(0).to(DEVICE)
    return VerifyInput(torch.cat(blocks).to(DEVICE), indptr, None, list(extend_lens))


def _extend_ref64(q, keys, values, prefix_lens, extend_lens, scaling, spec):
    """float64 reference: ``keys[i]``/``values[i]`` ``[p_i + e_i, Hkv, D]`` per request."""
    out, qs = [], 0
    for i, (p, e) in enumerate(zip(prefix_lens, extend_lens)):
        m = None
        if spec is not None:
            off = int(spec.mask_indptr[i])
            m = spec.custom_mask[off : off + e * (p + e)].view(e, p + e).cpu()
        out.append(attention_reference(q[qs : qs + e].double().cpu(), keys[i].double().cpu(),
                                       values[i].double().cpu(), torch.arange(p, p + e), torch.arange(p + e),
                                       scaling, custom_mask=m, compute_dtype=torch.float64))
        qs += e
    return torch.cat(out).reshape(sum(extend_lens), -1)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("mask", [False, True])
def test_latent_extend_over_cached_prefix_both_backends(page_size, mask):
    """Absorbed extend: the backend stores the new latent rows and reads the cached prefix
    through its own indices (ragged prefixes, one request without prefix)."""
    prefix_lens, extend_lens, hq = [0, 7, 19, 40], [5, 1, 9, 4], 8
    layer = RadixAttention(hq, R + ROPE, 0.13, num_kv_heads=1, layer_id=0, v_head_dim=R)
    for make in ("torch_native", "triton_mla"):
        case = LatentBatch(prefix_lens, page_size, seed=3 + 10 * mask + page_size)
        g = torch.Generator().manual_seed(17)
        spec = _tree_mask(prefix_lens, extend_lens, g) if mask else None
        loc, _ = case.grow(extend_lens)
        t = sum(extend_lens)
        q = torch.randn(t, hq, R + ROPE, generator=g).to(DEVICE)
        latent = torch.randn(t, R + ROPE, generator=g).to(DEVICE)
        backend = (TorchNativeAttnBackend(_config(case.pool, case.r2t, hq)) if make == "torch_native"
                   else _triton(case.pool, case.r2t, hq))
        fb = case.batch(ForwardMode.TARGET_VERIFY if mask else ForwardMode.EXTEND, prefix_lens, extend_lens, loc,
                        backend, spec_info=spec)
        backend.init_forward_metadata(fb)
        out = layer(q.reshape(t, -1), latent, None, fb)
        buf = case.pool.kv_buffer[0]
        assert torch.equal(buf[loc, 0], latent)  # stored by the backend
        keys = [buf[case.r2t.req_to_token[r, : p + e].long()] for r, p, e in zip(case.rows, prefix_lens, extend_lens)]
        ref = _extend_ref64(q, keys, [k[..., :R] for k in keys], prefix_lens, extend_lens, layer.scaling, spec)
        assert not torch.isnan(out).any(), make
        assert (out.double().cpu() - ref).abs().max().item() < 2e-5, make


def test_expanded_extend_without_prefix_both_backends():
    """Expanded (per-head) K/V of a prefill with no cached prefix: new tokens only; nothing
    is read from the pool (NaN everywhere); a step with a cached prefix is refused."""
    extend_lens, hq, dk, dv = [12, 3, 7], 4, 48, 32
    layer = RadixAttention(hq, dk, dk**-0.5, num_kv_heads=hq, layer_id=0, v_head_dim=dv)
    g = torch.Generator().manual_seed(4)
    t = sum(extend_lens)
    q, k, v = (torch.randn(t, hq, d, generator=g).to(DEVICE) for d in (dk, dk, dv))
    starts = [sum(extend_lens[:i]) for i in range(len(extend_lens))]
    ref = _extend_ref64(q, [k[s : s + e] for s, e in zip(starts, extend_lens)],
                        [v[s : s + e] for s, e in zip(starts, extend_lens)], [0] * 3, extend_lens, layer.scaling, None)
    for make in ("torch_native", "triton_mla"):
        case = LatentBatch([0, 0, 0], 4, seed=8)
        loc, _ = case.grow(extend_lens)
        backend = (TorchNativeAttnBackend(_config(case.pool, case.r2t, hq)) if make == "torch_native"
                   else _triton(case.pool, case.r2t, hq))
        fb = case.batch(ForwardMode.EXTEND, [0, 0, 0], extend_lens, loc, backend)
        backend.init_forward_metadata(fb)
        out = layer(q.reshape(t, -1), k, v, fb, save_kv_cache=False)
        assert (out.double().cpu() - ref).abs().max().item() < 2e-5, make
        loc2, prefix = case.grow([1, 1, 1])
        fb = case.batch(ForwardMode.EXTEND, prefix, [1, 1, 1], loc2, backend)
        backend.init_forward_metadata(fb)
        with pytest.raises(ValueError, match="cached prefixes; use the latent layer"):
            layer(q[:3].reshape(3, -1), k[:3], v[:3], fb, save_kv_cache=False)


def _model_steps(loaded, page_size, seed, make_backend, steps):
    """Run ``loaded`` (an MLA model) over ``steps`` of ``(mode, new tokens per request, token-id
    ranges)`` on a fresh `LatentBatch` of two requests with the backend ``make_backend(case)``
    builds: ``(logits per step, ForwardBatch.mla_prefix_plan per step)``."""
    mc = loaded.model_config
    case = LatentBatch([0, 0], page_size, num_layers=mc.num_hidden_layers, seed=seed, r=mc.kv_lora_rank,
                       rope=mc.qk_rope_head_dim, room=64)
    backend = make_backend(case)
    outs, plans = [], []
    for mode, new, id_ranges in steps:
        active = [i for i, n in enumerate(new) if n]
        rows_all, case.rows = case.rows, [case.rows[i] for i in active]
        loc, prefix = case.grow([new[i] for i in active])
        ids = [t for i in active for t in range(*id_ranges[i])]
        fb = ForwardBatch.init_new(mode, ids, case.rows, prefix, [new[i] for i in active], loc, case.r2t,
                                   case.pool, backend, DEVICE)
        backend.init_forward_metadata(fb)
        outs.append(loaded.model.compute_logits(loaded.model(fb.input_ids, fb.positions, fb)))
        plans.append(fb.mla_prefix_plan)
        case.rows = rows_all
    return outs, plans


@pytest.mark.parametrize("page_size", [1, 16])
def test_deepseek_tiny_model_triton_matches_torch_native(page_size):
    """Chunked prefill (expanded first chunk, then latent extend over the cached prefix) then batched decode of the
    DeepSeek-V2 tiny shape: logits of every step agree between the two backends."""
    from attnserve.model_loader.loader import load_model

    loaded = load_model("deepseek-v2-tiny", load_format="dummy", device=DEVICE, seed=3)
    mc = loaded.model_config

    steps = [(ForwardMode.EXTEND, [21, 0], [(3, 24), ()]), (ForwardMode.EXTEND, [5, 7], [(40, 45), (9, 16)])]
    steps += [(ForwardMode.DECODE, [1, 1], [(50 + i, 51 + i), (60 + i, 61 + i)]) for i in range(3)]

    def run(make_backend):
        return _model_steps(loaded, page_size, 9, make_backend, steps)[0]

    ref = run(lambda case: TorchNativeAttnBackend(_config(case.pool, case.r2t, mc.num_attention_heads)))
    got = run(lambda case: _triton(case.pool, case.r2t, mc.num_attention_heads))
    # float32 against float32 (the interpreter's dots go through NumPy's BLAS, torch_native's
    # through torch's): whole-forward rounding relative to the largest logit, N = 2 layers x
    # (512 + 256 + 160 + 128 + 1024 + 512 + 1024 + context) + 512 ~ 7.8e3, 4 u sqrt(N) = 2.1e-5
    terms = mla_terms(mc.hf_config, 21 + 5 + 3)  # the longest context (request 0)
    for i, (a, b) in enumerate(zip(ref, got)):
        assert a.shape == b.shape
        assert_within(b, a, forward_bound(a, terms), f"deepseek-v2-tiny triton vs torch_native, step {i}")


@pytest.mark.parametrize("page_size", [1, 16])
def test_deepseek_tiny_expanded_prefix_matches_absorbed(monkeypatch, page_size):
    """Extend steps over cached prefixes in the expanded form (the prefixes' latent rows
    up-projected per head, `mla_expanded_prefix`) give the logits of the absorbed form, on
    both backends: a chunked prompt next to a fresh one, then two prompts both over prefixes."""
    from attnserve.model_loader.loader import load_model

    loaded = load_model("deepseek-v2-tiny", load_format="dummy", device=DEVICE, seed=5)
    mc = loaded.model_config
    steps = [(ForwardMode.EXTEND, [19, 0], [(3, 22), ()]), (ForwardMode.EXTEND, [6, 11], [(40, 46), (9, 20)]),
             (ForwardMode.EXTEND, [4, 3], [(70, 74), (80, 83)])]

    def run(make_backend, setting):
        monkeypatch.setenv("ATTNSERVE_MLA_EXPANDED_PREFIX", setting)
        return _model_steps(loaded, page_size, 11, make_backend, steps)

    native = lambda case: TorchNativeAttnBackend(_config(case.pool, case.r2t, mc.num_attention_heads))  # noqa: E731
    triton = lambda case: _triton(case.pool, case.r2t, mc.num_attention_heads)  # noqa: E731
    ref, ref_plans = run(native, "0")
    assert ref_plans[1:] == [False, False]  # switched off: absorbed
    terms = mla_terms(mc.hf_config, 19 + 6 + 4)
    for make in (native, triton):
        got, plans = run(make, "1")
        assert plans[0] is None  # no prefix: plain expanded, no plan
        assert [p.num_tokens for p in plans[1:]] == [19, 25 + 11]
        for i, (a, b) in enumerate(zip(ref, got)):
            assert_within(b, a, forward_bound(a, terms), f"expanded prefix vs absorbed, step {i}")
