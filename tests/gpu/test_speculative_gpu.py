"""Speculative decoding on a GPU with CUDA graphs: captured target verify
(`VerifyGraphRunner`) and captured draft chains (`DraftChainRunner` over
`TritonMultiStepDraftBackend`) against the eager paths. Dummy SmolLM2-shape weights
(deterministic, so a draft model loaded from the same name is the target itself).

Identities are checked in float32 with IEEE matmuls and batch-invariant attention
(graphs pad batches and verify pads trees, so bf16 rounding would differ with the shapes).
After every test the pools are free.
"""

import pytest
import torch
from test_engine_loop_gpu import _assert_free  # pools free, no work left

from attnserve.engine.engine import Engine
from attnserve.engine.sampling_params import SamplingParams
from attnserve.server_args import ServerArgs

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("no_tf32")]

EXACT = dict(dtype="float32", enable_deterministic_inference=True)


def _engine(**kw):
    base = dict(model="smollm2-135m", load_format="dummy", device="cuda", max_total_tokens=20000,
                max_running_requests=8, context_length=1024, cuda_graph_max_bs=8)
    base.update(kw)
    return Engine(ServerArgs(**base))


def _prompts():
    rep = [101, 202, 303, 404, 505, 606, 707, 808] * 6  # repetition: n-gram drafts find matches
    return [rep, list(range(1000, 1090)), rep[:20] + list(range(50, 70)) + rep[:20], [7, 8, 9] * 5]


def _run(engine, prompts, max_new_tokens=40):
    reqs = [engine.add_request(p, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True))
            for p in prompts]
    while engine.has_work():
        engine.step()
    return [list(r.output_ids) for r in reqs], reqs


@pytest.fixture(scope="module")
def baseline():
    engine = _engine(**EXACT)
    out, _ = _run(engine, _prompts())
    del engine
    torch.cuda.empty_cache()
    return out


@pytest.mark.parametrize("page_size", [1, 16])
def test_ngram_verify_graphs_identical(baseline, page_size):
    engine = _engine(speculative_algorithm="NGRAM", speculative_num_draft_tokens=8, page_size=page_size, **EXACT)
    spec = engine.scheduler.spec
    assert spec.verify_graph is not None and spec.verify_graph.n == 8
    out, reqs = _run(engine, _prompts())
    assert out == baseline
    assert sum(r.spec_verify_ct for r in reqs) < sum(len(o) for o in out)  # some drafts were taken
    _assert_free(engine)


def test_ngram_eager_verify_identical(baseline):
    engine = _engine(speculative_algorithm="NGRAM", speculative_num_draft_tokens=8, disable_cuda_graph=True,
                     cuda_graph_max_bs=None, **EXACT)
    assert engine.scheduler.spec.verify_graph is None
    out, _ = _run(engine, _prompts())
    assert out == baseline
    _assert_free(engine)


