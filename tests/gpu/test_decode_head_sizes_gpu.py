"""Decode attention at head size 96 on a GPU (Phi-3-mini's heads): the whole-K tile rule
(`decode_tuning.WHOLE_DK_TILE`) and the tiles before it, against float64.

``pytest tests/gpu/test_decode_head_sizes_gpu.py``. Every test is marked ``cuda`` and
skipped without a GPU.
"""

from __future__ import annotations

import pytest
import torch

from test_decode_small_batch_gpu import _lens, _paged_slots, _reference
from test_extend_defaults_gpu import spy  # noqa: F401  (the fixture: the configs extend launches picked)

from attnserve.attention.triton_ops import decode_tuning as dtn
from attnserve.attention.triton_ops.decode_attention import decode_attention_fwd, decode_config
from attnserve.attention.triton_ops.decode_splits import SMALL_SPLIT_TOKENS, compute_num_kv_splits
from attnserve.attention.triton_ops.kv_indices import compute_kv_indptr

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
DEV = "cuda"
MAX_SPLITS = 32  # the engine's default (backend_config.DEFAULT_NUM_KV_SPLITS)
ATOL = RTOL = 2e-2  # bf16 outputs


def _engine_config(hq, hkv, d, bs):
    props = torch.cuda.get_device_properties(0)
    return decode_config(d, hq // hkv, torch.bfloat16, max_shared_mem=props.shared_memory_per_block_optin,
                         device_name=torch.cuda.get_device_name(), batch_size=bs, num_kv_heads=hkv,
                         num_sms=props.multi_processor_count)


def _metadata(lens, slots, hkv):
    """``(kv_indptr, kv_indices, num_kv_splits)`` of the requests' slots, splits by the engine's rule."""
    seq = torch.tensor(lens, dtype=torch.int32, device=DEV)
    idx = torch.cat(slots + [torch.zeros(1, dtype=torch.int64)]).to(DEV, torch.int32)
    ns = torch.empty(len(lens), dtype=torch.int32, device=DEV)
    compute_num_kv_splits(seq, ns, MAX_SPLITS, torch.cuda.get_device_properties(0).multi_processor_count, hkv,
                          small_split_tokens=SMALL_SPLIT_TOKENS)
    return compute_kv_indptr(seq), idx, ns


