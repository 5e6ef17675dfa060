"""Opt-in fp8 V-pairs tiles of decode stage 1 (``ATTNSERVE_DECODE_FP8_TILE``,
`decode_tuning.FP8_TILE_VARIANTS`): selection by `decode_config`, and each tile against the
float64 reference over the fp8-rounded cache (under the CPU interpreter only the tile's
``block_n`` and split alignment take effect; the GPU test
``tests/gpu/test_decode_fp8_tiles_gpu.py`` covers the compiled pipelines and ``maxnreg``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from test_fp8_kv_kernels import _check, _run_decode

from attnserve.attention.triton_ops import decode_tuning as dtn
from attnserve.attention.triton_ops.decode_attention import DecodeConfig, decode_config

H100, SMEM, SMS, HKV = "NVIDIA H100 80GB HBM3", 227 * 1024, 132, 8


def _cfg(dtype=torch.float8_e4m3fn, name=H100, bs=0):
    return decode_config(128, 4, dtype, max_shared_mem=SMEM, device_name=name, batch_size=bs,
                         num_kv_heads=HKV if bs else 0, num_sms=SMS if bs else 0)


@pytest.mark.parametrize("variant", sorted(dtn.FP8_TILE_VARIANTS))
def test_fp8_tile_variant_selected_on_hopper_only(variant, monkeypatch):
    """The named tile replaces both fp8 Hopper tiles (small batch and >= BATCH_PROGRAMS_PER_SM
    programs per SM); bf16 caches and other GPUs keep their tiles."""
    monkeypatch.delenv(dtn.FP8_TILE_ENV, raising=False)
    big_bs = dtn.BATCH_PROGRAMS_PER_SM * SMS // HKV
    before = {(dt, name, bs): _cfg(dt, name, bs) for dt in (torch.float8_e4m3fn, torch.bfloat16)
              for name in (H100, "NVIDIA A100-SXM4-80GB") for bs in (0, 4, big_bs)}
    monkeypatch.setenv(dtn.FP8_TILE_ENV, variant)
    n, stages, warps, maxnreg = dtn.FP8_TILE_VARIANTS[variant]
    for bs in (0, 4, big_bs):
        cfg = _cfg(bs=bs)
        assert (cfg.block_n, cfg.num_stages, cfg.num_warps, cfg.maxnreg) == (n, stages, warps, maxnreg)
        assert cfg.v_pairs and cfg.block_h == before[(torch.float8_e4m3fn, H100, bs)].block_h
    for (dt, name, bs), cfg in before.items():
        if dt == torch.bfloat16 or name != H100:
            assert _cfg(dt, name, bs) == cfg


def test_fp8_tile_default_and_unknown(monkeypatch):
    """Unset, empty and ``default`` give the measured tiles with ``maxnreg`` 0; an unknown
    name is refused with the known ones listed."""
    monkeypatch.delenv(dtn.FP8_TILE_ENV, raising=False)
    base = _cfg()
    assert (base.block_n, base.num_stages, base.num_warps) == dtn.FP8_HOPPER_TILE and base.maxnreg == 0
    for raw in ("", "default", " Default "):
        monkeypatch.setenv(dtn.FP8_TILE_ENV, raw)
        assert _cfg() == base
    monkeypatch.setenv(dtn.FP8_TILE_ENV, "db96")
    with pytest.raises(ValueError, match="db128"):
        _cfg()


@pytest.mark.parametrize("variant", sorted(dtn.FP8_TILE_VARIANTS))
def test_fp8_tile_variant_matches_reference(variant, gen, paged):
    """Each opt-in tile over an e4m3 cache with scales, lengths around its tile and several
    splits, against the float64 reference."""
    n, stages, warps, maxnreg = dtn.FP8_TILE_VARIANTS[variant]
    cfg = DecodeConfig(block_n=n, block_h=16, num_warps=warps, num_stages=stages, v_pairs=True, maxnreg=maxnreg)
    out, ref, ns = _run_decode(gen, paged, lens=[1, n - 1, n + 3, 2 * n + 40], hq=8, hkv=2,
                               kv_dtype=torch.float8_e4m3fn, q_dtype=torch.float32, dk=32, dv=32, page_size=16,
                               config=cfg)
    assert ns.max() > 1
    _check(out, ref, torch.float32)


@pytest.mark.parametrize("variant", sorted(dtn.BF16_TILE_VARIANTS))
def test_bf16_tile_variant_selected_for_16bit_caches_only(variant, monkeypatch):
    """``ATTNSERVE_DECODE_BF16_TILE`` replaces the 16-bit cache's tiles (small batch and
    batch tile alike, no V pairs); fp8 caches keep theirs; an unknown name is refused."""
    monkeypatch.delenv(dtn.BF16_TILE_ENV, raising=False)
    big_bs = dtn.BATCH_PROGRAMS_PER_SM * SMS // HKV
    fp8_before = {bs: _cfg(torch.float8_e4m3fn, H100, bs) for bs in (0, 4, big_bs)}
    bf16_before = {bs: _cfg(torch.bfloat16, H100, bs) for bs in (0, 4, big_bs)}
    monkeypatch.setenv(dtn.BF16_TILE_ENV, variant)
    n, stages, warps, maxnreg = dtn.BF16_TILE_VARIANTS[variant]
    for bs in (0, 4, big_bs):
        cfg = _cfg(torch.bfloat16, H100, bs)
        assert (cfg.block_n, cfg.num_stages, cfg.num_warps, cfg.maxnreg) == (n, stages, warps, maxnreg)
        assert not cfg.v_pairs and cfg.block_h == bf16_before[bs].block_h
        assert _cfg(torch.float8_e4m3fn, H100, bs) == fp8_before[bs]
    monkeypatch.setenv(dtn.BF16_TILE_ENV, "nope")
    with pytest.raises(ValueError, match=sorted(dtn.BF16_TILE_VARIANTS)[0]):
        _cfg(torch.bfloat16, H100, 4)


@pytest.mark.parametrize("variant", sorted(dtn.BF16_TILE_VARIANTS))
def test_bf16_tile_variant_matches_reference(variant, gen, paged):
    """Each opt-in 16-bit tile over a bf16 cache, lengths around its tile and several splits,
    against the float64 reference."""
    n, stages, warps, maxnreg = dtn.BF16_TILE_VARIANTS[variant]
    cfg = DecodeConfig(block_n=n, block_h=16, num_warps=warps, num_stages=stages, maxnreg=maxnreg)
    out, ref, ns = _run_decode(gen, paged, lens=[1, n - 1, n + 3, 2 * n + 40], hq=8, hkv=2,
                               kv_dtype=torch.bfloat16, q_dtype=torch.bfloat16, dk=32, dv=32, page_size=16,
                               k_scale=1.0, v_scale=1.0, config=cfg)
    assert ns.max() > 1
    _check(out, ref, torch.bfloat16)


def test_few_kv_heads_take_two_stages_on_h200_only(monkeypatch):
    """`decode_tuning.FEW_KV_HEADS`: a 16-bit cache of head size 128 with <= 4 KV heads takes 2
    stages below the batch tiles on an H200 (measured there), and nothing else changes: 8 KV
    heads, the H100, fp8 caches, other head sizes, the batch tile and the switch off keep theirs."""
    monkeypatch.delenv(dtn.FEW_KV_HEADS_ENV, raising=False)
    h200 = "NVIDIA H200"

    def cfg(hkv, name=h200, bs=64, dtype=torch.bfloat16, d=128):
        return decode_config(d, 4, dtype, max_shared_mem=SMEM, device_name=name, batch_size=bs, num_kv_heads=hkv,
                             num_sms=SMS)

    for hkv in (1, 2, 4):
        c = cfg(hkv)
        assert (c.block_n, c.num_stages, c.num_warps) == (128, 2, 4), hkv
        assert c == dataclasses.replace(cfg(hkv, name=H100), num_stages=2)  # only the stages differ from the H100's
    assert cfg(8).num_stages == 3 and cfg(2, name=H100).num_stages == 3
    assert cfg(2, dtype=torch.float8_e4m3fn).num_stages == cfg(2, dtype=torch.float8_e4m3fn, name=H100).num_stages
    assert cfg(2, d=64).num_stages == cfg(2, d=64, name=H100).num_stages
    big_bs = dtn.BATCH_PROGRAMS_PER_SM * SMS // 2
    assert (cfg(2, bs=big_bs).block_n, cfg(2, bs=big_bs).num_stages) == dtn.BATCH_TILE[:2]
    monkeypatch.setenv(dtn.FEW_KV_HEADS_ENV, "0")
    assert cfg(2).num_stages == 3
