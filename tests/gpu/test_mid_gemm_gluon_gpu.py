"""Gluon split-K / stream-K mid GEMM (`attnserve.models.layers.mid_gemm_gluon`) on an sm_90 GPU.

Shapes ``(N, K)``: Llama-3-8B qkv (6144, 4096), o (4096, 4096), down (4096, 14336); Qwen3-0.6B
qkv (4096, 1024), o (1024, 2048), down (1024, 3072); M in {17, 33, 64, 96, 128, 144, 200,
256} (pieces 32, 32 + 16, 64, 64 + 32, 128, 128 + 16, 256, 256). Configs cover the kernel's
paths: stream-K over every SM (split tiles: slot stores, counters, the last arriver's
fixed-order gather), split-K by 2 and 4 (one segment a CTA where S divides the K steps), by 3
(segments straddling tiles: CTAs with a first and a last partial segment, slots 2c and
2c + 1), by 8 with one consumer (more CTAs than SMs at 64-row tiles: nobody waits, so no
co-residency is needed), data-parallel (split_k 1: direct writes only), a small odd grid
(CTAs spanning whole tiles between partial ones), ``block_k`` 128 (two 64-column chunks a
stage), 2 x 128 rows, PDL. Ragged ``N`` and ``K`` (1000 x 1000: neither a multiple of a
tile) test the TMA zero fill. The outputs are poisoned (the caching allocator hands ``y`` a
block that held NaNs) so an unwritten element fails, and the workspace slots are filled with
NaNs before every launch, so a slot read before it is written (or a sum into a slot rather
than an overwrite) fails.

Reference: ``x.double() @ w.double().T (+ b)`` from the same bf16 inputs. Bound (element-
wise): float32 accumulation of K products in any order, ``gamma_{K+1} (|x| @ |W|^T + |b|)``
(Higham, "Accuracy and Stability of Numerical Algorithms", eq. 3.5;
`numeric_bounds.dot_product_bound` with one implementation), plus the final rounding to
bf16, half an ulp = ``2**-8 |y|`` (round to nearest). The bias is added in float32 (one more
term of the bound). A wrong tile, row, K chunk or slot gives errors of order |y|, far above
the bound.

CUDA graph: captured once with a caller-owned workspace, replayed twice on the same input
and once on a new one; the counters are zero after every replay, the replays agree with
the bound, and the two replays and an eager call of the same config are bit-identical for
every config (split tiles are summed in a fixed CTA order, whichever CTA arrives last).

Gated (`gluon_mid_linear_gated`, fused gate_up): Llama-3-8B 28672 x 4096 and Qwen3-0.6B 6144
x 1024 at M in {17, 33, 96, 144, 192}, plus a ragged 2000 x 1000; SiLU without bias and
GELU-tanh with bias; bound in `_check_gated`; a CUDA graph replayed on new inputs with the
counters zero after each replay.

Runtime: mostly Gluon compiles (~100 kernels: configs x row pieces x flags), a few minutes;
the benchmark (``benchmarks/midgemm_gluon.py``) then finds most of its kernels compiled.
"""

from __future__ import annotations

import math

import pytest
import torch

from attnserve.models.layers.mid_gemm_gluon import (
    GluonMidGemmConfig,
    GluonMidGemmWorkspace,
    fit_stages,
    gluon_mid_gemm_supported,
    gluon_mid_linear,
    launch_geometry,
)
from gate_reference import gate_act_ref
from numeric_bounds import dot_product_bound

pytestmark = pytest.mark.cuda
DEV = "cuda"
HALF_ULP = 2.0**-8
SHAPES = [(6144, 4096), (4096, 4096), (4096, 14336), (4096, 1024), (1024, 2048), (1024, 3072)]
MS = [17, 33, 64, 96, 128, 144, 200, 256]
# the benchmark's kernels (`fit_stages` trims the ring where it does not fit, as the benchmark
# does), so its run finds them compiled
CONFIGS = {
    "sk-c2": GluonMidGemmConfig(128, 64, 6, 2),
    "dp-c2": GluonMidGemmConfig(128, 64, 6, 2, split_k=1),
    "k2-c2": GluonMidGemmConfig(128, 64, 6, 2, split_k=2),
    "k3-c2": GluonMidGemmConfig(128, 64, 6, 2, split_k=3),
    "sk-c1": GluonMidGemmConfig(64, 64, 6, 1),
    "k8-c1": GluonMidGemmConfig(64, 64, 6, 1, split_k=8),
    "grid7-c1": GluonMidGemmConfig(64, 64, 6, 1, grid=7),
    "k128-c2": GluonMidGemmConfig(128, 128, 3, 2),
    "n256-c2": GluonMidGemmConfig(256, 64, 4, 2),  # 2 x 128 rows; only where the accumulators fit
    "pdl-k4-c2": GluonMidGemmConfig(128, 64, 6, 2, pdl=True, split_k=4),
}


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


