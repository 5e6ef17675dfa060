"""FP8 linears (issue 37) on sm 89+: each path against the float64 product of its
dequantised operands, the activation quantiser against the PyTorch reference, checkpoint
formats through the engine with CUDA graphs, and FP8 weights with the FP8 KV cache."""

from __future__ import annotations

import pytest
import torch

from attnserve.models.layers.linear import Linear
from attnserve.models.layers.parallel import load_param
from attnserve.models.layers.quantization import QuantizationConfig, quantized_construction
from attnserve.models.layers.quantization.apply import quantize_model_linears
from attnserve.models.layers.quantization.fp8_kernels import quantize_activation
from attnserve.models.layers.quantization.fp8_utils import dequantize, quantize_per_group, quantize_per_row

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available() or
                                                   torch.cuda.get_device_capability() < (8, 9), reason="FP8 GPU")]
CFGS = {"channel": QuantizationConfig("channel"), "tensor": QuantizationConfig("tensor"),
        "block": QuantizationConfig("block", (128, 128))}


def _layer(k, n, cfg):
    with torch.device("cuda"), quantized_construction(cfg):
        layer = Linear(k, n, dtype=torch.bfloat16)
    quantize_model_linears(layer, cfg, "cuda", torch.bfloat16)
    return layer


@pytest.mark.parametrize("strategy", list(CFGS))
@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (16, 512, 1024), (64, 384, 200), (300, 1024, 4096)])
def test_paths_match_float64(strategy, m, n, k):
    g = torch.Generator(device="cuda").manual_seed(m + k)
    layer = _layer(k, n, CFGS[strategy])
    load_param(layer.weight, torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.05, "w")
    x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
    y = layer(x).double()
    w = layer.quant_method.dequantized_weight(layer).double()
    if strategy != "block" and m <= 16:  # decode: W8A16 skinny kernel, x unquantised
        ref = x.double() @ w.t()
    elif strategy == "block":
        q, s = quantize_per_group(x)
        ref = dequantize(q, s, block=(1, 128)).double() @ w.t()
    else:
        q, s = quantize_per_row(x)
        ref = dequantize(q, s).double() @ w.t()
    # bf16 output rounding (2**-9 relative) and float32 accumulation
    assert (y - ref).abs().max() <= 8e-3 * ref.abs().max()


@pytest.mark.parametrize("group", [None, 128])
def test_activation_quant_kernel_matches_reference(group):
    x = torch.randn(37, 1000, device="cuda", dtype=torch.bfloat16) * 3
    q, s = quantize_activation(x, group)
    qr, sr = quantize_per_row(x) if group is None else quantize_per_group(x, group)
    sr = sr.unsqueeze(1) if group is None else sr
    torch.testing.assert_close(s, sr, rtol=1e-6, atol=0)
    mismatch = (q.float() != qr.float()).float().mean().item()
    assert mismatch < 1e-3  # division rounding may flip a rare tie


def test_gated_skinny_fp8_matches_unfused():
    cfg = CFGS["channel"]
    layer = _layer(4096, 2 * 1024, cfg)
    load_param(layer.weight, torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16) * 0.05, "w")
    x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)
    fused = layer.forward_gated(x, "silu").float()
    full = x.float() @ layer.quant_method.dequantized_weight(layer).t()
    ref = torch.nn.functional.silu(full[:, :1024]) * full[:, 1024:]
    assert (fused - ref).abs().max() <= 1e-2 * ref.abs().max()


def _save_tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(500)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t1", eos_token="t2", unk_token="t0").save_pretrained(path)


