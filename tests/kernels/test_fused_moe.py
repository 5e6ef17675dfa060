"""Fused MoE Triton path (`attnserve.models.layers.moe`: `align`, `fused_moe_triton`,
`tuned_configs`) against a float64 reference computed here (tests/moe_checks.py).

Runs under the Triton interpreter on the CPU (tests/kernels/conftest.py sets
TRITON_INTERPRET=1 without a GPU). Tiny shapes (H 32, I 16; one ragged pair H 48 / I 24
that leaves K tails and partial column bands) keep the interpreter's cost to about a
second a case. Covered: ragged token counts, top-k 1/2/6/8, E 8/64/128, an expert that
receives no token, one token (slot blocks, no alignment), both alignment forms (single
program and multi-launch), flat and nested configs with 16- and 32-row tiles, the tuned
tables shipped with the package, and bad input. Tolerances: the element-wise bound of `moe_checks.moe_reference`.
"""

from __future__ import annotations

import json

import pytest
import torch

from attnserve.models.layers.moe import align as align_mod
from attnserve.models.layers.moe.align import moe_align_block_size
from attnserve.models.layers.moe.fused_moe_triton import fused_experts_triton
from attnserve.models.layers.moe.tuned_configs import (
    CONFIG_DIR_ENV,
    FusedMoEConfig,
    config_file_name,
    default_config,
    get_fused_moe_config,
    load_tuned_configs,
    package_config_dir,
)
from moe_checks import check_alignment, moe_reference


def _routing(gen, t, e, k, exclude=()):
    allowed = torch.tensor([i for i in range(e) if i not in exclude])
    ids = torch.stack([allowed[torch.randperm(len(allowed), generator=gen)[:k]] for _ in range(t)]).to(torch.int32)
    w = torch.softmax(torch.randn(t, k, generator=gen), dim=-1)
    return w, ids


def _weights(gen, e, h, inter, dtype, device):
    w13 = (torch.randn(e, 2 * inter, h, generator=gen) / h**0.5).to(dtype).to(device)
    w2 = (torch.randn(e, h, inter, generator=gen) / inter**0.5).to(dtype).to(device)
    return w13, w2


@pytest.mark.parametrize(
    "t, k, e, bs, large",
    [(1, 8, 128, 16, False), (37, 2, 8, 16, False), (13, 6, 64, 32, False), (5, 8, 8, 16, True),
     (700, 8, 8, 64, False)],
    ids=["decode-1x8-E128", "ragged-37x2-E8", "13x6-E64-bs32", "multi-launch-forced", "multi-launch-5600-slots"],
)
def test_align_invariants(t, k, e, bs, large, gen, device, monkeypatch):
    if large:
        monkeypatch.setattr(align_mod, "SMALL_ALIGN_MAX_SLOTS", 0)
    _, ids = _routing(gen, t, e, k, exclude=(1,))  # expert 1 receives nothing
    out = moe_align_block_size(ids.to(device), bs, e)
    check_alignment(ids, bs, e, *out)
    assert 1 not in out[1].tolist()


def test_align_drops_out_of_range_ids(device):
    ids = torch.tensor([[0, 3], [4, 1], [-1, 3]], dtype=torch.int32)  # E = 4: ids 4 and -1 are invalid
    out = moe_align_block_size(ids.to(device), 16, 4)
    check_alignment(ids, 16, 4, *out)
    assert sorted(v for v in out[0].tolist() if v < 6) == [0, 1, 3, 5]


