"""FP8-weight mid-size GEMM (`fp8_mid_gemm`, issue 37) on an sm 89+ GPU at the Llama-3-8B
shapes (qkv 6144 x 4096, o 4096 x 4096, gate_up 2 x 14336 x 4096 gated, down 4096 x 14336)
and M = 32 / 64 / 128 / 256, both operand modes, against float64 of the same quantised
operands. ``pytest tests/gpu -k mid`` selects these (and the bf16 mid GEMM's).

Bound (element-wise; ``mag = |a| @ |W|^T`` over the dequantised operands ``a`` = x or
``q * s_x`` and ``W = W_q * s_w``):

* float32 summation of exact products in any order plus the epilogue's two scale products
  and bias add: ``gamma_{K+3} * mag`` (Higham eq. 3.5);
* W8A8 only: the tensor core adds FP8 products with reduced precision (DeepSeek-V3 report,
  arXiv:2412.19437, section 3.3.2: about 14 bits retained; its K = 4096 test: ~2% maximum
  relative error when never promoted). The kernel promotes to float32 every ``BLOCK_K``
  (``max_num_imprecise_acc``); ``2**-10 * mag`` allows that (~0.04 of ``|y|`` for random
  data at K = 4096, where ``mag ~ 40 |y|``) while a lost K tile (1/32 of the terms at K =
  4096: ~0.18 ``|y|``) or a wrong scale (~``|y|``) stays far above it;
* the bf16 output rounding: half an ulp, ``2**-8 |y|``.

Gated: ``1.2 |u| e_g + |act(g)| e_u`` plus ``(2**-8 + 1e-6) |y|`` (as test_mid_gemm_gpu.py).
"""

from __future__ import annotations

import pytest
import torch

from attnserve.models.layers.quantization.fp8_kernels import quantize_activation
from attnserve.models.layers.quantization.fp8_mid_gemm import (
    fp8_mid_candidates,
    fp8_mid_config,
    fp8_mid_linear,
)
from attnserve.models.layers.quantization.fp8_utils import dequantize, quantize_per_row, quantize_per_tensor
from numeric_bounds import FLOAT32_U

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available() or
                                                   torch.cuda.get_device_capability() < (8, 9), reason="FP8 GPU")]
DEV = "cuda"
HALF_ULP = 2.0**-8
IMPRECISE = 2.0**-10
SHAPES = {"qkv": (6144, 4096, False), "o": (4096, 4096, False), "gate_up": (28672, 4096, True),
          "down": (4096, 14336, False)}


def _operands(m, n, k, mode, seed, per_tensor=False, bias=False):
    g = torch.Generator(device=DEV).manual_seed(seed)
    w = torch.randn(n, k, device=DEV, generator=g) * 0.02
    wq, ws = quantize_per_tensor(w) if per_tensor else quantize_per_row(w)
    ws = ws.reshape(-1).contiguous()
    x = torch.randn(m, k, device=DEV, generator=g).to(torch.bfloat16)
    b = torch.randn(n, device=DEV, generator=g).to(torch.bfloat16) if bias else None
    if mode == "w8a8":
        q, s = quantize_activation(x)
        return dict(x=q, x_scale=s, out_dtype=torch.bfloat16), dequantize(q, s).double(), wq, ws, b
    return dict(x=x), x.double(), wq, ws, b


def _run(ops, wq, ws, b, act, cfg=None):
    return fp8_mid_linear(ops["x"], wq, ws, b, act, x_scale=ops.get("x_scale"), out_dtype=ops.get("out_dtype"),
                          config=cfg)


def _check(y, a64, wq, ws, b, mode, act):
    w64 = dequantize(wq, ws).double()
    b64 = b.double() if b is not None else None
    k = a64.shape[1] + 3
    ref = a64 @ w64.T + (b64 if b64 is not None else 0.0)
    mag = a64.abs() @ w64.abs().T + (b64.abs() if b64 is not None else 0.0)
    e = (k * FLOAT32_U / (1 - k * FLOAT32_U) + (IMPRECISE if mode == "w8a8" else 0.0)) * mag
    if act:
        i = ref.shape[1] // 2
        g, u = ref[:, :i], ref[:, i:]
        sg = g / (1.0 + torch.exp(-g))
        ref = sg * u
        bound = 1.2 * u.abs() * e[:, :i] + sg.abs() * e[:, i:] + (HALF_ULP + 1e-6) * ref.abs()
    else:
        bound = e + HALF_ULP * ref.abs()
    assert y.shape == ref.shape and y.dtype == torch.bfloat16
    ratio = ((y.double() - ref).abs() / (bound + 1e-30)).max().item()
    assert ratio <= 1.0, f"max |delta| / bound = {ratio:.3f}"
    assert float(bound.max()) < 0.2 * float(ref.abs().max())  # the bound is not vacuous


