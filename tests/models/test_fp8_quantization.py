"""FP8 linears (issue 37) on the CPU: each method against the float64 product of its
dequantised operands, tensor-parallel scale sharding, checkpoint formats round-tripped
through disk against the model quantised in memory, and the errors of bad input."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

from attnserve.distributed.group import TPGroup
from attnserve.distributed.partition import HeadRange
from attnserve.forward_batch import ForwardMode
from attnserve.model_loader.loader import load_model
from attnserve.models.layers.linear import Linear
from attnserve.models.layers.parallel import ColumnParallelLinear, RowParallelLinear, load_param
from attnserve.models.layers.quantization import QuantizationConfig, quantized_construction
from attnserve.models.layers.quantization.apply import quantize_model_linears
from attnserve.models.layers.quantization.export import export_fp8_checkpoint, fp8_format_config
from attnserve.models.layers.quantization.fp8_kernels import quantize_activation
from attnserve.models.layers.quantization.fp8_utils import dequantize

STRATEGIES = {"channel": QuantizationConfig("channel"), "tensor": QuantizationConfig("tensor"),
              "block": QuantizationConfig("block", (128, 128))}


def _quantized(module_fn, cfg):
    with quantized_construction(cfg):
        m = module_fn()
    quantize_model_linears(m, cfg, "cpu", torch.float32)
    return m


def _float64_reference(layer, x):
    """The product the method approximates: its own quantised activation and weight,
    dequantised, multiplied in float64."""
    block = layer.quant_method.config.weight_strategy == "block"
    q, s = quantize_activation(x, 128 if block else None)
    xd = dequantize(q, s, block=(1, 128) if block else None).double()
    return xd @ layer.quant_method.dequantized_weight(layer).double().t()


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("m,n,k", [(3, 40, 200), (7, 256, 384), (1, 130, 72)])
def test_method_matches_float64_product(strategy, m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + k)
    layer = _quantized(lambda: Linear(k, n, dtype=torch.float32), STRATEGIES[strategy])
    w = torch.randn(n, k, generator=g) * 0.05
    load_param(layer.weight, w, "w")
    x = torch.randn(m, k, generator=g)
    y = layer(x)
    ref = _float64_reference(layer, x)
    # float32 accumulation of K products, relative to the largest output
    assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    # and the quantised product is close to the unquantised one (e4m3: 3 mantissa bits)
    exact = x.double() @ w.double().t()
    assert (y.double() - exact).abs().max() <= 0.1 * exact.abs().max()


def test_triton_block_gemm_interpreter(monkeypatch):
    """The Triton scaled GEMM (block weight scales, 1 x 128 activation groups, K = 200 not
    a multiple of 128) under the interpreter, against the float64 product."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from attnserve.models.layers.quantization.fp8_kernels import scaled_fp8_gemm
    from attnserve.models.layers.quantization.fp8_utils import quantize_per_block, quantize_per_group

    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(3, 200, generator=g), torch.randn(40, 200, generator=g)
    xq, xs = quantize_per_group(x)  # the PyTorch quantiser (the interpreter rounds FP8 casts differently)
    wq, ws = quantize_per_block(w)
    y = scaled_fp8_gemm(xq, xs, wq, ws, torch.float32)
    ref = dequantize(xq, xs, block=(1, 128)).double() @ dequantize(wq, ws, block=(128, 128)).double().t()
    assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


