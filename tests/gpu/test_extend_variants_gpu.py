"""GPU checks of the extend kernel's TMA-descriptor reads (`ExtendConfig.kv_desc`) and of the
tile candidates of ``benchmarks/extend_long_sweep.py``, at serving shapes (bf16, Hq 32 / Hkv 8
or MHA, D 128, ragged, plain and over paged prefixes).

Same inputs as the default kernel (seeded `_extend` of test_triton_kernels_gpu): every
candidate must be within ``REL_TOL`` of the float64 reference; ``kv_desc`` with the default's
tiles (any stage count) computes each tile with the default's operations in the same order,
so it must also give the default kernel's bits. Descriptor reads apply to plain prefills only
(``has_prefix=False``); over prefixes the kernel must stay as it is. "desc" alone (K and V
descriptors, 3 stages) is left out: Triton 3.6's ptxas 12.8 crashed compiling it offline
(scripts/extend_variants_offline.py); the sweep still tries it. About a minute on an H100,
mostly compilation.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_triton_kernels_gpu import EXT_LENS, EXT_PREFIX, REL_TOL, _extend, _rel_err

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _default():
    """The old default (128, 64, 8, 3): what every candidate is compared with (passed
    explicitly: on sm_90 the launch's own default now depends on the length, `extend_tuning`)."""
    from attnserve.attention.triton_ops.extend_attention import extend_config

    return extend_config(128, 128, torch.bfloat16, has_prefix=False)


# name -> (config changes, same bits as the default)
SAME_BITS = {
    "desc-k": (dict(kv_desc="k"), True),
    "desc-v": (dict(kv_desc="v"), True),
    "128x64x8x4 desc": (dict(num_stages=4, kv_desc="kv"), True),
    "128x64x8x2 desc": (dict(num_stages=2, kv_desc="kv"), True),
    "64x64x4x3": (dict(block_m=64, num_warps=4), False),
    "64x64x4x2 desc": (dict(block_m=64, num_warps=4, num_stages=2, kv_desc="kv"), False),
    "64x32x4x3": (dict(block_m=64, block_n=32, num_warps=4), False),
    "128x128 desc": (dict(block_n=128, kv_desc="kv"), False),
}
# (prefix lens, new lens, page size, hq, hkv): plain ragged prefill, and ragged over paged prefixes
SHAPES = [
    ([0, 0, 0], [4096, 700, 1], 16, 32, 8),
    (EXT_PREFIX, EXT_LENS, 16, 32, 8),
    (EXT_PREFIX, EXT_LENS, 1, 8, 8),
]


@pytest.mark.parametrize("name", list(SAME_BITS))
@pytest.mark.parametrize("shape", range(len(SHAPES)))
def test_extend_variant_matches_default_and_reference(name, shape):
    prefix, ext, page, hq, hkv = SHAPES[shape]
    changes, same_bits = SAME_BITS[name]
    has_prefix = any(prefix)
    base = dataclasses.replace(_default(), block_n_prefix=128 if has_prefix else None)
    cfg = dataclasses.replace(base, **changes)
    o_default, ref = _extend(prefix, ext, page, hq, hkv, 128, seed=40 + shape, has_prefix=has_prefix, config=base)
    o, _ = _extend(prefix, ext, page, hq, hkv, 128, seed=40 + shape, has_prefix=has_prefix, config=cfg)
    err = _rel_err(o, ref)
    assert err <= REL_TOL, f"{name}: rel err {err:.3g} against float64"
    diff = (o.float() - o_default.float()).abs().max().item()
    if same_bits:
        assert torch.equal(o, o_default), f"{name}: not the default's bits (max |diff| {diff:.3g})"
    else:  # another summation order: within bf16 rounding of the default
        assert _rel_err(o, o_default.double()) <= 4e-3, f"{name}: max |diff| to the default {diff:.3g}"


def test_extend_descriptors_are_built_on_this_gpu():
    """The TMA descriptors exist for packed heads (else ``kv_desc`` silently runs pointers)."""
    from attnserve.attention.triton_ops.extend_attention import _new_token_descriptors

    k = torch.zeros(100, 8, 128, dtype=torch.bfloat16, device="cuda")
    qkv = torch.zeros(100, (32 + 16) * 128, dtype=torch.bfloat16, device="cuda")
    k_view = qkv[:, 32 * 128: 40 * 128].view(100, 8, 128)  # a slice of a fused qkv output, as the model passes
    assert _new_token_descriptors(k, k, 64, False) is not None
    assert _new_token_descriptors(k_view, k_view, 64, False) is not None



@pytest.mark.parametrize("window,logit_cap", [(4095, 50.0), (511, 30.0), (-1, 0.0)])
@pytest.mark.parametrize("has_prefix", [False, True])
def test_head_256_default_tile(window, logit_cap, has_prefix, monkeypatch):
    """Head size 256 (Gemma 2 / Gemma 3) with a sliding window and a logit cap: the launch's own
    default (`extend_tuning.HEAD256_TILE`) against float64 and within bf16 rounding of the old
    tile (``ATTNSERVE_EXTEND_DEFAULTS=old``), plain ragged prefills and over paged prefixes."""
    from attnserve.attention.triton_ops import extend_tuning as tun

    prefix = EXT_PREFIX if has_prefix else [0] * len(EXT_LENS)
    seed = 60 + (window % 97) + int(logit_cap) + 7 * has_prefix
    monkeypatch.delenv(tun.EXTEND_CONFIG_ENV, raising=False)
    monkeypatch.delenv(tun.EXTEND_DEFAULTS_ENV, raising=False)
    o, ref = _extend(prefix, EXT_LENS, 16, 8, 4, 256, seed=seed, window=window, logit_cap=logit_cap,
                     has_prefix=has_prefix)
    assert _rel_err(o, ref) <= REL_TOL
    monkeypatch.setenv(tun.EXTEND_DEFAULTS_ENV, "old")
    o_old, _ = _extend(prefix, EXT_LENS, 16, 8, 4, 256, seed=seed, window=window, logit_cap=logit_cap,
                       has_prefix=has_prefix)
    assert _rel_err(o_old, ref) <= REL_TOL
    assert _rel_err(o, o_old.double()) <= 4e-3
