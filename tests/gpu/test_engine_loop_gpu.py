"""The engine loop on a GPU: overlap scheduling, retraction, stop conditions, aborts, with
CUDA graphs on. Dummy SmolLM2-shape weights (the GGUF does not travel to the GPU box).

Overlap on and off run the same batches when every request ends by length (limits are
known on the host), so their outputs must be bit-identical in bf16. Stop tokens, aborts,
retraction and batch-vs-alone comparisons change which requests share a batch (a request
finished at step N still rides in step N+1 under overlap), so those identities are checked
in float32 with batch-invariant attention (``enable_deterministic_inference``) and IEEE
matmuls (`EXACT`). After every test the pools are free.
"""

import random

import pytest

from attnserve.engine.engine import Engine
from attnserve.engine.sampling_params import SamplingParams
from attnserve.server_args import ServerArgs

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("no_tf32")]


#: settings under which a request's logits do not depend on the rest of its batch
EXACT = dict(dtype="float32", enable_deterministic_inference=True)


def _engine(**kw):
    base = dict(model="smollm2-135m", load_format="dummy", device="cuda", dtype="bfloat16",
                max_total_tokens=40000, max_running_requests=32, context_length=1024)
    base.update(kw)
    return Engine(ServerArgs(**base))


def _prompts(n, seed, lo=5, hi=200):
    rnd = random.Random(seed)
    return [[rnd.randrange(100, 40000) for _ in range(rnd.randrange(lo, hi))] for _ in range(n)]


def _run(engine, prompts, params, join_every=0):
    """Run to completion; request i joins at step ``i * join_every``. Returns the reqs."""
    reqs, step = [], 0
    pending = list(zip(prompts, params))
    while pending or engine.has_work():
        while pending and step >= len(reqs) * join_every:
            p, sp = pending.pop(0)
            reqs.append(engine.add_request(p, sp))
        engine.step()
        step += 1
    return reqs


def _assert_free(engine):
    runner = engine.model_runner
    alloc, rows = runner.token_to_kv_pool_allocator, runner.req_to_token_pool
    tree = engine.scheduler.tree_cache
    assert alloc.available_size() + tree.evictable_size() == alloc.size and tree.protected_size() == 0
    assert rows.available_size() == rows.size
    assert not engine.has_work()


@pytest.mark.parametrize("page_size", [1, 16])
def test_overlap_matches_sequential_bf16_graphs(page_size):
    prompts = _prompts(20, page_size)
    params = [SamplingParams(max_new_tokens=20 + 7 * (i % 9), temperature=0.0, ignore_eos=True) for i in range(20)]
    outs = {}
    for overlap in (False, True):
        eng = _engine(page_size=page_size, disable_overlap_schedule=not overlap)
        assert eng.scheduler.overlap is overlap and eng.model_runner.cuda_graph_runner is not None
        reqs = _run(eng, prompts, params, join_every=3)
        outs[overlap] = [r.output_ids for r in reqs]
        assert [len(o) for o in outs[overlap]] == [p.max_new_tokens for p in params]
        _assert_free(eng)
        del eng
    assert outs[True] == outs[False]


def test_stop_tokens_and_abort_exact_under_overlap():
    eng = _engine(**EXACT)
    assert eng.scheduler.overlap
    prompts = _prompts(8, 5)
    free_run = _run(eng, prompts, [SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)] * 8)
    stops = [r.output_ids[10 + i] for i, r in enumerate(free_run)]
    params = [SamplingParams(max_new_tokens=40, temperature=0.0, stop_token_ids=[s]) for s in stops]
    reqs = _run(eng, prompts, params)
    for r, ref, s in zip(reqs, free_run, stops):
        cut = ref.output_ids.index(s) + 1
        assert r.output_ids == ref.output_ids[:cut] and r.finish_reason.value == "stop"
    _assert_free(eng)
    # abort one request mid-decode: the others are unaffected and the pool empties
    sp = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    reqs = [eng.add_request(p, sp) for p in prompts]
    while len(reqs[3].output_ids) < 6:
        eng.step()
    assert eng.abort_request(reqs[3].rid)
    while eng.has_work():
        eng.step()
    assert reqs[3].finish_reason.value == "abort"
    assert [r.output_ids for i, r in enumerate(reqs) if i != 3] == [r.output_ids for i, r in enumerate(free_run)
                                                                     if i != 3]
    _assert_free(eng)