@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
@pytest.mark.parametrize("proj", list(SHAPES))
@pytest.mark.parametrize("m", [32, 64, 128, 256])
def test_fp8_mid_llama_shapes_default_config(m, proj, mode):
    n, k, gated = SHAPES[proj]
    ops, a64, wq, ws, _ = _operands(m, n, k, mode, seed=m + n + k)
    act = "silu" if gated else None
    _check(_run(ops, wq, ws, None, act), a64, wq, ws, None, mode, act)


@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
@pytest.mark.parametrize("proj", list(SHAPES))
def test_fp8_mid_sweep_candidates_m64(proj, mode):
    """Every candidate the benchmark's ``--sweep`` times (split-K, block sizes, warps, TMA)
    at 64 rows, so a config copied from its output into the table is a checked one."""
    n, k, gated = SHAPES[proj]
    ops, a64, wq, ws, _ = _operands(64, n, k, mode, seed=n + k)
    act = "silu" if gated else None
    for cfg in fp8_mid_candidates(64, n, k, mode, gated):
        _check(_run(ops, wq, ws, None, act, cfg), a64, wq, ws, None, mode, act)


@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
@pytest.mark.parametrize("m", [17, 100, 200])
def test_fp8_mid_per_tensor_bias_ragged(m, mode):
    """Per-tensor scale, bias, M not a bucket size (two row pieces at 100), K = 4000 (not a
    multiple of the K tile), N = 1000 (a partial column block)."""
    ops, a64, wq, ws, b = _operands(m, 1000, 4000, mode, seed=m, per_tensor=True, bias=True)
    _check(_run(ops, wq, ws[:1].clone(), b, None), a64, wq, ws, b, mode, None)


@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
def test_fp8_mid_cuda_graph_split_k(mode):
    """Captured at 64 rows with split-K (the workspace memset inside the graph), replayed
    on new inputs: within the bound each time (counters and workspace start from zero)."""
    n, k, _ = SHAPES["down"]
    ops, _, wq, ws, _ = _operands(64, n, k, mode, seed=1)
    cfg = fp8_mid_config(64, n, k, mode)
    assert cfg.split_k > 1
    static = {key: v.clone() if torch.is_tensor(v) else v for key, v in ops.items()}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            _run(static, wq, ws, None, None)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        y = _run(static, wq, ws, None, None)
    for seed in (11, 12, 13):
        new, a64, _, _, _ = _operands(64, n, k, mode, seed=seed)
        static["x"].copy_(new["x"])
        if mode == "w8a8":
            static["x_scale"].copy_(new["x_scale"])
        graph.replay()
        torch.cuda.synchronize()
        _check(y, a64, wq, ws, None, mode, None)


