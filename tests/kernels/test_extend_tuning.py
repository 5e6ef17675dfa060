"""The extend kernel's launch tuning (`extend_tuning`): the sm_90 plain-prefill rule on fake
device capabilities and lengths, what keeps the old defaults, both environment variables,
and the interpreter path (unchanged whatever the rule says)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import attnserve.attention.triton_ops.extend_attention as ext_mod
from attnserve.attention.triton_ops import extend_tuning as tun
from attnserve.attention.triton_ops.extend_tuning import (
    EXTEND_CONFIG_ENV,
    EXTEND_DEFAULTS_ENV,
    SM90_LONG,
    SM90_SHORT,
    SM90_SHORT_MAX_LEN,
    ExtendConfig,
    extend_config,
    sm90_plain_prefill_config,
)

#: the defaults before the sm_90 rule (D 128, 16-bit): plain prefill, and with the prefix stage
OLD_PLAIN = ExtendConfig(128, 64, 8, 3)
OLD_PREFIX = ExtendConfig(128, 64, 8, 3, block_n_prefix=128)
H100 = (9, 0)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv(EXTEND_CONFIG_ENV, raising=False)
    monkeypatch.delenv(EXTEND_DEFAULTS_ENV, raising=False)


def _plain(n, **kw):
    args = dict(has_prefix=False, capability=H100, max_len_extend=n)
    args.update(kw)
    dtype = args.pop("dtype", torch.bfloat16)
    return extend_config(args.pop("dk", 128), args.pop("dv", 128), dtype, **args)


def test_rule_threshold_and_configs():
    """Short up to the threshold, long above it; the long config is the old default's tiles
    (same bits) with K through a descriptor; unknown length or batch invariance: long."""
    assert SM90_SHORT_MAX_LEN == 2048
    for n in (1, 7, 512, 2047, 2048):
        assert sm90_plain_prefill_config(n) == SM90_SHORT == ExtendConfig(64, 32, 4, 3)
    for n in (2049, 4096, 8190, 131072):
        assert sm90_plain_prefill_config(n) == SM90_LONG
    assert sm90_plain_prefill_config(None) == SM90_LONG
    assert sm90_plain_prefill_config(512, batch_invariant=True) == SM90_LONG
    assert dataclasses.replace(SM90_LONG, kv_desc="") == OLD_PLAIN and SM90_LONG.kv_desc == "k"


def test_plain_causal_prefill_on_sm90_takes_the_rule():
    for dtype in (torch.bfloat16, torch.float16):
        assert _plain(512, dtype=dtype) == SM90_SHORT
        assert _plain(SM90_SHORT_MAX_LEN, dtype=dtype) == SM90_SHORT
        assert _plain(SM90_SHORT_MAX_LEN + 1, dtype=dtype) == SM90_LONG
        assert _plain(8190, dtype=dtype) == SM90_LONG
    assert _plain(512, batch_invariant=True) == SM90_LONG  # deterministic inference
    assert _plain(None) == SM90_LONG


@pytest.mark.parametrize("n", [512, 8190])
def test_everything_else_keeps_the_old_defaults(n):
    # the prefix stage (chunked prefill over a cached prefix), on sm_90 too
    assert _plain(n, has_prefix=True) == OLD_PREFIX
    # other GPUs, or none known
    for cap in [(8, 0), (8, 9), (10, 0), (12, 0), None]:
        assert _plain(n, capability=cap) == OLD_PLAIN, cap
    # non-causal, other head sizes, fp32, custom masks, ROCm
    assert _plain(n, is_causal=False) == OLD_PLAIN
    assert _plain(n, dk=64, dv=64) == OLD_PLAIN
    assert _plain(n, dk=128, dv=64) == OLD_PLAIN
    assert _plain(n, dtype=torch.float32) == ExtendConfig(32, 32, 4, 1)
    assert _plain(n, has_custom_mask=True) == ExtendConfig(64, 64, 8, 2)
    assert _plain(n, is_hip=True) == ExtendConfig(64, 64, 4, 1)
    assert _plain(n, dk=256, dv=256, has_custom_mask=True) == ExtendConfig(64, 64, 8, 2)
    # callers that pass neither device nor length (benchmarks, old call sites)
    assert extend_config(128, 128, torch.bfloat16, has_prefix=False) == OLD_PLAIN
    assert extend_config(128, 128, torch.bfloat16) == OLD_PREFIX


@pytest.mark.parametrize("has_prefix", [False, True])
def test_head_256_tile(monkeypatch, has_prefix):
    """Heads of 129-256: 128 query rows x 32-key tiles on any CUDA GPU and length, plain or over
    a prefix; custom masks and ``ATTNSERVE_EXTEND_DEFAULTS=old`` keep the old 64 x 64 tile; the
    interpreter, fp32 and ROCm keep theirs."""
    for cap in (H100, (8, 0), None):
        for n in (16, 512, 8190, None):
            for dk, dv in ((256, 256), (192, 192), (192, 128)):
                assert _plain(n, dk=dk, dv=dv, capability=cap, has_prefix=has_prefix) == \
                    tun.HEAD256_TILE == ExtendConfig(128, 32, 8, 2)
    assert _plain(512, dk=256, dv=256, has_prefix=has_prefix, has_custom_mask=True) == tun.HEAD256_OLD
    assert _plain(512, dk=256, dv=256, has_prefix=has_prefix, dtype=torch.float32) == ExtendConfig(32, 32, 4, 1)
    assert _plain(512, dk=256, dv=256, has_prefix=has_prefix, is_hip=True) == ExtendConfig(64, 32, 4, 1)
    assert _plain(512, dk=256, dv=256, has_prefix=has_prefix, interpret=True).block_m == 32
    assert _plain(512, dk=576, dv=512, has_prefix=has_prefix) == ExtendConfig(32, 32, 8, 2)  # MLA, unchanged
    monkeypatch.setenv(EXTEND_DEFAULTS_ENV, "old")
    assert _plain(512, dk=256, dv=256, has_prefix=has_prefix) == tun.HEAD256_OLD == ExtendConfig(64, 64, 8, 2)


def test_interpreter_config_is_unchanged_by_the_rule():
    interp = ExtendConfig(block_m=32, block_n=16, num_warps=4, num_stages=1, block_n_prefix=32)
    for n in (16, 8190):
        for cap in (H100, None):
            assert _plain(n, capability=cap, interpret=True, dtype=torch.float32) == interp
            assert _plain(n, capability=cap, interpret=True) == interp


def test_defaults_env_switch(monkeypatch):
    """``ATTNSERVE_EXTEND_DEFAULTS=old`` gives the old defaults back (any case), ``new`` or
    unset the rule; another value is refused, naming the variable."""
    for old in ("old", " OLD "):
        monkeypatch.setenv(EXTEND_DEFAULTS_ENV, old)
        assert _plain(512) == OLD_PLAIN and _plain(8190) == OLD_PLAIN
        assert _plain(512, has_prefix=True) == OLD_PREFIX
    monkeypatch.setenv(EXTEND_DEFAULTS_ENV, "new")
    assert _plain(512) == SM90_SHORT
    monkeypatch.setenv(EXTEND_DEFAULTS_ENV, "newest")
    with pytest.raises(ValueError, match=EXTEND_DEFAULTS_ENV):
        _plain(512)


def test_config_env_overrides_the_rule(monkeypatch):
    """``ATTNSERVE_EXTEND_CONFIG`` replaces the rule's pick at any length (and the old
    default with ``ATTNSERVE_EXTEND_DEFAULTS=old``); the prefix tile stays."""
    monkeypatch.setenv(EXTEND_CONFIG_ENV, "128,128,8,3,desc")
    want = ExtendConfig(128, 128, 8, 3, kv_desc="kv")
    assert _plain(512) == want and _plain(8190) == want
    assert _plain(512, has_prefix=True) == dataclasses.replace(want, block_n_prefix=128)
    monkeypatch.setenv(EXTEND_DEFAULTS_ENV, "old")
    assert _plain(512) == want
    monkeypatch.setenv(EXTEND_CONFIG_ENV, "64,64,4,3")
    monkeypatch.setenv(EXTEND_DEFAULTS_ENV, "new")
    assert _plain(8190) == ExtendConfig(64, 64, 4, 3)


def test_launcher_passes_host_values_and_interpreter_runs_as_before(gen, device, monkeypatch):
    """`extend_attention_fwd` asks `extend_config` with the host's ``max_len_extend``,
    causality and batch-invariance flag (no device read); under the interpreter the
    capability is None and the interpreter's tiles run (a tiny plain prefill, checked
    against a float64 reference)."""
    seen = []
    real = tun.extend_config

    def spy(*args, **kw):
        seen.append((args, kw, real(*args, **kw)))
        return seen[-1][2]

    monkeypatch.setattr(ext_mod, "extend_config", spy)
    t, hq, hkv, d = 40, 4, 2, 64
    q = torch.randn(t, hq, d, generator=gen)
    k = torch.randn(t, hkv, d, generator=gen)
    v = torch.randn(t, hkv, d, generator=gen)
    qo = torch.tensor([0, 33, 40], dtype=torch.int32, device=device)
    zero = torch.zeros(3, dtype=torch.int32, device=device)
    o = torch.empty(t, hq, d, device=device)
    ext_mod.extend_attention_fwd(q.to(device), k.to(device), v.to(device), o, k.to(device), v.to(device), qo, zero,
                                 zero, None, True, None, 33, d ** -0.5, has_prefix=False, batch_invariant=True)
    (_, kw, cfg), = seen
    assert kw["max_len_extend"] == 33 and kw["is_causal"] is True and kw["batch_invariant"] is True
    if device.type == "cpu":
        assert kw["interpret"] is True and kw["capability"] is None
        assert cfg == ExtendConfig(32, 16, 4, 1, 32)
    ref = torch.empty(t, hq, d, dtype=torch.float64)
    for a, b in ((0, 33), (33, 40)):
        kk = k[a:b].double().repeat_interleave(hq // hkv, 1)
        vv = v[a:b].double().repeat_interleave(hq // hkv, 1)
        s = torch.einsum("qhd,khd->hqk", q[a:b].double(), kk) * d ** -0.5
        s = s.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), float("-inf"))
        ref[a:b] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vv)
    torch.testing.assert_close(o.cpu().double(), ref, atol=2e-5, rtol=2e-5)


def test_whole_dk_rule_for_head_size_96(monkeypatch):
    """`extend_tuning._whole_dk`: K and V heads of 96 read K whole on a GPU when the launch
    has a cached-prefix stage (sm_90 or not), plain prefills keep the split; other head sizes,
    unequal K / V sizes and ``ATTNSERVE_WHOLE_DK=0`` keep the split; the interpreter's and
    fp32's small tiles never take it."""
    from attnserve.attention.triton_ops.decode_tuning import WHOLE_DK_ENV

    monkeypatch.delenv(WHOLE_DK_ENV, raising=False)
    bf16 = torch.bfloat16
    for has_prefix in (False, True):
        for cap in (None, (9, 0), (8, 0)):
            cfg = extend_config(96, 96, bf16, has_prefix=has_prefix, capability=cap, max_len_extend=700)
            assert cfg.whole_dk == has_prefix, (has_prefix, cap)
    assert not extend_config(128, 128, bf16, has_prefix=True).whole_dk
    assert not extend_config(96, 64, bf16, has_prefix=True).whole_dk
    assert not extend_config(80, 80, bf16, has_prefix=True).whole_dk
    assert not extend_config(96, 96, bf16, interpret=True).whole_dk
    assert not extend_config(96, 96, torch.float32).whole_dk
    before = extend_config(96, 96, bf16, has_prefix=True)
    monkeypatch.setenv(WHOLE_DK_ENV, "0")
    after = extend_config(96, 96, bf16, has_prefix=True)
    assert not after.whole_dk and dataclasses.replace(after, whole_dk=True) == before


@pytest.mark.parametrize("has_prefix", [False, True])
def test_extend_whole_dk_matches_reference(has_prefix, gen, paged, device):
    """A head of 96 read whole (masked to 128) against the float64 reference, under the
    interpreter (plain and over a cached prefix)."""
    from test_extend_attention import _check, _run

    cfg = ExtendConfig(block_m=32, block_n=16, num_warps=4, num_stages=1, block_n_prefix=32, whole_dk=True)
    _, ref, (out,) = _run(gen, paged, device, prefix=[0, 40] if has_prefix else [0, 0], ext=[33, 20], hq=4, hkv=2,
                          dk=96, dv=96, variants=(cfg,), has_prefix=has_prefix)
    _check(out, ref, torch.float32)
