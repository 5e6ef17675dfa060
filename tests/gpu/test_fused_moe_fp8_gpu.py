"""FP8 experts (W8A16, issue 37) in the fused MoE Triton kernel on a GPU at real shapes,
against the float64 product of the dequantised experts (`fp8_moe_checks`, the bound of
`moe_checks.moe_reference`).

Shapes (E, H, I, top_k): Qwen3-30B-A3B (128, 2048, 768, 8), Mixtral-8x7B (8, 4096, 14336, 2),
DeepSeek-V3's expert shape with 16 of its 256 experts (16, 7168, 2048, 8; the float64
reference of all 256 would not fit) and its tp-8 slice (I 256). Per-channel and
128 x 128 block scales; 1 (decode, slot blocks), 37 and 300 tokens (ragged); experts 0
and 3 get no token. Also CUDA graph capture / replay, the `FusedMoE` layer quantised at
load (Triton) against its native path, and no 16-bit copy of the experts at run time.

W8A8 (large batches: e4m3 activations, e4m3 x e4m3 dots): the same shapes at 37 and 300
tokens (forced), against the float64 product of the dequantised experts and quantised
input (`fp8_moe_checks.fp8_w8a8_moe_reference`) with the accumulation unit of Hopper's FP8
MMA inside a K step (`W8A8_ACC_U`); the rule choosing W8A8 at Mixtral's 64 tokens, CUDA graph
replay of the W8A8 path, and the fast-accumulation variant within 2 % (Frobenius).
"""

from __future__ import annotations

import pytest
import torch

from attnserve.models.layers.moe.fused_moe_triton import fused_experts_triton
from fp8_moe_checks import fp8_moe_reference, fp8_w8a8_moe_reference, fp8_w8a8_moe_simulated, quantize_experts

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available() or
                                                   torch.cuda.get_device_capability() < (8, 9), reason="FP8 GPU")]
DEV = "cuda"
SHAPES = {"qwen3-30b-a3b": (128, 2048, 768, 8), "mixtral-8x7b": (8, 4096, 14336, 2),
          "deepseek-v3-16e": (16, 7168, 2048, 8), "deepseek-v3-16e-tp8": (16, 7168, 256, 8)}
BLOCKS = {"channel": None, "block": (128, 128)}


def _case(shape, t, block, seed=0, exclude=(0, 3)):
    e, h, inter, k = SHAPES[shape]
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(t, h, device=DEV, generator=g).to(torch.bfloat16)
    w13 = torch.randn(e, 2 * inter, h, device=DEV, generator=g) / h**0.5
    w2 = torch.randn(e, h, inter, device=DEV, generator=g) / inter**0.5
    q13, s13, q2, s2 = quantize_experts(w13, w2, block)
    del w13, w2
    allowed = torch.tensor([i for i in range(e) if i not in exclude], device=DEV)
    ids = allowed[torch.rand(t, len(allowed), device=DEV, generator=g).topk(k, dim=-1).indices].to(torch.int32)
    w = torch.softmax(torch.randn(t, k, device=DEV, generator=g), dim=-1)
    return x, q13, s13, q2, s2, w, ids


def _run(x, q13, s13, q2, s2, w, ids, block):
    return fused_experts_triton(x, q13, q2, w, ids, w13_scale=s13, w2_scale=s2, block_shape=block)


def _check(out, x, q13, s13, q2, s2, w, ids, block):
    ref, bound = fp8_moe_reference(x, q13, s13, q2, s2, block, w, ids)
    diff = (out.double() - ref).abs()
    assert out.dtype == x.dtype and out.shape == x.shape and torch.isfinite(out).all()
    ratio = (diff / bound).max().item()
    assert ratio <= 1.0, f"max |delta| {diff.max().item():.3e}, {ratio:.3f} of the bound"


@pytest.mark.parametrize("scales", list(BLOCKS))
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("t", [1, 37, 300])
def test_real_shapes_fp8(shape, t, scales):
    block = BLOCKS[scales]
    case = _case(shape, t, block, seed=t)
    out = _run(*case, block)
    _check(out, *case, block)
    torch.cuda.empty_cache()


@pytest.mark.parametrize("scales", list(BLOCKS))
def test_cuda_graph_replay_fp8(scales):
    block = BLOCKS[scales]
    x, q13, s13, q2, s2, w, ids = _case("qwen3-30b-a3b", 4, block, seed=1)
    sx, sw, sids = x.clone(), w.clone(), ids.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _run(sx, q13, s13, q2, s2, sw, sids, block)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sout = _run(sx, q13, s13, q2, s2, sw, sids, block)
    for seed in (2, 3):
        x2, _, _, _, _, w2_, ids2 = _case("qwen3-30b-a3b", 4, block, seed=seed, exclude=())
        sx.copy_(x2)
        sw.copy_(w2_)
        sids.copy_(ids2)
        graph.replay()
        torch.cuda.synchronize()
        eager = _run(x2, q13, s13, q2, s2, w2_, ids2, block)
        assert torch.equal(sout, eager)
        _check(sout, x2, q13, s13, q2, s2, w2_, ids2, block)


