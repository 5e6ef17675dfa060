"""Mid-size decode GEMM (`attnserve.models.layers.mid_gemm`, 16 < M <= 256) against float64.

Runs on CPU under the Triton interpreter (tests/kernels/conftest.py) and on a GPU as is.
Shapes are tiny and ragged: N = 40 / 72 / 2 x 20 (not multiples of ``block_n``), K = 72 /
100 (tails of 8 and 36 past ``block_k``), M = 17 (one 32-row piece), 33 (32 + 16 pieces) and
64; split-K with 2 and 3 programs per column block (one of them with an empty or short
range), TMA off (the interpreter path). The PDL form (`MidGemmConfig.pdl`: first K step
peeled off the loop; under the interpreter without its griddepcontrol / prefetch
instructions) must equal the plain kernel bit for bit.

Bound (element-wise), the reference being float64 from the *same* bf16 inputs:

* float32 accumulation over K terms in whatever order the kernel and its split-K atomics
  add them: ``gamma_{K+1} * (|x| @ |W|^T + |b|)`` (Higham eq. 3.5, any order;
  `dot_product_bound` with ``implementations=1``);
* one rounding of the output to bf16: at most one bf16 ulp, ``2**-7 * |y|`` (round to
  nearest gives half of it on a GPU; the interpreter's conversion may truncate).

Gated: ``act(g) * u`` with ``|act'| <= 1.2`` for SiLU and GELU-tanh, so the accumulation
errors ``eg``, ``eu`` of gate and up propagate as ``1.2 |u| eg + |act(g)| eu`` (plus second
order terms, far smaller), float32 activation math adds ``~1e-6 |y|``, then the bf16
rounding as above.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from attnserve.models.layers.mid_gemm import (
    MidGemmConfig,
    load_mid_gemm_table,
    m_pieces,
    mid_gemm_supported,
    mid_linear,
    mid_linear_gated,
    select_from_table,
    table_file_name,
    table_key,
)
from gate_reference import gate_act_ref
from numeric_bounds import assert_within, dot_product_bound
from call_spy import LaunchSpy

BF16_ULP = 2.0**-7


def _inputs(gen, m, n, k, device, bias):
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(device)
    w = (torch.randn(n, k, generator=gen) / math.sqrt(k)).to(torch.bfloat16).to(device)
    b = torch.randn(n, generator=gen).to(torch.bfloat16).to(device) if bias else None
    return x, w, b



@pytest.mark.parametrize("m,n,k,cfg,bias", [
    (17, 40, 72, MidGemmConfig(block_n=16, block_k=32, num_stages=2), False),
    (33, 40, 72, MidGemmConfig(block_n=32, block_k=32, split_k=3), True),
    (64, 72, 100, MidGemmConfig(block_n=64, block_k=64, split_k=2), False),
], ids=["m17", "m33-split3-bias", "m64-split2"])
def test_mid_linear_matches_float64(gen, device, m, n, k, cfg, bias):
    x, w, b = _inputs(gen, m, n, k, device, bias)
    assert mid_gemm_supported(x, w, b)
    y = mid_linear(x, w, b, config=cfg)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16 and y.is_contiguous()
    ref = x.double() @ w.double().T + (b.double() if b is not None else 0.0)
    bound = dot_product_bound(x, w, b, implementations=1) + BF16_ULP * ref.abs()
    assert_within(y.cpu(), ref.cpu(), bound.cpu() + 1e-30, f"mid_linear m={m} {cfg}")


@pytest.mark.parametrize("m,activation,cfg,bias", [
    (33, "silu", MidGemmConfig(block_n=16, block_k=32), True),
    (17, "gelu_tanh", MidGemmConfig(block_n=16, block_k=32, split_k=2), False),
], ids=["m33-silu-bias", "m17-gelu-split2"])
def test_mid_linear_gated_matches_float64(gen, device, m, activation, cfg, bias):
    n, k = 40, 72  # 20 gate + 20 up rows: a partial 16-row block
    x, w, b = _inputs(gen, m, n, k, device, bias)
    y = mid_linear_gated(x, w, activation, bias=b, config=cfg)
    assert y.shape == (m, n // 2) and y.dtype == torch.bfloat16
    full = x.double() @ w.double().T + (b.double() if b is not None else 0.0)
    g, u = full[:, : n // 2], full[:, n // 2:]
    ref = gate_act_ref(g, activation) * u
    e = dot_product_bound(x, w, b, implementations=1)
    eg, eu = e[:, : n // 2], e[:, n // 2:]
    bound = 1.2 * u.abs() * eg + gate_act_ref(g, activation).abs() * eu + (BF16_ULP + 1e-6) * ref.abs() + 1e-30
    assert_within(y.cpu(), ref.cpu(), bound.cpu(), f"mid_linear_gated {activation} m={m}")


def test_m_pieces_cover_rows_with_little_padding():
    for m in range(1, 257):
        m1, m2 = m_pieces(m)
        assert m1 + m2 >= m and m1 >= 16 and (m2 == 0 or 16 <= m2 < m1)
        for p in (m1, m2):
            assert p == 0 or p & (p - 1) == 0
        # padding: within 2x of the rows and below a single next-power-of-two tile
        assert m1 + m2 <= max(32, 2 * m) and m1 + m2 <= max(16, 1 << (m - 1).bit_length())
    assert m_pieces(144) == (128, 16) and m_pieces(96) == (64, 32) and m_pieces(200) == (256, 0)
    with pytest.raises(ValueError):
        m_pieces(257)


def test_rejects_bad_inputs(device):
    x = torch.zeros(20, 8, dtype=torch.bfloat16, device=device)
    w = torch.zeros(16, 8, dtype=torch.bfloat16, device=device)
    assert not mid_gemm_supported(x.float(), w.float(), None)  # float32: not this path
    assert not mid_gemm_supported(torch.zeros(257, 8, dtype=torch.bfloat16, device=device), w)
    assert not mid_gemm_supported(x, torch.zeros(8, 16, dtype=torch.bfloat16, device=device).t())  # strided weight
    assert mid_gemm_supported(x, w)
    with pytest.raises(ValueError, match="mid_linear"):
        mid_linear(x.float(), w.float(), config=MidGemmConfig(16, 16))
    with pytest.raises(ValueError, match="even number of rows"):
        mid_linear_gated(x, w[:15], "silu", config=MidGemmConfig(16, 16))
    with pytest.raises(ValueError, match="activation"):
        mid_linear_gated(x, w, "relu", config=MidGemmConfig(16, 16))
    with pytest.raises(ValueError, match="powers of two"):
        MidGemmConfig(block_n=48, block_k=64).validate()


def test_table_buckets(tmp_path, monkeypatch):
    """A table written as ``benchmarks/midgemm.py --table-out`` writes it: an entry
    measured at M serves (previous measured M, M]; ``"cublas"`` and rows past the
    largest measured M select cuBLAS (None); unknown shapes give None."""
    device = "NVIDIA Test GPU 80GB"
    cfg = {"block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 4, "split_k": 2, "use_tma": True,
           "us": 40.0, "cublas_us": 50.0}
    data = {"meta": {}, "entries": {table_key(4096, 14336, False): {"64": "cublas", "144": cfg, "32": cfg}}}
    (tmp_path / table_file_name(device, torch.bfloat16)).write_text(json.dumps(data))
    monkeypatch.setenv("ATTNSERVE_MID_GEMM_CONFIG_DIR", str(tmp_path))
    table = load_mid_gemm_table(device, torch.bfloat16)
    want = MidGemmConfig(block_n=64, block_k=128, num_warps=4, num_stages=4, split_k=2, use_tma=True)
    for m, expect in [(17, want), (32, want), (33, None), (64, None), (65, want), (144, want), (145, None)]:
        assert select_from_table(table, m, 4096, 14336, False) == expect, m
    assert select_from_table(table, 144, 4096, 14336, True) is None  # gated entry absent
    assert load_mid_gemm_table(device, torch.float16) is None  # no file for that dtype
    bad = {"entries": {table_key(8, 8, False): {"32": {"block_n": 48, "block_k": 64}}}}
    (tmp_path / table_file_name("Bad GPU", torch.bfloat16)).write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="powers of two"):
        load_mid_gemm_table("Bad GPU", torch.bfloat16)



@pytest.mark.parametrize("m,n,k,gated,bias", [(17, 40, 100, False, True), (33, 40, 72, True, False)],
                         ids=["m17-bias-ktail", "m33-gated"])
def test_pdl_form_equals_plain_kernel(gen, device, monkeypatch, m, n, k, gated, bias):
    """The PDL form (first K step peeled off the loop, its weight loaded before the grid
    wait; under the interpreter without the griddepcontrol / prefetch instructions) adds
    the same products in the same order as the plain kernel: equal bit for bit, ragged M
    (one 32-row piece; 32 + 16 pieces), ragged N and K tails included."""
    from attnserve.models.layers import mid_gemm_triton as kt
    from attnserve.pdl import pdl_enabled

    spy = LaunchSpy(kt._mid_gemm_kernel)
    monkeypatch.setattr(kt, "_mid_gemm_kernel", spy)
    x, w, b = _inputs(gen, m, n, k, device, bias)
    plain = MidGemmConfig(block_n=16, block_k=32, num_stages=2)
    peeled = MidGemmConfig(block_n=16, block_k=32, num_stages=2, pdl=True, prefetch=2)
    if gated:
        y0 = mid_linear_gated(x, w, "silu", bias=b, config=plain)
        y1 = mid_linear_gated(x, w, "silu", bias=b, config=peeled)
    else:
        y0 = mid_linear(x, w, b, config=plain)
        y1 = mid_linear(x, w, b, config=peeled)
    on = device.type == "cpu" or pdl_enabled(device)  # the interpreter always runs the peeled form
    assert [kw["USE_PDL"] for kw in spy.launches] == [False, on]
    assert [kw.get("launch_pdl", False) for kw in spy.launches] == [False, on and device.type == "cuda"]
    assert spy.launches[1]["PREFETCH_LINES"] == (1 if on else 0)  # 2 steps of 32 = one 128-byte line
    assert torch.equal(y0, y1)
    ref = x.double() @ w.double().T + (b.double() if b is not None else 0.0)
    if not gated:  # and right, not only equal (the gated form's accuracy: the tests above)
        bound = dot_product_bound(x, w, b, implementations=1) + BF16_ULP * ref.abs()
        assert_within(y1.cpu(), ref.cpu(), bound.cpu() + 1e-30, "mid_linear pdl form")


def test_config_pdl_round_trip_and_rules():
    """``pdl`` / ``prefetch`` survive to_dict -> from_dict; a table entry written before they
    existed loads as False / 0; PDL with split-K and prefetch without PDL are refused; the
    PDL form's shared-memory estimate counts its peeled step's stage."""
    cfg = MidGemmConfig(block_n=64, block_k=128, num_warps=8, num_stages=3, use_tma=True, pdl=True, prefetch=3)
    assert MidGemmConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.to_dict()["pdl"] is True and cfg.to_dict()["prefetch"] == 3
    old = {"block_n": 64, "block_k": 128, "num_warps": 8, "num_stages": 3, "split_k": 1, "use_tma": True,
           "us": 80.0, "cublas_us": 90.0}
    loaded = MidGemmConfig.from_dict(old)
    assert loaded.pdl is False and loaded.prefetch == 0
    assert MidGemmConfig.from_dict(loaded.to_dict()) == loaded
    with pytest.raises(ValueError, match="pdl needs split_k == 1"):
        MidGemmConfig.from_dict(dict(old, split_k=2, pdl=True))
    with pytest.raises(ValueError, match="prefetch"):
        MidGemmConfig(block_n=64, block_k=64, prefetch=2).validate()
    with pytest.raises(ValueError, match="prefetch"):
        MidGemmConfig(block_n=64, block_k=64, pdl=True, prefetch=-1).validate()
    plain = MidGemmConfig(block_n=64, block_k=64, num_stages=4)
    pdl = MidGemmConfig(block_n=64, block_k=64, num_stages=4, pdl=True)
    assert plain.smem_bytes(144, True) == 4 * (128 + 144) * 64 * 2
    assert pdl.smem_bytes(144, True) == 5 * (128 + 144) * 64 * 2