requires_hopper = pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU (Gluon wgmma/TMA kernel)")


def _config(name, n, m):
    """CONFIGS[name] as run at ``m`` rows (None: it does not fit there)."""
    return fit_stages(CONFIGS[name], m)


def _inputs(m, n, k, seed, bias=False):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(m, k, device=DEV, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device=DEV, generator=g) / math.sqrt(k)).to(torch.bfloat16)
    b = torch.randn(n, device=DEV, generator=g).to(torch.bfloat16) if bias else None
    return x, w, b


def _poison(nbytes):
    """Leave a freed NaN block in the caching allocator, so the next output lands on NaNs."""
    t = torch.full((nbytes // 4 + 1024,), float("nan"), device=DEV)
    del t


class _Ref:
    def __init__(self, x, w, b=None):
        self.ref = x.double() @ w.double().T + (b.double() if b is not None else 0.0)
        self.bound = dot_product_bound(x, w, b, implementations=1) + HALF_ULP * self.ref.abs() + 1e-30

    def check(self, y, what=""):
        assert y.shape == self.ref.shape and y.dtype == torch.bfloat16
        assert torch.isfinite(y).all(), f"{what}: non-finite output (an element left unwritten?)"
        ratio = ((y.double() - self.ref).abs() / self.bound).max().item()
        assert ratio <= 1.0, f"{what}: max |delta| / bound = {ratio:.3f}"


def _prepare(ws, m, n, k, cfg, gated=False):
    """Create the launch's workspace now and fill its slots with NaN (a slot read before it
    is written, or accumulated into, poisons the output); the counters must already be 0."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    geo = launch_geometry(m, n, k, cfg, sms, gated)
    slots, cnt = ws.get(torch.device(DEV), geo["ws_rows"], geo["ws_cols"], geo["counters"])
    assert len(ws.buffers) == 1, "the launch must find these buffers (one device key)"
    slots.fill_(float("nan"))
    return geo


def _counters_zero(ws, what=""):
    for cnt in ws.counters():
        assert cnt.abs().max().item() == 0, f"{what}: tile counters left non-zero"


@requires_hopper
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", MS)
def test_real_shapes_all_configs(m, n, k):
    x, w, _ = _inputs(m, n, k, seed=m * 7 + n + k)
    ref = _Ref(x, w)
    ws = GluonMidGemmWorkspace()
    ran = 0
    for name in CONFIGS:
        cfg = _config(name, n, m)
        if cfg is None:
            continue
        _prepare(ws, m, n, k, cfg)
        _poison(m * n * 2)
        y = gluon_mid_linear(x, w, config=cfg, workspace=ws)
        torch.cuda.synchronize()
        ref.check(y, f"{name} M={m} N={n} K={k}")
        _counters_zero(ws, name)
        ran += 1
    assert ran >= 6


@requires_hopper
@pytest.mark.parametrize("n,k", [(6144, 4096), (1024, 3072)])
@pytest.mark.parametrize("m", MS)
def test_bias(m, n, k):
    x, w, b = _inputs(m, n, k, seed=m + 3, bias=True)
    ref = _Ref(x, w, b)
    for name in ("sk-c2", "dp-c2", "k3-c2"):
        cfg = _config(name, n, m)
        ws = GluonMidGemmWorkspace()
        _prepare(ws, m, n, k, cfg)
        _poison(m * n * 2)
        ref.check(gluon_mid_linear(x, w, b, config=cfg, workspace=ws), f"{name} bias M={m}")


@requires_hopper
def test_strided_x_and_refusals():
    x, w, _ = _inputs(144, 4096, 1024, seed=1)
    big = torch.zeros(144, 1024 + 64, dtype=torch.bfloat16, device=DEV)
    big[:, :1024] = x
    xs = big[:, :1024]  # row stride 1088
    _Ref(x, w).check(gluon_mid_linear(xs, w, config=CONFIGS["sk-c2"], workspace=GluonMidGemmWorkspace()), "strided")
    assert not gluon_mid_gemm_supported(torch.zeros(144, 1001, dtype=torch.bfloat16, device=DEV),
                                        torch.zeros(64, 1001, dtype=torch.bfloat16, device=DEV))
    with pytest.raises(ValueError):
        gluon_mid_linear(torch.zeros(144, 1001, dtype=torch.bfloat16, device=DEV),
                         torch.zeros(64, 1001, dtype=torch.bfloat16, device=DEV))
    with pytest.raises(ValueError):
        gluon_mid_linear(x, w, config=GluonMidGemmConfig(128, 128, 6, 2))  # ring over shared memory


@requires_hopper
@pytest.mark.parametrize("name", ["sk-c2", "dp-c2", "k2-c2", "k3-c2", "k8-c1", "grid7-c1", "pdl-k4-c2"])
@pytest.mark.parametrize("m,n,k", [(144, 6144, 4096), (144, 4096, 14336), (200, 1024, 2048), (33, 4096, 1024)])
def test_cuda_graph_deterministic(name, m, n, k):
    """Captured behind the kernel that writes x (PDL overlaps it where enabled), replayed twice
    on one input (bit-identical, and bit-identical to an eager call) and once on another;
    the counters are zero after every replay, the slots NaN-filled before each."""
    cfg = _config(name, n, m)
    x, w, b = _inputs(m, n, k, seed=11, bias=True)
    src = x.float()
    static_x = torch.empty_like(x)
    ws = GluonMidGemmWorkspace()
    _prepare(ws, m, n, k, cfg)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up: compile, create the workspace outside the capture
            static_x.copy_(src)
            gluon_mid_linear(static_x, w, b, config=cfg, workspace=ws)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        static_x.copy_(src)  # the producer of x: a kernel right before the GEMM
        y = gluon_mid_linear(static_x, w, b, config=cfg, workspace=ws)
    ref = _Ref(x, w, b)
    outs = []
    for _ in range(2):
        _prepare(ws, m, n, k, cfg)
        graph.replay()
        torch.cuda.synchronize()
        ref.check(y, f"{name} replay")
        _counters_zero(ws, f"{name} replay")
        outs.append(y.clone())
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16)), f"{name}: replays differ in bits"
    eager = gluon_mid_linear(x, w, b, config=cfg, workspace=ws)
    assert torch.equal(outs[0].view(torch.int16), eager.view(torch.int16)), f"{name}: graph and eager differ"
    x2, _, _ = _inputs(m, n, k, seed=12)
    src.copy_(x2.float())
    graph.replay()
    torch.cuda.synchronize()
    _Ref(x2, w, b).check(y, f"{name} replay on new input")
    _counters_zero(ws, f"{name} new input")


# ----------------------------------------------------------------------------- gated form
#: gated configs: two consumers of 64 gate + 64 up rows each (M <= 160), one consumer (M <= 192)
GATED_CONFIGS = {
    "g-sk-c2": GluonMidGemmConfig(128, 64, 6, 2),
    "g-dp-c2": GluonMidGemmConfig(128, 64, 6, 2, split_k=1),
    "g-sk-c1": GluonMidGemmConfig(64, 64, 6, 1),
    "g-k3-c2": GluonMidGemmConfig(128, 64, 6, 2, split_k=3),
}



def _check_gated(y, x, w, activation, b=None, what=""):
    """Bound: the accumulation errors ``e_g``, ``e_u`` of gate and up (as `_Ref`) propagate as
    ``1.2 |u| e_g + |act(g)| e_u`` (``|act'| <= 1.2`` for SiLU and GELU-tanh; second-order
    terms are far smaller), float32 activation math ``1e-6 |y|``, then the bf16 rounding."""
    full = x.double() @ w.double().T + (b.double() if b is not None else 0.0)
    i = w.shape[0] // 2
    g, u = full[:, :i], full[:, i:]
    ref = gate_act_ref(g, activation) * u
    e = dot_product_bound(x, w, b, implementations=1)
    bound = 1.2 * u.abs() * e[:, :i] + gate_act_ref(g, activation).abs() * e[:, i:] + (HALF_ULP + 1e-6) * ref.abs() + 1e-30
    assert y.shape == ref.shape and torch.isfinite(y).all(), f"{what}: shape or non-finite output"
    ratio = ((y.double() - ref).abs() / bound).max().item()
    assert ratio <= 1.0, f"{what}: max |delta| / bound = {ratio:.3f}"


def _gated_config(name, i, m):
    return fit_stages(GATED_CONFIGS[name], m, gated=True)


GATED_CASES = [(m, n2, k) for n2, k in [(28672, 4096), (6144, 1024)] for m in (17, 33, 96, 144, 192)]
GATED_CASES += [(33, 2000, 1000), (144, 2000, 1000)]  # ragged I and K: TMA zero fill


@requires_hopper
@pytest.mark.parametrize("m,n2,k", GATED_CASES)
def test_gated(m, n2, k):
    from attnserve.models.layers.mid_gemm_gluon import gluon_mid_linear_gated

    x, w, b = _inputs(m, n2, k, seed=m + n2, bias=True)
    ws = GluonMidGemmWorkspace()
    ran = 0
    for name in GATED_CONFIGS:
        cfg = _gated_config(name, n2 // 2, m)
        if cfg is None:
            continue
        for act, bias in (("silu", None), ("gelu_tanh", b)):
            _prepare(ws, m, n2 // 2, k, cfg, gated=True)
            _poison(m * n2)
            y = gluon_mid_linear_gated(x, w, act, bias, config=cfg, workspace=ws)
            torch.cuda.synchronize()
            _check_gated(y, x, w, act, bias, f"{name} {act} M={m} 2I={n2} K={k}")
            _counters_zero(ws, name)
            ran += 1
    assert ran >= 2


@requires_hopper
def test_gated_cuda_graph_and_refusals():
    from attnserve.models.layers.mid_gemm_gluon import gluon_mid_linear_gated

    m, n2, k = 144, 6144, 1024
    x, w, _ = _inputs(m, n2, k, seed=5)
    cfg = _gated_config("g-sk-c2", n2 // 2, m)
    ws = GluonMidGemmWorkspace()
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        gluon_mid_linear_gated(static_x, w, "silu", config=cfg, workspace=ws)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        y = gluon_mid_linear_gated(static_x, w, "silu", config=cfg, workspace=ws)
    outs = []
    for seed in (6, 7, 6):
        x2, _, _ = _inputs(m, n2, k, seed=seed)
        static_x.copy_(x2)
        _prepare(ws, m, n2 // 2, k, cfg, gated=True)
        graph.replay()
        torch.cuda.synchronize()
        _check_gated(y, x2, w, "silu", None, f"graph replay {seed}")
        _counters_zero(ws, "gated graph")
        outs.append(y.clone())
    assert torch.equal(outs[0].view(torch.int16), outs[2].view(torch.int16)), "gated replays differ in bits"
    with pytest.raises(ValueError):
        gluon_mid_linear_gated(x, w, "relu", config=cfg)
    with pytest.raises(ValueError):
        gluon_mid_linear_gated(x, w[:-1], "silu", config=cfg)
    with pytest.raises(ValueError):  # gate + up accumulators of 2 x 64 rows at 256 rows: over the registers
        gluon_mid_linear_gated(torch.zeros(256, k, dtype=torch.bfloat16, device=DEV), w, "silu",
                               config=GluonMidGemmConfig(128, 64, 4, 2))


# ----------------------------------------------------------------------------- ragged (last)
@requires_hopper
@pytest.mark.parametrize("m", [17, 144, 256])
@pytest.mark.parametrize("n,k", [(1000, 1000), (200, 72), (4104, 1032)])
def test_ragged_n_and_k(m, n, k):
    """K not a multiple of block_k (nor of 64), N not a multiple of block_n: TMA zero fill.
    4104 x 1032 also issues boxes wholly past the tensor (a consumer's rows past N, a 64-column
    chunk past K with block_k 128), which must land as zeros and count their bytes: last in
    this file, so a hang there leaves every other result printed."""
    x, w, b = _inputs(m, n, k, seed=m + n, bias=True)
    ref = _Ref(x, w, b)
    for name in CONFIGS:
        cfg = _config(name, n, m)
        if cfg is not None:
            ws = GluonMidGemmWorkspace()
            _prepare(ws, m, n, k, cfg)
            _poison(m * n * 2)
            ref.check(gluon_mid_linear(x, w, b, config=cfg, workspace=ws), f"{name} {m}x{n}x{k}")
            _counters_zero(ws, name)
