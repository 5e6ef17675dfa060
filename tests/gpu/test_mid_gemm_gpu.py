"""Mid-size decode GEMM (`attnserve.models.layers.mid_gemm`) on a GPU at real shapes.

Shapes ``(N, K)``: Llama-3-8B qkv (6144, 4096), o (4096, 4096), gate_up (28672, 4096,
gated), down (4096, 14336); Qwen3-0.6B o (1024, 2048), down (1024, 3072); M in {17, 96,
144, 256} (one piece, 64 + 32, 128 + 16, 256). Configs: pointer loads, TMA, split-K 4 (the
forms of the benchmark's candidates). Reference: float64 product of the same bf16 inputs.

Bound (element-wise): float32 accumulation over K terms in any order, ``gamma_{K+1} (|x|
@ |W|^T)`` (Higham eq. 3.5, `dot_product_bound` with one implementation), plus the
rounding of the output to bf16, half an ulp = ``2**-8 |y|`` (round to nearest). Gated:
``1.2 |u| e_g + |act(g)| e_u`` for the accumulation errors of gate and up (|act'| <= 1.2),
float32 activation math ``1e-6 |y|``, then the bf16 rounding. A wrong row, column or K
chunk gives errors of order |y|, far above.

The PDL form (`MidGemmConfig.pdl`, issue 33) must equal the same config without PDL bit
for bit (same products, same order), eagerly and inside a CUDA graph behind the kernel
that writes its input; those tests skip where PDL is off (pre-Hopper, ``ATTNSERVE_PDL=0``).
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F

from attnserve.models.layers.linear import Linear
from attnserve.models.layers.mid_gemm import (
    MidGemmConfig,
    mid_linear,
    mid_linear_gated,
    table_file_name,
    table_key,
)
from gate_reference import gate_act_ref
from numeric_bounds import dot_product_bound
from call_spy import LaunchSpy

pytestmark = pytest.mark.cuda
DEV = "cuda"
HALF_ULP = 2.0**-8
#: a weight shape in no packaged table (plain or gated), for the table-selection test
TABLE_TEST_SHAPE = (2560, 1536)
CONFIGS = {
    "ptr": MidGemmConfig(block_n=64, block_k=64, num_warps=4, num_stages=4),
    "tma": MidGemmConfig(block_n=64, block_k=64, num_warps=8, num_stages=4, use_tma=True),
    "tma-sk4": MidGemmConfig(block_n=64, block_k=64, num_warps=4, num_stages=5, split_k=4, use_tma=True),
    "ptr-sk2-n128": MidGemmConfig(block_n=128, block_k=64, num_warps=8, num_stages=4, split_k=2),
}


def _inputs(m, n, k, seed, bias=False):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(m, k, device=DEV, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device=DEV, generator=g) / math.sqrt(k)).to(torch.bfloat16)
    b = torch.randn(n, device=DEV, generator=g).to(torch.bfloat16) if bias else None
    return x, w, b


def _check_linear(y, x, w, b=None):
    ref = x.double() @ w.double().T + (b.double() if b is not None else 0.0)
    bound = dot_product_bound(x, w, b, implementations=1) + HALF_ULP * ref.abs() + 1e-30
    ratio = ((y.double() - ref).abs() / bound).max().item()
    assert ratio <= 1.0, f"max |delta| / bound = {ratio:.3f}"



def _check_gated(y, x, w, activation, b=None):
    full = x.double() @ w.double().T + (b.double() if b is not None else 0.0)
    i = w.shape[0] // 2
    g, u = full[:, :i], full[:, i:]
    ref = gate_act_ref(g, activation) * u
    e = dot_product_bound(x, w, b, implementations=1)
    bound = 1.2 * u.abs() * e[:, :i] + gate_act_ref(g, activation).abs() * e[:, i:] + (HALF_ULP + 1e-6) * ref.abs() + 1e-30
    ratio = ((y.double() - ref).abs() / bound).max().item()
    assert ratio <= 1.0, f"max |delta| / bound = {ratio:.3f}"


@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (4096, 14336), (1024, 2048), (1024, 3072)])
@pytest.mark.parametrize("m", [17, 96, 144, 256])
def test_mid_linear_real_shapes(m, n, k, cfg):
    x, w, _ = _inputs(m, n, k, seed=m + n + k)
    y = mid_linear(x, w, config=CONFIGS[cfg])
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    _check_linear(y, x, w)


@pytest.mark.parametrize("m, cfg", [(m, c) for m in (17, 144, 256) for c in ("ptr", "tma", "ptr-sk2-n128")
                                     if (m, c) != (256, "ptr-sk2-n128")])  # 256 KB of shared memory: never tabled
def test_mid_linear_gated_llama_gate_up(m, cfg):
    x, w, _ = _inputs(m, 28672, 4096, seed=3 * m)
    y = mid_linear_gated(x, w, "silu", config=CONFIGS[cfg])
    assert y.shape == (m, 14336)
    _check_gated(y, x, w, "silu")


@pytest.mark.parametrize("cfg", ["ptr", "tma-sk4"])
def test_mid_linear_bias_and_gelu(cfg):
    x, w, b = _inputs(100, 6144, 1024, seed=5, bias=True)
    _check_linear(mid_linear(x, w, b, config=CONFIGS[cfg]), x, w, b)
    _check_gated(mid_linear_gated(x, w, "gelu_tanh", bias=b, config=CONFIGS[cfg]), x, w, "gelu_tanh", b)


@pytest.mark.parametrize("cfg", ["tma", "tma-sk4"])
def test_cuda_graph_capture_replay(cfg):
    """Captured at M = 144 (a decode graph's static batch), replayed on new inputs: equal to
    eager calls bit for bit where there is no split-K, within the bound otherwise."""
    config = CONFIGS[cfg]
    x, w, _ = _inputs(144, 4096, 14336, seed=7)
    _, wg, _ = _inputs(144, 2 * 1536, 14336, seed=8)
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            mid_linear(static_x, w, config=config)
            mid_linear_gated(static_x, wg, "silu", config=config)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        y = mid_linear(static_x, w, config=config)
        z = mid_linear_gated(static_x, wg, "silu", config=config)
    for seed in (21, 22):
        new_x, _, _ = _inputs(144, 4096, 14336, seed=seed)
        static_x.copy_(new_x)
        graph.replay()
        torch.cuda.synchronize()
        _check_linear(y, new_x, w)
        _check_gated(z, new_x, wg, "silu")
        if config.split_k == 1:
            torch.testing.assert_close(y, mid_linear(new_x, w, config=config), rtol=0, atol=0)


def test_linear_takes_the_path_only_with_a_table_entry(tmp_path, monkeypatch):
    """No table: cuBLAS (F.linear) for 17..256 rows. A table whose entry for (N, K) at M <= 64
    holds a config: those rows go through `mid_linear` (and the gated form through its
    own entry); rows past the entry's buckets and ``ATTNSERVE_MID_GEMM=0`` stay on cuBLAS."""
    import attnserve.models.layers.linear as linear_mod

    calls = []
    real, real_g = linear_mod.mid_linear, linear_mod.mid_linear_gated
    monkeypatch.setattr(linear_mod, "mid_linear", lambda *a, **kw: calls.append("lin") or real(*a, **kw))
    monkeypatch.setattr(linear_mod, "mid_linear_gated", lambda *a, **kw: calls.append("gated") or real_g(*a, **kw))
    monkeypatch.setenv("ATTNSERVE_MID_GEMM_CONFIG_DIR", str(tmp_path / "empty"))
    # (N, K) of no model the packaged tables cover (6144 x 1024 is Qwen3-0.6B's gate_up there)
    n, k = TABLE_TEST_SHAPE
    lin = Linear(k, n, dtype=torch.bfloat16).to(DEV)
    x, w, _ = _inputs(64, n, k, seed=9)
    with torch.no_grad():
        lin.weight.copy_(w)
    dev_name = torch.cuda.get_device_name()
    for gated in (False, True):
        for m in (17, 32, 64, 65, 256):
            if linear_mod.mid_gemm_config(m, n, k, torch.bfloat16, x.device, gated) is not None:
                pytest.fail(f"a packaged table already selects ({n}, {k}, gated={gated}) at M={m}; pick another shape")
    lin(x)
    lin.forward_gated(x, "silu")
    assert calls == []
    cfg = CONFIGS["tma"].to_dict()
    table = {"entries": {table_key(n, k, False): {"32": "cublas", "64": cfg},
                         table_key(n, k, True): {"64": cfg}}}
    d = tmp_path / "tables"
    d.mkdir()
    (d / table_file_name(dev_name, torch.bfloat16)).write_text(json.dumps(table))
    monkeypatch.setenv("ATTNSERVE_MID_GEMM_CONFIG_DIR", str(d))
    _check_linear(lin(x), x, w)
    _check_gated(lin.forward_gated(x, "silu"), x, w, "silu")
    assert calls == ["lin", "gated"]
    lin(x[:32])  # bucket (16, 32] says cublas
    lin(torch.cat([x, x])[:65])  # past the largest measured M
    assert calls == ["lin", "gated"]
    monkeypatch.setenv("ATTNSERVE_MID_GEMM", "0")
    lin(x)
    assert calls == ["lin", "gated"]
    torch.testing.assert_close(lin(x), F.linear(x, w), rtol=0, atol=0)  # cuBLAS itself


# ----------------------------------------------------------------------------- PDL form
#: the PDL form (`MidGemmConfig.pdl`), pointer and TMA loads, with and without L2 prefetch;
#: three stages so that the gated form fits at M = 256 with the peeled step's extra stage
PDL_CONFIGS = {
    "ptr-pdl": MidGemmConfig(block_n=64, block_k=64, num_warps=4, num_stages=3, pdl=True),
    "tma-pdl-pf3": MidGemmConfig(block_n=64, block_k=64, num_warps=8, num_stages=3, use_tma=True, pdl=True,
                                 prefetch=3),
    "ptr-k128-pdl-pf2": MidGemmConfig(block_n=64, block_k=128, num_warps=8, num_stages=2, pdl=True, prefetch=2),
}


#: what the sweep would try (benchmarks/midgemm.py: SMEM_LIMIT, ACC_LIMIT); e.g. the
#: block_k 128 config needs 240 KB of shared memory at M = 256
_SMEM_CAP, _ACC_CAP = 220 << 10, 160


def _pdl_cases(ms, gated):
    return [(m, c) for m in ms for c, cfg in PDL_CONFIGS.items()
            if cfg.smem_bytes(m, gated) <= _SMEM_CAP and cfg.acc_per_thread(m, gated) <= _ACC_CAP]


def _plain(cfg: MidGemmConfig) -> MidGemmConfig:
    return dataclasses.replace(cfg, pdl=False, prefetch=0)


def _need_pdl():
    from attnserve.pdl import pdl_enabled

    if not pdl_enabled(torch.device(DEV)):
        pytest.skip("PDL is off here (pre-Hopper GPU, Triton < 3.3 or ATTNSERVE_PDL=0): the PDL form is not exercised")



@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (4096, 1024), (1024, 3072)],
                         ids=["llama-qkv", "llama-o", "qwen-qkv", "qwen-down"])