@pytest.mark.parametrize("page_size", [1, 16])
def test_standalone_draft_chain_graphs(baseline, page_size):
    """The target as its own draft: every draft is right, so each verify takes all
    ``num_steps`` drafts (a wrong token from the captured chain would be rejected)."""
    engine = _engine(speculative_algorithm="STANDALONE", speculative_draft_model_path="smollm2-135m",
                     speculative_num_steps=4, speculative_num_draft_tokens=5, page_size=page_size, **EXACT)
    spec = engine.scheduler.spec
    chain = spec.drafter.chain
    assert chain is not None and chain.graphs and chain.multi is not None and spec.verify_graph is not None
    out, reqs = _run(engine, _prompts())
    assert out == baseline
    for r, o in zip(reqs, out):  # 1 token from prefill, then 5 per verify (the last verify may be cut short)
        assert r.spec_verify_ct == -(-(len(o) - 1) // 5)
    _assert_free(engine)


def test_draft_chain_graph_equals_eager():
    """`DraftChainRunner`: replayed graph and eager steps give the same tokens (same batch)."""
    engine = _engine(speculative_algorithm="STANDALONE", speculative_draft_layers=12, speculative_num_steps=4,
                     speculative_num_draft_tokens=5, **EXACT)
    chain = engine.scheduler.spec.drafter.chain
    seen = []
    run_eager = chain._steps

    def both(bs, rows, seq_lens, step_limits, tokens, out_cache_loc):
        graphed = chain._replay(bs, rows, seq_lens, step_limits, tokens, out_cache_loc).clone()
        eager = run_eager(bs, rows, seq_lens, step_limits, tokens, out_cache_loc)
        seen.append(bs)
        assert torch.equal(graphed, eager)
        return eager

    chain.run = lambda rows, seq_lens, step_limits, tokens, loc: both(
        int(rows.shape[0]), rows, seq_lens, step_limits, tokens, loc)
    _run(engine, _prompts()[:3], max_new_tokens=24)
    assert seen and max(seen) == 3
    _assert_free(engine)


def test_bf16_speculative_with_graphs_runs_clean():
    """bf16 with graphs on: NGRAM trees and a self-draft chain run to their lengths, pools
    end free (token identity is the float32 tests' job)."""
    for kw in (dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=8),
               dict(speculative_algorithm="STANDALONE", speculative_draft_layers=8, speculative_num_steps=3)):
        engine = _engine(dtype="bfloat16", **kw)
        out, reqs = _run(engine, _prompts(), max_new_tokens=33)
        assert [len(o) for o in out] == [33] * 4
        assert all(1 <= r.spec_verify_ct <= 32 for r in reqs)
        _assert_free(engine)
        del engine
        torch.cuda.empty_cache()


def test_draft_chain_above_the_largest_graph(baseline):
    """Batches larger than the captured graphs run the chain eagerly over the same
    multi-step metadata (its buffers cover --max-running-requests)."""
    engine = _engine(speculative_algorithm="STANDALONE", speculative_draft_model_path="smollm2-135m",
                     speculative_num_steps=3, speculative_num_draft_tokens=4, cuda_graph_max_bs=2, **EXACT)
    chain = engine.scheduler.spec.drafter.chain
    assert chain.capture_bs[-1] == 2 and chain.multi.max_bs == 8
    out, _ = _run(engine, _prompts())
    assert out == baseline
    _assert_free(engine)


def test_ngram_verify_graphs_share_one_logits_buffer(baseline):
    """Every verify graph writes its logits into the largest graph's buffer (8 requests x 8
    nodes). Requests that end at different steps replay graphs of several sizes below the
    largest (4, then smaller: the 3-token request ends within 2 verify steps, the 40-token
    one needs at least 5), all writing the same memory, and still give the baseline's tokens."""
    engine = _engine(speculative_algorithm="NGRAM", speculative_num_draft_tokens=8, **EXACT)
    graph = engine.scheduler.spec.verify_graph
    assert graph.capture_bs == [1, 2, 4, 8]
    big = graph.outputs[graph.max_bs]
    vocab = big.shape[1]
    assert big.shape == (graph.max_bs * graph.n, vocab) and big.dtype == torch.float32
    for bs, out in graph.outputs.items():
        assert out.shape == (bs * graph.n, vocab) and out.data_ptr() == big.data_ptr()
    assert graph.logits_buffer_bytes == graph.max_bs * graph.n * vocab * 4
    per_graph = sum(graph.capture_bs) * graph.n * vocab * 4
    print(f"verify graphs {graph.capture_bs} x {graph.n} nodes, vocab {vocab}: capture used "
          f"{graph.graph_memory_bytes / 2**20:.1f} MiB; shared logits {graph.logits_buffer_bytes / 2**20:.1f} MiB "
          f"(one buffer per graph: {per_graph / 2**20:.1f} MiB)")
    replayed = []
    replay = graph.replay
    graph.replay = lambda packed, raw: replayed.append(raw) or replay(packed, raw)
    lens = [40, 26, 13, 3]
    reqs = [engine.add_request(p, SamplingParams(temperature=0.0, max_new_tokens=m, ignore_eos=True))
            for p, m in zip(_prompts(), lens)]
    while engine.has_work():
        engine.step()
    assert [list(r.output_ids) for r in reqs] == [b[:m] for b, m in zip(baseline, lens)]
    print(f"verify batch sizes replayed: {replayed}")
    assert max(replayed) == 4 and min(replayed) < 4, replayed
    _assert_free(engine)