@pytest.mark.parametrize("fmt", ["fp8-block", "fp8-tensor", "compressed-tensors"])
def test_checkpoint_formats_in_the_engine_with_graphs(fmt, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from attnserve.engine.llm import LLM
    from attnserve.engine.sampling_params import SamplingParams
    from attnserve.models.layers.quantization.export import export_fp8_checkpoint, fp8_format_config

    src = tmp_path / "src"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2,
                                 num_key_value_heads=2, head_dim=128, vocab_size=500,
                                 max_position_embeddings=512)).save_pretrained(src)
    export_fp8_checkpoint(str(src), str(tmp_path / fmt), fmt)
    for d in (src, tmp_path / fmt):  # the engine loads a tokenizer: a word-level one of the vocabulary
        _save_tokenizer(str(d))
    prompts = [[1, 5, 9, 200, 3, 77], [4, 8, 15, 16, 23, 42, 99]]
    sp = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    outs = []
    for path, q in ((str(tmp_path / fmt), None), (str(src), fp8_format_config(fmt))):
        llm = LLM(path, device="cuda", dtype="bfloat16", kv_cache_dtype="fp8_e4m3", quantization=q)
        assert llm.engine.model_runner.cuda_graph_runner is not None
        outs.append([o.token_ids for o in llm.generate(prompts, sp)])
        llm.shutdown()
    assert outs[0] == outs[1]


def test_dummy_llama_fp8_decode_graph_matches_eager():
    from attnserve.engine.llm import LLM
    from attnserve.engine.sampling_params import SamplingParams

    sp = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    res = []
    for graphs_off in (False, True):
        llm = LLM("llama-tiny", load_format="dummy", device="cuda", quantization="fp8", disable_cuda_graph=graphs_off)
        res.append([o.token_ids for o in llm.generate(prompts, sp)])
        llm.shutdown()
    assert res[0] == res[1]


# ---- W8A16 tiles of the tables, W8A16 past 16 rows, producers with the quantisation fused ----

@pytest.mark.parametrize("table", ["1", "0"])
@pytest.mark.parametrize("m", [1, 16, 17, 64, 128])
@pytest.mark.parametrize("n,k,act", [(6144, 4096, None), (4096, 14336, None), (2 * 2048, 4096, "silu")])
def test_skinny_fp8_tiles_match_float64(table, m, n, k, act, monkeypatch):
    """`skinny_linear_fp8` on its default tiles (``ATTNSERVE_FP8_SKINNY_TABLE`` 1: the
    FP8 tables; 0: the 16-bit tiles, M <= 16 only) against x times the dequantised weight."""
    from attnserve.models.layers.skinny_gemm import skinny_linear_fp8

    if table == "0" and m > 16:
        pytest.skip("M > 16 always takes FP8_SKINNY_WIDE")
    monkeypatch.setenv("ATTNSERVE_FP8_SKINNY_TABLE", table)
    monkeypatch.setenv("ATTNSERVE_FP8_GEMV", "skinny")  # one row: the skinny kernel, not fp8_gemv
    g = torch.Generator(device="cuda").manual_seed(m + n)
    wq, ws = quantize_per_row(torch.randn(n, k, device="cuda", generator=g) * 0.05)
    x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
    y = skinny_linear_fp8(x, wq, ws, None, act).double()
    full = x.double() @ dequantize(wq, ws).double().t()
    ref = full if act is None else torch.nn.functional.silu(full[:, :n // 2]) * full[:, n // 2:]
    assert (y - ref).abs().max() <= 8e-3 * ref.abs().max()


def test_w8a16_max_m_routes_larger_batches(monkeypatch):
    """``ATTNSERVE_FP8_W8A16_MAX_M=64``: a 64-row batch runs `skinny_linear_fp8` (the same
    bits as calling it), unset it runs the W8A8 path (different bits)."""
    from attnserve.models.layers.skinny_gemm import skinny_linear_fp8

    layer = _layer(4096, 4096, CFGS["channel"])
    load_param(layer.weight, torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) * 0.05, "w")
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    direct = skinny_linear_fp8(x, layer.weight, layer.weight_scale)
    monkeypatch.setenv("ATTNSERVE_FP8_W8A16_MAX_M", "64")
    assert torch.equal(layer(x), direct)
    monkeypatch.delenv("ATTNSERVE_FP8_W8A16_MAX_M")
    assert not torch.equal(layer(x), direct)
    monkeypatch.setenv("ATTNSERVE_FP8_W8A16_MAX_M", "129")
    with pytest.raises(ValueError, match="ATTNSERVE_FP8_W8A16_MAX_M"):
        layer(x)


@pytest.mark.parametrize("one_pass_max", [16384, 0])  # I = 14,336: the one-pass kernel, then two passes
@pytest.mark.parametrize("m", [1, 37, 300])
def test_fused_producer_quant_matches_unfused(m, one_pass_max, monkeypatch):
    from attnserve.models.layers.fused_kernels import fused_add_rmsnorm, silu_and_mul
    from attnserve.models.layers.quantization import fp8_kernels

    monkeypatch.setattr(fp8_kernels, "SILU_QUANT_ONE_PASS_MAX", one_pass_max)
    from attnserve.models.layers.quantization.fp8_kernels import (
        fused_add_rmsnorm_quant_fp8,
        silu_and_mul_quant_fp8,
    )

    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, 4096, device="cuda", generator=g, dtype=torch.bfloat16)
    r = torch.randn(m, 4096, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.rand(4096, device="cuda", generator=g, dtype=torch.bfloat16)
    r_plain = r.clone()
    q, s = fused_add_rmsnorm_quant_fp8(x, r, w, 1e-5)
    q_ref, s_ref = quantize_activation(fused_add_rmsnorm(x, r_plain, w, 1e-5))
    assert torch.equal(r, r_plain)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    assert (q.float() != q_ref.float()).float().mean() < 1e-3
    gu = torch.randn(m, 2 * 14336, device="cuda", generator=g, dtype=torch.bfloat16) * 3
    q, s = silu_and_mul_quant_fp8(gu)
    q_ref, s_ref = quantize_activation(silu_and_mul(gu))
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    assert (q.float() != q_ref.float()).float().mean() < 1e-3


def fp8_llama_graph_and_eager_tokens() -> list:
    """Greedy tokens of 24 requests x 8 of a tiny FP8 Llama (dummy weights) decoding with CUDA
    graphs, then eagerly: ``[graph tokens, eager tokens]``."""
    from attnserve.engine.llm import LLM
    from attnserve.engine.sampling_params import SamplingParams

    sp = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[1 + i, 2, 3 + i, 4] for i in range(24)]
    res = []
    for graphs_off in (False, True):
        llm = LLM("llama-tiny", load_format="dummy", device="cuda", quantization="fp8", disable_cuda_graph=graphs_off)
        res.append([o.token_ids for o in llm.generate(prompts, sp)])
        llm.shutdown()
    return res


