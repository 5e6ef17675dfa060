"""Greedy parity of the whole engine with HF transformers on the same GGUF (float32, CPU)."""

import os

import pytest
import torch

from attnserve.engine.sampling_params import SamplingParams
from attnserve.forward_batch import ForwardMode
from numeric_bounds import assert_within, forward_bound, llama_like_terms

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn.",
    "How many legs does a spider have?",
    "Explain gravity in one sentence.",
    "Name three primary colors.",
]


@pytest.fixture(scope="module")
def hf_model(llm):
    from transformers import AutoModelForCausalLM

    from attnserve.model_loader.loader import resolve_model

    path = resolve_model("smollm2-135m").gguf_path
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32)
    return model.eval()


def hf_greedy(model, prompt_ids, n):
    """Plain greedy decoding with HF's own KV cache (no EOS handling, no logits processors)."""
    out_ids = []
    with torch.inference_mode():
        out = model(torch.tensor([prompt_ids]), use_cache=True)
        for _ in range(n):
            tok = int(out.logits[0, -1].argmax())
            out_ids.append(tok)
            out = model(torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
    return out_ids


def test_greedy_tokens_match_hf(llm, hf_model):
    sp = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
    outs = llm.generate(CHAT_PROMPTS, sp, chat=True)
    for out in outs:
        assert len(out.token_ids) == 32
        assert out.token_ids == hf_greedy(hf_model, out.prompt_token_ids, 32)
    assert outs[0].text.startswith("The capital of France is Paris")


def test_prefill_logits_match_hf(llm, hf_model):
    engine = llm.engine
    ids = engine.tokenize(CHAT_PROMPTS[3], chat=True)
    runner = engine.model_runner
    row = runner.req_to_token_pool.alloc(1)[0]
    slots = runner.token_to_kv_pool_allocator.alloc_extend([0], [len(ids)], [0])
    try:
        runner.req_to_token_pool.write(row, 0, slots)
        fb = runner.build_forward_batch(ForwardMode.EXTEND, ids, [row], [0], [len(ids)], slots)
        ours = runner.forward(fb, return_all_logits=True)
        with torch.inference_mode():
            ref = hf_model(torch.tensor([ids])).logits[0].float()
        assert ours.shape == ref.shape
        # float32 rounding of the whole forward on both sides, relative to the largest logit:
        # SmolLM2-135M, N ~ 30 x (3328 + context) + 576, 4 u sqrt(N) ~ 7.6e-5 of max|ref|
        # (tests/numeric_bounds.py); the GEMM kernels, and so the rounding, differ by CPU
        assert_within(ours, ref, forward_bound(ref, llama_like_terms(hf_model.config, len(ids))),
                      "engine prefill vs HF")
    finally:
        runner.token_to_kv_pool_allocator.free(slots)
        runner.req_to_token_pool.free(row)


def test_greedy_logprobs_match_hf(llm, hf_model):
    """Issue 35: the logprobs of greedy tokens, of the prompt (``echo``) and of the top
    alternatives are within 1e-3 of HF's ``log_softmax`` of the same sequence (float32);
    each top list is sorted, starts with the chosen token and sums to at most 1."""
    sp = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=5,
                        prompt_logprobs=True)
    for out in llm.generate(CHAT_PROMPTS[:2], sp, chat=True):
        n = len(out.prompt_token_ids)
        seq = torch.tensor(out.prompt_token_ids + out.token_ids)
        with torch.inference_mode():
            ref = torch.log_softmax(hf_model(seq[None]).logits[0].float(), dim=-1)
        want = ref[:-1].gather(1, seq[1:, None])[:, 0]  # position q predicts token q + 1
        got = torch.tensor(out.prompt_token_logprobs[1:] + out.output_token_logprobs)
        assert out.prompt_token_logprobs[0] is None and got.shape == want.shape
        assert (got - want).abs().max() < 1e-3
        for q, (tok, top) in enumerate(zip(out.token_ids, out.output_top_logprobs)):
            vals = [v for _, v in top]
            assert top[0][0] == tok and vals == sorted(vals, reverse=True)
            assert sum(torch.tensor(vals).exp()) <= 1 + 1e-5
            assert max(abs(v - float(ref[n - 1 + q, t])) for t, v in top) < 1e-3
