"""``--enable-fp8-lm-head``: the LM head as an FP8 linear (per-row e4m3 weights, dynamic
per-token activations), checked against the float64 product of the same quantised values,
for an untied head (its bf16 rows dropped) and a tied one (the embedding kept for lookups)."""

import pytest
import torch

from attnserve.model_loader.loader import load_model
from attnserve.models.layers.quantization.fp8_utils import dequantize, quantize_per_row


def _hidden(model, rows=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, model.config.hidden_size, generator=g)


@pytest.mark.parametrize("shape", ["qwen3-tiny", "smollm2-135m"])  # untied; tied (embedding = head)
def test_fp8_head_matches_the_float64_product_of_its_quantised_values(shape):
    plain = load_model(shape, load_format="dummy", load_tokenizer=False, progress=False, quantization="fp8").model
    head = load_model(shape, load_format="dummy", load_tokenizer=False, progress=False, quantization="fp8",
                      fp8_lm_head=True).model
    w = plain.lm_head_weight.float()  # same seed: the same dummy weights
    assert head.lm_head_fp8 is not None and head.lm_head_fp8.weight.dtype == torch.float8_e4m3fn
    if plain.lm_head is None:  # tied: the embedding stays for the token lookup
        assert head.model.embed_tokens.weight.shape == w.shape
    else:  # untied: the bf16 rows are gone
        assert head.lm_head.weight.numel() == 0
    h = _hidden(head)
    got = head.compute_logits(h)
    qw, sw = quantize_per_row(w)
    assert torch.equal(head.lm_head_fp8.weight.float(), qw.float()) and torch.equal(head.lm_head_fp8.weight_scale, sw)
    layer = head.lm_head_fp8
    qx, sx = layer.quant_method._quantize_input(layer, h)  # the path's own activation quantiser (tested elsewhere)
    want = (dequantize(qx, sx).double() @ dequantize(qw, sw).double().t())[:, : head.config.vocab_size]
    assert got.dtype == torch.float32 and got.shape == want.shape
    # float32 products of the same e4m3 values: K-term float32 accumulation against float64
    scale = want.abs().max().item()
    assert (got.double() - want).abs().max().item() <= 1e-5 * scale
    exact = plain.compute_logits(h).double()  # the unquantised head
    rel = ((got.double() - exact).norm() / exact.norm()).item()
    assert 0 < rel < 0.1  # e4m3's 3 mantissa bits on weights and activations: a few percent


def test_fp8_head_counts_as_fp8_bytes_and_needs_fp8_linears():
    from types import SimpleNamespace

    from attnserve.engine.model_facts import roofline_facts
    from attnserve.server_args import ServerArgs

    def facts(model):
        mc = SimpleNamespace(**{k: getattr(loaded.model_config, k) for k in ("num_hidden_layers", "num_attention_heads",
                                                                                 "head_dim", "is_mla")})
        mc.kv_cache_bytes_per_token = lambda dtype, heads: 0
        return roofline_facts(SimpleNamespace(model=model, model_config=mc, kv_cache_dtype=torch.float32))

    loaded = load_model("qwen3-tiny", load_format="dummy", load_tokenizer=False, progress=False, quantization="fp8")
    head = load_model("qwen3-tiny", load_format="dummy", load_tokenizer=False, progress=False, quantization="fp8",
                      fp8_lm_head=True).model
    rows, hidden = loaded.model.lm_head_weight.shape
    a, b = facts(loaded.model), facts(head)
    assert b["params"] == a["params"] and b["fp8_params"] == a["fp8_params"] + rows * hidden
    assert a["weight_bytes"] - b["weight_bytes"] == rows * hidden * (4 - 1) - rows * 4  # float32 -> e4m3 + scales
    with pytest.raises(ValueError, match="--enable-fp8-lm-head quantises the LM head with the other linears"):
        load_model("qwen3-tiny", load_format="dummy", load_tokenizer=False, progress=False, fp8_lm_head=True)
    assert ServerArgs(enable_fp8_lm_head=True).enable_fp8_lm_head


def test_engine_generates_with_an_fp8_head():
    from attnserve.engine.llm import LLM
    from attnserve.engine.sampling_params import SamplingParams

    with LLM("qwen3-tiny", load_format="dummy", device="cpu", quantization="fp8", enable_fp8_lm_head=True,
             max_total_tokens=512) as llm:
        assert llm.engine.model_runner.model.lm_head_fp8 is not None
        out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True))[0]
        assert len(out.token_ids) == 6 and all(0 <= t < 301 for t in out.token_ids)
