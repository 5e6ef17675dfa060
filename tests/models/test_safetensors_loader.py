"""HF safetensors directories: a small random HF Llama saved to disk, loaded by us, same logits."""

from __future__ import annotations

import pytest
import torch

from attnserve.forward_batch import ForwardMode
from attnserve.model_loader.loader import load_model
from numeric_bounds import assert_within, forward_bound, llama_like_terms


def _tiny_hf_llama(tmp_path, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
    )
    kw.update(overrides)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**kw)).eval()
    with torch.no_grad():  # non-trivial norms and biases
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize(
    "overrides",
    [
        dict(tie_word_embeddings=True),
        dict(
            tie_word_embeddings=False,
            attention_bias=True,
            mlp_bias=True,
            head_dim=32,  # != hidden / heads
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ],
    ids=["tied", "untied-bias-llama3"],
)
def test_safetensors_dir_matches_hf(tmp_path, overrides, step_runner):
    hf = _tiny_hf_llama(tmp_path, **overrides)
    loaded = load_model(str(tmp_path), load_tokenizer=False, progress=False)
    assert loaded.load_format == "safetensors" and loaded.gguf_file is None
    assert loaded.model_config.architecture == "LlamaForCausalLM"
    ids = torch.randint(0, 300, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    runner = step_runner(loaded.model, loaded.model_config, page_size=8)
    row = runner.new_request()
    out = torch.cat(
        [runner.step(ForwardMode.EXTEND, [(row, ids[:100])])]
        + [runner.step(ForwardMode.DECODE, [(row, [t])]) for t in ids[100:]]
    )
    # float32 rounding of the whole forward, relative to the largest logit (tests/numeric_bounds.py):
    # N = 2 layers x (64 + 128 + 64 + 96 + 32 + 150) + 64 ~ 1.1e3 (head_dim 16 or 32), 4 u sqrt(N) ~ 8e-6
    assert_within(out, ref, forward_bound(ref, llama_like_terms(hf.config, len(ids))), "safetensors llama vs HF")
