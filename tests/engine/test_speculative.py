"""Speculative decoding end to end (real SmolLM2, fp32, CPU): the tokens are those of plain
decoding, for greedy and seeded sampled requests alike, with chains and trees, page sizes
1 and 16, chunked prefill and the radix cache; the pools are fully free afterwards.

Why sampled requests match too: drafts are proposed deterministically and the sampler's
noise is a function of (seed, output position), so verifying a node samples exactly the
token plain decoding would have sampled there (`attnserve.engine.speculative.verify`).
"""

import pytest

from attnserve.engine.sampling_params import SamplingParams

from test_overlap_retract import PROMPTS, _assert_idle, _params, _summary

EDIT_PROMPT = (
    "Repeat the following paragraph exactly, but replace the word 'cat' with 'dog':\n\n"
    "The cat sat on the warm windowsill and watched the birds in the garden. Every morning the cat "
    "waited for the sun to rise, and every evening the cat slept on the old blue chair by the door."
)


SMALL = 6  # requests of the STANDALONE cases (a draft model costs a forward per draft step on the CPU)


@pytest.fixture(scope="module")
def baseline(llm):
    return _summary(llm.generate(PROMPTS, _params(), chat=True))


@pytest.fixture(scope="module")
def small_baseline(llm):
    return _summary(llm.generate(PROMPTS[:SMALL], _params()[:SMALL], chat=True))


@pytest.mark.parametrize("kwargs", [
    dict(speculative_num_draft_tokens=8),  # trees (breadth 10)
    dict(speculative_num_draft_tokens=4, speculative_ngram_max_bfs_breadth=1),  # chains
    dict(speculative_num_draft_tokens=6, page_size=16, chunked_prefill_size=16),  # pages, chunked prefill
    dict(speculative_num_draft_tokens=5, disable_radix_cache=True),
])
def test_ngram_outputs_identical(llm_factory, baseline, kwargs):
    llm = llm_factory(speculative_algorithm="NGRAM", **kwargs)
    assert llm.engine.scheduler.spec is not None and llm.engine.scheduler.overlap is False
    outs = llm.generate(PROMPTS, _params(), chat=True)
    assert _summary(outs) == baseline
    assert all(o.spec_verify_ct >= 1 for o in outs if len(o.token_ids) > 1)
    _assert_idle(llm)


def test_ngram_accepts_drafts_on_an_editing_prompt(llm_factory, llm):
    """Repeating a paragraph: the drafts come from the prompt, several tokens per verify,
    and the text is plain greedy decoding's."""
    params = SamplingParams(max_new_tokens=64, temperature=0.0)
    plain = llm.generate([EDIT_PROMPT], params, chat=True)[0]
    spec_llm = llm_factory(speculative_algorithm="NGRAM", speculative_num_draft_tokens=8)
    out = spec_llm.generate([EDIT_PROMPT], params, chat=True)[0]
    assert out.token_ids == plain.token_ids
    stats = spec_llm.engine.scheduler.spec.stats
    assert stats.num_verify == out.spec_verify_ct
    assert len(out.token_ids) / out.spec_verify_ct > 1.5, (len(out.token_ids), out.spec_verify_ct)
    _assert_idle(spec_llm)


def test_speculative_flags_are_checked():
    from attnserve.server_args import ServerArgs

    with pytest.raises(ValueError, match="valid: NGRAM, STANDALONE"):
        ServerArgs(speculative_algorithm="MEDUSA", device="cpu").check()
    with pytest.raises(ValueError, match="--speculative-num-draft-tokens must be in 1..64"):
        ServerArgs(speculative_algorithm="NGRAM", speculative_num_draft_tokens=0, device="cpu").check()
    with pytest.raises(ValueError, match="--speculative-num-draft-tokens needs --speculative-algorithm"):
        ServerArgs(speculative_num_draft_tokens=4, device="cpu").check()
    with pytest.raises(ValueError, match="exactly one of --speculative-draft-model-path"):
        ServerArgs(speculative_algorithm="STANDALONE", device="cpu").check()
    with pytest.raises(ValueError, match="is for STANDALONE"):
        ServerArgs(speculative_algorithm="NGRAM", speculative_eagle_topk=2, device="cpu").check()
    with pytest.raises(ValueError, match="min-match-window-size"):
        ServerArgs(speculative_algorithm="NGRAM", speculative_ngram_min_match_window_size=3,
                   speculative_ngram_max_match_window_size=2, device="cpu").check()


def test_gemma3_ngram_identical_and_chains(llm_factory):
    """Gemma 3 270M (sliding-window layers, real weights): NGRAM drafts chains there (the
    backends place windows by slot, which is the tree depth only on a chain) and the
    tokens are plain decoding's."""
    prompts = [EDIT_PROMPT, "Count from one to twenty: one, two, three,", "What is the capital of France?"]
    params = [SamplingParams(max_new_tokens=28, temperature=0.0),
              SamplingParams(max_new_tokens=28, temperature=0.0, ignore_eos=True),
              SamplingParams(max_new_tokens=16, temperature=0.9, seed=5)]
    plain = llm_factory(model="gemma3-270m").generate(prompts, params)
    llm = llm_factory(model="gemma3-270m", speculative_algorithm="NGRAM", speculative_num_draft_tokens=6)
    assert llm.engine.scheduler.spec.proposer.drafter.max_bfs_breadth == 1
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert sum(len(o.token_ids) for o in outs) > sum(o.spec_verify_ct for o in outs)  # some drafts accepted
    _assert_idle(llm)


@pytest.mark.parametrize("kwargs", [
    dict(speculative_draft_model_path="smollm2-135m", speculative_num_steps=4),  # the target as its own draft
    dict(speculative_draft_layers=20, speculative_num_steps=3, page_size=16, chunked_prefill_size=16),
    dict(speculative_draft_layers=12, speculative_num_steps=3, speculative_eagle_topk=2,
         speculative_num_draft_tokens=5),  # trees from the draft model
])
def test_standalone_outputs_identical(llm_factory, small_baseline, kwargs):
    llm = llm_factory(speculative_algorithm="STANDALONE", **kwargs)
    outs = llm.generate(PROMPTS[:SMALL], _params()[:SMALL], chat=True)
    assert _summary(outs) == small_baseline
    _assert_idle(llm)
    stats = llm.engine.scheduler.spec.stats
    assert stats.num_verify == sum(o.spec_verify_ct for o in outs)
    if "speculative_draft_model_path" in kwargs:  # a perfect draft: every step takes all num_steps drafts
        assert stats.mean_accept_length > 3.0, stats


def test_standalone_bad_drafts_are_refused():
    from attnserve.engine.engine import Engine
    from attnserve.server_args import ServerArgs

    with pytest.raises(ValueError, match="must be below the target's 30 layers"):
        Engine(ServerArgs(speculative_algorithm="STANDALONE", speculative_draft_layers=30, device="cpu",
                          max_total_tokens=256, load_format="dummy"))
    with pytest.raises(ValueError, match="another vocabulary"):
        Engine(ServerArgs(speculative_algorithm="STANDALONE", speculative_draft_model_path="gemma3-270m",
                          device="cpu", max_total_tokens=256, load_format="dummy"))
    with pytest.raises(ValueError, match="exceeds what 2 steps of top-2 can draft"):
        ServerArgs(speculative_algorithm="STANDALONE", speculative_draft_layers=2, speculative_num_steps=2,
                   speculative_eagle_topk=2, speculative_num_draft_tokens=6, device="cpu").check()