def test_retraction_matches_large_pool_fp32():
    from attnserve.engine.scheduler import AdmissionPolicy

    prompts = _prompts(16, 9, lo=40, hi=120)
    params = [SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True)] * 16
    kw = dict(EXACT, page_size=16)
    ref = [r.output_ids for r in _run(_engine(**kw), prompts, params)]
    eng = _engine(max_total_tokens=16 * 200 // 2, **kw)  # half of the worst case
    eng.scheduler.policy = AdmissionPolicy(init_ratio=0.05, min_ratio=0.01)
    eng.scheduler.new_token_ratio = 0.05
    got = [r.output_ids for r in _run(eng, prompts, params)]
    assert eng.scheduler.stats.num_retractions > 0
    assert got == ref
    _assert_free(eng)


def test_sampling_params_mix_and_seeds_on_gpu():
    """Sampled rows beside greedy ones: a seeded request gives the same tokens alone and in
    a batch; a vanishing temperature is greedy (no NaN)."""
    eng = _engine(**EXACT)
    prompts = _prompts(4, 11)
    seeded = SamplingParams(max_new_tokens=24, temperature=0.9, top_p=0.95, top_k=40, seed=7, ignore_eos=True)
    alone = _run(eng, prompts[:1], [seeded])[0].output_ids
    params = [seeded, SamplingParams(max_new_tokens=24, temperature=1e-300, ignore_eos=True),
              SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True),
              SamplingParams(max_new_tokens=24, temperature=1.5, min_p=0.1, seed=3, ignore_eos=True)]
    reqs = _run(eng, prompts, params)
    assert reqs[0].output_ids == alone
    # the same batch with row 1 plainly greedy: identical rows (one row's settings never
    # reach another's logits)
    again = _run(eng, prompts, [params[0], params[2], params[2], params[3]])
    assert [r.output_ids for r in again] == [r.output_ids for r in reqs]
    _assert_free(eng)


@pytest.mark.parametrize("page_size", [1, 16])
def test_prefix_cache_with_graphs_and_overlap(page_size):
    """Shared prefixes, repeats and prompts wholly in the tree, with CUDA graphs and the
    overlap scheduler: same tokens with and without the radix cache (exact settings), and
    the cache really served the prefix."""
    rnd = random.Random(page_size)
    prefix = [rnd.randrange(100, 40000) for _ in range(300)]
    prompts = [prefix + [rnd.randrange(100, 40000) for _ in range(rnd.randrange(3, 60))] for _ in range(12)]
    prompts += [prompts[0], prompts[3][:250]]
    params = [SamplingParams(max_new_tokens=16 + i, temperature=0.0, ignore_eos=True) for i in range(len(prompts))]
    outs = {}
    for disable in (True, False):
        eng = _engine(page_size=page_size, disable_radix_cache=disable, **EXACT)
        assert eng.scheduler.overlap and eng.model_runner.cuda_graph_runner is not None
        first = _run(eng, prompts[:1], params[:1])
        rest = _run(eng, prompts[1:], params[1:], join_every=2)
        outs[disable] = [r.output_ids for r in first + rest]
        if not disable:
            assert all(r.cached_tokens >= 300 // page_size * page_size for r in rest[:-1])
            assert rest[-1].cached_tokens == 249 // page_size * page_size  # a prompt wholly in the tree
            assert eng.scheduler.stats.cached_prompt_tokens >= 12 * (300 // page_size * page_size)
        _assert_free(eng)
        del eng
    assert outs[False] == outs[True]


def test_dropped_engine_gives_its_gpu_memory_back():
    """An engine with CUDA graphs that has served requests, once dropped (no reference left,
    garbage collected, allocator cache emptied), leaves no more than 64 MiB allocated above
    what was allocated before it: a process can build a second engine (another KV dtype,
    another model) in the memory of the first."""
    import gc
    import weakref

    import torch

    gc.collect()
    base = torch.cuda.memory_allocated()
    eng = _engine(max_total_tokens=100_000)
    assert eng.model_runner.cuda_graph_runner is not None
    _run(eng, _prompts(4, 5), [SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)] * 4)
    held = torch.cuda.memory_allocated() - base
    pool = weakref.ref(eng.model_runner.token_to_kv_pool)
    assert held > 100 * 2**20  # weights + a 100K-token pool
    eng.shutdown()
    del eng
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    assert pool() is None
    assert torch.cuda.memory_allocated() - base <= 64 * 2**20