def _tp_layers(tp):
    head = 128
    q, kv = HeadRange(tp.rank * 2 // tp.size, 2 // tp.size, 2), HeadRange(tp.rank * 2 // tp.size, 2 // tp.size, 2)
    qkv = ColumnParallelLinear(256, [(q, head), (kv, head), (kv, head)], dtype=torch.float32)
    o = RowParallelLinear([(q, head)], 256, tp, dtype=torch.float32)
    return nn.ModuleDict({"qkv_proj": qkv, "o_proj": o})


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_tensor_parallel_scales_are_sharded(strategy):
    """Each rank of tp 2 holds exactly its rows (qkv, scales concatenated per part) or
    columns (o) of the tp-1 quantised layers."""
    cfg = STRATEGIES[strategy]
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(256, 256, generator=g) for _ in range(3)]
    wo = torch.randn(256, 256, generator=g)
    full = _quantized(lambda: _tp_layers(TPGroup.single()), cfg)
    ranks = [_quantized(lambda r=r: _tp_layers(TPGroup(rank=r, size=2)), cfg) for r in range(2)]
    for mod in [full] + ranks:
        for i, t in enumerate(parts):
            load_param(mod["qkv_proj"].weight, t, f"q{i}", part=i)
        load_param(mod["o_proj"].weight, wo, "o")
    deq = {k: full[k].quant_method.dequantized_weight(full[k]) for k in full}
    for r, mod in enumerate(ranks):
        got_qkv = mod["qkv_proj"].quant_method.dequantized_weight(mod["qkv_proj"])
        want_qkv = torch.cat([deq["qkv_proj"][p * 256 + r * 128: p * 256 + (r + 1) * 128] for p in range(3)])
        assert torch.equal(got_qkv, want_qkv)
        got_o = mod["o_proj"].quant_method.dequantized_weight(mod["o_proj"])
        assert torch.equal(got_o, deq["o_proj"][:, r * 128:(r + 1) * 128])


def test_block_tp_slice_not_on_a_block_is_refused():
    head = 64  # 2 heads of 64 split over 2 ranks: 64-row slices of 128-row blocks
    with pytest.raises(ValueError, match="not aligned"):
        _quantized(lambda: ColumnParallelLinear(256, [(HeadRange(1, 1, 2), head)], dtype=torch.float32),
                   STRATEGIES["block"])


# ---- checkpoints -----------------------------------------------------------------------------