@pytest.mark.parametrize("m,cfg", _pdl_cases([17, 96, 144, 256], gated=False))
def test_pdl_form_eager_equals_plain_and_f_linear(monkeypatch, m, n, k, cfg):
    """Eager: the PDL launch equals the same config without PDL bit for bit, is within the
    float64 bound, and within twice that bound of ``F.linear`` (cuBLAS with float32
    reductions: both results carry at most the bound's error)."""
    _need_pdl()
    from attnserve.models.layers import mid_gemm_triton as kt

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction", False)
    spy = LaunchSpy(kt._mid_gemm_kernel)
    monkeypatch.setattr(kt, "_mid_gemm_kernel", spy)
    config = PDL_CONFIGS[cfg]
    x, w, _ = _inputs(m, n, k, seed=11 * m + n + k)
    y = mid_linear(x, w, config=config)
    y_plain = mid_linear(x, w, config=_plain(config))
    assert spy.launches[0]["USE_PDL"] and spy.launches[0].get("launch_pdl")
    assert not spy.launches[1]["USE_PDL"] and "launch_pdl" not in spy.launches[1]
    assert torch.equal(y, y_plain)
    _check_linear(y, x, w)
    ref = x.double() @ w.double().T
    # each result: float32 accumulation error e, then a rounding of at most 2**-8 of |ref| + e
    bound = 2.0 * (1 + HALF_ULP) * (dot_product_bound(x, w, None, implementations=1) + HALF_ULP * ref.abs()) + 1e-30
    ratio = ((y.double() - F.linear(x, w).double()).abs() / bound).max().item()
    assert ratio <= 1.0, f"max |ours - F.linear| / bound = {ratio:.3f}"


