"""Qwen3ForCausalLM vs HF transformers: a small random Qwen3 saved with save_pretrained and
loaded by us through load_model(dir), float32, torch_native backend.

Logits agree within `numeric_bounds.forward_bound` (float32 rounding of the whole forward,
relative to the largest logit): N = 4 layers x (256 + 512 + 256 + 512 + 64 + context) + 256
~ 6.8e3 terms at 40 tokens, 4 u sqrt(N) = 2.0e-5 of max|ref|.
"""

from __future__ import annotations

import pytest
import torch

from attnserve.forward_batch import ForwardMode
from attnserve.model_loader.loader import load_model
from numeric_bounds import assert_within, forward_bound, llama_like_terms

TINY = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,  # 8 * 64 = 512 != hidden: head_dim must come from the config
    vocab_size=1000,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
)
STEPS = 20


def _save_tiny_hf_qwen3(path, **overrides):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**{**TINY, **overrides})).eval()
    with torch.no_grad():  # non-trivial norm weights (HF initialises them to ones)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def qwen3_pair(request, tmp_path_factory):
    """(HF model, our LoadedModel) with the same random weights."""
    path = tmp_path_factory.mktemp(f"qwen3-{request.param}")
    hf = _save_tiny_hf_qwen3(path, tie_word_embeddings=request.param)
    ours = load_model(str(path), load_tokenizer=False, progress=False)
    return hf, ours


def _prompt(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, TINY["vocab_size"], (n,), generator=g).tolist()


def test_loads_as_qwen3_with_qk_norm(qwen3_pair):
    from attnserve.models.qwen3 import Qwen3ForCausalLM

    hf, ours = qwen3_pair
    model, mc = ours.model, ours.model_config
    assert isinstance(model, Qwen3ForCausalLM) and ours.load_format == "safetensors"
    assert (mc.architecture, mc.head_dim, mc.num_key_value_heads) == ("Qwen3ForCausalLM", 64, 2)
    assert mc.sliding_window_size == -1
    attn = model.model.layers[1].self_attn
    assert attn.qkv_proj.weight.shape == (8 * 64 + 2 * 2 * 64, 256) and attn.qkv_proj.bias is None
    assert attn.attn.scaling == pytest.approx(64**-0.5) and attn.attn.sliding_window_size == -1
    torch.testing.assert_close(attn.q_norm.weight, hf.model.layers[1].self_attn.q_norm.weight, rtol=0, atol=0)
    torch.testing.assert_close(attn.k_norm.weight, hf.model.layers[1].self_attn.k_norm.weight, rtol=0, atol=0)
    assert model.model.rotary_emb.base == 1e6
    assert (model.lm_head is None) == hf.config.tie_word_embeddings


def test_prefill_logits_match_hf(qwen3_pair, step_runner):
    hf, ours = qwen3_pair
    ids = _prompt(40, 1)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    runner = step_runner(ours.model, ours.model_config)
    logits = runner.step(ForwardMode.EXTEND, [(runner.new_request(), ids)])
    assert logits.shape == ref.shape
    assert_within(logits, ref, forward_bound(ref, llama_like_terms(hf.config, len(ids))), "qwen3 prefill vs HF")