def test_dummy_llama_fp8_w8a16_wide_graph_matches_eager(monkeypatch):
    """24 requests decode on the W8A16 kernel (``ATTNSERVE_FP8_W8A16_MAX_M=64``, 32-row
    tiles) under CUDA graphs and eagerly: the same tokens."""
    monkeypatch.setenv("ATTNSERVE_FP8_W8A16_MAX_M", "64")
    res = fp8_llama_graph_and_eager_tokens()
    assert res[0] == res[1]


def test_fused_producers_match_unfused_mlp(monkeypatch):
    """A Llama layer's post-attention norm and MLP with the producers marked
    (`fused_inputs`): 64 rows go through `Fp8Activation` (norm and gate_up emit it) and
    give the unfused output; 8 rows (W8A16 decode) are left 16-bit."""
    from attnserve.model_loader.loader import load_model
    from attnserve.models.layers.quantization.fused_inputs import Fp8Activation, enable_fused_producers

    monkeypatch.setenv("ATTNSERVE_FP8_FUSED_PRODUCERS", "0")  # loaded unmarked; marked below
    # gate_up on the row-wise GEMM in both runs, so the two differ only by the producers' fusion
    # (the folded-scale route rounds its SiLU input elsewhere: its own test below)
    monkeypatch.setenv("ATTNSERVE_FP8_FOLDED_GATE_SCALES", "0")
    monkeypatch.setenv("ATTNSERVE_FP8_FOLDED_DOWN_SCALES", "0")  # likewise down_proj (its own test below)
    loaded = load_model("llama-tiny", load_format="dummy", load_tokenizer=False, progress=False,
                        quantization="fp8", dtype=torch.bfloat16, device="cuda")
    layer = loaded.model.model.layers[0]
    h = layer.post_attention_layernorm.hidden_size
    g = torch.Generator(device="cuda").manual_seed(0)
    inputs = {m: [torch.randn(m, h, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2)]
              for m in (64, 8)}
    outs = []
    for marked in (False, True):
        if marked:
            assert enable_fused_producers(loaded.model) > 0
        for m, (x, r) in inputs.items():
            normed, _ = layer.post_attention_layernorm.forward(x, r.clone())
            assert isinstance(normed, Fp8Activation) == (marked and m == 64)
            outs.append(layer.mlp.forward(normed).float())
    for plain, fused in zip(outs[:2], outs[2:]):
        assert (plain - fused).abs().max() <= 2e-2 * plain.abs().max()  # bf16 ulps and rare quantiser ties


