"""Our LlamaForCausalLM on the torch_native backend vs HF transformers, same SmolLM2 GGUF, float32.

Logits agree within `numeric_bounds.forward_bound`: float32 rounding of the whole forward,
relative to the largest logit. SmolLM2-135M: N = 30 layers x (576 + 576 + 576 + 1536 + 64 +
context) + 576 ~ 1.0e5 terms for a ~35-token prompt, so 4 u sqrt(N) ~ 7.6e-5 of max|ref|.
"""

from __future__ import annotations

import pytest
import torch

from attnserve.forward_batch import ForwardMode
from numeric_bounds import assert_within, forward_bound, llama_like_terms

NEW_TOKENS = 10


@pytest.fixture(scope="module")
def hf_logits(hf_smollm2, prompt_ids):
    with torch.no_grad():
        return hf_smollm2(torch.tensor([prompt_ids])).logits[0].float()


@pytest.fixture(scope="module")
def hf_greedy(hf_smollm2, prompt_ids):
    x = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = hf_smollm2.generate(
            input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, do_sample=False
        )
    return out[0, x.shape[1] :].tolist()


def _bound(hf_smollm2, prompt_ids, hf_logits) -> float:
    return forward_bound(hf_logits, llama_like_terms(hf_smollm2.config, len(prompt_ids)))


def test_prefill_logits_match_hf(smollm2_loaded, hf_smollm2, prompt_ids, hf_logits, step_runner):
    runner = step_runner(smollm2_loaded.model, smollm2_loaded.model_config)
    row = runner.new_request()
    logits = runner.step(ForwardMode.EXTEND, [(row, prompt_ids)])
    assert logits.dtype == torch.float32 and logits.shape == hf_logits.shape
    assert_within(logits, hf_logits, _bound(hf_smollm2, prompt_ids, hf_logits), "smollm2 prefill vs HF")


@pytest.mark.parametrize("page_size", [1, 16])
def test_prefill_then_decode_matches_hf_greedy(smollm2_loaded, prompt_ids, hf_greedy, step_runner, page_size):
    runner = step_runner(smollm2_loaded.model, smollm2_loaded.model_config, page_size=page_size)
    row = runner.new_request()
    logits = runner.step(ForwardMode.EXTEND, [(row, prompt_ids)])
    tokens = [int(logits[-1].argmax())]
    for _ in range(len(hf_greedy) - 1):
        logits = runner.step(ForwardMode.DECODE, [(row, [tokens[-1]])])
        tokens.append(int(logits[-1].argmax()))
    assert tokens == hf_greedy
    text = smollm2_loaded.tokenizer.decode(tokens)
    assert text.startswith("The capital of France is Paris"), text


def test_batched_ragged_extend_with_prefix(smollm2_loaded, hf_smollm2, prompt_ids, hf_logits, step_runner):
    """Two requests in one EXTEND step, one on top of a cached prefix, equal the single run."""
    runner = step_runner(smollm2_loaded.model, smollm2_loaded.model_config, page_size=4)
    a, b = runner.new_request(), runner.new_request()
    split = 21  # not a page multiple
    runner.step(ForwardMode.EXTEND, [(b, prompt_ids[:split])])
    logits = runner.step(ForwardMode.EXTEND, [(a, prompt_ids), (b, prompt_ids[split:])])
    n = len(prompt_ids)
    bound = _bound(hf_smollm2, prompt_ids, hf_logits)
    assert_within(logits[:n], hf_logits, bound, "smollm2 batched extend vs HF")
    assert_within(logits[n:], hf_logits[split:], bound, "smollm2 extend over a cached prefix vs HF")


def test_bf16_runs_and_agrees_on_top_token(smollm2_loaded, prompt_ids, hf_logits, step_runner):
    import copy

    model = copy.deepcopy(smollm2_loaded.model).to(torch.bfloat16)
    assert model.model.rotary_emb.cos_sin_cache.dtype == torch.float32  # the RoPE table keeps its precision
    assert model.model.layers[3].self_attn.rotary_emb is model.model.rotary_emb  # one shared table
    runner = step_runner(model, smollm2_loaded.model_config)
    row = runner.new_request()
    logits = runner.step(ForwardMode.EXTEND, [(row, prompt_ids)])
    assert logits.dtype == torch.float32
    assert int(logits[-1].argmax()) == int(hf_logits[-1].argmax())
