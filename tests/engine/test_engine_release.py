"""`LLM.shutdown` / `Engine.shutdown` give back what the engine holds (CPU, tiny dummy models).

Each engine serves a few requests, then weak references to what it allocated (the runner,
the model and one of its parameters, a KV buffer, ``req_to_token``, the attention backend,
the scheduler and its future-token map, the speculative decoder and draft runner) must be
dead right after shutdown while the `LLM` object itself is still referenced. Python's cyclic
garbage collector is off during the check and shutdown's own collection is disabled, so the
objects are freed by reference counting alone: no reference cycle keeps them (the torch
native backend, for one, keeps the last `ForwardBatch`, which points back at it). The GPU
counterpart (memory returns to its level before the first engine) is
tests/gpu/test_engine_release_gpu.py.
"""

import gc
import weakref

import pytest

from attnserve.engine import engine as engine_module
from attnserve.engine.llm import LLM
from attnserve.engine.model_runner import ModelRunner
from attnserve.engine.request import FinishReason
from attnserve.engine.sampling_params import SamplingParams

TINY = dict(model="llama-tiny", load_format="dummy", device="cpu", max_total_tokens=1024, max_running_requests=8)
GREEDY = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7], list(range(10, 40))]


def _owned(llm: LLM) -> dict:
    """Weak references to the device-memory owners of ``llm``'s engine."""
    eng = llm.engine
    runner, sched = eng.model_runner, eng.scheduler
    pool = runner.token_to_kv_pool
    kv = pool.kv_buffer[0] if hasattr(pool, "kv_buffer") else pool.k_buffer[0]
    refs = {
        "runner": runner, "model": runner.model, "parameter": next(runner.model.parameters()), "kv_pool": pool,
        "kv_buffer": kv, "req_to_token": runner.req_to_token_pool.req_to_token, "backend": runner.attn_backend,
        "scheduler": sched, "token_map": sched.token_map, "packer": sched.packer,
    }
    if sched.spec is not None:
        refs["spec_decoder"] = sched.spec
    if eng.draft_runner is not None:
        refs["draft_runner"] = eng.draft_runner
        refs["draft_kv_pool"] = eng.draft_runner.token_to_kv_pool
        refs["draft_model"] = eng.draft_runner.model
    return {k: weakref.ref(v) for k, v in refs.items()}


@pytest.fixture
def no_cyclic_gc(monkeypatch):
    """Only reference counting frees objects during the test (shutdown's own gc.collect
    included); counts the collections shutdown asked for."""
    calls = []
    monkeypatch.setattr(engine_module.gc, "collect", lambda *a: calls.append(a) or 0)
    was_enabled = gc.isenabled()
    gc.disable()
    yield calls
    if was_enabled:
        gc.enable()


@pytest.mark.parametrize("extra", [
    dict(),
    dict(disable_overlap_schedule=False),  # the overlap scheduler: a pending step at the end of generate
    dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=4),
    dict(speculative_algorithm="STANDALONE", speculative_draft_layers=1, speculative_num_steps=2),
    dict(model="deepseek-v2-tiny"),  # MLA pool
])
def test_shutdown_frees_every_owner_by_reference_counting(no_cyclic_gc, extra):
    llm = LLM(**{**TINY, **extra})
    outs = llm.generate(PROMPTS, GREEDY)
    assert [len(o.token_ids) for o in outs] == [4, 4, 4]
    refs = _owned(llm)
    llm.shutdown()
    alive = sorted(k for k, r in refs.items() if r() is not None)
    assert alive == [], f"still referenced after shutdown: {alive}"
    assert len(no_cyclic_gc) == 1  # shutdown asked for one collection (disabled here)
    assert llm.engine.is_shut_down


def test_several_engines_in_turn_each_freed():
    """Build, use and shut down four engines in one process; after each, nothing of it is
    left (here with the ordinary garbage collector)."""
    for i in range(4):
        llm = LLM(**TINY, random_seed=i)
        assert len(llm.generate(PROMPTS[:1], GREEDY)[0].token_ids) == 4
        refs = _owned(llm)
        llm.shutdown()
        gc.collect()
        assert all(r() is None for r in refs.values()), i


def test_context_manager_shuts_down_also_on_exception():
    with LLM(**TINY) as llm:
        assert len(llm.generate(PROMPTS[:1], GREEDY)[0].token_ids) == 4
        refs = _owned(llm)
    assert llm.engine.is_shut_down
    gc.collect()
    assert all(r() is None for r in refs.values())

    with pytest.raises(KeyError, match="inside the block"):
        with LLM(**TINY) as llm2:
            refs = _owned(llm2)
            raise KeyError("inside the block")
    assert llm2.engine.is_shut_down
    gc.collect()
    assert all(r() is None for r in refs.values())


def test_use_after_shutdown_raises_and_shutdown_is_idempotent():
    llm = LLM(**TINY)
    eng = llm.engine
    waiting = eng.add_request([1, 2, 3], GREEDY)  # never stepped: aborted by the shutdown
    llm.shutdown()
    assert waiting.finish_reason is FinishReason.ABORT and "shut down" in waiting.error
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(PROMPTS[:1], GREEDY)
    for call in (eng.step, eng.has_work, lambda: eng.add_request([1, 2], GREEDY), lambda: eng.tokenize([1, 2]),
                 lambda: eng.context_len, lambda: eng.abort_request("x")):
        with pytest.raises(RuntimeError, match="build a new one"):
            call()
    llm.shutdown()  # idempotent
    eng.shutdown()
    assert eng.model_runner is None and eng.scheduler is None


def test_runner_keeps_everything_when_the_device_does_not_drain():
    """`ModelRunner.release` frees nothing while the device is still busy (its graphs could
    not be released: freeing would race or block on the device) and says so."""
    runner = ModelRunner.__new__(ModelRunner)
    sentinel_backend, pool, model = object(), object(), object()
    runner.cuda_graph_runner = object()
    runner.attn_backend, runner.token_to_kv_pool, runner.model = sentinel_backend, pool, model
    runner.release_cuda_graphs = lambda drain_timeout_s=10.0: False
    assert runner.release() is False
    assert (runner.attn_backend, runner.token_to_kv_pool, runner.model) == (sentinel_backend, pool, model)
