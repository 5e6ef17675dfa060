"""FP8 weights on the Llama-form families beyond Llama (Qwen3, Qwen2, Mistral): the fused
activation quantisers and the folded routes that `fused_inputs.enable_fused_producers`
gives them, against the unfused path, and the engine with CUDA graphs against eager."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available() or
                                                   torch.cuda.get_device_capability() < (8, 9), reason="FP8 GPU")]
FAMILIES = ["qwen3-tiny", "qwen2-tiny", "mistral-tiny"]


def _load(name, monkeypatch, marked):
    from attnserve.model_loader.loader import load_model

    monkeypatch.setenv("ATTNSERVE_FP8_FUSED_PRODUCERS", "1" if marked else "0")
    loaded = load_model(name, load_format="dummy", load_tokenizer=False, progress=False, quantization="fp8",
                        dtype=torch.bfloat16, device="cuda", seed=0)
    monkeypatch.delenv("ATTNSERVE_FP8_FUSED_PRODUCERS")
    return loaded.model.model.layers[0]


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("m", [64, 144, 300])
def test_marked_family_layer_matches_unfused(name, m, monkeypatch):
    """Layer 0 of a family loaded with the producers marked and unmarked (same dummy
    weights): ``input_layernorm`` -> ``qkv_proj`` and ``post_attention_layernorm`` -> MLP
    on ``m`` rows. The marked norms emit an `Fp8Activation` (past the W8A16 rows); the folded
    ``down_proj`` runs at decode batches (``FOLDED_DOWN_MAX_M``) and only when marked.

    Bound, element-wise: the two paths quantise the same 16-bit input ``a`` of a projection
    (the normed rows; for ``down_proj`` the SiLU-and-mul, computed in different roundings)
    to e4m3, each within half a step (2**-4 of an element's magnitude), so their products
    with the dequantised weight ``W`` differ by at most 2**-3 ``|a| @ |W|^T`` (2**-6 more for
    the SiLU-and-mul's inputs, whose bf16 roundings differ between the routes); plus each
    output's bf16 rounding (2**-8 relative, twice) and e4m3's subnormal step (2**-9 of a
    row's scale, amax / 448, per element, twice)."""
    from attnserve.models.layers.quantization import fp8_kernels
    from attnserve.models.layers.quantization.fp8_linear import FOLDED_DOWN_MAX_M
    from attnserve.models.layers.quantization.fp8_utils import dequantize
    from attnserve.models.layers.quantization.fused_inputs import Fp8Activation, ScaledProduct

    layers = {marked: _load(name, monkeypatch, marked) for marked in (False, True)}
    assert torch.equal(layers[False].mlp.down_proj.weight, layers[True].mlp.down_proj.weight)
    h = layers[True].input_layernorm.hidden_size
    g = torch.Generator(device="cuda").manual_seed(m)
    x, r = (torch.randn(m, h, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    calls = []
    real = fp8_kernels.scale_rows_cols
    monkeypatch.setattr(fp8_kernels, "scale_rows_cols", lambda *a, **kw: calls.append(m) or real(*a, **kw))
    outs, inputs = {}, ()
    for marked, layer in layers.items():
        attn_in, _ = layer.input_layernorm.forward(x, r.clone())
        mlp_in, _ = layer.post_attention_layernorm.forward(x, r.clone())
        assert isinstance(attn_in, Fp8Activation) == marked and isinstance(mlp_in, Fp8Activation) == marked
        mlp_out = layer.mlp.forward(mlp_in)
        if isinstance(mlp_out, ScaledProduct):  # lazy scales: applied by the reading norm (`fused_inputs`)
            mlp_out = mlp_out.materialize()
        outs[marked] = (layer.self_attn.qkv_proj.forward(attn_in).float(), mlp_out.float())
        if not marked:
            act = layer.mlp.gate_up_proj.forward_gated(mlp_in, "silu")
            inputs = (attn_in.float(), act.float())
    assert len(calls) == (1 if m <= FOLDED_DOWN_MAX_M else 0)  # only the marked layer folds
    plain_layer = layers[False]
    for a, proj, plain, fused in zip(inputs, (plain_layer.self_attn.qkv_proj, plain_layer.mlp.down_proj),
                                     outs[False], outs[True]):
        w = dequantize(proj.weight, proj.weight_scale).float()
        subnormal = 2 ** -9 * (a.abs().amax(dim=1, keepdim=True) / 448) * w.abs().sum(dim=1)
        bound = (2 ** -3 + 2 ** -6) * (a.abs() @ w.abs().t()) + 2 ** -7 * plain.abs() + subnormal
        assert torch.isfinite(fused).all()
        assert ((plain - fused).abs() <= bound).all(), (name, float((plain - fused).abs().max()))


@pytest.mark.parametrize("name", FAMILIES)
def test_family_fp8_engine_graph_matches_eager(name, monkeypatch):
    """80 requests x 8 greedy tokens of a tiny FP8 model (dummy weights): decode batches past
    the W8A16 rows, so the fused quantisers and folded routes run, inside CUDA graphs and
    eagerly: the same tokens, and the fused add-RMSNorm quantiser was launched."""
    from attnserve.engine.llm import LLM
    from attnserve.engine.sampling_params import SamplingParams
    from attnserve.models.layers.quantization import fp8_kernels

    launched = []
    real = fp8_kernels.fused_add_rmsnorm_quant_fp8
    monkeypatch.setattr(fp8_kernels, "fused_add_rmsnorm_quant_fp8",
                        lambda *a, **kw: launched.append(a[0].shape[0]) or real(*a, **kw))
    sp = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[1 + i % 200, 2, 3 + i % 150, 4] for i in range(80)]
    res = []
    for graphs_off in (False, True):
        llm = LLM(name, load_format="dummy", device="cuda", quantization="fp8", disable_cuda_graph=graphs_off)
        res.append([o.token_ids for o in llm.generate(prompts, sp)])
        llm.shutdown()
    assert launched and max(launched) >= 80
    assert res[0] == res[1]
