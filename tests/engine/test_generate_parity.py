"""Greedy parity of the whole engine with HF transformers on the same GGUF (float32, CPU)."""

import os

import pytest
import torch

from attnserve.engine.sampling_params import SamplingParams
from attnserve.forward_batch import ForwardMode

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


def test_greedy_tokens_match_hf(llm, hf_model):
    sp = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
    outs = llm.generate(CHAT_PROMPTS, sp, chat=True)
    for out in outs:
        ids = torch.tensor([out.prompt_token_ids])
        with torch.inference_mode():
            ref = hf_model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)
        assert out.token_ids == ref[0, ids.shape[1]:].tolist()
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
        assert (ours - ref).abs().max().item() < 1e-3
    finally:
        runner.token_to_kv_pool_allocator.free(slots)
        runner.req_to_token_pool.free(row)