@pytest.mark.parametrize("m", [24, 144, 300, 512, 513, 2048])
def test_folded_gate_up_scales_match_rowwise_and_float64(m, monkeypatch):
    """A marked ``gate_up`` (its SiLU-and-mul quantised for ``down_proj``) on the tensor-wise
    GEMM with the scales folded into the SiLU-and-mul kernel (up to ``FOLDED_GATE_MAX_M``
    rows; larger batches stay row-wise) gives the row-wise GEMM's
    `Fp8Activation` (``ATTNSERVE_FP8_FOLDED_GATE_SCALES=0``) and, dequantised, the float64
    SwiGLU of the dequantised operands within e4m3's rounding of the output (2**-4 relative
    to the row's largest value, the step of a quantised e4m3 value near the top)."""
    from attnserve.model_loader.loader import load_model
    from attnserve.models.layers.quantization import fp8_kernels
    from attnserve.models.layers.quantization.fused_inputs import Fp8Activation

    loaded = load_model("llama-tiny", load_format="dummy", load_tokenizer=False, progress=False,
                        quantization="fp8", dtype=torch.bfloat16, device="cuda")
    gate_up = loaded.model.model.layers[0].mlp.gate_up_proj
    assert gate_up.fp8_output
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, gate_up.in_features, device="cuda", generator=g, dtype=torch.bfloat16)
    xq, xs = quantize_activation(x)
    calls = []
    real = fp8_kernels.silu_and_mul_quant_fp8
    monkeypatch.setattr(fp8_kernels, "silu_and_mul_quant_fp8",
                        lambda *a, **kw: calls.append(kw.get("row_scale") is not None) or real(*a, **kw))
    outs = {}
    for folded in ("1", "0"):
        monkeypatch.setenv("ATTNSERVE_FP8_FOLDED_GATE_SCALES", folded)
        out = gate_up.forward_gated(Fp8Activation(xq, xs, x.dtype), "silu")
        assert isinstance(out, Fp8Activation) and out.q.shape == (m, gate_up.out_features // 2)
        outs[folded] = dequantize(out.q, out.scale).double()
    from attnserve.models.layers.quantization.fp8_linear import FOLDED_GATE_MAX_M

    # the folded route (decode batches up to FOLDED_GATE_MAX_M rows), then the row-wise GEMM's
    assert calls == [m <= FOLDED_GATE_MAX_M, False]
    full = dequantize(xq, xs).double() @ dequantize(gate_up.weight, gate_up.weight_scale).double().t()
    half = full.shape[1] // 2
    ref = torch.nn.functional.silu(full[:, :half]) * full[:, half:]
    bound = 2 ** -4 * ref.abs().amax(dim=1, keepdim=True)
    for folded, y in outs.items():
        assert ((y - ref).abs() <= bound).all(), folded
    assert ((outs["1"] - outs["0"]).abs() <= 2 * bound).all()  # each within half a step of ref


@pytest.mark.parametrize("proj,m", [("down", m) for m in (24, 65, 144, 256, 257, 512, 2048)]
                         + [("o", m) for m in (72, 144, 200, 201, 512)])
def test_folded_scales_match_rowwise_and_float64(proj, m, monkeypatch):
    """A marked ``down_proj`` (input: the SiLU-and-mul's `Fp8Activation`) or ``o_proj``
    (input: 16-bit, quantised per token by the linear) on the tensor-wise GEMM with unit
    scales and `scale_rows_cols` after it (up to ``FOLDED_DOWN_MAX_M`` / ``FOLDED_O_MAX_M``
    rows; larger batches stay row-wise): against the float64 product of the dequantised
    operands within one bf16 rounding (2**-8 relative) plus fast accumulation's term (13-bit
    partial sums over K / 32 tensor-core steps, as `test_fast_accumulation_within_its_bound`),
    for both routes; and the two routes within twice that of each other."""
    from attnserve.model_loader.loader import load_model
    from attnserve.models.layers.quantization import fp8_kernels
    from attnserve.models.layers.quantization.fp8_linear import FOLDED_DOWN_MAX_M, FOLDED_O_MAX_M
    from attnserve.models.layers.quantization.fused_inputs import Fp8Activation, ScaledProduct

    loaded = load_model("llama-tiny", load_format="dummy", load_tokenizer=False, progress=False,
                        quantization="fp8", dtype=torch.bfloat16, device="cuda")
    layer = loaded.model.model.layers[0]
    linear = layer.mlp.down_proj if proj == "down" else layer.self_attn.o_proj
    max_m = FOLDED_DOWN_MAX_M if proj == "down" else FOLDED_O_MAX_M
    assert linear.fp8_folded_max_m == max_m
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, linear.in_features, device="cuda", generator=g, dtype=torch.bfloat16)
    xq, xs = quantize_activation(x)
    calls = []
    real = fp8_kernels.scale_rows_cols
    monkeypatch.setattr(fp8_kernels, "scale_rows_cols", lambda *a, **kw: calls.append(m) or real(*a, **kw))
    outs = {}
    for folded in ("1", "0"):
        monkeypatch.setenv("ATTNSERVE_FP8_FOLDED_DOWN_SCALES", folded)
        y = linear(Fp8Activation(xq, xs, x.dtype) if proj == "down" else x)
        # marked for lazy scales (`fused_inputs`): the folded route leaves them to its reader
        assert isinstance(y, ScaledProduct) == (folded == "1" and m <= max_m)
        y = y.materialize() if isinstance(y, ScaledProduct) else y
        assert y.dtype == torch.bfloat16 and y.shape == (m, linear.out_features)
        outs[folded] = y.double()
    assert len(calls) == (1 if m <= max_m else 0)  # the folded route at decode batches only
    xd, wd = dequantize(xq, xs).double(), dequantize(linear.weight, linear.weight_scale).double()
    ref = xd @ wd.t()
    k = linear.in_features
    bound = 2 ** -8 * ref.abs() + (k / 32) * 2 ** -13 * (xd.abs() @ wd.abs().t()) + 1e-6 * ref.abs().max()
    for folded, y in outs.items():
        assert ((y - ref).abs() <= bound).all(), folded
    assert ((outs["1"] - outs["0"]).abs() <= 2 * bound).all()