_TINY = dict(hidden_size=192, intermediate_size=256, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=2, head_dim=64, vocab_size=256)


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory):
    """A one-layer HF Llama directory written directly (``config.json`` + random
    ``model.safetensors`` under HF's names; no transformers model is built). The hidden
    size 192 is not a multiple of the 128 x 128 blocks (edge blocks along K of qkv and
    gate|up, along N of o)."""
    from safetensors.torch import save_file

    path = str(tmp_path_factory.mktemp("fp8src"))
    h, f, d, v = _TINY["hidden_size"], _TINY["intermediate_size"], _TINY["head_dim"], _TINY["vocab_size"]
    shapes = {"model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h), "model.norm.weight": (h,)}
    for i in range(_TINY["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        shapes.update({pre + "input_layernorm.weight": (h,), pre + "post_attention_layernorm.weight": (h,),
                       pre + "self_attn.q_proj.weight": (2 * d, h), pre + "self_attn.k_proj.weight": (2 * d, h),
                       pre + "self_attn.v_proj.weight": (2 * d, h), pre + "self_attn.o_proj.weight": (h, 2 * d),
                       pre + "mlp.gate_proj.weight": (f, h), pre + "mlp.up_proj.weight": (f, h),
                       pre + "mlp.down_proj.weight": (h, f)})
    g = torch.Generator().manual_seed(0)
    tensors = {name: (1.0 + 0.1 * torch.randn(shape, generator=g)) if len(shape) == 1
               else torch.randn(shape, generator=g) * 0.05 for name, shape in shapes.items()}
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(dict(_TINY, architectures=["LlamaForCausalLM"], model_type="llama", max_position_embeddings=256,
                       rms_norm_eps=1e-5, tie_word_embeddings=False, torch_dtype="float32"), fh)
    return path


_IDS = torch.randint(0, _TINY["vocab_size"], (12,), generator=torch.Generator().manual_seed(1)).tolist()


def _logits(loaded):
    """Prefill of 10 tokens, then 2 decode steps (the PyTorch reference of the FP8 methods:
    the interpreter's kernels are checked by the method tests above)."""
    from models.conftest import StepRunner

    runner = StepRunner(loaded.model, loaded.model_config, page_size=4)
    row = runner.new_request()
    return torch.cat([runner.step(ForwardMode.EXTEND, [(row, _IDS[:10])])]
                     + [runner.step(ForwardMode.DECODE, [(row, [t])]) for t in _IDS[10:]])


@pytest.fixture(scope="module")
def plain_logits(tiny_hf_dir):
    return _logits(load_model(tiny_hf_dir, load_tokenizer=False, progress=False))


@pytest.mark.parametrize("fmt", ["fp8-block", "fp8-tensor", "compressed-tensors"])
def test_checkpoint_format_round_trip(fmt, tiny_hf_dir, plain_logits, tmp_path, monkeypatch):
    """Export to ``fmt``, load from disk: every parameter (weights and scales) and the
    logits equal those of the source quantised at load with `fp8_format_config`, and the
    logits differ from the unquantised model's by FP8 error only."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    export_fp8_checkpoint(tiny_hf_dir, str(tmp_path), fmt)
    from_disk = load_model(str(tmp_path), load_tokenizer=False, progress=False)
    in_memory = load_model(tiny_hf_dir, load_tokenizer=False, progress=False, quantization=fp8_format_config(fmt))
    assert from_disk.model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    disk_params, mem_params = dict(from_disk.model.named_parameters()), dict(in_memory.model.named_parameters())
    assert disk_params.keys() == mem_params.keys()
    for name, p in disk_params.items():
        q = mem_params[name]
        assert p.dtype == q.dtype and p.shape == q.shape, name
        assert torch.equal(p.view(torch.uint8) if p.dtype == torch.float8_e4m3fn else p,
                           q.view(torch.uint8) if q.dtype == torch.float8_e4m3fn else q), name
    a, b = _logits(from_disk), _logits(in_memory)
    assert torch.equal(a, b)
    assert (a - plain_logits).abs().max() <= 0.2 * plain_logits.abs().max()
    assert not torch.equal(a, plain_logits)


def _rewrite(src, dst, edit_tensors=None, edit_config=None):
    from safetensors.torch import load_file, save_file

    os.makedirs(dst, exist_ok=True)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    if edit_tensors:
        edit_tensors(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    if edit_config:
        edit_config(cfg)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)


@pytest.mark.parametrize("fmt,scale", [("compressed-tensors", "weight_scale"), ("fp8-block", "weight_scale_inv")])
def test_scale_shape_mismatch_names_the_tensor(fmt, scale, tiny_hf_dir, tmp_path):
    export_fp8_checkpoint(tiny_hf_dir, str(tmp_path / "ok"), fmt)
    name = f"model.layers.0.self_attn.k_proj.{scale}"

    def grow(t):
        t[name] = torch.cat([t[name], t[name][:1]])

    _rewrite(str(tmp_path / "ok"), str(tmp_path / "bad"), edit_tensors=grow)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        load_model(str(tmp_path / "bad"), load_tokenizer=False, progress=False)


def test_unknown_quant_method_and_flag(tiny_hf_dir, tmp_path):
    _rewrite(tiny_hf_dir, str(tmp_path), edit_config=lambda c: c.update(quantization_config={"quant_method": "awq"}))
    with pytest.raises(ValueError, match="'awq'"):
        load_model(str(tmp_path), load_tokenizer=False, progress=False)
    with pytest.raises(ValueError, match="'int4'"):
        load_model("llama-tiny", load_format="dummy", load_tokenizer=False, progress=False, quantization="int4")


def test_fp8_refused_below_sm89(monkeypatch):
    from attnserve.models.layers.quantization import check_quantization_device

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"NVIDIA A100 \(sm 80\)"):
        check_quantization_device(QuantizationConfig(), "cuda:0")


def test_online_dummy_matches_quantised_bf16_weights():
    """--quantization fp8 with dummy weights draws the unquantised model's weights and
    quantises them: the dequantised weight is within e4m3 rounding of the plain one."""
    plain = load_model("llama-tiny", load_format="dummy", load_tokenizer=False, progress=False)
    fp8 = load_model("llama-tiny", load_format="dummy", load_tokenizer=False, progress=False, quantization="fp8")
    for name in ("self_attn.qkv_proj", "mlp.down_proj"):
        a = plain.model.model.layers[1].get_submodule(name).weight
        layer = fp8.model.model.layers[1].get_submodule(name)
        d = layer.quant_method.dequantized_weight(layer)
        row_max = a.abs().amax(dim=1, keepdim=True)
        assert ((d - a).abs() <= row_max * 2.0 ** -4 + 1e-12).all()
    assert fp8.model.lm_head.weight.dtype == torch.float32  # LM head unquantised


# ---- W8A16 tiles of the tables, and producers with the quantisation fused (interpreter) ----

@pytest.mark.parametrize("m,n,k,act", [(1, 8, 1100, None), (40, 64, 200, "silu")])
def test_skinny_fp8_table_tiles_interpreter(m, n, k, act, monkeypatch):
    """`skinny_linear_fp8` on its default tiles: one row with K > 1024 (the `FP8_SKINNY_M1`
    entry of its shape class) and 40 rows (`FP8_SKINNY_WIDE`, a 64-row ``tl.dot``
    tile, gated), against the float64 product of x and the dequantised weight. (One row
    takes `fp8_gemv`'s f16x2 unless ``ATTNSERVE_FP8_GEMV=skinny``.)"""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("ATTNSERVE_FP8_GEMV", "skinny")
    from attnserve.models.layers.quantization.fp8_utils import quantize_per_row
    from attnserve.models.layers.skinny_gemm import FP8_SKINNY_M1, _shape_class, fp8_skinny_config, skinny_linear_fp8

    cfg = fp8_skinny_config(m, n, k, gated=act is not None)
    if m == 1:
        assert (cfg.block_n, cfg.block_k, cfg.num_warps, cfg.carry) == FP8_SKINNY_M1[_shape_class(n, k, False)]
    else:
        assert cfg.use_dot and cfg.block_m(m) == 64
    g = torch.Generator().manual_seed(m)
    wq, ws = quantize_per_row(torch.randn(n, k, generator=g) * 0.05)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    y = skinny_linear_fp8(x, wq, ws, None, act).double()
    full = x.double() @ dequantize(wq, ws).double().t()
    ref = full if act is None else torch.nn.functional.silu(full[:, :n // 2]) * full[:, n // 2:]
    # bf16 output (the interpreter truncates: one ulp, 2**-7 relative) and float32 sums
    assert (y - ref).abs().max() <= 1e-2 * ref.abs().max()


def test_fused_producer_quant_matches_unfused_interpreter(monkeypatch):
    """Fused add-RMSNorm + quantisation and SiLU-and-mul + quantisation give the unfused
    kernels' residual, scales and e4m3 values (float32: no 16-bit rounding to differ in)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from attnserve.models.layers.fused_kernels import fused_add_rmsnorm, silu_and_mul
    from attnserve.models.layers.quantization import fp8_kernels
    from attnserve.models.layers.quantization.fp8_kernels import (
        fused_add_rmsnorm_quant_fp8,
        silu_and_mul_quant_fp8,
    )

    g = torch.Generator().manual_seed(5)
    x, r, w = torch.randn(3, 200, generator=g), torch.randn(3, 200, generator=g), torch.rand(200, generator=g)
    r_fused, r_plain = r.clone(), r.clone()
    q, s = fused_add_rmsnorm_quant_fp8(x, r_fused, w, 1e-5)
    q_ref, s_ref = quantize_activation(fused_add_rmsnorm(x, r_plain, w, 1e-5))
    assert torch.equal(r_fused, r_plain)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    assert (q.float() != q_ref.float()).float().mean() <= 0.01  # a rare tie may round apart
    gu = torch.randn(2, 600, generator=g) * 3
    q_ref, s_ref = quantize_activation(silu_and_mul(gu))
    for one_pass_max in (16384, 128):  # the row in registers (I = 300), then two chunked passes
        monkeypatch.setattr(fp8_kernels, "SILU_QUANT_ONE_PASS_MAX", one_pass_max)
        q, s = silu_and_mul_quant_fp8(gu)
        assert q.shape == (2, 300) and s.shape == (2, 1)
        torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
        assert (q.float() != q_ref.float()).float().mean() <= 0.01
        # an unscaled product with its token and channel scales applied in the kernel
        rs, cs = torch.rand(2, 1, generator=g) + 0.5, torch.rand(600, generator=g) + 0.5
        q_sc, s_sc = silu_and_mul_quant_fp8(gu, row_scale=rs, col_scale=cs)
        q_ref_sc, s_ref_sc = quantize_activation(silu_and_mul(gu * (rs * cs)))
        torch.testing.assert_close(s_sc, s_ref_sc, rtol=1e-6, atol=0)
        assert (q_sc.float() != q_ref_sc.float()).float().mean() <= 0.01
        assert not torch.allclose(s_sc, s)  # the scales were applied
    with pytest.raises(ValueError, match="given together"):
        silu_and_mul_quant_fp8(gu, row_scale=torch.ones(2, 1))
    with pytest.raises(ValueError, match="given together"):
        silu_and_mul_quant_fp8(gu, row_scale=torch.ones(3, 1), col_scale=torch.ones(600))


@pytest.mark.parametrize("interpret", [True, False])
def test_scale_rows_cols(interpret, monkeypatch):
    """`scale_rows_cols` (the epilogue of the folded ``down_proj``): ``x * rs[m] * cs[n]`` in
    float32, rounded once to the output dtype, for float32 and bf16 inputs, ragged sizes
    (N not a multiple of the 1,024-column block), a strided input; the Triton kernel under
    the interpreter and the PyTorch fallback; argument errors."""
    if interpret:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from attnserve.models.layers.quantization.fp8_kernels import scale_rows_cols

    g = torch.Generator().manual_seed(11)
    for m, n, src, out in [(3, 1000, torch.float32, torch.bfloat16), (5, 2100, torch.bfloat16, torch.bfloat16),
                           (1, 16, torch.float32, torch.float16), (0, 64, torch.float32, torch.bfloat16)]:
        x = (torch.randn(m, n + 8, generator=g) * 300)[:, :n].to(src)  # row stride n + 8
        rs, cs = torch.rand(m, 1, generator=g) * 1e-3, torch.rand(n, generator=g) * 1e-2
        y = scale_rows_cols(x, rs, cs, out)
        want = (x.double() * rs.double() * cs.double())
        assert y.dtype == out and y.shape == (m, n) and y.is_contiguous()
        # one rounding to the output dtype: half an ulp (2**-8 relative for bf16, 2**-11 for fp16,
        # whose subnormals below 2**-14 have a fixed step of 2**-24); the interpreter truncates
        # (a whole ulp); plus the float32 products' own rounding (2**-21 relative, generous)
        half_ulp = (2 ** -8 if out == torch.bfloat16 else 2 ** -11) * (2 if interpret else 1)
        floor = 2 ** -24 if out == torch.float16 else 0.0
        assert ((y.double() - want).abs() <= (half_ulp + 2 ** -21) * want.abs() + floor).all(), (m, n, src, out)
    with pytest.raises(ValueError, match="float32 row_scale of 2"):
        scale_rows_cols(torch.ones(2, 4), torch.ones(3, 1), torch.ones(4), torch.bfloat16)
    with pytest.raises(ValueError, match="float32"):
        scale_rows_cols(torch.ones(2, 4), torch.ones(2, 1, dtype=torch.float64), torch.ones(4), torch.bfloat16)
    with pytest.raises(ValueError, match="unit column stride"):
        scale_rows_cols(torch.ones(4, 2).t(), torch.ones(2, 1), torch.ones(4), torch.bfloat16)


# name -> per layer: (input_layernorm marked, rows o_proj folds, post_attention_layernorm marked,
# rows down_proj folds); FOLDED_O_MAX_M = 200, FOLDED_DOWN_MAX_M = 256
_FAMILY_MARKS = {
    "qwen3-tiny": [(True, 200, True, 256)] * 2,
    "mistral-tiny": [(True, 200, True, 256)] * 2,
    "qwen2-tiny": [(True, 200, True, 256)] * 2,  # its q/k/v bias is added after the GEMM as before
    "qwen3-moe-tiny": [(True, 200, True, 256), (True, 200, False, 0)],  # layer 1's MoE block is not marked
    "deepseek-v2-moe-tiny": [(False, 0, True, 256), (False, 0, False, 0)],  # MLA is not; the dense MLP is
}


@pytest.mark.parametrize("name", sorted(_FAMILY_MARKS))
def test_fused_producers_marked_by_forward_not_exact_class(name):
    """Subclasses that keep Llama's decoder-layer, attention and MLP ``forward`` get the
    fused quantisers and the folded ``o_proj`` / ``down_proj`` as Llama does
    (`enable_fused_producers`); MoE blocks and MLA do not. A biased ``qkv_proj`` (Qwen2)
    given its input quantised by the norm computes what it computes from the 16-bit input
    (CPU: the reference path)."""
    from attnserve.models.layers.quantization.fused_inputs import Fp8Activation

    loaded = load_model(name, load_format="dummy", load_tokenizer=False, progress=False, quantization="fp8")

    def folded(module, name):
        return getattr(getattr(module, name, None), "fp8_folded_max_m", 0)

    marks = [(layer.input_layernorm.fp8_output, folded(layer.self_attn, "o_proj"),
              layer.post_attention_layernorm.fp8_output, folded(layer.mlp, "down_proj"))
             for layer in loaded.model.model.layers]
    assert marks == _FAMILY_MARKS[name]
    if name == "qwen2-tiny":
        qkv = loaded.model.model.layers[0].self_attn.qkv_proj
        assert qkv.bias is not None
        x = torch.randn(20, qkv.in_features, generator=torch.Generator().manual_seed(3))
        q, s = quantize_activation(x)
        assert torch.equal(qkv(Fp8Activation(q, s, x.dtype)), qkv(x))


def test_fused_producers_skip_layers_that_override_forward(monkeypatch):
    """A decoder layer whose class overrides ``forward`` may use a norm's output elsewhere:
    none of its producers is marked (the other layers still are)."""
    from attnserve.models.layers.quantization.fused_inputs import enable_fused_producers
    from attnserve.models.llama import LlamaDecoderLayer

    class OwnForward(LlamaDecoderLayer):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    monkeypatch.setenv("ATTNSERVE_FP8_FUSED_PRODUCERS", "0")  # loaded unmarked; marked below
    loaded = load_model("llama-tiny", load_format="dummy", load_tokenizer=False, progress=False, quantization="fp8")
    layers = loaded.model.model.layers
    layers[0].__class__ = OwnForward
    assert enable_fused_producers(loaded.model) == 4  # layer 1's two norms, o_proj and gate_up
    assert not (layers[0].input_layernorm.fp8_output or layers[0].post_attention_layernorm.fp8_output
                or getattr(layers[0].mlp.down_proj, "fp8_folded_max_m", 0)
                or getattr(layers[0].self_attn.o_proj, "fp8_folded_max_m", 0))
    assert layers[1].input_layernorm.fp8_output and layers[1].mlp.down_proj.fp8_folded_max_m


def test_fused_producers_marked_and_prequantized_input_path(monkeypatch):
    """By default (and with ``ATTNSERVE_FP8_FUSED_PRODUCERS=1``) both norms and ``gate_up``
    of every plain Llama layer are marked, with ``=0`` none; a linear given its input
    already quantised (`Fp8Activation`) computes what it computes from the 16-bit input
    (CPU: the reference path)."""
    from attnserve.models.layers.quantization.fused_inputs import Fp8Activation

    monkeypatch.setenv("ATTNSERVE_FP8_FUSED_PRODUCERS", "0")
    off = load_model("llama-tiny", load_format="dummy", load_tokenizer=False, progress=False, quantization="fp8")
    assert not any(getattr(m, "fp8_output", False) for m in off.model.modules())
    monkeypatch.delenv("ATTNSERVE_FP8_FUSED_PRODUCERS")
    loaded = load_model("llama-tiny", load_format="dummy", load_tokenizer=False, progress=False, quantization="fp8")
    for layer in loaded.model.model.layers:
        assert layer.input_layernorm.fp8_output and layer.post_attention_layernorm.fp8_output
        assert layer.mlp.gate_up_proj.fp8_output and layer.mlp.down_proj.fp8_folded_max_m
        assert layer.self_attn.o_proj.fp8_folded_max_m and not getattr(layer.self_attn.qkv_proj, "fp8_folded_max_m", 0)
    assert not loaded.model.model.norm.fp8_output
    assert not any(getattr(m, "fp8_folded_max_m", False) for m in off.model.modules())
    down = loaded.model.model.layers[0].mlp.down_proj
    x = torch.randn(20, down.in_features, generator=torch.Generator().manual_seed(2))
    q, s = quantize_activation(x)
    assert torch.equal(down(Fp8Activation(q, s, x.dtype)), down(x))
