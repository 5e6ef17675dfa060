"""GPU checks of the extend kernel's default configs (`extend_tuning`): on sm_90, plain causal
prefills take `SM90_SHORT` up to `SM90_SHORT_MAX_LEN` new tokens in the longest request and
`SM90_LONG` above; the prefix stage (chunked prefill over a cached prefix) keeps the old
default; other GPUs keep the old defaults everywhere.

Each launch goes through the default path (``config=None``) with `extend_config` spied on:
the test checks the config the launch really used, the output against the float64 reference
(``REL_TOL``) and against the old defaults (``ATTNSERVE_EXTEND_DEFAULTS=old``, same inputs):
`SM90_LONG` and every unchanged path must give the old bits exactly, `SM90_SHORT` (keys summed
in tiles of 32) within bf16 rounding of them. bf16, Hq 32 / Hkv 8, D 128 (the measured shape,
``benchmarks/results/h100-80gb-hbm3-extend-long-sweep-2026-11-27.json``). About a minute on an
H100, most of it compilation.
"""

from __future__ import annotations

import pytest
import torch
from test_triton_kernels_gpu import DEV, EXT_LENS, EXT_PREFIX, REL_TOL, _extend, _rel_err

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

HQ, HKV, D = 32, 8, 128


def _sm90() -> bool:
    return torch.cuda.get_device_capability() == (9, 0)


@pytest.fixture
def spy(monkeypatch):
    """The configs `extend_attention_fwd` picked by default, in launch order."""
    import attnserve.attention.triton_ops.extend_attention as ext_mod
    from attnserve.attention.triton_ops import extend_tuning

    monkeypatch.delenv(extend_tuning.EXTEND_CONFIG_ENV, raising=False)
    monkeypatch.delenv(extend_tuning.EXTEND_DEFAULTS_ENV, raising=False)
    # these are the Triton kernel's tiles: long plain prefills would otherwise take the Gluon
    # kernel (`prefill_gluon`, tested in test_prefill_gluon_gpu.py)
    monkeypatch.setenv("ATTNSERVE_EXTEND_GLUON", "0")
    seen = []
    real = extend_tuning.extend_config

    def record(*args, **kw):
        seen.append(real(*args, **kw))
        return seen[-1]

    monkeypatch.setattr(ext_mod, "extend_config", record)
    return seen


def _expected(max_len: int, has_prefix: bool):
    from attnserve.attention.triton_ops.extend_tuning import ExtendConfig, sm90_plain_prefill_config

    old = ExtendConfig(128, 64, 8, 3, block_n_prefix=128 if has_prefix else None)
    if has_prefix or not _sm90():
        return old, True
    cfg = sm90_plain_prefill_config(max_len)
    return cfg, cfg.block_n == old.block_n  # SM90_LONG: the old tiles, the old bits


def _with_old_defaults(monkeypatch, fn):
    from attnserve.attention.triton_ops.extend_tuning import EXTEND_DEFAULTS_ENV

    monkeypatch.setenv(EXTEND_DEFAULTS_ENV, "old")
    try:
        return fn()
    finally:
        monkeypatch.delenv(EXTEND_DEFAULTS_ENV)


# name -> (prefix lens, new lens, page size, window, logit cap): plain prefills at the threshold's
# edges (2,048 takes SM90_SHORT, 2,049 SM90_LONG), windowed and capped ones, and chunked
# prefills over cached prefixes (unchanged)
CASES = {
    "plain 16x512": ([0] * 16, [512] * 16, 16, -1, 0.0),
    "plain edge 2048": ([0, 0, 0], [2048, 700, 1], 16, -1, 0.0),
    "plain edge 2049": ([0, 0, 0], [2049, 700, 1], 16, -1, 0.0),
    "plain long 4100": ([0, 0], [4100, 33], 16, -1, 0.0),
    "plain window 255": ([0, 0], [2000, 300], 16, 255, 0.0),
    "plain long window 1000": ([0], [3000], 16, 1000, 0.0),
    "plain cap 30": ([0, 0], [2049, 17], 16, -1, 30.0),
    "prefix ragged": (EXT_PREFIX, EXT_LENS, 16, -1, 0.0),
    "prefix chunk 2048 + 2049": ([2048], [2049], 16, -1, 0.0),
    "prefix chunk 2048 + 512, page 1": ([2048, 0], [512, 300], 1, -1, 0.0),
}


