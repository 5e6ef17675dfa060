"""Whole-engine checks on a GPU: triton vs torch_native, CUDA graphs vs eager.

SmolLM2 shape with dummy weights (the GGUF does not travel to the GPU box), float32 and
IEEE matmuls so that greedy argmax comparisons are not decided by rounding.
"""

import random
from types import SimpleNamespace

import pytest
import torch

from attnserve.engine.engine import Engine
from attnserve.engine.sampling_params import SamplingParams
from attnserve.forward_batch import ForwardMode
from attnserve.server_args import ServerArgs

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def _engine(**kw):
    base = dict(model="smollm2-135m", load_format="dummy", device="cuda", dtype="float32",
                max_total_tokens=40000, max_running_requests=32, context_length=2048)
    base.update(kw)
    return Engine(ServerArgs(**base))


def _prompts(n, seed, lo=5, hi=300):
    rnd = random.Random(seed)
    return [[rnd.randrange(100, 40000) for _ in range(rnd.randrange(lo, hi))] for _ in range(n)]


def _run_schedule(engine, schedule, max_new):
    """schedule: {step_index: [prompts]} — requests join while others decode."""
    reqs = []
    step = 0
    while step <= max(schedule) or engine.has_work():
        for i, p in enumerate(schedule.get(step, [])):
            reqs.append(engine.add_request(p, SamplingParams(max_new_tokens=max_new[len(reqs)], temperature=0.0,
                                                             ignore_eos=True)))
        engine.step()
        step += 1
    return [r.output_ids for r in reqs]


def test_triton_matches_torch_native_64_steps():
    prompts = _prompts(6, 0)
    outs = {}
    for backend in ("torch_native", "triton"):
        eng = _engine(attention_backend=backend, disable_cuda_graph=True)
        reqs = [eng.add_request(p, SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True))
                for p in prompts]
        while eng.has_work():
            eng.step()
        outs[backend] = [r.output_ids for r in reqs]
        del eng
    assert outs["triton"] == outs["torch_native"]


@pytest.mark.parametrize("page_size", [1, 16])
def test_graphs_match_eager_while_batch_grows_and_shrinks(page_size):
    # 3 -> 8 -> 17 requests, then they finish at different times down to 5 and 0
    prompts = _prompts(17, page_size)
    schedule = {0: prompts[:3], 10: prompts[3:8], 25: prompts[8:17]}
    max_new = [128, 60, 128, 128, 40, 128, 50, 128] + [30, 128, 35, 40, 45, 50, 55, 60, 128]
    kw = dict(page_size=page_size, attention_backend="triton", enable_deterministic_inference=True)
    eager = _run_schedule(_engine(disable_cuda_graph=True, **kw), schedule, max_new)
    eng = _engine(**kw)
    assert eng.model_runner.cuda_graph_runner is not None
    graphed = _run_schedule(eng, schedule, max_new)
    assert graphed == eager


def test_padded_rows_never_touch_real_kv():
    eng = _engine(attention_backend="triton", cuda_graph_bs=[4])
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
            for p in _prompts(3, 7)]
    eng.step()  # prefill (eager)
    runner = eng.model_runner
    before = [b.clone() for b in runner.token_to_kv_pool.k_buffer]
    live = {r.rid: r.kv_len for r in reqs}
    eng.step()  # one decode of 3 rows replayed in the bs=4 graph
    changed = set()
    for b0, b1 in zip(before, runner.token_to_kv_pool.k_buffer):
        changed |= set(torch.nonzero((b0 != b1).flatten(1).any(1)).flatten().tolist())
    written = {int(runner.req_to_token_pool.req_to_token[r.req_pool_idx, live[r.rid]]) for r in reqs}
    assert written <= changed  # the real rows were written
    assert changed - written <= set(range(runner.page_size))  # padding only touched the dummy page


def test_batch_above_largest_bucket_runs_eagerly():
    prompts = _prompts(6, 3)
    kw = dict(attention_backend="triton", enable_deterministic_inference=True)
    schedule = {0: prompts}
    max_new = [20] * 6
    ref = _run_schedule(_engine(disable_cuda_graph=True, **kw), schedule, max_new)
    eng = _engine(cuda_graph_bs=[1, 2, 4], **kw)
    assert not eng.model_runner.cuda_graph_runner.can_run(SimpleNamespace(forward_mode=ForwardMode.DECODE,
                                                                          batch_size=6))
    assert _run_schedule(eng, schedule, max_new) == ref


def test_torch_native_with_explicit_graphs_is_config_error():
    with pytest.raises(ValueError, match="capturable"):
        _engine(attention_backend="torch_native", cuda_graph_max_bs=8)


def test_graph_buckets_are_timed_and_a_larger_graph_gives_the_same_tokens():
    # timed at start-up (not deterministic): each bucket maps to a size >= it, no slower than its own
    runner = _engine(attention_backend="triton", cuda_graph_bs=[4, 8, 16]).model_runner.cuda_graph_runner
    assert set(runner.replay_ms) == {4, 8, 16} and min(runner.replay_ms.values()) > 0
    for b, c in runner.replay_bs.items():
        assert c >= b and runner.replay_ms[c] <= runner.replay_ms[b]
    # deterministic: not timed; forced to replay every bucket in the 16-row graph, the tokens are eager's
    prompts = _prompts(7, 11)
    kw = dict(attention_backend="triton", enable_deterministic_inference=True)
    schedule = {0: prompts[:5], 6: prompts[5:]}
    max_new = [40, 12, 30, 25, 8, 20, 33]
    ref = _run_schedule(_engine(disable_cuda_graph=True, **kw), schedule, max_new)
    eng = _engine(cuda_graph_bs=[4, 8, 16], **kw)
    graphs = eng.model_runner.cuda_graph_runner
    assert graphs.replay_ms == {} and graphs.replay_bs == {4: 4, 8: 8, 16: 16}
    graphs.replay_bs = {4: 16, 8: 16, 16: 16}
    assert _run_schedule(eng, schedule, max_new) == ref
