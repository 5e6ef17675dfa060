"""The FP8 mid GEMM's default route (`fp8_mid_gemm.fp8_mid_route`, issue 37): W8A8 at 33..64
rows for the weight shapes a device's `FP8_MID_DEFAULT_W8A8` lists, ``_scaled_mm`` (here,
on the CPU: its Triton stand-in `scaled_fp8_gemm`) otherwise; and the FP8 MLP chain it
builds: ``gate_up`` with SiLU-and-mul in the epilogue, its ``[M, I]`` output quantised per
token (`quantize_activation`) for ``down_proj``.

Runs under the Triton interpreter on the CPU (tests/kernels/conftest.py) on tiny shapes:
H = 80 (``K`` of ``gate_up``: a tail past ``block_k`` 64), I = 48, 33 rows (row pieces 32 +
16). The test table entry gives the CPU device a tag and tiles with split-K.

Bounds (element-wise; float64 references over the dequantised operands, as
test_fp8_mid_gemm.py explains): a GEMM of exact products summed in float32 with two scale
products: ``gamma_{K+3} * (|a| @ |W|^T)``; the gate ``act(g) * u``: ``1.2 |u| e_g + |act(g)|
e_u``, ``1e-6 |h|`` of float32 activation math, one bf16 rounding ``2**-7 |h|`` (the
interpreter may truncate); the per-token e4m3 quantiser: half a step, ``2**-4 |h|`` for
normal values, ``2**-10 * s`` among the subnormals (spacing ``2**-9 s``), with ``s`` the
row's scale.
"""

from __future__ import annotations

import pytest
import torch

import attnserve.models.layers.quantization.fp8_mid_gemm as mid
from attnserve.models.layers.mid_gemm import table_key
from attnserve.models.layers.quantization.fp8_kernels import quantize_activation
from attnserve.models.layers.quantization.fp8_utils import dequantize
from numeric_bounds import FLOAT32_U, assert_within
from call_spy import spy_calls

H, I = 80, 48
TAG = "TEST_CPU_DEVICE"
#: tiles of the test table: gate_up [2I, H] two column blocks, split-K 2 over its two K
#: steps; down [H, I] five column blocks, one K step
TEST_TABLE = {table_key(2 * I, H, True): (32, 64, 4, 2, 2), table_key(H, I, False): (16, 64, 4, 2, 1)}
LLAMA_8B = {table_key(6144, 4096, False), table_key(4096, 4096, False), table_key(28672, 4096, True),
            table_key(4096, 14336, False)}


@pytest.fixture
def test_device_table(monkeypatch):
    """The CPU device tagged ``TAG`` with `TEST_TABLE` as its default-route entries."""
    monkeypatch.setattr(mid, "fp8_mid_device_tag", lambda device: TAG)
    monkeypatch.setitem(mid.FP8_MID_DEFAULT_W8A8, TAG, TEST_TABLE)
    monkeypatch.delenv(mid.FP8_MID_ENV, raising=False)


def _gamma(k):
    return (k + 3) * FLOAT32_U / (1 - (k + 3) * FLOAT32_U)


def _mlp(device):
    """Quantised ``gate_up`` ([2I, H], ``fp8_output`` as `enable_fused_producers` marks it)
    and ``down`` ([H, I]) `Linear` layers with random weights, fused kernels on."""
    from attnserve.models.layers.linear import Linear
    from attnserve.models.layers.parallel import load_param
    from attnserve.models.layers.quantization import QuantizationConfig, quantized_construction
    from attnserve.models.layers.quantization.apply import quantize_model_linears

    cfg = QuantizationConfig("channel")
    g = torch.Generator().manual_seed(7)
    layers = []
    for n, k in ((2 * I, H), (H, I)):
        with quantized_construction(cfg):
            layer = Linear(k, n, dtype=torch.bfloat16)
        quantize_model_linears(layer, cfg, device, torch.bfloat16)
        load_param(layer.weight, (torch.randn(n, k, generator=g) * 0.1).to(torch.bfloat16).to(device), "w")
        layer.use_fused = True
        layers.append(layer)
    layers[0].fp8_output = True
    return layers