@pytest.mark.parametrize("name", list(CASES))
def test_default_config_matches_reference_and_old_default(name, spy, monkeypatch):
    prefix, ext, page, window, cap = CASES[name]
    has_prefix = any(prefix)
    kw = dict(window=window, logit_cap=cap, has_prefix=has_prefix)
    o, ref = _extend(prefix, ext, page, HQ, HKV, D, seed=70, **kw)
    want, same_bits = _expected(max(ext), has_prefix)
    assert spy == [want], f"{name}: launched {spy}, expected {want}"
    err = _rel_err(o, ref)
    assert err <= REL_TOL, f"{name}: rel err {err:.3g} against float64"
    o_old, _ = _with_old_defaults(monkeypatch, lambda: _extend(prefix, ext, page, HQ, HKV, D, seed=70, **kw))
    diff = (o.float() - o_old.float()).abs().max().item()
    if same_bits:
        assert torch.equal(o, o_old), f"{name}: not the old default's bits (max |diff| {diff:.3g})"
    else:  # keys summed in tiles of 32 instead of 64: within bf16 rounding of the old default
        assert _rel_err(o, o_old.double()) <= 4e-3, f"{name}: max |diff| to the old default {diff:.3g}"
    print(f"{name}: {spy[0]}, rel err {err:.2e}, max |diff| to old {diff:.3g}")


def _plain(lens, seeds, batch_invariant):
    """A plain causal prefill of requests whose inputs depend on their own seed only; the
    output rows of each request."""
    from attnserve.attention.triton_ops.extend_attention import extend_attention_fwd

    qs, ks, vs = [], [], []
    for n, s in zip(lens, seeds):
        g = torch.Generator(device=DEV).manual_seed(s)
        qs.append(torch.randn(n, HQ, D, generator=g, device=DEV).bfloat16())
        ks.append(torch.randn(n, HKV, D, generator=g, device=DEV).bfloat16())
        vs.append(torch.randn(n, HKV, D, generator=g, device=DEV).bfloat16())
    q, k, v = torch.cat(qs), torch.cat(ks), torch.cat(vs)
    o = torch.full_like(q, float("nan"))
    qo = torch.tensor([0] + lens, dtype=torch.int32, device=DEV).cumsum(0).to(torch.int32)
    zero = torch.zeros(len(lens) + 1, dtype=torch.int32, device=DEV)
    extend_attention_fwd(q, k, v, o, k, v, qo, zero, zero, None, True, None, max(lens), D ** -0.5,
                         has_prefix=False, batch_invariant=batch_invariant)
    return list(o.split(lens))


def test_batch_invariant_launch_keeps_one_config(spy):
    """``batch_invariant`` (deterministic inference): a 512-token request gets the same bits
    alone and beside a 3,000-token one (`SM90_LONG`, the old default's tiles, at any length)."""
    from attnserve.attention.triton_ops.extend_tuning import ExtendConfig, SM90_LONG

    alone = _plain([512], [5], batch_invariant=True)[0]
    batched = _plain([512, 3000], [5, 6], batch_invariant=True)[0]
    assert torch.equal(alone, batched)
    want = SM90_LONG if _sm90() else ExtendConfig(128, 64, 8, 3)
    assert spy == [want, want]


def test_config_env_overrides_the_new_defaults(spy, monkeypatch):
    from attnserve.attention.triton_ops.extend_tuning import EXTEND_CONFIG_ENV, ExtendConfig

    monkeypatch.setenv(EXTEND_CONFIG_ENV, "64,64,4,3")
    for lens in ([512, 40], [3000]):
        o, ref = _extend([0] * len(lens), lens, 16, HQ, HKV, D, seed=71, has_prefix=False)
        assert _rel_err(o, ref) <= REL_TOL
    assert spy == [ExtendConfig(64, 64, 4, 3)] * 2