@pytest.mark.parametrize("rule", ["on", "off"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("bs,ctx", [(1, 2048), (8, 800), (96, 800), (200, 1500)])
@pytest.mark.parametrize("hq,hkv", [(32, 32), (32, 8)])
def test_head_size_96_decode_matches_float64(hq, hkv, bs, ctx, page_size, rule, monkeypatch):
    """bf16 KV of head size 96, ragged batches with 0- and 1-key requests, the engine's split
    rule; with the rule on the config must read K whole (on a GPU with the big shared memory)."""
    monkeypatch.setenv(dtn.WHOLE_DK_ENV, "1" if rule == "on" else "0")
    d = 96
    cfg = _engine_config(hq, hkv, d, bs)
    big_smem = torch.cuda.get_device_properties(0).shared_memory_per_block_optin >= dtn._BIG_SMEM
    assert cfg.whole_dk == (rule == "on" and big_smem)
    gen = torch.Generator().manual_seed(bs * 13 + ctx + page_size + hkv)
    lens = _lens(bs, ctx)
    slots, num_slots = _paged_slots(lens, page_size, gen)
    kb = torch.randn(num_slots, hkv, d, generator=gen).to(DEV, torch.bfloat16)
    vb = torch.randn(num_slots, hkv, d, generator=gen).to(DEV, torch.bfloat16)
    q = torch.randn(bs, hq, d, generator=gen).to(DEV, torch.bfloat16)
    indptr, idx, ns = _metadata(lens, slots, hkv)
    o = torch.full((bs, hq, d), float("nan"), dtype=torch.bfloat16, device=DEV)
    logits = torch.full((bs, hq, MAX_SPLITS, d), float("nan"), device=DEV)
    lse = torch.full((bs, hq, MAX_SPLITS), float("nan"), device=DEV)
    decode_attention_fwd(q, kb, vb, o, indptr, idx, logits, lse, ns, MAX_SPLITS, d ** -0.5)
    torch.cuda.synchronize()
    assert not torch.isnan(o).any(), "an output element was not written"
    torch.testing.assert_close(o.double(), _reference(q, kb, vb, slots), atol=ATOL, rtol=RTOL)
    assert all((o[i] == 0).all() for i, n in enumerate(lens) if n == 0)


def test_head_size_96_whole_and_split_agree_in_graph(monkeypatch):
    """The whole-K tile and the split-K tiles (rule off) inside CUDA graphs, replayed with
    new K/V and q: the two agree with each other and with float64 on every replay."""
    monkeypatch.delenv(dtn.WHOLE_DK_ENV, raising=False)
    hq = hkv = 32
    d, bs = 96, 64
    gen = torch.Generator().manual_seed(5)
    lens = _lens(bs, 700)
    slots, num_slots = _paged_slots(lens, 1, gen)
    kb = torch.empty(num_slots, hkv, d, device=DEV, dtype=torch.bfloat16)
    vb = torch.empty_like(kb)
    q = torch.empty(bs, hq, d, device=DEV, dtype=torch.bfloat16)
    indptr, idx, ns = _metadata(lens, slots, hkv)
    configs = {"whole": _engine_config(hq, hkv, d, bs)}
    monkeypatch.setenv(dtn.WHOLE_DK_ENV, "0")
    configs["split"] = _engine_config(hq, hkv, d, bs)
    outs, graphs = {}, {}
    for name, cfg in configs.items():
        outs[name] = torch.empty(bs, hq, d, device=DEV, dtype=torch.bfloat16)
        logits = torch.empty(bs, hq, MAX_SPLITS, d, device=DEV)
        lse = torch.empty(bs, hq, MAX_SPLITS, device=DEV)

        def step(o=outs[name], logits=logits, lse=lse, cfg=cfg):
            decode_attention_fwd(q, kb, vb, o, indptr, idx, logits, lse, ns, MAX_SPLITS, d ** -0.5, config=cfg)

        kb.normal_()
        vb.normal_()
        q.normal_()
        step()  # compiles outside the capture
        torch.cuda.synchronize()
        graphs[name] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[name]):
            step()
    for replay in range(3):
        kb.copy_(torch.randn(kb.shape, generator=gen).to(DEV, torch.bfloat16))
        vb.copy_(torch.randn(vb.shape, generator=gen).to(DEV, torch.bfloat16))
        q.copy_(torch.randn(q.shape, generator=gen).to(DEV, torch.bfloat16))
        for g in graphs.values():
            g.replay()
        torch.cuda.synchronize()
        ref = _reference(q, kb, vb, slots)
        for name, o in outs.items():
            torch.testing.assert_close(o.double(), ref, atol=ATOL, rtol=RTOL, msg=f"{name}, replay {replay}")
        torch.testing.assert_close(outs["whole"].float(), outs["split"].float(), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("has_prefix", [False, True])
@pytest.mark.parametrize("hq,hkv", [(32, 32), (32, 8)])
def test_head_size_96_extend_matches_float64(hq, hkv, has_prefix, spy, monkeypatch):
    """The extend kernel at head size 96 through its default path, plain and over a cached
    prefix on 16-slot pages, no sliding window: a launch with the prefix stage reads K whole
    (with K as 64 + 32 that stage crashed Triton 3.6's ptxas), a plain one keeps the split,
    and the output matches float64. ``spy``: the configs the launches picked."""
    from test_triton_kernels_gpu import EXT_LENS, EXT_PREFIX, REL_TOL, _extend, _rel_err

    monkeypatch.delenv(dtn.WHOLE_DK_ENV, raising=False)
    prefix = EXT_PREFIX if has_prefix else [0] * len(EXT_PREFIX)
    o, ref = _extend(prefix, EXT_LENS, 16, hq, hkv, 96, seed=hq + hkv + has_prefix, has_prefix=has_prefix)
    assert spy and spy[-1].whole_dk == has_prefix
    assert _rel_err(o, ref) < REL_TOL


def test_head_size_96_engine_serves_prefix_hits_in_bf16(tmp_path_factory):
    """A tiny random Phi-3 with heads of 96 (Phi-3-mini's size) and no sliding window, in bf16
    on the Triton backend: chunked prefills (32-token chunks) and a second batch that hits the
    cached prefix run the extend kernel's cached-prefix stage at head size 96 (which with K as
    64 + 32 crashed Triton 3.6's ptxas). Every request completes with its tokens and the
    second batch is served from the cache."""
    import os
    import random
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
    from tiny_hf import hf_variant_getter

    from attnserve.engine.llm import LLM
    from attnserve.engine.sampling_params import SamplingParams

    vocab = 256
    variants = {"phi3_d96": ("Phi3Config", "Phi3ForCausalLM", dict(
        hidden_size=192, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=vocab, max_position_embeddings=1024, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, tie_word_embeddings=False))}
    path, _ = hf_variant_getter(tmp_path_factory, variants, 9600, lambda model, name: None, vocab)("phi3_d96")
    rnd = random.Random(96)
    shared = [rnd.randrange(3, vocab) for _ in range(80)]
    prompts = [shared + [rnd.randrange(3, vocab) for _ in range(n)] for n in (5, 17, 40, 63)]
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    with LLM(model=path, device="cuda", dtype="bfloat16", max_total_tokens=4096, context_length=512,
             chunked_prefill_size=32) as llm:
        first = llm.generate(prompts[:1], params)
        rest = llm.generate(prompts[1:], params)
    assert [len(o.token_ids) for o in first + rest] == [8] * len(prompts)
    assert all(o.cached_tokens >= 64 for o in rest), [o.cached_tokens for o in rest]