@pytest.mark.parametrize("n,k", [(28672, 4096), (6144, 1024)], ids=["llama-gate_up", "qwen-gate_up"])
@pytest.mark.parametrize("m,cfg", _pdl_cases([17, 144, 256], gated=True))
def test_pdl_form_gated_eager_equals_plain(m, n, k, cfg):
    _need_pdl()
    config = PDL_CONFIGS[cfg]
    x, w, _ = _inputs(m, n, k, seed=13 * m + n)
    y = mid_linear_gated(x, w, "silu", config=config)
    assert torch.equal(y, mid_linear_gated(x, w, "silu", config=_plain(config)))
    _check_gated(y, x, w, "silu")


@pytest.mark.parametrize("m,cfg", _pdl_cases([96, 144], gated=True))
def test_pdl_form_in_cuda_graph_behind_its_producer(m, cfg):
    """Captured as a decode step runs it: add + RMSNorm (the producer, PDL-launched as in
    the model) writes x, then the PDL GEMM reads it; a second norm, then the gated PDL GEMM.
    Replayed on new inputs, each output equals the plain config run eagerly on the x that
    the replay produced, bit for bit: a GEMM that read x before its producer finished
    would see the previous replay's x."""
    _need_pdl()
    from attnserve.models.layers.norm import RMSNorm

    config = PDL_CONFIGS[cfg]
    k = 4096
    _, w, _ = _inputs(m, 6144, k, seed=31)  # Llama-3-8B qkv
    _, wg, _ = _inputs(m, 28672, k, seed=32)  # Llama-3-8B gate_up
    g = torch.Generator(device=DEV).manual_seed(33)
    norm1 = RMSNorm(k, eps=1e-5, dtype=torch.bfloat16).to(DEV)
    norm2 = RMSNorm(k, eps=1e-5, dtype=torch.bfloat16).to(DEV)
    with torch.no_grad():
        norm1.weight.copy_(torch.rand(k, device=DEV, generator=g) + 0.5)
        norm2.weight.copy_(torch.rand(k, device=DEV, generator=g) + 0.5)
    delta = torch.zeros(m, k, dtype=torch.bfloat16, device=DEV)
    res = torch.zeros(m, k, dtype=torch.bfloat16, device=DEV)
    delta2 = torch.zeros(m, k, dtype=torch.bfloat16, device=DEV)

    def step():
        h1, _ = norm1(delta, res)
        y = mid_linear(h1, w, config=config)
        h2, _ = norm2(delta2, res)
        z = mid_linear_gated(h2, wg, "silu", config=config)
        return h1, y, h2, z

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        h1, y, h2, z = step()
    for _ in range(3):
        delta.copy_(torch.randn(m, k, device=DEV, generator=g))
        delta2.copy_(torch.randn(m, k, device=DEV, generator=g))
        res.copy_(torch.randn(m, k, device=DEV, generator=g))
        graph.replay()
        torch.cuda.synchronize()
        x1, x2 = h1.clone(), h2.clone()
        assert torch.equal(y, mid_linear(x1, w, config=_plain(config)))
        assert torch.equal(z, mid_linear_gated(x2, wg, "silu", config=_plain(config)))
        _check_linear(y, x1, w)
        _check_gated(z, x2, wg, "silu")


