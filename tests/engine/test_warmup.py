"""The start-up warm-up (`attnserve.engine.warmup`): its plan stays within the engine's
limits and covers the batch-size classes it promises; running it leaves the engine as
it found it (slots, rows, prefix cache, counters, seeds); the flag turns it off."""

import argparse

import pytest

from attnserve.engine.engine import Engine
from attnserve.engine.sampling_params import SamplingParams
from attnserve.engine.warmup import (
    EngineOccupancy,
    WarmupLimits,
    _int_class,
    _next_pow2,
    build_warmup_plan,
    eager_decode_batch_sizes,
    run_warmup,
    warmup_enabled,
)
from attnserve.server_args import ServerArgs

PHASES = ["prefill", "prefix", "chunked", "mixed", "sampling", "decode"]


def _limits(**kw):
    base = dict(vocab_size=1000, max_request_tokens=4096, pool_tokens=40000, max_running_requests=64,
                chunked_prefill_size=1024, graph_max_bs=16, page_size=1)
    base.update(kw)
    return WarmupLimits(**base)


def _decode_steps(wave):
    """Rows of each decode step of ``wave`` (one-token prompts: a request that generates
    ``m`` tokens decodes in steps 1 .. m-1)."""
    most = max(r.params.max_new_tokens for r in wave.requests)
    return [sum(r.params.max_new_tokens >= s + 1 for r in wave.requests) for s in range(1, most)]


@pytest.mark.parametrize("kw", [{}, dict(page_size=16, chunked_prefill_size=8192, max_request_tokens=8192),
                                dict(max_request_tokens=300, pool_tokens=2000, max_running_requests=3,
                                     graph_max_bs=0, max_queued_requests=2)])
def test_plan_fits_the_limits(kw):
    lim = _limits(**kw)
    plan = build_warmup_plan(lim)
    names = [ph.name for ph in plan]
    assert names[:2] == ["prefill", "prefix"] and "mixed" in names and "sampling" in names
    for ph in plan:
        for wave in ph.waves:
            assert wave.requests
            for r in wave.requests:
                assert len(r.prompt_ids) >= 1 and all(0 <= t < lim.vocab_size for t in r.prompt_ids)
                assert len(r.prompt_ids) + r.params.max_new_tokens <= lim.max_request_tokens
            assert sum(len(r.prompt_ids) + r.params.max_new_tokens for r in wave.requests) <= lim.pool_tokens
            if ph.name == "decode" and lim.max_queued_requests is not None:  # admitted at once
                assert len(wave.requests) <= lim.max_queued_requests