@pytest.mark.parametrize("strategy", ["channel", "block"])
def test_layer_quantised_at_load(strategy):
    """`FusedMoE` built for ``--quantization fp8`` on CUDA: FP8 parameters, the Triton path
    equals the native (dequantising) path within the kernel's bound, the output is within
    FP8 error of the bf16 layer, and the forward allocates no 16-bit expert weights."""
    from torch import nn

    from attnserve.models.layers.moe.layer import FusedMoE
    from attnserve.models.layers.moe.native import fused_experts_native
    from attnserve.models.layers.quantization import QuantizationConfig, quantized_construction
    from attnserve.models.layers.quantization.apply import quantize_model_linears

    e, h, inter, k = SHAPES["qwen3-30b-a3b"]
    cfg = QuantizationConfig("block", (128, 128)) if strategy == "block" else QuantizationConfig("channel")
    holder = nn.Module()
    with torch.device(DEV), quantized_construction(cfg):
        holder.experts = FusedMoE(e, h, inter, torch.bfloat16)
    quantize_model_linears(holder, cfg, DEV, torch.bfloat16)
    moe = holder.experts
    g = torch.Generator(device=DEV).manual_seed(9)
    w13 = (torch.randn(e, 2 * inter, h, device=DEV, generator=g) / h**0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, h, inter, device=DEV, generator=g) / inter**0.5).to(torch.bfloat16)
    for x_ in range(e):
        moe.load_expert_weight("w1", x_, w13[x_, :inter], f"experts.{x_}.gate_proj.weight")
        moe.load_expert_weight("w3", x_, w13[x_, inter:], f"experts.{x_}.up_proj.weight")
        moe.load_expert_weight("w2", x_, w2[x_], f"experts.{x_}.down_proj.weight")
    assert moe.w13_weight.dtype == torch.float8_e4m3fn and moe.missing_expert_weights() == []
    x = torch.randn(64, h, device=DEV, generator=g).to(torch.bfloat16)
    ids = torch.rand(64, e, device=DEV, generator=g).topk(k, dim=-1).indices.to(torch.int32)
    w = torch.softmax(torch.randn(64, k, device=DEV, generator=g), dim=-1)
    moe(x, w, ids)  # compile
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    out = moe(x, w, ids)
    torch.cuda.synchronize()
    # transient memory of the forward: activations only (a dequantised w13 would be 2 bytes per weight)
    assert torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated() < w13.numel() // 8
    native = fused_experts_native(x, moe.w13_weight, moe.w2_weight, w, ids, **moe.quant_method.kernel_args(moe))
    assert (out.float() - native.float()).abs().max() <= 2**-6 * native.float().abs().max()
    base = fused_experts_triton(x, w13, w2, w, ids).float()
    assert (out.float() - base).norm() / base.norm() <= 0.08


@pytest.mark.parametrize("model", ["qwen3-moe-tiny", "deepseek-v2-moe-tiny"])
def test_engine_fp8_experts_decode_graph_matches_eager(model, monkeypatch):
    """``--quantization fp8`` on a dummy MoE model: the experts are FP8 (Triton path), and
    greedy tokens with CUDA graphs equal those of the eager engine (two short prompts: the
    decode batch stays within the dense linears' W8A16 rows, as in test_fp8_linear_gpu)."""
    from attnserve.engine.llm import LLM
    from attnserve.engine.sampling_params import SamplingParams
    from attnserve.models.layers.moe.layer import FusedMoE

    monkeypatch.delenv("ATTNSERVE_MOE_BACKEND", raising=False)
    sp = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    res = []
    for graphs_off in (False, True):
        llm = LLM(model, load_format="dummy", device="cuda", quantization="fp8", disable_cuda_graph=graphs_off)
        moes = [m for m in llm.engine.model_runner.model.modules() if isinstance(m, FusedMoE)]
        assert moes and all(m.w13_weight.dtype == torch.float8_e4m3fn and m.quant_method is not None for m in moes)
        res.append([o.token_ids for o in llm.generate(prompts, sp)])
        llm.shutdown()
    assert res[0] == res[1]


