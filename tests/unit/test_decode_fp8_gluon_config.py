"""CPU tests of the pure-Python parts of `decode_fp8_gluon`: config validation, the
``ATTNSERVE_DECODE_FP8_GLUON`` values and `gluon_fp8_decode_supported` (no GPU, no Gluon import)."""

from __future__ import annotations

import pytest
import torch

from attnserve.attention.triton_ops.decode_fp8_gluon import (DEFAULT_CONFIG, MAX_GROUP, GluonFp8DecodeConfig,
                                                             gluon_config_from_env, gluon_fp8_decode_supported)

E4M3 = torch.float8_e4m3fn


def _sup(**kw):
    args = dict(q_dtype=torch.bfloat16, kv_dtype=E4M3, head_dim=128, v_head_dim=128, num_q_heads=32, num_kv_heads=8,
                logit_cap=0.0, capability=(9, 0))
    args.update(kw)
    return gluon_fp8_decode_supported(**args)


def test_default_config_fits_three_programs_per_sm():
    assert DEFAULT_CONFIG.shared_bytes == 2 * 4 * 64 * 128
    assert 3 * (DEFAULT_CONFIG.shared_bytes + 1024) <= 227 * 1024


@pytest.mark.parametrize("kw", [dict(block_n=32), dict(block_n=256), dict(num_buffers=1), dict(num_buffers=9),
                                dict(num_warps=8), dict(split_align=64, block_n=128), dict(split_align=96),
                                dict(block_n=128, num_buffers=8)])
def test_config_rejects_out_of_range(kw):
    with pytest.raises(ValueError):
        GluonFp8DecodeConfig(**kw)


@pytest.mark.parametrize("kw", [dict(), dict(block_n=128, num_buffers=3), dict(num_buffers=2, split_align=256),
                                dict(block_n=128, num_buffers=6)])
def test_config_accepts_valid(kw):
    cfg = GluonFp8DecodeConfig(**kw)
    assert cfg.shared_bytes == 2 * cfg.num_buffers * cfg.block_n * 128 <= 227 * 1024


def test_supported_llama_heads_and_groups():
    assert _sup()
    assert _sup(q_dtype=torch.float16)
    for hkv in (32, 8, 4, 2):
        assert _sup(num_kv_heads=hkv)
    assert _sup(num_q_heads=MAX_GROUP, num_kv_heads=1)
    assert not _sup(num_q_heads=2 * MAX_GROUP, num_kv_heads=1)


@pytest.mark.parametrize("kw", [
    dict(kv_dtype=torch.float8_e5m2), dict(kv_dtype=torch.bfloat16), dict(q_dtype=torch.float32),
    dict(head_dim=64, v_head_dim=64), dict(head_dim=192), dict(v_head_dim=512), dict(num_q_heads=30),
    dict(logit_cap=30.0), dict(capability=(8, 0)), dict(capability=(10, 0)), dict(capability=None),
    dict(batch_invariant=True),
])
def test_unsupported(kw):
    assert not _sup(**kw)


@pytest.mark.parametrize("raw", [None, "", " ", "0", "off", "False", "no"])
def test_env_off(raw):
    assert gluon_config_from_env(raw) is None


@pytest.mark.parametrize("raw", ["1", "on", "TRUE", "yes"])
def test_env_on_default(raw):
    assert gluon_config_from_env(raw) == DEFAULT_CONFIG


def test_env_tiles():
    assert gluon_config_from_env("64x3") == GluonFp8DecodeConfig(block_n=64, num_buffers=3)
    assert gluon_config_from_env("128x2") == GluonFp8DecodeConfig(block_n=128, num_buffers=2)
    assert gluon_config_from_env("64x4-bytes") == GluonFp8DecodeConfig(pairs=False)


@pytest.mark.parametrize("raw", ["2", "64", "64x", "x4", "64x4x2", "abc", "32x4", "64x1", "128x8", "64x4-byte"])
def test_env_bad_values_raise(raw):
    with pytest.raises(ValueError):
        gluon_config_from_env(raw)