def test_plan_covers_the_extend_classes():
    """Plain and prefix extends reach num_m_blocks 1, neither and a multiple of 16 for
    128-row query tiles; both token-count parities; bs 1 and bs 4 (prefix-length views
    aligned to 16 bytes or not)."""
    plan = {ph.name: ph for ph in build_warmup_plan(_limits(chunked_prefill_size=8192, max_request_tokens=16384))}
    pre = plan["prefix"].waves[0].requests[0].prompt_ids[:-1]
    for name, shift in (("prefill", 0), ("prefix", len(pre))):
        waves = [w for w in plan[name].waves if not (name == "prefix" and w is plan[name].waves[0])]
        longest = {max(len(r.prompt_ids) - shift for r in w.requests) for w in waves}
        classes = {_int_class(-(-n // 128)) for n in longest}
        assert classes == {"1", "n", "16"}, (name, longest)
        assert {sum(len(r.prompt_ids) - shift for r in w.requests) % 2 for w in waves} == {0, 1}
        assert {1, 4} <= {len(w.requests) for w in waves}
    full = plan["prefill"].waves[-1]
    assert sum(len(r.prompt_ids) for r in full.requests) == 8192  # one whole prefill chunk
    assert len(plan["chunked"].waves[0].requests[0].prompt_ids) > 8192


@pytest.mark.parametrize("kw", [dict(chunked_prefill_size=8192, max_request_tokens=16384),
                                dict(chunked_prefill_size=3000, max_request_tokens=16384),
                                dict(chunked_prefill_size=16384, max_request_tokens=2600),
                                dict(chunked_prefill_size=2048, max_request_tokens=16384)])
def test_plan_compiles_every_sm90_plain_prefill_variant(kw):
    """On sm_90 a plain causal prefill's tiles depend on its longest extend
    (`sm90_plain_prefill_config`): for every length serving can launch in one step, the
    prefill phase runs a wave with the same config and the same ``num_m_blocks`` class, so the
    first requests compile nothing."""
    from attnserve.attention.triton_ops.extend_tuning import sm90_plain_prefill_config

    lim = _limits(**kw)
    longest = min(lim.max_request_tokens - 2, lim.chunked_prefill_size, lim.pool_tokens // 2)

    def variant(n):
        cfg = sm90_plain_prefill_config(n)
        return cfg, _int_class(-(-n // cfg.block_m))

    plan = {ph.name: ph for ph in build_warmup_plan(lim)}
    warmed = {variant(max(len(r.prompt_ids) for r in w.requests)) for w in plan["prefill"].waves}
    assert warmed == {variant(n) for n in range(1, longest + 1)}, (longest, warmed)


def test_eager_decode_sizes_cover_every_key():
    def grid(bs):  # the shape of decode_grid_splits: cdiv(4 * SMs, bs * heads) within 1..32
        return max(1, min(32, -(-528 // (bs * 2))))

    for lo, hi in ((1, 64), (17, 300), (257, 1024)):
        sizes = eager_decode_batch_sizes(lo, hi, grid)
        assert sizes == sorted(sizes, reverse=True) and all(lo <= b <= hi for b in sizes)

        def key(b):
            return _next_pow2(b), _int_class(b), b % 2, _int_class(grid(b))

        assert {key(b) for b in range(lo, hi + 1)} == {key(b) for b in sizes}
        assert len(sizes) == len({key(b) for b in sizes})  # one per key
    assert eager_decode_batch_sizes(65, 64) == []


def test_decode_wave_runs_exactly_the_chosen_sizes():
    lim = _limits(graph_max_bs=0, max_running_requests=40)
    wave = {ph.name: ph for ph in build_warmup_plan(lim)}["decode"].waves[0]
    assert all(len(r.prompt_ids) == 1 for r in wave.requests)
    assert _decode_steps(wave) == eager_decode_batch_sizes(1, 40)
    with_graphs = {ph.name for ph in build_warmup_plan(_limits(graph_max_bs=64, max_running_requests=64))}
    assert "decode" not in with_graphs  # every decode batch has a graph
    assert "decode" not in {ph.name for ph in build_warmup_plan(_limits(graph_max_bs=0, speculative=True))}


def test_enabled_on_cuda_unless_skipped():
    assert warmup_enabled(ServerArgs(), "cuda")
    assert not warmup_enabled(ServerArgs(skip_server_warmup=True), "cuda")
    assert not warmup_enabled(ServerArgs(), "cpu")
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert ServerArgs.from_cli_args(parser.parse_args(["--skip-server-warmup"])).skip_server_warmup
    assert not ServerArgs.from_cli_args(parser.parse_args([])).skip_server_warmup


def _engine(**kw):
    base = dict(model="llama-tiny", load_format="dummy", device="cpu", max_total_tokens=2048,
                max_running_requests=8, chunked_prefill_size=128, attention_backend="torch_native")
    base.update(kw)
    return Engine(ServerArgs(**base))


def _generate(engine, prompts, params):
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    while engine.has_work():
        engine.step()
    engine.scheduler.flush()
    return [r.rid for r in reqs], [list(r.output_ids) for r in reqs]


def test_warmup_runs_every_phase_and_leaves_the_engine_as_it_was():
    eng = _engine()
    assert eng.warmup_report is None  # off on CPU
    sched = eng.scheduler
    start = EngineOccupancy.of(eng)
    assert start == EngineOccupancy(2048, 9, 0, 0)
    stack0 = sched.allocator._stack.clone()
    report = run_warmup(eng, progress=False)
    assert list(report.phase_seconds) == PHASES
    assert report.steps > len(PHASES) and report.requests > 20
    assert EngineOccupancy.of(eng) == start
    assert sched.allocator._stack.equal(stack0)  # slots are handed out in the start-up order again
    assert sched.req_to_token_pool._free_rows == list(range(9))
    assert sched.stats.num_steps == 0 and sched.stats.admitted_prompt_tokens == 0
    assert sched.new_token_ratio == sched.policy.init_ratio
    assert not sched.requests and not sched.running and not sched.waiting

    # no trace either: greedy and (unseeded) sampled outputs, request ids and the prefix cache
    # behave as in an engine that never warmed up
    fresh = _engine()
    prompts = [[5, 9, 17, 33, 2, 71] * 6, [5, 9, 17, 33, 2, 71] * 6 + [8, 8], [201, 3, 4]]
    params = [SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True),
              SamplingParams(max_new_tokens=6, temperature=1.0, top_k=40, ignore_eos=True),
              SamplingParams(max_new_tokens=6, temperature=0.8, ignore_eos=True)]
    assert _generate(eng, prompts, params) == _generate(fresh, prompts, params)
    assert sched.stats.cached_prompt_tokens == fresh.scheduler.stats.cached_prompt_tokens > 0


def test_warmup_refuses_a_busy_engine():
    eng = _engine()
    eng.add_request([1, 2, 3], SamplingParams(max_new_tokens=2))
    with pytest.raises(RuntimeError, match="idle"):
        run_warmup(eng, progress=False)



@pytest.mark.parametrize("hq,hkv", [(8, 2), (4, 4)])
def test_decode_grid_mirrors_the_decode_kernel(monkeypatch, hq, hkv):
    """`triton_decode_grid` gives the split grid `decode_attention_fwd` launches, recorded
    from real decode steps of the triton backend (the interpreter on CPU), also behind a
    hybrid backend; None for another decode backend."""
    import os
    from types import SimpleNamespace

    import torch

    from attention_harness import backend_config, make_batch
    from attnserve.attention.hybrid import HybridAttnBackend
    from attnserve.attention.torch_native import TorchNativeAttnBackend
    from attnserve.attention.triton_backend import TritonAttnBackend
    from attnserve.attention.triton_ops import decode_attention
    from attnserve.engine.warmup import triton_decode_grid
    from attnserve.forward_batch import ForwardMode

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    runs = []
    for bs in (1, 3):
        case = make_batch(ForwardMode.DECODE, [5 + i for i in range(bs)], [1] * bs, hq, hkv, 16, 1, seed=bs,
                          device=device)
        backend = TritonAttnBackend(backend_config(case))
        grid = triton_decode_grid(SimpleNamespace(attn_backend=backend, kv_cache_dtype=case.k.dtype))
        hybrid = HybridAttnBackend(TorchNativeAttnBackend(backend_config(case)), backend)
        assert triton_decode_grid(SimpleNamespace(attn_backend=hybrid, kv_cache_dtype=case.k.dtype))(bs) == grid(bs)
        other = TorchNativeAttnBackend(backend_config(case))
        assert triton_decode_grid(SimpleNamespace(attn_backend=other, kv_cache_dtype=case.k.dtype)) is None
        runs.append((bs, case, backend, grid))
    seen = []
    real = decode_attention.decode_grid_splits

    def record(bs, head_programs, max_kv_splits, num_sms):
        seen.append((bs, real(bs, head_programs, max_kv_splits, num_sms)))
        return seen[-1][1]

    monkeypatch.setattr(decode_attention, "decode_grid_splits", record)
    for bs, case, backend, grid in runs:
        case.fb.attn_backend = backend
        backend.init_forward_metadata(case.fb)
        case.layer(case.q.reshape(bs, -1), case.k.reshape(bs, -1), case.v.reshape(bs, -1), case.fb)
        assert seen and seen[-1][0] == bs and all(grid(b) == g for b, g in seen if b == bs)
    assert {b for b, _ in seen} == {1, 3}
