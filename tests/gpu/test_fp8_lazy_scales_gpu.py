"""Lazy scales of the folded FP8 linears on the GPU (`fused_inputs`, "Lazy scales"): a folded
``o_proj`` / ``down_proj`` returns its unscaled product and scales (`ScaledProduct`) and the
add-RMSNorm that reads it applies them in its own kernel. Against the same model loaded with
``ATTNSERVE_FP8_LAZY_SCALES=0`` (`scale_rows_cols`, then the norm): the same bits, with
fewer launches; and the engine's greedy tokens, in CUDA graphs."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available() or
                                                   torch.cuda.get_device_capability() < (8, 9), reason="FP8 GPU")]


def _load(lazy: bool, monkeypatch):
    from attnserve.model_loader.loader import load_model
    from attnserve.models.layers.quantization.fused_inputs import LAZY_SCALES_ENV

    monkeypatch.setenv(LAZY_SCALES_ENV, "1" if lazy else "0")
    loaded = load_model("llama-tiny", load_format="dummy", load_tokenizer=False, progress=False, quantization="fp8",
                        dtype=torch.bfloat16, device="cuda", seed=0)
    monkeypatch.delenv(LAZY_SCALES_ENV)
    return loaded.model.model


def _bits(t):
    from attnserve.models.layers.quantization.fused_inputs import Fp8Activation

    if isinstance(t, Fp8Activation):
        return (t.q.view(torch.uint8), t.scale)
    return (t,)


@pytest.mark.parametrize("m", [8, 24, 64, 144, 200, 201, 256, 300])
def test_layer_chain_bit_identical(m, monkeypatch):
    """``input_layernorm`` -> ``o_proj`` (on a random attention output) ->
    ``post_attention_layernorm`` -> MLP -> the next layer's ``input_layernorm`` and the final
    norm, on ``m`` rows: every norm output (e4m3 values and scales, or 16-bit) and residual
    equal bit for bit with and without lazy scales. The products stay unscaled exactly where
    the folded routes run (``o_proj`` up to ``FOLDED_O_MAX_M`` rows, ``down_proj`` up to
    ``FOLDED_DOWN_MAX_M``, both past the W8A16 rows), and `scale_rows_cols` then runs only
    where a norm does not quantise (the final one)."""
    from attnserve.models.layers.quantization import fp8_kernels
    from attnserve.models.layers.quantization.fp8_linear import FOLDED_DOWN_MAX_M, FOLDED_O_MAX_M, w8a16_max_m
    from attnserve.models.layers.quantization.fused_inputs import ScaledProduct

    models = {lazy: _load(lazy, monkeypatch) for lazy in (True, False)}
    assert torch.equal(models[True].layers[0].mlp.down_proj.weight, models[False].layers[0].mlp.down_proj.weight)
    l0 = models[True].layers[0]
    h, q_in = l0.input_layernorm.hidden_size, l0.self_attn.o_proj.in_features
    g = torch.Generator(device="cuda").manual_seed(m)
    x, r = (torch.randn(m, h, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    attn = torch.randn(m, q_in, device="cuda", generator=g, dtype=torch.bfloat16)
    calls = []
    real = fp8_kernels.scale_rows_cols
    monkeypatch.setattr(fp8_kernels, "scale_rows_cols", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    outs, kinds, launches = {}, {}, {}
    for lazy, model in models.items():
        calls.clear()
        layer0, layer1 = model.layers[0], model.layers[1]
        a, r1 = layer0.input_layernorm.forward(x, r.clone())
        o = layer0.self_attn.o_proj.forward(attn)
        hn, r2 = layer0.post_attention_layernorm.forward(o, r1)
        y = layer0.mlp.forward(hn)
        kinds[lazy] = (isinstance(o, ScaledProduct), isinstance(y, ScaledProduct))
        h1, r3 = layer1.input_layernorm.forward(y, r2)
        fin, r4 = model.norm.forward(y, r3.clone())
        outs[lazy] = [*_bits(a), r1, *_bits(hn), r2, *_bits(h1), r3, fin, r4]
        launches[lazy] = len(calls)
    past_w8a16 = m > w8a16_max_m()
    o_folded, down_folded = past_w8a16 and m <= FOLDED_O_MAX_M, past_w8a16 and m <= FOLDED_DOWN_MAX_M
    assert kinds == {True: (o_folded, down_folded), False: (False, False)}
    assert launches == {True: int(down_folded), False: int(o_folded) + int(down_folded)}
    for got, want in zip(outs[True], outs[False]):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_engine_tokens_match_without_lazy_scales(monkeypatch):
    """80 requests x 8 greedy tokens of the tiny FP8 Llama in CUDA graphs (decode batches on
    the folded routes): the same tokens with and without lazy scales, and the norms took the
    products' scales in their own kernel."""
    from attnserve.engine.llm import LLM
    from attnserve.engine.sampling_params import SamplingParams
    from attnserve.models.layers.quantization import fp8_kernels
    from attnserve.models.layers.quantization.fused_inputs import LAZY_SCALES_ENV

    scaled = []
    real = fp8_kernels.fused_add_rmsnorm_quant_fp8
    monkeypatch.setattr(fp8_kernels, "fused_add_rmsnorm_quant_fp8",
                        lambda *a, **kw: scaled.append(kw.get("row_scale") is not None) or real(*a, **kw))
    sp = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[1 + i % 200, 2, 3 + i % 150, 4] for i in range(80)]
    res = {}
    for lazy in ("1", "0"):
        monkeypatch.setenv(LAZY_SCALES_ENV, lazy)
        scaled.clear()
        llm = LLM("llama-tiny", load_format="dummy", device="cuda", quantization="fp8")
        res[lazy] = [o.token_ids for o in llm.generate(prompts, sp)]
        llm.shutdown()
        assert any(scaled) == (lazy == "1")
    assert res["1"] == res["0"]