def _run_mlp(gate_up, down, x):
    """The engine's MLP on a producer-quantised ``x``: ``(Fp8Activation of down's input, y)``."""
    from attnserve.models.layers.quantization.fused_inputs import Fp8Activation

    q, s = quantize_activation(x)
    h = gate_up.forward_gated(Fp8Activation(q, s, torch.bfloat16), "silu")
    assert isinstance(h, Fp8Activation) and h.q.shape == (x.shape[0], I) and h.scale.shape == (x.shape[0], 1)
    return h, down.forward(h), dequantize(q, s).double().cpu()


def _gate_ref(a64, gate_up):
    """float64 ``(h, e_g, e_u, g, u)``: ``h = silu(g) * u`` of ``a64 @ W_gu^T`` and the GEMM
    bounds of its gate and up halves."""
    wgu = dequantize(gate_up.weight.cpu(), gate_up.weight_scale.cpu()).double()
    ref = a64 @ wgu.T
    e = _gamma(H) * (a64.abs() @ wgu.abs().T)
    g, u = ref[:, :I], ref[:, I:]
    return g / (1.0 + torch.exp(-g)) * u, e[:, :I], e[:, I:], g, u


def test_default_route_mlp_matches_float64(test_device_table, device, monkeypatch):
    """33 rows: both projections go through `fp8_mid_linear` (gate_up gated), and (1) the
    gated output equals float64 ``silu(g) * u`` of the dequantised operands within the GEMM,
    gate and bf16 bounds; (2) down's input is `quantize_activation` of it, bit for bit (the
    quantiser itself is checked against float64 on the GPU: the Triton 3.9 interpreter
    rounds values that round up to a power of two in e4m3 to half that power, e.g. 124.3 ->
    64); (3) the output equals float64 ``(q_h * s_h) @ W_down^T`` of that quantised input
    within the GEMM bound and a bf16 rounding."""
    calls = []
    spy_calls(monkeypatch, mid, "fp8_mid_linear", calls)
    gate_up, down = _mlp(device)
    x = (torch.randn(33, H, generator=torch.Generator().manual_seed(3)) * 2).to(torch.bfloat16).to(device)
    h, y, a64 = _run_mlp(gate_up, down, x)
    assert [(tuple(a[1].shape), a[4] if len(a) > 4 else kw.get("activation")) for a, kw, _ in calls] == \
        [((2 * I, H), "silu"), ((H, I), None)]
    gated = calls[0][2]
    assert gated.shape == (33, I) and gated.dtype == torch.bfloat16

    h64, e_g, e_u, g, u = _gate_ref(a64, gate_up)
    sg = g / (1.0 + torch.exp(-g))
    bound = 1.2 * u.abs() * e_g + sg.abs() * e_u + (2.0**-7 + 1e-6) * h64.abs()
    assert_within(gated.double().cpu(), h64, bound + 1e-30, "gated W8A8 mid GEMM vs float64")
    assert float(bound.max()) < 0.05 * float(h64.abs().max())  # not vacuous: a lost K step moves ~|h|
    q, s = quantize_activation(gated)
    assert torch.equal(h.q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(h.scale, s)

    dq = dequantize(h.q.cpu(), h.scale.cpu()).double()
    wd = dequantize(down.weight.cpu(), down.weight_scale.cpu()).double()
    ref_y = dq @ wd.T
    bound_y = _gamma(I) * (dq.abs() @ wd.abs().T) + 2.0**-7 * ref_y.abs()
    assert y.shape == (33, H) and y.dtype == torch.bfloat16
    assert_within(y.double().cpu(), ref_y, bound_y + 1e-30, "down mid on the quantised gate output vs float64")


def test_default_route_picks_rows_shapes_devices(test_device_table, monkeypatch):
    """`fp8_mid_route` by rows, shape, device table and ``ATTNSERVE_FP8_MID_GEMM``."""
    dev = torch.device("cpu")
    gk, dk = (2 * I, H, True), (H, I, False)
    for m in (1, 16, 17, 32, 33, 48, 64, 65, 128, 256):
        for n, k, gated in (gk, dk):
            route = mid.fp8_mid_route(m, n, k, gated, dev)
            if 33 <= m <= 64:
                bn, bk, warps, stages, split = TEST_TABLE[table_key(n, k, gated)]
                assert route is not None and route[0] == "w8a8"
                assert (route[1].block_n, route[1].block_k, route[1].num_warps, route[1].split_k) == \
                    (bn, bk, warps, split)
            else:
                assert route is None, (m, n, k)
    assert mid.fp8_mid_route(48, 2 * I, H, False, dev) is None  # the same rows ungated: no entry
    assert mid.fp8_mid_route(48, 64, 64, False, dev) is None  # no entry for the shape
    for off in ("off", "0", "none", "OFF"):
        monkeypatch.setenv(mid.FP8_MID_ENV, off)
        assert mid.fp8_mid_route(48, *gk, dev) is None and mid.fp8_mid_gemm_mode() is None
    monkeypatch.setenv(mid.FP8_MID_ENV, "auto")
    assert mid.fp8_mid_route(48, *gk, dev)[0] == "w8a8" and mid.fp8_mid_gemm_mode() is None
    for mode in mid.FP8_MID_MODES:  # explicit modes: 17..256 rows, any shape, the class table
        monkeypatch.setenv(mid.FP8_MID_ENV, mode)
        assert mid.fp8_mid_route(16, 64, 64, False, dev) is None
        assert mid.fp8_mid_route(257, 64, 64, False, dev) is None
        for m in (17, 100, 256):
            assert mid.fp8_mid_route(m, 64, 64, False, dev) == (mode, mid.fp8_mid_config(m, 64, 64, mode))
    monkeypatch.setenv(mid.FP8_MID_ENV, "w4a8")
    with pytest.raises(ValueError, match="ATTNSERVE_FP8_MID_GEMM"):
        mid.fp8_mid_route(48, *gk, dev)


def test_default_tables_by_device(monkeypatch):
    """The shipped default: the H100 80GB HBM3 routes exactly the four Llama-3-8B
    projections at 33..64 rows, the H200 its qkv and gate_up (its o and down keep the
    folded ``_scaled_mm`` routes); an unknown GPU and the CPU route nothing."""
    monkeypatch.delenv(mid.FP8_MID_ENV, raising=False)
    assert set(mid.FP8_MID_DEFAULT_W8A8) == {"NVIDIA_H100_80GB_HBM3", "NVIDIA_H200"}
    assert set(mid.FP8_MID_DEFAULT_W8A8["NVIDIA_H100_80GB_HBM3"]) == LLAMA_8B
    h200 = {mid.table_key(6144, 4096, False), mid.table_key(28672, 4096, True)}
    assert set(mid.FP8_MID_DEFAULT_W8A8["NVIDIA_H200"]) == h200
    assert mid.fp8_mid_device_tag(torch.device("cpu")) is None
    assert mid.fp8_mid_route(48, 4096, 4096, False, torch.device("cpu")) is None
    shapes = [(6144, 4096, False), (4096, 4096, False), (28672, 4096, True), (4096, 14336, False)]
    for tag, listed in (("NVIDIA_H100_80GB_HBM3", LLAMA_8B), ("NVIDIA_H200", h200), ("NVIDIA_A100-SXM4-80GB", set())):
        monkeypatch.setattr(mid, "fp8_mid_device_tag", lambda device, t=tag: t)
        for n, k, gated in shapes:
            expect = mid.table_key(n, k, gated) in listed
            for m in (32, 33, 64, 65):
                route = mid.fp8_mid_route(m, n, k, gated, torch.device("cpu"))
                assert (route is not None) == (expect and 33 <= m <= 64), (tag, n, k, m)
                if route is not None:
                    route[1].validate()
                    assert route[0] == "w8a8" and route[1].block_k in (128, 256)
        assert mid.fp8_mid_route(48, 8192, 4096, False, torch.device("cpu")) is None  # unmeasured shape


def test_mlp_outside_route_takes_scaled_gemm(test_device_table, device, monkeypatch):
    """65 rows, and 48 rows with ``ATTNSERVE_FP8_MID_GEMM=off``: the kernel is not called;
    the chain runs the ``_scaled_mm`` path's stand-in (`scaled_fp8_gemm`) and the fused
    SiLU-and-mul quantiser. At 48 rows the two routes' gate outputs (before down's
    quantiser) agree to their bf16 roundings: each within its bound of float64 ``silu(g) *
    u`` (off: gate and up rounded to bf16 first, ``2**-7`` each, then the product); their
    MLP outputs differ by what their quantised down inputs differ, times ``|W_down|``."""
    import attnserve.models.layers.quantization.fp8_linear as fl

    calls, gemm_calls = [], []
    spy_calls(monkeypatch, mid, "fp8_mid_linear", calls)
    spy_calls(monkeypatch, fl, "scaled_fp8_gemm", gemm_calls)
    gate_up, down = _mlp(device)
    x = (torch.randn(65, H, generator=torch.Generator().manual_seed(4)) * 2).to(torch.bfloat16).to(device)
    _run_mlp(gate_up, down, x)
    assert calls == [] and len(gemm_calls) == 2
    h_mid, y_mid, a64 = _run_mlp(gate_up, down, x[:48])
    assert len(calls) == 2 and len(gemm_calls) == 2
    monkeypatch.setenv(mid.FP8_MID_ENV, "off")
    h_off, y_off, _ = _run_mlp(gate_up, down, x[:48])
    assert len(calls) == 2 and len(gemm_calls) == 4

    h64, e_g, e_u, g, u = _gate_ref(a64, gate_up)
    sg = g / (1.0 + torch.exp(-g))
    ulp = 2.0**-7
    gu = gemm_calls[2][2].double().cpu()  # off: gate_up's [M, 2I] bf16 output
    h_off_pre = (torch.nn.functional.silu(gu[:, :I].float()) * gu[:, I:].float()).to(torch.bfloat16).double()
    bound_mid = 1.2 * u.abs() * e_g + sg.abs() * e_u + (ulp + 1e-6) * h64.abs()
    bound_off = (1.2 * u.abs() * (e_g + ulp * (g.abs() + e_g)) + (sg.abs() + 1.2 * (e_g + ulp * g.abs()))
                 * (e_u + ulp * (u.abs() + e_u)) + (ulp + 1e-6) * h64.abs())
    assert_within(calls[0][2].double().cpu(), h64, bound_mid + 1e-30, "mid gate output vs float64")
    assert_within(h_off_pre, h64, bound_off + 1e-30, "_scaled_mm-path gate output vs float64")
    assert float(bound_off.max()) < 0.1 * float(h64.abs().max())

    dm = dequantize(h_mid.q.cpu(), h_mid.scale.cpu()).double()
    do = dequantize(h_off.q.cpu(), h_off.scale.cpu()).double()
    flips = (h_mid.q.float() != h_off.q.float()).double().mean().item()
    print(f"e4m3 down-input codes differing between the routes: {flips:.3f}")
    assert flips < 0.5  # most elements quantise to the same code (scales differ by ~2**-8)
    wd = dequantize(down.weight.cpu(), down.weight_scale.cpu()).double()
    ym, yo = y_mid.double().cpu(), y_off.double().cpu()
    bound = ((dm - do).abs() @ wd.abs().T + _gamma(I) * ((dm.abs() + do.abs()) @ wd.abs().T)
             + ulp * (ym.abs() + yo.abs()))
    assert_within(ym, yo, bound + 1e-30, "MLP output, mid vs off")
