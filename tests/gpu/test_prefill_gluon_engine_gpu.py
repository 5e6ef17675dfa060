"""The Gluon prefill over a cached prefix inside the engine (sm_90; `prefill_gluon`, on by
default, ``ATTNSERVE_EXTEND_GLUON_PREFIX=0`` off): the check that made that route the default
(first H100 run 2026-11-27: passed within the bounds below).

Two engine-level paths reach it: the second and later chunks of a prompt longer than
``--chunked-prefill-size`` (the prefix is the request's own earlier chunks), and a radix-cache
hit followed by >= 1,024 new tokens. Each run asserts the route was taken (a spy on
`gluon_prefill_fwd` with a paged prefix), then compares the logprobs with the Triton
extend kernel's (the switch off) on the same engine settings.

Bound: the two kernels' attention outputs differ by ~2e-3 relative (bf16 rounding of P and
O in different tile orders; `prefill_gluon_bench.py` measured 1.5e-3 - 2.1e-3 against
Triton), and 28 bf16 layers of a dummy-weight model carry that into the final log-softmax.
A wrong prefix (keys skipped, read twice, or from the wrong slots) moves logprobs by O(1),
so the per-position bound 0.25 nats and the mean bound 0.02 nats separate the two by more
than an order of magnitude. Written without a GPU run (2026-11-27): if the first H100 run
shows the bf16 noise above these bounds, calibrate them against two Triton runs with
different chunk sizes rather than loosening them blindly.
"""

import random

import pytest
import torch

from attnserve.engine.engine import Engine, GenerateOutput
from attnserve.engine.sampling_params import SamplingParams
from attnserve.server_args import ServerArgs

pytestmark = [pytest.mark.cuda]

MAX_ABS_NATS = 0.25
MEAN_ABS_NATS = 0.02


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.fixture
def prefix_spy(monkeypatch):
    """Counts `gluon_prefill_fwd` launches that carried a paged prefix."""
    import attnserve.attention.triton_ops.prefill_gluon as pg

    calls = []
    real = pg.gluon_prefill_fwd

    def spy(*args, **kw):
        calls.append(kw.get("k_buffer") is not None)
        return real(*args, **kw)

    monkeypatch.setattr(pg, "gluon_prefill_fwd", spy)
    return calls


def _engine():
    return Engine(ServerArgs(model="qwen3-0.6b", load_format="dummy", device="cuda", dtype="bfloat16",
                             chunked_prefill_size=1024, max_total_tokens=32768, max_running_requests=8,
                             context_length=4096))


def _drain(engine, reqs):
    while engine.has_work():
        engine.step()
    return [GenerateOutput.from_req(r) for r in reqs]


def _prompts():
    rnd = random.Random(7)
    long_prompt = [rnd.randrange(100, 100000) for _ in range(3000)]
    shared = [rnd.randrange(100, 100000) for _ in range(2000)]
    return long_prompt, shared, [rnd.randrange(100, 100000) for _ in range(1200)]


def _run(switch: str, monkeypatch):
    """(prompt logprobs of the chunked 3,000-token prompt, top-5 logprobs of the first output
    token after a 2,000-token cache hit + 1,200 new tokens)."""
    monkeypatch.setenv("ATTNSERVE_EXTEND_GLUON_PREFIX", switch)
    long_prompt, shared, tail = _prompts()
    engine = _engine()
    try:
        chunked = _drain(engine, [engine.add_request(long_prompt, SamplingParams(
            max_new_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=True))])[0]
        warm = _drain(engine, [engine.add_request(shared + [5], SamplingParams(max_new_tokens=1, ignore_eos=True))])
        assert warm[0].finish_reason == "length"
        hit = _drain(engine, [engine.add_request(shared + tail, SamplingParams(
            max_new_tokens=1, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=5))])[0]
        assert hit.cached_tokens >= 1900, f"the radix cache served only {hit.cached_tokens} tokens"
        return chunked.prompt_token_logprobs[1:], hit.output_top_logprobs[0]
    finally:
        engine.shutdown()


@pytest.mark.skipif(not _sm90(), reason="the Gluon prefill runs on sm_90 only")
def test_engine_prefix_route_matches_triton(prefix_spy, monkeypatch):
    triton_prompt, triton_top = _run("0", monkeypatch)
    assert not any(prefix_spy), "the switch off must keep prefixes on the Triton kernel"
    gluon_prompt, gluon_top = _run("1", monkeypatch)
    # one launch a layer for the second chunk (1,024 new over 1,024 cached) and for the cache
    # hit (1,200 new over ~2,000); the third chunk (952 new) stays below the length rule
    assert sum(prefix_spy) >= 2 * 28, f"prefix launches through Gluon: {sum(prefix_spy)}"

    diffs = torch.tensor([abs(a - b) for a, b in zip(gluon_prompt, triton_prompt)], dtype=torch.float64)
    assert len(diffs) == 2999
    assert diffs.max().item() <= MAX_ABS_NATS, f"max |d logprob| {diffs.max().item():.3g}"
    assert diffs.mean().item() <= MEAN_ABS_NATS, f"mean |d logprob| {diffs.mean().item():.3g}"
    # the second chunk's positions are the ones the prefix route computed
    assert diffs[1023:2047].mean().item() <= MEAN_ABS_NATS

    triton_lp = dict(triton_top)
    common = [t for t, _ in gluon_top if t in triton_lp]
    assert len(common) >= 3, f"top-5 after the cache hit share only {len(common)} tokens"
    for tok, lp in gluon_top:
        if tok in triton_lp:
            assert abs(lp - triton_lp[tok]) <= MAX_ABS_NATS