CASES = [
    # (T, E, top_k, dtype, H, I, config)
    (1, 8, 1, torch.float32, 32, 16, None),
    (1, 128, 8, torch.bfloat16, 32, 16, None),  # one token: slot blocks, no alignment
    (7, 8, 2, torch.bfloat16, 32, 16, None),
    (13, 64, 6, torch.float32, 32, 16, None),
    (3, 128, 8, torch.bfloat16, 32, 16, None),
    (9, 8, 2, torch.float16, 32, 16, None),
    (21, 8, 2, torch.float32, 48, 24,
     {"BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 2, "num_warps": 4, "num_stages": 1}),
    (11, 8, 8, torch.bfloat16, 48, 24,
     {"BLOCK_SIZE_M": 16, "gemm1": {"BLOCK_SIZE_N": 16, "BLOCK_SIZE_K": 16, "GROUP_SIZE_M": 1},
      "gemm2": {"BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 16, "GROUP_SIZE_M": 4}}),
]


@pytest.mark.parametrize("t, e, k, dtype, h, inter, config", CASES,
                         ids=[f"T{c[0]}-E{c[1]}-k{c[2]}-{str(c[3])[6:]}-H{c[4]}-I{c[5]}" + ("-cfg" if c[6] else "")
                              for c in CASES])
def test_fused_experts_matches_float64(t, e, k, dtype, h, inter, config, gen, device):
    x = torch.randn(t, h, generator=gen).to(dtype).to(device)
    w13, w2 = _weights(gen, e, h, inter, dtype, device)
    # experts 0 and 3 receive no token (when E leaves room for it)
    w, ids = _routing(gen, t, e, k, exclude=(0, 3) if e - 2 >= k else ())
    out = fused_experts_triton(x, w13, w2, w.to(device), ids.to(device), config=config)
    assert out.dtype == dtype and out.shape == (t, h)
    ref, bound = moe_reference(x.cpu(), w13.cpu(), w2.cpu(), w, ids)
    diff = (out.cpu().double() - ref).abs()
    assert torch.isfinite(out).all()
    assert (diff <= bound).all(), f"max |delta| {diff.max():.3e}, worst ratio {(diff / bound).max():.3f}"
    # the bound is tight enough to matter: dropping one slot's contribution breaks it
    one = moe_reference(x[:1].cpu(), w13.cpu(), w2.cpu(), w[:1, :1], ids[:1, :1])[0]
    wrong = ref.clone()
    wrong[0] -= one[0]
    assert ((out.cpu().double() - wrong).abs() > bound).any()


def test_zero_tokens(device):
    x = torch.empty(0, 32, device=device)
    w13, w2 = torch.randn(4, 32, 32, device=device), torch.randn(4, 32, 16, device=device)
    out = fused_experts_triton(x, w13, w2, torch.empty(0, 2, device=device),
                               torch.empty(0, 2, dtype=torch.int32, device=device))
    assert out.shape == (0, 32)


@pytest.mark.parametrize("bad", ["w2-shape", "dtype", "ids-shape", "ids-float", "config"])
def test_bad_input(bad, device):
    x = torch.randn(3, 32, device=device)
    w13, w2 = torch.randn(4, 32, 32, device=device), torch.randn(4, 32, 16, device=device)
    w, ids = torch.rand(3, 2, device=device), torch.zeros(3, 2, dtype=torch.int32, device=device)
    cfg = None
    if bad == "w2-shape":
        w2 = torch.randn(4, 32, 8, device=device)
    elif bad == "dtype":
        w13 = w13.half()
    elif bad == "ids-shape":
        ids = ids[:2]
    elif bad == "ids-float":
        ids = ids.float()
    else:
        cfg = {"BLOCK_SIZE_M": 24, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 32}
    with pytest.raises(ValueError):
        fused_experts_triton(x, w13, w2, w, ids, config=cfg)


def test_shipped_tables_are_valid():
    files = sorted(package_config_dir().glob("*.json"))
    assert files, f"no tuned tables in {package_config_dir()}"
    for f in files:
        data = json.loads(f.read_text())
        meta = data["meta"]
        dtype = getattr(torch, meta["dtype"])
        assert f.name == config_file_name(meta["E"], meta["N"], meta["K"], dtype, meta["device_name"])
        table = load_tuned_configs(meta["E"], meta["N"], meta["K"], dtype, meta["device_name"])
        assert table and all(isinstance(c, FusedMoEConfig) for c in table.values())
        assert sorted(table) == sorted(int(k) for k in data["configs"])


def test_tuned_table_lookup(tmp_path, monkeypatch):
    cfg_a = FusedMoEConfig.from_dict({"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128})
    cfg_b = FusedMoEConfig.from_dict({"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 8})
    name = config_file_name(8, 16, 32, torch.bfloat16, "Some GPU 80GB")
    assert name == "E=8,N=16,K=32,device_name=Some_GPU_80GB,dtype=bfloat16.json"
    (tmp_path / name).write_text(json.dumps({"meta": {}, "configs": {"1": cfg_a.to_dict(), "256": cfg_b.to_dict()}}))
    monkeypatch.setenv(CONFIG_DIR_ENV, str(tmp_path))
    table = load_tuned_configs(8, 16, 32, torch.bfloat16, "Some GPU 80GB")
    assert table == {1: cfg_a, 256: cfg_b}
    assert load_tuned_configs(8, 16, 32, torch.float16, "Some GPU 80GB") is None
    # CPU tensors never use tables (the interpreter's rule)
    assert get_fused_moe_config(200, 8, 16, 32, 2, torch.bfloat16, torch.device("cpu")).block_m == 16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_default_rule_valid(dtype):
    seen = set()
    for t in (1, 3, 64, 256, 1000, 8192):
        for e, n, k, top_k in ((128, 768, 2048, 8), (8, 14336, 4096, 2), (4, 8, 16, 1)):
            cfg = default_config(t, e, n, k, top_k, dtype)
            cfg.validate()
            p2 = lambda v: max(16, 1 << (v - 1).bit_length())  # noqa: E731
            assert cfg.gemm1.block_n <= p2(2 * n) and cfg.gemm1.block_k <= p2(k)
            assert cfg.gemm2.block_n <= p2(k) and cfg.gemm2.block_k <= p2(n)
            seen.add(cfg.block_m)
    assert len(seen) >= 3  # the M tile follows the tokens per expert
