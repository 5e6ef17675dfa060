"""CPU checks of the Gluon prefill kernel's host side (`prefill_gluon`): tile arithmetic,
config validation, the supported() predicate and the opt-in switch. The kernel itself needs
an sm_90 GPU (tests/gpu/test_prefill_gluon_gpu.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from attnserve.attention.triton_ops import prefill_gluon as pg


def _visible_key_tiles(m0: int, ext_len: int, bm: int, bn: int) -> int:
    """Brute force: the key tiles holding a key that some query row of ``[m0, m0 + bm)`` inside
    the request sees (key <= query < ext_len); tiles are visited from 0 to the last such one."""
    last = -1
    for q in range(m0, min(m0 + bm, ext_len)):
        last = max(last, q // bn)  # key q itself is the query's last visible key
    return last + 1


@pytest.mark.parametrize("bn", [64, 128])
def test_key_tiles_match_the_causal_mask(bn):
    for ext_len in [1, 2, 17, 63, 64, 65, 127, 128, 129, 255, 256, 257, 1000, 2053]:
        for m0 in range(0, ext_len + 256, 128):
            assert pg.key_tiles(m0, ext_len, 128, bn) == _visible_key_tiles(m0, ext_len, 128, bn), (m0, ext_len)


def test_num_query_tiles():
    assert [pg.num_query_tiles(n) for n in (0, 1, 127, 128, 129, 8190)] == [0, 1, 1, 1, 2, 64]
    assert pg.num_query_tiles(129, block_m=64) == 3


def test_causal_flops():
    # 4 * Hq * D * L^2 / 2 a request: 1 x 8190, Llama-3-8B's 32 heads
    assert pg.causal_flops([8190], 32) == 4 * 32 * 128 * 8190 * 8190 / 2
    assert pg.causal_flops([3, 5], 2, 64) == 4 * 2 * 64 * (9 + 25) / 2


def test_config_validation():
    assert pg.DEFAULT_CONFIG.validate() is pg.DEFAULT_CONFIG
    assert pg.DEFAULT_CONFIG.shared_bytes() == 160 * 1024
    assert pg.GluonPrefillConfig(stages=3).validate().shared_bytes() == 224 * 1024
    bad = [dict(block_m=64), dict(block_n=32), dict(block_n=256), dict(stages=0), dict(stages=4),
           dict(consumer_regs=244), dict(loader_regs=16), dict(consumer_regs=256, loader_regs=40),
           dict(maxnreg=176)]
    for kw in bad:
        with pytest.raises(ValueError):
            pg.GluonPrefillConfig(**kw).validate()
    pg.GluonPrefillConfig(block_n=64, stages=4).validate()  # 32 + 4 * 32 KB


def _inputs(t=300, hq=32, hkv=8, d=128, dtype=torch.bfloat16):
    q = torch.zeros(t, hq, d, dtype=dtype)
    k = torch.zeros(t, hkv, d, dtype=dtype)
    v = torch.zeros(t, hkv, d, dtype=dtype)
    o = torch.empty(t, hq, d, dtype=dtype)
    return q, k, v, o


def test_supported_predicate():
    q, k, v, o = _inputs()
    sm90 = dict(capability=(9, 0))
    assert pg.gluon_prefill_supported(q, k, v, o, **sm90)
    assert pg.gluon_prefill_supported(*_inputs(dtype=torch.float16), **sm90)
    assert pg.gluon_prefill_supported(*_inputs(hq=32, hkv=32), **sm90)
    assert not pg.gluon_prefill_supported(q, k, v, o)  # CPU tensors, capability read from the device
    assert not pg.gluon_prefill_supported(q, k, v, o, capability=(10, 0))
    assert not pg.gluon_prefill_supported(q, k, v, o, capability=(8, 0))
    assert not pg.gluon_prefill_supported(*_inputs(dtype=torch.float32), **sm90)
    assert not pg.gluon_prefill_supported(*_inputs(d=64), **sm90)
    assert not pg.gluon_prefill_supported(*_inputs(hq=12, hkv=8), **sm90)
    assert not pg.gluon_prefill_supported(q, k, v, o, is_causal=False, **sm90)
    assert not pg.gluon_prefill_supported(q, k, v, o, has_prefix=True, **sm90)
    assert not pg.gluon_prefill_supported(q, k, v, o, custom_mask=torch.ones(4, dtype=torch.bool), **sm90)
    assert not pg.gluon_prefill_supported(q, k, v, o, logit_cap=30.0, **sm90)
    assert not pg.gluon_prefill_supported(q, k, v, o, sliding_window_size=512, **sm90)
    assert pg.gluon_prefill_supported(q, k, v, o, sliding_window_size=-1, **sm90)
    # mixed dtypes, wrong shapes
    assert not pg.gluon_prefill_supported(q, k.half(), v, o, **sm90)
    assert not pg.gluon_prefill_supported(q, k[:-1], v, o, **sm90)
    assert not pg.gluon_prefill_supported(q, k, v, o[:, :16], **sm90)
    # strides: q/k/v as views of a fused qkv projection are fine (rows 16-byte aligned, heads packed)
    qkv = torch.zeros(300, 48 * 128, dtype=torch.bfloat16)
    qv, kv_, vv = qkv[:, :4096].view(300, 32, 128), qkv[:, 4096:5120].view(300, 8, 128), qkv[:, 5120:].view(300, 8, 128)
    assert pg.gluon_prefill_supported(qv, kv_, vv, o, **sm90)
    # heads not packed (every other head), or a last dimension that is not contiguous
    assert not pg.gluon_prefill_supported(torch.zeros(300, 64, 128, dtype=torch.bfloat16)[:, ::2], k, v, o, **sm90)
    # a [Hq, T, D] buffer seen as [T, Hq, D]: heads not packed
    assert not pg.gluon_prefill_supported(q.transpose(0, 1).contiguous().transpose(0, 1), k, v, o, **sm90)
    # a base that is not 16-byte aligned
    flat = torch.zeros(300 * 32 * 128 + 1, dtype=torch.bfloat16)
    assert not pg.gluon_prefill_supported(flat[1:].view(300, 32, 128), k, v, o, **sm90)


def test_host_module_imports_no_gluon():
    """Importing the host module must not import Triton's Gluon (lazy: only the launch does);
    checked in a fresh interpreter so this process's modules stay as they are."""
    code = ("import sys, attnserve.attention.triton_ops.prefill_gluon as m; "
            "print(any(n.startswith('triton.experimental') for n in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert out.stdout.strip() == "False"


def test_switch_and_length_rule(monkeypatch):
    from attnserve.attention.triton_ops.extend_attention import _use_gluon_prefill

    monkeypatch.delenv(pg.GLUON_PREFILL_ENV, raising=False)
    assert not pg.gluon_prefill_enabled()
    # auto: by the longest request, never for batch-invariant launches
    assert not pg.gluon_prefill_enabled(pg.GLUON_PREFILL_MIN_LEN - 1)
    assert pg.gluon_prefill_enabled(pg.GLUON_PREFILL_MIN_LEN)
    assert not pg.gluon_prefill_enabled(8190, batch_invariant=True)
    for value, on in (("1", True), ("on", True), ("0", False), ("off", False)):
        monkeypatch.setenv(pg.GLUON_PREFILL_ENV, value)
        assert pg.gluon_prefill_enabled() is on
        assert pg.gluon_prefill_enabled(8190) is on  # set, the switch wins over the length
    monkeypatch.setenv(pg.GLUON_PREFILL_ENV, "")  # empty: auto
    assert not pg.gluon_prefill_enabled(1) and pg.gluon_prefill_enabled(8190)
    monkeypatch.setenv(pg.GLUON_PREFILL_ENV, "1")
    # CPU tensors: switched on, still not taken (no sm_90 device)
    assert not _use_gluon_prefill(*_inputs(), True, None, 0.0, -1)


def test_fwd_rejects_unsupported_inputs():
    q, k, v, o = _inputs()
    lens = torch.tensor([300], dtype=torch.int32)
    with pytest.raises(ValueError, match="unsupported"):
        pg.gluon_prefill_fwd(q, k, v, o, lens * 0, lens, 300, 0.1)


def test_attention_flops_with_prefix():
    # 4 * Hq * D * (E * P + E^2 / 2): 1 x (4096 prefix + 4096 new), 32 heads
    assert pg.attention_flops([4096], [4096], 32) == 4 * 32 * 128 * (4096 * 4096 + 4096 * 4096 / 2)
    assert pg.attention_flops([3, 5], [0, 0], 2, 64) == pg.causal_flops([3, 5], 2, 64)
    assert pg.attention_flops([1, 2], [7, 0], 1, 1) == 4 * (1 * 7 + 0.5) + 4 * (0 + 2)


def _cache(slots=50, hkv=8, d=128, dtype=torch.bfloat16):
    return torch.zeros(slots, hkv, d, dtype=dtype)


def test_supported_predicate_with_prefix():
    q, k, v, o = _inputs()
    sm90 = dict(capability=(9, 0), has_prefix=True)
    kb, vb = _cache(), _cache()
    assert pg.gluon_prefill_supported(q, k, v, o, k_buffer=kb, v_buffer=vb, **sm90)
    assert not pg.gluon_prefill_supported(q, k, v, o, **sm90)  # no buffers
    assert not pg.gluon_prefill_supported(q, k, v, o, k_buffer=kb, v_buffer=None, **sm90)
    assert not pg.gluon_prefill_supported(q, k, v, o, k_buffer=kb, v_buffer=vb, k_scale=0.5, **sm90)
    assert not pg.gluon_prefill_supported(q, k, v, o, k_buffer=kb, v_buffer=vb, v_scale=2.0, **sm90)
    # fp8 or fp16 cache with bf16 q, wrong head count or head dim
    f8 = getattr(torch, "float8_e4m3fn", torch.float16)
    assert not pg.gluon_prefill_supported(q, k, v, o, k_buffer=kb.to(f8), v_buffer=vb.to(f8), **sm90)
    assert not pg.gluon_prefill_supported(q, k, v, o, k_buffer=kb.half(), v_buffer=vb.half(), **sm90)
    assert not pg.gluon_prefill_supported(q, k, v, o, k_buffer=_cache(hkv=4), v_buffer=_cache(hkv=4), **sm90)
    assert not pg.gluon_prefill_supported(q, k, v, o, k_buffer=_cache(d=64), v_buffer=_cache(d=64), **sm90)
    # K and V halves of one [slots, 2, Hkv, D] pool are fine; a slot stride of 4 bytes is not
    kv = torch.zeros(50, 2, 8, 128, dtype=torch.bfloat16)
    assert pg.gluon_prefill_supported(q, k, v, o, k_buffer=kv[:, 0], v_buffer=kv[:, 1], **sm90)
    odd = torch.zeros(50 * 8 * 128 + 2, dtype=torch.bfloat16)[2:].view(50, 8, 128)  # base 4-byte aligned
    assert not pg.gluon_prefill_supported(q, k, v, o, k_buffer=odd, v_buffer=vb, **sm90)
    # the other limits still apply with a prefix
    assert not pg.gluon_prefill_supported(q, k, v, o, k_buffer=kb, v_buffer=vb, sliding_window_size=64, **sm90)
    assert not pg.gluon_prefill_supported(q, k, v, o, k_buffer=kb, v_buffer=vb, capability=(8, 0), has_prefix=True)
    # without has_prefix the buffers are not looked at
    assert pg.gluon_prefill_supported(q, k, v, o, k_buffer=kb.half(), capability=(9, 0))


def test_prefix_switch(monkeypatch):
    from attnserve.attention.triton_ops.extend_attention import _use_gluon_prefill

    monkeypatch.delenv(pg.GLUON_PREFILL_ENV, raising=False)
    monkeypatch.delenv(pg.GLUON_PREFILL_PREFIX_ENV, raising=False)
    # prefixes: on by default, by the length rule on the new tokens
    assert pg.gluon_prefill_enabled(8190, has_prefix=True)
    assert not pg.gluon_prefill_enabled(pg.GLUON_PREFILL_MIN_LEN - 1, has_prefix=True)
    # switched off: never, whatever the length or the main switch; plain prefills unaffected
    monkeypatch.setenv(pg.GLUON_PREFILL_PREFIX_ENV, "0")
    assert not pg.gluon_prefill_enabled(8190, has_prefix=True)
    monkeypatch.setenv(pg.GLUON_PREFILL_ENV, "1")
    assert not pg.gluon_prefill_enabled(8190, has_prefix=True)
    assert pg.gluon_prefill_enabled(8190)
    # on: the main switch / the length rule on the new tokens decide, as for plain prefills
    monkeypatch.setenv(pg.GLUON_PREFILL_PREFIX_ENV, "1")
    assert pg.gluon_prefill_enabled(1, has_prefix=True)
    monkeypatch.delenv(pg.GLUON_PREFILL_ENV)
    assert not pg.gluon_prefill_enabled(pg.GLUON_PREFILL_MIN_LEN - 1, has_prefix=True)
    assert pg.gluon_prefill_enabled(pg.GLUON_PREFILL_MIN_LEN, has_prefix=True)
    assert not pg.gluon_prefill_enabled(8190, batch_invariant=True, has_prefix=True)
    monkeypatch.setenv(pg.GLUON_PREFILL_ENV, "0")
    assert not pg.gluon_prefill_enabled(8190, has_prefix=True)
    monkeypatch.setenv(pg.GLUON_PREFILL_PREFIX_ENV, "0")
    monkeypatch.setenv(pg.GLUON_PREFILL_ENV, "1")
    assert not pg.gluon_prefill_enabled(8190, has_prefix=True)
    # CPU tensors: switched on, still not taken
    monkeypatch.setenv(pg.GLUON_PREFILL_PREFIX_ENV, "1")
    assert not _use_gluon_prefill(*_inputs(), True, None, 0.0, -1, 8190, False, True, _cache(), _cache())


def test_fwd_with_prefix_needs_indices():
    q, k, v, o = _inputs()
    qo = torch.tensor([0, 300], dtype=torch.int32)
    with pytest.raises(ValueError):  # CPU tensors: unsupported before the index check
        pg.gluon_prefill_fwd(q, k, v, o, None, None, 300, 0.1, qo_indptr=qo, k_buffer=_cache(), v_buffer=_cache())