#: Error per term of an e4m3 x e4m3 ``tl.dot`` over one 128-wide K step, in units of the sum of
#: |products|: sm 90's FP8 MMA keeps ~13 bits past the leading one of its running sum (DeepSeek-V3
#: report, section 3.3.2, "around 14 bits"), one truncation per 32-wide instruction step, so a K
#: step of n terms is off by <= (n / 32) 2**-13 = n 2**-18 of its magnitude sum; 2**-17 is twice that.
#: The kernel adds each step's product to a float32 accumulator (no fast accumulation).
W8A8_ACC_U = 2.0**-17


def _check_w8a8(out, x, q13, s13, q2, s2, w, ids, block):
    ref, bound = fp8_w8a8_moe_reference(x, q13, s13, q2, s2, block, w, ids, acc_u=W8A8_ACC_U)
    diff = (out.double() - ref).abs()
    assert out.dtype == x.dtype and out.shape == x.shape and torch.isfinite(out).all()
    ratio = (diff / bound).max().item()
    assert ratio <= 1.0, f"max |delta| {diff.max().item():.3e}, {ratio:.3f} of the bound"
    sim = fp8_w8a8_moe_simulated(x, q13, s13, q2, s2, block, w, ids)
    rel = ((out.double() - sim).norm() / sim.norm()).item()
    assert rel <= 0.02, f"relative error {rel:.3e} against the simulated W8A8 steps"
    return rel


@pytest.mark.parametrize("scales", list(BLOCKS))
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("t", [37, 300])
def test_real_shapes_fp8_w8a8(shape, t, scales):
    block = BLOCKS[scales]
    case = _case(shape, t, block, seed=t + 1)
    out = fused_experts_triton(case[0], case[1], case[3], case[5], case[6], w13_scale=case[2], w2_scale=case[4],
                               block_shape=block, fp8_w8a8=True)
    rel = _check_w8a8(out, *case, block)
    print(f"W8A8 {shape} T={t} {scales}: relative error {rel:.2e} vs simulated steps")
    torch.cuda.empty_cache()


@pytest.mark.parametrize("scales", list(BLOCKS))
def test_w8a8_rule_and_cuda_graph(scales, monkeypatch):
    """Mixtral-8x7B shape at 64 tokens (16 slots an expert): W8A8 by the default rule (both
    inputs quantised), the same at 32 tokens is W8A16; the W8A8 call replays in a CUDA graph."""
    import attnserve.models.layers.moe.fused_moe_triton as fmt
    from attnserve.models.layers.moe.fp8_w8a8 import W8A8_MIN_SLOTS_ENV

    monkeypatch.delenv(W8A8_MIN_SLOTS_ENV, raising=False)
    block = BLOCKS[scales]
    calls = []
    real = fmt.quantize_moe_activation
    monkeypatch.setattr(fmt, "quantize_moe_activation", lambda a, b: calls.append(tuple(a.shape)) or real(a, b))
    x, q13, s13, q2, s2, w, ids = _case("mixtral-8x7b", 32, block, seed=5, exclude=())
    _run(x, q13, s13, q2, s2, w, ids, block)
    assert calls == []
    x, q13, s13, q2, s2, w, ids = _case("mixtral-8x7b", 64, block, seed=6, exclude=())
    eager = _run(x, q13, s13, q2, s2, w, ids, block)
    assert calls == [(64, 4096), (128, 14336)]
    _check_w8a8(eager, x, q13, s13, q2, s2, w, ids, block)
    sx, sw, sids = x.clone(), w.clone(), ids.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _run(sx, q13, s13, q2, s2, sw, sids, block)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sout = _run(sx, q13, s13, q2, s2, sw, sids, block)
    x2, _, _, _, _, w2_, ids2 = _case("mixtral-8x7b", 64, block, seed=7, exclude=())
    sx.copy_(x2)
    sw.copy_(w2_)
    sids.copy_(ids2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(sout, _run(x2, q13, s13, q2, s2, w2_, ids2, block))
    torch.cuda.empty_cache()


def test_w8a8_fast_accum():
    """``use_fast_accum`` (per-channel: the FP8 MMA accumulates over all of K): within 2 % of
    the simulated W8A8 steps (Frobenius; no element-wise bound: the reduced-precision sum
    over 14336 terms has none worth stating)."""
    x, q13, s13, q2, s2, w, ids = _case("mixtral-8x7b", 300, None, seed=8)
    out = fused_experts_triton(x, q13, q2, w, ids, w13_scale=s13, w2_scale=s2, fp8_w8a8=True, use_fast_accum=True)
    assert torch.isfinite(out).all()
    sim = fp8_w8a8_moe_simulated(x, q13, s13, q2, s2, None, w, ids)
    rel = ((out.double() - sim).norm() / sim.norm()).item()
    print(f"fast accumulation: relative error {rel:.2e} vs simulated steps")
    assert rel <= 0.02