@pytest.mark.parametrize("m", [144, 300])
def test_fast_accumulation_within_its_bound(m, monkeypatch):
    """``ATTNSERVE_FP8_FAST_ACCUM=1`` (the default): the W8A8 path with Hopper's fast accumulation
    against the float64 product of the dequantised operands. Bound per element: the bf16
    output's rounding (2**-8 relative) plus, for partial sums that keep ~13 mantissa bits over
    K / 32 tensor-core steps (DeepSeek-V3, arXiv:2412.19437, section 3.3.2: "around 14 bits"),
    (K / 32) * 2**-13 times the sum of the products' magnitudes. And over the whole output the
    RMS error stays under a quarter of the FP8 quantisation's own (3.75% of the RMS output for
    these operands; fast accumulation measured 0.13% at K = 4,096, one H100, 2026-11-28)."""
    monkeypatch.setenv("ATTNSERVE_FP8_FAST_ACCUM", "1")
    n, k = 1024, 4096
    g = torch.Generator(device="cuda").manual_seed(m)
    layer = _layer(k, n, CFGS["channel"])
    load_param(layer.weight, torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.05, "w")
    x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
    y = layer(x).double()
    q, s = quantize_per_row(x)
    xd, wd = dequantize(q, s).double(), layer.quant_method.dequantized_weight(layer).double()
    ref = xd @ wd.t()
    bound = 2 ** -8 * ref.abs() + (k / 32) * 2 ** -13 * (xd.abs() @ wd.abs().t()) + 1e-6 * ref.abs().max()
    assert ((y - ref).abs() <= bound).all()
    assert (y - ref).pow(2).mean().sqrt() <= 0.25 * 0.0375 * ref.pow(2).mean().sqrt()


