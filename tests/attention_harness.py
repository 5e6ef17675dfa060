"""Random paged attention batches for backend tests, and a float64 per-query reference.

`make_batch` builds a real `ReqToTokenPool`/allocator/`MHATokenToKVPool`, fills the cached
prefixes with random K/V through shuffled pages (so slots are non-contiguous), and returns
a `ForwardBatch` plus the new tokens' q/k/v. `naive_reference` recomputes the attention
query by query in float64 from the same numbers; `sink_reference` is HF transformers'
gpt-oss formula (attention sinks) in float64 on the pool's device.
"""

from dataclasses import dataclass
import math
import random
from typing import List

import torch

from attnserve.attention.radix_attention import RadixAttention
from attnserve.forward_batch import ForwardBatch, ForwardMode
from attnserve.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool, TokenToKVPoolAllocator


@dataclass
class Case:
    fb: ForwardBatch
    layer: RadixAttention
    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor
    prefix_lens: List[int]
    extend_lens: List[int]
    rows: List[int]
    pool: MHATokenToKVPool
    req_to_token: torch.Tensor


def make_batch(mode, prefix_lens, extend_lens, hq, hkv, d, page_size, dtype=torch.float32, device="cpu",
               window=-1, logit_cap=0.0, seed=0, sm_scale=None, dv=None, backend=None) -> Case:
    g = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    dv = dv or d
    bs = len(prefix_lens)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    total_pages = sum(-(-s // page_size) for s in seq_lens) + 4
    alloc = TokenToKVPoolAllocator(total_pages * page_size, page_size)
    alloc.shuffle_free_pages(rnd)  # random physical order of pages
    pool = MHATokenToKVPool(alloc.size, page_size, dtype, hkv, d, 1, device, v_head_dim=dv)
    r2t = ReqToTokenPool(bs + 2, max(seq_lens) + 1, device)
    rows = r2t.alloc(bs)
    rnd.shuffle(rows)
    layer = RadixAttention(hq, d, sm_scale if sm_scale is not None else 1.0 / math.sqrt(d), hkv, 0,
                           logit_cap=logit_cap, v_head_dim=dv, sliding_window_size=window)
    # cache the prefixes
    for row, p in zip(rows, prefix_lens):
        if p:
            slots = alloc.alloc_extend([0], [p], [0])
            r2t.write(row, 0, slots)
            pool.set_kv_buffer(layer, slots.to(device),
                               torch.randn(p, hkv, d, generator=g).to(device, dtype),
                               torch.randn(p, hkv, dv, generator=g).to(device, dtype))
    last = [int(r2t.req_to_token[row, p - 1]) if p else 0 for row, p in zip(rows, prefix_lens)]
    out_loc = alloc.alloc_extend(prefix_lens, seq_lens, last)
    off = 0
    for row, p, e in zip(rows, prefix_lens, extend_lens):
        r2t.write(row, p, out_loc[off:off + e])
        off += e
    T = sum(extend_lens)
    q = torch.randn(T, hq, d, generator=g).to(device, dtype)
    k = torch.randn(T, hkv, d, generator=g).to(device, dtype)
    v = torch.randn(T, hkv, dv, generator=g).to(device, dtype)
    ids = [0] * T
    fb = ForwardBatch.init_new(mode, ids, rows, prefix_lens, extend_lens, out_loc, r2t, pool, backend, device)
    return Case(fb, layer, q, k, v, list(prefix_lens), list(extend_lens), rows, pool, r2t.req_to_token)


def naive_reference(case: Case, custom_masks=None) -> torch.Tensor:
    """float64 attention, one query at a time, from the pool contents (after the new K/V
    were written) -> ``[T, Hq, Dv]``. ``custom_masks[i]``: bool ``[extend_len, seq_len]``."""
    layer = case.layer
    kb = case.pool.get_key_buffer(0).double().cpu()
    vb = case.pool.get_value_buffer(0).double().cpu()
    r2t = case.req_to_token.cpu()
    group = layer.tp_q_head_num // layer.tp_k_head_num
    outs = []
    t = 0
    for i, (row, p, e) in enumerate(zip(case.rows, case.prefix_lens, case.extend_lens)):
        slots = r2t[row, :p + e].long()
        K, V = kb[slots], vb[slots]
        for j in range(e):
            pos = p + j
            o = torch.zeros(layer.tp_q_head_num, layer.v_head_dim, dtype=torch.float64)
            for h in range(layer.tp_q_head_num):
                qv = case.q[t + j, h].double().cpu()
                s = (K[:, h // group] @ qv) * layer.scaling
                if layer.logit_cap > 0:
                    s = layer.logit_cap * torch.tanh(s / layer.logit_cap)
                kpos = torch.arange(p + e)
                vis = kpos <= pos if custom_masks is None else custom_masks[i][j]
                if layer.sliding_window_size >= 0:
                    vis = vis & (kpos >= pos - layer.sliding_window_size)
                if vis.any():
                    s = s.masked_fill(~vis, float("-inf"))
                    o[h] = torch.softmax(s, 0) @ V[:, h // group]
            outs.append(o)
        t += e
    return torch.stack(outs)


def sink_reference(case: Case, sinks, custom_masks=None) -> torch.Tensor:
    """float64 ``[T, Hq, Dv]`` on the pool's device from the pool contents (after the new K/V
    were written): HF transformers' gpt_oss ``eager_attention_forward`` written out per
    request: scores * scaling, logit cap, causal (or ``custom_masks[i]``, bool ``[E_i, P_i +
    E_i]``) and window mask, ``sinks`` (``[Hq]``, or None: plain attention) concatenated as
    one more column, softmax, that column dropped, times V."""
    layer = case.layer
    kb = case.pool.get_key_buffer(0)
    dev = kb.device
    kb, vb = kb.double(), case.pool.get_value_buffer(0).double()
    r2t = case.req_to_token.to(dev)
    hq, group = layer.tp_q_head_num, layer.tp_q_head_num // layer.tp_k_head_num
    q_all = case.q.to(dev).double()
    outs, t = [], 0
    for i, (row, p, e) in enumerate(zip(case.rows, case.prefix_lens, case.extend_lens)):
        slots = r2t[row, : p + e].long()
        k = kb[slots].repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, D]
        v = vb[slots].repeat_interleave(group, dim=1).transpose(0, 1)
        q = q_all[t : t + e].transpose(0, 1)  # [Hq, E, D]
        w = torch.matmul(q, k.transpose(1, 2)) * layer.scaling  # [Hq, E, L]
        if layer.logit_cap > 0:
            w = layer.logit_cap * torch.tanh(w / layer.logit_cap)
        q_pos = torch.arange(p, p + e, device=dev)[:, None]
        k_pos = torch.arange(p + e, device=dev)[None, :]
        vis = (k_pos <= q_pos) if custom_masks is None else custom_masks[i].to(dev).bool()
        if layer.sliding_window_size >= 0:
            vis = vis & (k_pos >= q_pos - layer.sliding_window_size)
        w = w.masked_fill(~vis[None], float("-inf"))
        if sinks is not None:
            col = sinks.to(dev).double().view(hq, 1, 1).expand(hq, e, 1)
            probs = torch.softmax(torch.cat([w, col], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(w, dim=-1).nan_to_num(0.0)
        outs.append(torch.matmul(probs, v).transpose(0, 1))
        t += e
    return torch.cat(outs)


def backend_config(case: Case, **kw):
    """`AttentionBackendConfig` over the case's pools (windows from its layer)."""
    from attnserve.attention.backend_config import AttentionBackendConfig

    return AttentionBackendConfig.from_pools(case.fb.req_to_token_pool, case.pool, case.layer.tp_q_head_num,
                                             layer_windows=(case.layer.sliding_window_size,), **kw)