def _kernel_names(fn):
    """Names of the CUDA kernels ``fn`` launches (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def test_fp8_mid_split_k_workspace_graph_bits():
    """The persistent split-K workspace (`split_k_workspace`): W8A8 calls of three shapes with
    split-K 2 (o; a gated weight of 2 x 1000 rows whose last 64-column block is partial, so
    its finisher must not zero the up sums of block 0, at 48 rows: two row pieces; qkv with TMA
    loads) share one
    `SplitKWorkspace`, eagerly and captured twice each in one CUDA graph replayed twice. Split-K
    2 adds two partial sums onto zero, an order-free result, so every output must equal the bits
    of the same call on a fresh zeroed buffer (``workspace=None``), and the buffer must be all
    zero after each run. Eager calls on the warm workspace launch the kernel only (no fill)."""
    from attnserve.models.layers.mid_gemm import MidGemmConfig
    from attnserve.models.layers.split_k_workspace import SplitKWorkspace

    cases = [(4096, 4096, None, MidGemmConfig(64, 128, 4, 4, split_k=2)),
             (2000, 4096, "silu", MidGemmConfig(64, 128, 4, 4, split_k=2)),
             (6144, 4096, None, MidGemmConfig(64, 128, 4, 4, split_k=2, use_tma=True))]
    runs = []
    for j, (n, k, act, cfg) in enumerate(cases):
        ops, _, wq, ws, _ = _operands(48 if j == 1 else 64, n, k, "w8a8", seed=100 + j)
        runs.append((ops, wq, ws, act, cfg))
    fresh = [_run(ops, wq, ws, None, act, cfg) for ops, wq, ws, act, cfg in runs]
    workspace = SplitKWorkspace()

    def all_calls():
        return [fp8_mid_linear(ops["x"], wq, ws, None, act, x_scale=ops["x_scale"], out_dtype=torch.bfloat16,
                               config=cfg, workspace=workspace) for ops, wq, ws, act, cfg in runs]

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        eager = all_calls() + all_calls()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    (buf,) = workspace.buffers(DEV)
    for i, y in enumerate(eager):
        assert torch.equal(y, fresh[i % 3]), f"eager call {i} on the shared workspace"
    assert int(torch.count_nonzero(buf)) == 0
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        captured = all_calls() + all_calls()
    held = workspace.buffers(DEV)
    assert len(held) == 1 and held[0] is buf  # the capture reused it: no allocation, no memset in the graph
    for rep in range(2):
        graph.replay()
        torch.cuda.synchronize()
        for i, y in enumerate(captured):
            assert torch.equal(y, fresh[i % 3]), f"replay {rep}, call {i}"
        assert int(torch.count_nonzero(buf)) == 0, f"buffer not zero after replay {rep}"
    names = _kernel_names(all_calls)
    assert len(names) == 3 and all("fp8_mid_gemm" in nm for nm in names), names


def test_fp8_mid_split_k4_workspace_graph_within_bound():
    """The table's split-4 ``down`` tile (four partial sums: atomics in no fixed order, so no
    bit comparison) on a shared workspace in a CUDA graph, replayed on new inputs after eager
    calls of another shape on the same workspace: within the float64 bound each time, and
    the buffer all zero after."""
    from attnserve.models.layers.split_k_workspace import SplitKWorkspace

    n, k, _ = SHAPES["down"]
    ops, _, wq, ws, _ = _operands(64, n, k, "w8a8", seed=7)
    cfg = fp8_mid_config(64, n, k, "w8a8")
    assert cfg.split_k == 4
    o_ops, o_a64, o_wq, o_ws, _ = _operands(40, 4096, 4096, "w8a8", seed=8)
    o_cfg = fp8_mid_config(40, 4096, 4096, "w8a8")
    workspace = SplitKWorkspace()

    def down():
        return fp8_mid_linear(ops["x"], wq, ws, x_scale=ops["x_scale"], out_dtype=torch.bfloat16, config=cfg,
                              workspace=workspace)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        down()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        y = down()
    for seed in (21, 22):
        y_o = fp8_mid_linear(o_ops["x"], o_wq, o_ws, x_scale=o_ops["x_scale"], out_dtype=torch.bfloat16,
                             config=o_cfg, workspace=workspace)
        _check(y_o, o_a64, o_wq, o_ws, None, "w8a8", None)
        new, a64, _, _, _ = _operands(64, n, k, "w8a8", seed=seed)
        ops["x"].copy_(new["x"])
        ops["x_scale"].copy_(new["x_scale"])
        graph.replay()
        torch.cuda.synchronize()
        _check(y, a64, wq, ws, None, "w8a8", None)
        assert all(int(torch.count_nonzero(b)) == 0 for b in workspace.buffers(DEV))


def test_fp8_mid_env_routes_linear_and_producers(monkeypatch):
    """``ATTNSERVE_FP8_MID_GEMM``: a quantised `Linear` at 64 rows gives the kernel's result
    (within the bound of its mode: ``w8a16`` against the unquantised rows, which
    ``_scaled_mm``'s quantised activations would miss by ~2**-5 relative); ``w8a16`` keeps the fused producers from quantising 17..256 rows, ``w8a8`` does not."""
    from attnserve.models.layers.linear import Linear
    from attnserve.models.layers.parallel import load_param
    from attnserve.models.layers.quantization import QuantizationConfig, quantized_construction
    from attnserve.models.layers.quantization.apply import quantize_model_linears
    from attnserve.models.layers.quantization.fused_inputs import emits_fp8

    cfg = QuantizationConfig("channel")
    with torch.device(DEV), quantized_construction(cfg):
        layer = Linear(4096, 6144, dtype=torch.bfloat16)
    quantize_model_linears(layer, cfg, DEV, torch.bfloat16)
    load_param(layer.weight, torch.randn(6144, 4096, device=DEV, dtype=torch.bfloat16) * 0.02, "w")
    layer.use_fused = True
    x = torch.randn(64, 4096, device=DEV, dtype=torch.bfloat16)
    for mode in ("w8a16", "w8a8"):
        monkeypatch.setenv("ATTNSERVE_FP8_MID_GEMM", mode)
        y = layer(x)
        if mode == "w8a16":
            _check(y, x.double(), layer.weight, layer.weight_scale, None, mode, None)
            assert not emits_fp8(x, True) and emits_fp8(torch.cat([x] * 5), True)  # 320 rows: past the kernel
        else:
            q, s = quantize_activation(x)
            _check(y, dequantize(q, s).double(), layer.weight, layer.weight_scale, None, mode, None)
            assert emits_fp8(x, True)
    monkeypatch.delenv("ATTNSERVE_FP8_MID_GEMM")
    assert emits_fp8(x, True)


@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
def test_fp8_mid_dummy_llama_graph_decode(mode, monkeypatch):
    """24 requests of a tiny FP8 Llama decode through the kernel with CUDA graphs and
    eagerly. Split-K adds partial sums with atomics in no fixed order, so the two runs may
    round differently and a near-tie of the greedy argmax may flip: at least 90% of the
    tokens agree (a broken graph path gives unrelated tokens)."""
    from test_fp8_linear_gpu import fp8_llama_graph_and_eager_tokens

    monkeypatch.setenv("ATTNSERVE_FP8_MID_GEMM", mode)
    res = fp8_llama_graph_and_eager_tokens()
    assert all(len(t) == 8 for t in res[0])
    same = sum(a == b for ta, tb in zip(*res) for a, b in zip(ta, tb))
    assert same >= 0.9 * 24 * 8, f"{same} of {24 * 8} tokens agree"