# ---- opt-in W8A16 one-row variants (`fp8_gemv`, ATTNSERVE_FP8_GEMV) ----

LLAMA_M1 = [(6144, 4096, None), (4096, 4096, None), (2 * 14336, 4096, "silu"), (4096, 14336, None),
            (4096, 4200, None), (2 * 1024, 4200, "silu"), (1000, 1000, None)]  # K = 4200, 1000: partial K steps


def _gemv_case(n, k, act, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    wq, ws = quantize_per_row(torch.randn(n, k, device="cuda", generator=g) * 0.05)
    x = torch.randn(1, k, device="cuda", generator=g, dtype=torch.bfloat16)
    full = x.double() @ dequantize(wq, ws).double().t()
    ref = full if act is None else torch.nn.functional.silu(full[:, :n // 2]) * full[:, n // 2:]
    return x, wq, ws, ref


def _assert_gemv_close(y, ref, bound, what):
    err = (y.double() - ref).abs()
    worst = float((err / bound).max())
    # elementwise: bf16 output rounding + the variant's arithmetic (`fp8_gemv_error_bound`,
    # the f16x2 bound derived in `fp8_gemv_triton`); and overall within the default's 8e-3
    assert worst <= 1.0, f"{what}: error / bound = {worst:.3f}"
    assert err.max() <= 8e-3 * ref.abs().max(), f"{what}: max error {float(err.max()):.3g}"


@pytest.mark.parametrize("variant", ["f32", "f16x2", "dot16"])
@pytest.mark.parametrize("n,k,act", LLAMA_M1)
def test_fp8_gemv_variants_match_float64(variant, n, k, act):
    """Each variant on its default tile: the four Llama-3-8B decode projections (gate_up
    gated with SiLU), K = 4200 (not a multiple of any tile, nor of 16: unvectorised
    loads) plain and gated, and a small square matrix."""
    from attnserve.models.layers.fp8_gemv import fp8_gemv, fp8_gemv_error_bound

    x, wq, ws, ref = _gemv_case(n, k, act, n + k)
    y = fp8_gemv(x, wq, ws, None, act, variant=variant)
    assert y.shape == ref.shape and y.dtype == torch.bfloat16
    _assert_gemv_close(y, ref, fp8_gemv_error_bound(x, wq, ws, variant, act), f"{variant} {n}x{k}")


@pytest.mark.parametrize("variant", ["f32", "f16x2", "dot16"])
@pytest.mark.parametrize("n,k,act", [(6144, 4096, None), (2 * 14336, 4096, "silu"), (4096, 14336, None)])
def test_fp8_gemv_bench_candidates_match_float64(variant, n, k, act):
    """Every tile `benchmarks/fp8_bench.py --sweep` times (`fp8_gemv_candidates`)."""
    from attnserve.models.layers.fp8_gemv import fp8_gemv, fp8_gemv_candidates, fp8_gemv_error_bound

    x, wq, ws, ref = _gemv_case(n, k, act, 7 * n + k)
    bound = fp8_gemv_error_bound(x, wq, ws, variant, act)
    for cfg in fp8_gemv_candidates(variant, n // 2 if act else n, k, gated=act is not None):
        _assert_gemv_close(fp8_gemv(x, wq, ws, None, act, variant=variant, config=cfg), ref, bound, cfg.label())


@pytest.mark.parametrize("variant", ["f32", "f16x2", "dot16"])
def test_fp8_gemv_bias_large_x_and_cuda_graph(variant):
    """With a bias and an x of large entries (f16 range of f16x2), eagerly and replayed
    from a CUDA graph (new x copied in): the same bits; and the routing of
    ``ATTNSERVE_FP8_GEMV`` through `Linear` gives them too."""
    from attnserve.models.layers.fp8_gemv import fp8_gemv, fp8_gemv_error_bound

    n, k = 4096, 4096
    x, wq, ws, ref = _gemv_case(n, k, None, 5)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    x_big = (x.float() * 3000).to(torch.bfloat16)
    y = fp8_gemv(x_big, wq, ws, b, variant=variant)
    ref_big = x_big.double() @ dequantize(wq, ws).double().t() + b.double()
    bound = fp8_gemv_error_bound(x_big, wq, ws, variant) + 2.0 ** -8 * b.double().abs()
    _assert_gemv_close(y, ref_big, bound, f"{variant} bias, |x| ~ 3000")
    static_x = x.clone()
    fp8_gemv(static_x, wq, ws, b, variant=variant)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_gemv(static_x, wq, ws, b, variant=variant)
    static_x.copy_(x_big)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, y)


def test_fp8_gemv_env_routes_linear(monkeypatch):
    """``ATTNSERVE_FP8_GEMV=f16x2``: a one-row `Linear` forward (channel FP8) gives the bits
    of `fp8_gemv`; two rows keep the default kernel (the bits of an explicit config)."""
    from attnserve.models.layers.fp8_gemv import fp8_gemv
    from attnserve.models.layers.skinny_gemm import fp8_skinny_config, skinny_linear_fp8

    layer = _layer(4096, 6144, CFGS["channel"])
    load_param(layer.weight, torch.randn(6144, 4096, device="cuda", dtype=torch.bfloat16) * 0.05, "w")
    x = torch.randn(2, 4096, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setenv("ATTNSERVE_FP8_GEMV", "f16x2")
    direct = fp8_gemv(x[:1], layer.weight, layer.weight_scale, variant="f16x2")
    assert torch.equal(layer(x[:1]), direct)
    two = skinny_linear_fp8(x, layer.weight, layer.weight_scale, config=fp8_skinny_config(2, 6144, 4096))
    assert torch.equal(layer(x), two)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="row-wise torch._scaled_mm needs sm 90")
@pytest.mark.parametrize("m", [64, 65, 100, 144, 255])
def test_scaled_mm_rowwise_padded_rows_match_float64(m, monkeypatch):
    """`scaled_mm_rowwise` pads 64 < M < 256 rows to a multiple of 128 (large weights; the
    size floor is lowered here): each row equals the
    float64 product of its dequantised operands (one bf16 rounding), padded or not, and the
    result is a contiguous [M, N] tensor."""
    from attnserve.models.layers.quantization.fp8_linear import (SCALED_MM_PAD_ENV, scaled_mm_padded_rows,
                                                                 scaled_mm_rowwise)

    from attnserve.models.layers.quantization import fp8_linear

    monkeypatch.setenv("ATTNSERVE_FP8_FAST_ACCUM", "0")  # the bound below is exact float32 accumulation's
    monkeypatch.setattr(fp8_linear, "PAD_MIN_WEIGHT_ELEMENTS", 0)  # pad this small weight too
    g = torch.Generator(device="cuda").manual_seed(m)
    n, k = 1024, 2048
    x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
    q, sa = quantize_activation(x)
    wq, ws = quantize_per_row(torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.05)
    ref = (q.double() * sa.double()) @ (wq.double() * ws.double().view(-1, 1)).t()
    for pad in ("1", "0"):
        monkeypatch.setenv(SCALED_MM_PAD_ENV, pad)
        y = scaled_mm_rowwise(q, sa, wq, ws, torch.bfloat16)
        assert y.shape == (m, n) and y.is_contiguous() and y.dtype == torch.bfloat16
        # bf16 output: one rounding, |err| <= 2^-8 of the value, plus float32 accumulation slack
        torch.testing.assert_close(y.double(), ref, rtol=2 ** -8, atol=1e-3 * ref.abs().max().item())
    monkeypatch.delenv(SCALED_MM_PAD_ENV)
    assert (scaled_mm_padded_rows(m) != m) == (64 < m < 256 and m % 128 != 0)