def test_pdl_switch_off_launches_plainly(monkeypatch):
    """``ATTNSERVE_PDL=0``: a ``pdl`` config launches the plain kernel (no ``launch_pdl``,
    ``USE_PDL`` False), with the same result."""
    from attnserve.models.layers import mid_gemm_triton as kt

    spy = LaunchSpy(kt._mid_gemm_kernel)
    monkeypatch.setattr(kt, "_mid_gemm_kernel", spy)
    monkeypatch.setenv("ATTNSERVE_PDL", "0")
    config = PDL_CONFIGS["tma-pdl-pf3"]
    x, w, _ = _inputs(144, 4096, 1024, seed=41)
    y = mid_linear(x, w, config=config)
    assert spy.launches[0]["USE_PDL"] is False and "launch_pdl" not in spy.launches[0]
    assert spy.launches[0]["PREFETCH_LINES"] == 0
    torch.testing.assert_close(y, mid_linear(x, w, config=_plain(config)), rtol=0, atol=0)


def test_shipped_table_entries_match_float64():
    """Every kernel entry of the table shipped for this GPU (`mid_gemm.package_table_dir`; none
    for GPUs without one: skipped) at its own row count, plain or gated as its key says,
    against the float64 product within the bounds above. (The sweep that wrote the table
    checked each candidate against cuBLAS; this keeps the shipped JSON honest after edits.)"""
    import os

    from attnserve.models.layers.mid_gemm import _read_table, package_table_dir

    path = os.path.join(str(package_table_dir()), table_file_name(torch.cuda.get_device_name(), torch.bfloat16))
    table = _read_table(path)
    if table is None:
        pytest.skip(f"no shipped bf16 mid GEMM table for {torch.cuda.get_device_name()}")
    ran = 0
    for key, rows in table.items():
        fields = dict(part.split("=") for part in key.split(","))
        n, k, gated = int(fields["N"]), int(fields["K"]), fields["gated"] == "1"
        for m, cfg in rows:
            if cfg is None:
                continue
            x, w, _ = _inputs(m, n, k, seed=m + n + k)
            if gated:
                _check_gated(mid_linear_gated(x, w, "silu", config=cfg), x, w, "silu")
            else:
                _check_linear(mid_linear(x, w, config=cfg), x, w)
            ran += 1
    assert ran > 0
