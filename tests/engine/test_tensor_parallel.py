"""Tensor parallelism on CPU ranks (gloo): greedy tokens identical to tp 1, faults, flags.

Each tensor-parallel engine spawns its ranks as processes; every test checks that none is
left behind once the engine is shut down.
"""

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import pytest

from attnserve.engine.tp.launch import RankDied, free_port
from attnserve.engine.llm import LLM
from attnserve.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Count from one to five."]


@pytest.fixture
def no_orphans():
    """Fails the test if a spawned rank outlives its engine, or if a step queue's
    shared-memory segment of this process is left in /dev/shm."""
    yield
    deadline = time.monotonic() + 10
    while mp.active_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert mp.active_children() == []
    if os.path.isdir("/dev/shm"):
        assert [f for f in os.listdir("/dev/shm") if f.startswith(f"attnserve-stepq-{os.getpid()}-")] == []


def _tokens(outs):
    return [o.token_ids for o in outs]


def _tp_engine(**kw):
    kw.setdefault("max_total_tokens", 8192)
    return LLM(**kw)


def _assert_dead(pids):
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize("model,tp_size", [("smollm2-135m", 3), ("gemma3-270m", 2)])
def test_real_weights_match_tp1(llm_factory, no_orphans, model, tp_size):
    """SmolLM2 (9 heads, 3 KV heads) at tp 3; Gemma 3 270M (4 heads, 1 KV head: replicated)
    at tp 2. The second round hits the prefix cache (rank 0's ``req_to_token`` writes for the
    matched prefixes travel with the next step)."""
    chat = model == "smollm2-135m"  # the Gemma GGUF has no chat template
    ref = llm_factory(model=model)
    want = _tokens(ref.generate(PROMPTS, GREEDY, chat=chat))
    llm = _tp_engine(model=model, tp_size=tp_size)
    pids = [p.pid for p in llm.engine.tp_runtime.procs]
    assert len(pids) == tp_size - 1
    try:
        first = llm.generate(PROMPTS, GREEDY, chat=chat)
        assert _tokens(first) == want
        again = llm.generate(PROMPTS, GREEDY, chat=chat)
        assert _tokens(again) == want
        assert all(o.cached_tokens > 0 for o in again)
    finally:
        llm.engine.shutdown()
    _assert_dead(pids)


@pytest.mark.parametrize("model,page_size", [("llama-tiny", 1), ("qwen3-tiny", 4), ("deepseek-v2-tiny", 1),
                                             ("qwen3-moe-tiny", 4), ("deepseek-v2-moe-tiny", 1)])
def test_random_models_tp2_match_tp1(no_orphans, model, page_size):
    kw = dict(model=model, load_format="dummy", page_size=page_size, max_total_tokens=2048, max_running_requests=8)
    prompts = [[1, 5, 9, 13, 17, 21, 25], [3, 4, 5], list(range(10, 60)), [7] * 11]
    params = [GREEDY, SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True)] * 2
    one = LLM(**kw)
    want = _tokens(one.generate(prompts, params))
    del one
    llm = LLM(tp_size=2, **kw)
    try:
        assert llm.engine.tp_runtime.tp.step_queue is not None  # steps travel through shared memory
        if model in ("llama-tiny", "qwen3-tiny"):  # o_proj and down_proj sums moved into the norms (gloo: apart)
            inner = llm.engine.model_runner.model.model
            assert inner.fused_allreduces == 2 * len(inner.layers)
        assert _tokens(llm.generate(prompts, params)) == want
    finally:
        llm.engine.shutdown()