@pytest.mark.parametrize("page_size", [1, 4])
def test_greedy_with_cached_prefix_matches_hf(qwen3_pair, step_runner, page_size):
    """Request ``a`` prefills in one step; request ``b`` prefills a prefix, then the rest on
    top of the cached prefix in the same step as ``a``'s first decode; both then decode
    together. Every step's logits match HF's and the greedy tokens are HF's."""
    hf, ours = qwen3_pair
    ids = _prompt(37, 2)
    x = torch.tensor([ids])
    with torch.no_grad():
        out = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=STEPS, do_sample=False,
                          output_logits=True, return_dict_in_generate=True)
    hf_tokens = out.sequences[0, len(ids):].tolist()
    hf_logits = [lg[0] for lg in out.logits]

    runner = step_runner(ours.model, ours.model_config, page_size=page_size)
    a, b = runner.new_request(), runner.new_request()
    split = 13
    logits = runner.step(ForwardMode.EXTEND, [(a, ids), (b, ids[:split])])
    toks_a = [int(logits[len(ids) - 1].argmax())]
    logits = runner.step(ForwardMode.EXTEND, [(b, ids[split:]), (a, [toks_a[-1]])])  # prefix + a decode token
    last_b = len(ids) - split - 1
    terms = llama_like_terms(hf.config, len(ids) + STEPS)  # the longest context of any step
    bounds = [forward_bound(lg, terms) for lg in hf_logits]  # each step's own max|ref|
    assert_within(logits[last_b], hf_logits[0], bounds[0], "qwen3 extend over a cached prefix vs HF")
    assert_within(logits[-1], hf_logits[1], bounds[1], "qwen3 decode in an extend step vs HF")
    toks_b = [int(logits[last_b].argmax())]
    toks_a.append(int(logits[-1].argmax()))
    decoded, refs, steps = [], [], []
    while len(toks_b) < STEPS:
        reqs = [(b, [toks_b[-1]])] + ([(a, [toks_a[-1]])] if len(toks_a) < STEPS else [])
        logits = runner.step(ForwardMode.DECODE, reqs)
        decoded.append(logits[0])
        refs.append(hf_logits[len(toks_b)])
        steps.append(len(toks_b))
        toks_b.append(int(logits[0].argmax()))
        if len(reqs) == 2:
            toks_a.append(int(logits[1].argmax()))
    assert toks_a == hf_tokens
    assert toks_b == hf_tokens
    assert_within(torch.stack(decoded), torch.stack(refs), torch.tensor([[bounds[i]] for i in steps]),
                  "qwen3 decode vs HF")


def test_dummy_shape_qwen3_0_6b():
    """The named dummy shape builds (on ``meta``: no memory) with Qwen3-0.6B's parameter count."""
    from attnserve.models.qwen3 import Qwen3ForCausalLM

    loaded = load_model("qwen3-0.6b", load_format="dummy", device="meta", load_tokenizer=False)
    mc = loaded.model_config
    assert isinstance(loaded.model, Qwen3ForCausalLM) and loaded.model.lm_head is None
    assert (mc.hidden_size, mc.num_hidden_layers, mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim) == (
        1024, 28, 16, 8, 128)
    assert loaded.model.model.rotary_emb.base == 1e6
    h = 1024
    layer_params = h * (16 + 8 + 8) * 128 + 16 * 128 * h + 3 * h * 3072 + 2 * h + 2 * 128
    expected = 151936 * h + 28 * layer_params + h
    assert sum(p.numel() for p in loaded.model.parameters()) == expected  # 596,049,920


def test_dummy_weights_run(tmp_path, step_runner):
    """``load_format="dummy"`` on a config-only directory: random weights, finite logits."""
    from transformers import Qwen3Config

    Qwen3Config(**TINY, architectures=["Qwen3ForCausalLM"]).save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), load_format="dummy", load_tokenizer=False)
    norm = loaded.model.model.layers[0].self_attn.q_norm.weight
    assert torch.equal(norm, torch.ones_like(norm))
    runner = step_runner(loaded.model, loaded.model_config)
    row = runner.new_request()
    logits = runner.step(ForwardMode.EXTEND, [(row, _prompt(9, 3))])
    logits = runner.step(ForwardMode.DECODE, [(row, [int(logits[-1].argmax())])])
    assert logits.shape == (1, TINY["vocab_size"]) and torch.isfinite(logits).all()


def test_registry_knows_qwen3():
    from attnserve.models.registry import architecture_for_model_type, get_model_class
    from attnserve.models.qwen3 import Qwen3ForCausalLM

    assert architecture_for_model_type("qwen3") == "Qwen3ForCausalLM"
    assert get_model_class("Qwen3ForCausalLM") is Qwen3ForCausalLM