def test_mla_expanded_prefix_tp2_matches_tp1(no_orphans, monkeypatch):
    """DeepSeek-V2 tiny with 16-token prefill chunks and the prefixes forced into the expanded
    MLA form (``ATTNSERVE_MLA_EXPANDED_PREFIX=1``, inherited by the spawned rank): each rank
    up-projects its own heads of the prefixes; greedy tokens equal tp 1's in the absorbed form."""
    kw = dict(model="deepseek-v2-tiny", load_format="dummy", max_total_tokens=2048, max_running_requests=8,
              chunked_prefill_size=16)
    prompts = [list(range(10, 60)), [7] * 11, list(range(100, 137))]
    monkeypatch.setenv("ATTNSERVE_MLA_EXPANDED_PREFIX", "0")
    one = LLM(**kw)
    want = _tokens(one.generate(prompts, GREEDY))
    del one
    monkeypatch.setenv("ATTNSERVE_MLA_EXPANDED_PREFIX", "1")
    llm = LLM(tp_size=2, **kw)
    try:
        assert _tokens(llm.generate(prompts, GREEDY)) == want
    finally:
        llm.engine.shutdown()


def test_prefill_overlap_tp2_matches_tp1(no_orphans, monkeypatch):
    """``ATTNSERVE_TP_OVERLAP_MIN_HALF_MB=0`` (inherited by the spawned rank): every forward of
    two or more tokens sends its all-reduces in two token halves, overlapped with the other
    half's MLP (`tp_prefill_overlap`); greedy tokens stay tp 1's."""
    from attnserve.models.layers import tp_prefill_overlap as tpo

    kw = dict(model="llama-tiny", load_format="dummy", max_total_tokens=2048, max_running_requests=8)
    prompts = [[1, 5, 9, 13, 17, 21, 25], list(range(10, 60)), [7] * 11]
    one = LLM(**kw)
    want = _tokens(one.generate(prompts, GREEDY))
    del one
    monkeypatch.setenv(tpo.TP_OVERLAP_MIN_HALF_ENV, "0")
    monkeypatch.setenv(tpo.TP_OVERLAP_ENV, "1")
    calls = []
    real = tpo.overlapped_layer_forward
    monkeypatch.setattr(tpo, "overlapped_layer_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    llm = LLM(tp_size=2, **kw)
    try:
        assert _tokens(llm.generate(prompts, GREEDY)) == want
        assert len(calls) >= 2 * len(llm.engine.model_runner.model.model.layers)  # rank 0 took the overlap
    finally:
        llm.engine.shutdown()


def test_two_nodes_on_loopback(no_orphans):
    """``--nnodes 2``: node 1 (one rank) runs the CLI in its own process and follows node 0."""
    port = free_port()
    common = ["--model", "llama-tiny", "--load-format", "dummy", "--device", "cpu", "--max-total-tokens", "2048",
              "--tp-size", "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{port}"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    node1 = subprocess.Popen([sys.executable, "-m", "attnserve", "generate", "--node-rank", "1", *common],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    prompts = [[1, 5, 9, 13], list(range(20, 45))]
    try:
        llm = LLM(model="llama-tiny", load_format="dummy", device="cpu", max_total_tokens=2048, tp_size=2, nnodes=2,
                  node_rank=0, dist_init_addr=f"127.0.0.1:{port}")
        try:
            got = _tokens(llm.generate(prompts, GREEDY))
        finally:
            llm.engine.shutdown()
        out, _ = node1.communicate(timeout=60)
    finally:
        if node1.poll() is None:
            node1.kill()
    assert node1.returncode == 0, out
    assert "rank 0 shut the engine down" in out
    want = _tokens(LLM(model="llama-tiny", load_format="dummy", max_total_tokens=2048).generate(prompts, GREEDY))
    assert got == want


def test_killed_rank_is_reported(no_orphans):
    llm = LLM(model="llama-tiny", load_format="dummy", max_total_tokens=2048, tp_size=2)
    try:
        assert len(llm.generate([[1, 2, 3]], GREEDY)[0].token_ids) == 16
        victim = llm.engine.tp_runtime.procs[0]
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(10)
        with pytest.raises(RankDied, match=r"rank 1 .*exited with code -9"):
            llm.generate([[4, 5, 6]], GREEDY)
        with pytest.raises(RankDied, match="rank 1"):  # and stays stopped
            llm.engine.step()
    finally:
        llm.engine.shutdown()


def test_rank0_step_failure_stops_every_rank(no_orphans):
    from attnserve.engine.tp.launch import TPStepFailed

    llm = LLM(model="llama-tiny", load_format="dummy", max_total_tokens=2048, tp_size=2)
    try:
        assert len(llm.generate([[1, 2, 3]], GREEDY)[0].token_ids) == 16
        pids = [p.pid for p in llm.engine.tp_runtime.procs]
        model = llm.engine.model_runner.model
        real_forward = model.forward

        def failing_forward(*args, **kwargs):  # after rank 1 entered the step's collectives
            real_forward(*args, **kwargs)
            raise RuntimeError("injected failure on rank 0")

        model.forward = failing_forward
        t0 = time.monotonic()
        with pytest.raises(TPStepFailed, match="injected failure on rank 0"):
            llm.generate([[4, 5, 6]], GREEDY)
        assert time.monotonic() - t0 < 30  # stopped, not waiting on rank 1
        model.forward = real_forward
        _assert_dead(pids)
        with pytest.raises(TPStepFailed, match="start a new engine"):  # and stays stopped
            llm.engine.step()
    finally:
        llm.engine.shutdown()


def test_shutdown_releases_graphs_before_the_ranks_and_the_groups(no_orphans, monkeypatch):
    """A CUDA graph that captured a collective keeps NCCL's teardown waiting (seen on two
    H100s: a 10 s teardown timeout, then an abort at exit). Rank 0 therefore releases its
    graphs while the other ranks still serve collectives, then sends SHUTDOWN, then tears
    the groups down; on a failed engine (`test_rank0_step_failure_stops_every_rank`) it
    skips the release."""
    from attnserve.engine import model_runner
    from attnserve.engine.tp import launch, step_sync

    calls = []

    def spy(name, real):
        def wrapper(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(model_runner.ModelRunner, "release_cuda_graphs",
                        spy("graphs", model_runner.ModelRunner.release_cuda_graphs))
    monkeypatch.setattr(step_sync.StepSender, "shutdown", spy("shutdown message", step_sync.StepSender.shutdown))
    monkeypatch.setattr(launch, "_release_process_groups", spy("groups", launch._release_process_groups))
    llm = LLM(model="llama-tiny", load_format="dummy", max_total_tokens=2048, tp_size=2)
    pids = [p.pid for p in llm.engine.tp_runtime.procs]
    try:
        assert len(llm.generate([[1, 2, 3]], GREEDY)[0].token_ids) == 16
        assert calls == []
        assert llm.engine.scheduler.stats.tp_send_seconds > 0  # rank 0 timed its step broadcasts
    finally:
        llm.engine.shutdown()
    assert calls == ["graphs", "shutdown message", "groups"]
    llm.engine.shutdown()  # idempotent
    assert calls == ["graphs", "shutdown message", "groups"]
    _assert_dead(pids)


def test_tp_start_up_errors(monkeypatch):
    # 9 attention heads cannot be split over 2 ranks: refused before any process starts
    with pytest.raises(ValueError, match="does not divide the 9 attention heads"):
        LLM(model="smollm2-135m", load_format="dummy", tp_size=2)
    with pytest.raises(ValueError, match="does not divide the 4 attention heads"):
        LLM(model="llama-tiny", load_format="dummy", tp_size=3)
    with pytest.raises(ValueError, match="speculative"):
        LLM(model="llama-tiny", load_format="dummy", tp_size=2, speculative_algorithm="NGRAM")
    with pytest.raises(ValueError, match="--dist-init-addr"):
        LLM(model="llama-tiny", load_format="dummy", tp_size=2, nnodes=2)
    with pytest.raises(ValueError, match="multiple of --nnodes"):
        LLM(model="llama-tiny", load_format="dummy", tp_size=3, nnodes=2, dist_init_addr="127.0.0.1:1")
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="needs 2 GPUs on this node, but it has 1"):
        LLM(model="llama-tiny", load_format="dummy", device="cuda", tp_size=2)
    assert mp.active_children() == []
