"""GPU checks of the Gluon causal prefill over a cached prefix (`prefill_gluon.gluon_prefill_fwd`
with ``k_buffer``; `prefill_gluon_prefix_kernel`; sm_90 only).

Each case: a ragged batch of requests with prefix lengths ``P`` and new-token lengths ``E``,
the prefix K/V in a paged pool at page-size-1 slots in shuffled order (every other slot of
the pool NaN, so a wrong gather shows), the output poisoned with NaN, against a float64
reference per request (query ``t`` sees the ``P`` prefix keys and new keys ``0..t``), and for
group 4 against the Triton extend kernel (`extend_attention_fwd`, ``has_prefix=True``).

Bounds. Scores are float32 sums of exact 16-bit products; what matters is 16-bit rounding
(unit roundoff ``u`` = 2^-8 for bf16): P is rounded before the PV product (error <= u p_j a
term: <= u max|v| after the division by the row sum) and the output is rounded (<= u |o|),
so every element is within ``u (max|v| + max|o|)`` of the reference; ``MAX_SLACK`` = 1.5
leaves a margin for float32 accumulation. That bound is loose for long prefixes (|o| shrinks
as the softmax spreads), where dropping a 128-key tile moves outputs by ~|o| / 30 only, so
the root-mean-square error is bounded too: the rounding errors have random signs, about
``u / 2 rms(o)`` in all, and ``RMS_REL`` = 2^-7 of rms(o) leaves 4x; against Triton (same
roundings) the Gluon rms error must not exceed 1.25x Triton's, and its max error 2x Triton's
plus u / 4 of max|o|.

One run: about a minute on an H100, mostly compiling (Gluon prefix kernel for groups 1 / 4 / 8
and fp16; the Triton extend kernel with a prefix for group 4).
"""

from __future__ import annotations

import faulthandler
import math

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0),
                       reason="the Gluon prefill kernel is sm_90 only"),
]

D = 128
MAX_SLACK = 1.5
RMS_REL = 2.0**-7
RMS_RATIO = 1.25
HANG_S = 60.0
PREFIXES = [0, 1, 127, 128, 1000, 4096]
EXTENDS = [1, 17, 128, 1000, 2048]
CROSS = [(p, e) for p in PREFIXES for e in EXTENDS]  # 30 requests


@pytest.fixture(autouse=True)
def _abort_on_hang():
    """A barrier deadlock would hang the GPU run: after ``HANG_S`` s in one test, dump the
    tracebacks and end the process."""
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def _batch(reqs, hq, hkv, seed, dtype=torch.bfloat16, q_scale=1.0, idx_dtype=torch.int32, fused_pool=False):
    """Inputs of requests ``reqs`` = [(P, E), ...]: q/k/v of the new tokens (concatenated), a
    pool of ``2 * sum(P) + 8`` slots (NaN except the prefix slots, which are a random
    permutation), qo_indptr / kv_indptr / kv_indices, o poisoned with NaN. ``fused_pool``: K and
    V are the halves of one ``[slots, 2, Hkv, D]`` tensor (strided views)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    t = sum(e for _, e in reqs)
    n_pre = sum(p for p, _ in reqs)
    slots = 2 * n_pre + 8
    q = (torch.randn(t, hq, D, generator=g, device=dev) * q_scale).to(dtype)
    k = torch.randn(t, hkv, D, generator=g, device=dev).to(dtype)
    v = torch.randn(t, hkv, D, generator=g, device=dev).to(dtype)
    if fused_pool:
        pool = torch.full((slots, 2, hkv, D), float("nan"), dtype=dtype, device=dev)
        k_buf, v_buf = pool[:, 0], pool[:, 1]
    else:
        k_buf = torch.full((slots, hkv, D), float("nan"), dtype=dtype, device=dev)
        v_buf = torch.full((slots, hkv, D), float("nan"), dtype=dtype, device=dev)
    kv_indices = torch.randperm(slots, generator=g, device=dev)[:n_pre].to(idx_dtype)
    k_buf[kv_indices.long()] = torch.randn(n_pre, hkv, D, generator=g, device=dev).to(dtype)
    v_buf[kv_indices.long()] = torch.randn(n_pre, hkv, D, generator=g, device=dev).to(dtype)
    qo = torch.zeros(len(reqs) + 1, dtype=idx_dtype, device=dev)
    kv = torch.zeros(len(reqs) + 1, dtype=idx_dtype, device=dev)
    qo[1:] = torch.cumsum(torch.tensor([e for _, e in reqs], device=dev), 0)
    kv[1:] = torch.cumsum(torch.tensor([p for p, _ in reqs], device=dev), 0)
    o = torch.full((t, hq, D), float("nan"), dtype=dtype, device=dev)
    return dict(q=q, k=k, v=v, o=o, k_buf=k_buf, v_buf=v_buf, qo=qo, kv=kv, idx=kv_indices,
                max_e=max(e for _, e in reqs), reqs=reqs)


def _reference(c, sm_scale):
    """float64 attention per request over prefix + new keys (causal on the new ones): list of
    (output ``[E, Hq, D]``, max |v| of the request's keys)."""
    q, hq, hkv = c["q"], c["q"].shape[1], c["k"].shape[1]
    out = []
    for b, (p, e) in enumerate(c["reqs"]):
        s, ks = int(c["qo"][b]), int(c["kv"][b])
        sl = c["idx"][ks:ks + p].long()
        kk = torch.cat([c["k_buf"][sl], c["k"][s:s + e]]).double().transpose(0, 1).repeat_interleave(hq // hkv, 0)
        vv = torch.cat([c["v_buf"][sl], c["v"][s:s + e]]).double().transpose(0, 1).repeat_interleave(hq // hkv, 0)
        qi = q[s:s + e].double().transpose(0, 1)
        mask = torch.ones(e, p + e, dtype=torch.bool, device=q.device).tril(diagonal=p)
        res = torch.empty(hq, e, D, dtype=torch.float64, device=q.device)
        for h0 in range(0, hq, 8):
            sc = (qi[h0:h0 + 8] @ kk[h0:h0 + 8].transpose(1, 2)) * sm_scale
            res[h0:h0 + 8] = torch.softmax(sc.masked_fill(~mask, float("-inf")), dim=-1) @ vv[h0:h0 + 8]
        out.append((res.transpose(0, 1), vv.abs().max().item()))
    return out


def _errors(o, ref, c):
    """Per request: (max |o - ref|, rms(o - ref), max |ref|, rms(ref), max |v|); no NaN allowed."""
    errs = []
    for b, ((r, vmax), (p, e)) in enumerate(zip(ref, c["reqs"])):
        s = int(c["qo"][b])
        oi = o[s:s + e].double()
        assert not torch.isnan(oi).any(), f"NaN in request (prefix {p}, extend {e})"
        d = oi - r
        errs.append((d.abs().max().item(), d.pow(2).mean().sqrt().item(), r.abs().max().item(),
                     r.pow(2).mean().sqrt().item(), vmax))
    return errs


def _check_reference(errs, reqs, u):
    for (mx, rms, rmax, rrms, vmax), (p, e) in zip(errs, reqs):
        assert mx <= MAX_SLACK * u * (vmax + rmax), f"(P {p}, E {e}): max error {mx:.3e} (|v| {vmax:.2f}, |o| {rmax:.3f})"
        assert rms <= RMS_REL * rrms, f"(P {p}, E {e}): rms error {rms:.3e} vs rms(o) {rrms:.3e}"


def _gluon(c, sm_scale):
    from attnserve.attention.triton_ops.prefill_gluon import gluon_prefill_fwd

    gluon_prefill_fwd(c["q"], c["k"], c["v"], c["o"], None, None, c["max_e"], sm_scale, qo_indptr=c["qo"],
                      k_buffer=c["k_buf"], v_buffer=c["v_buf"], kv_indptr=c["kv"], kv_indices=c["idx"])
    torch.cuda.synchronize()
    return c["o"]


def _extend(c, sm_scale, **kw):
    from attnserve.attention.triton_ops.extend_attention import extend_attention_fwd

    o = torch.full_like(c["q"], float("nan"))
    extend_attention_fwd(c["q"], c["k"], c["v"], o, c["k_buf"], c["v_buf"], c["qo"], c["kv"], c["idx"], None, True,
                         None, c["max_e"], sm_scale, has_prefix=True, **kw)
    torch.cuda.synchronize()
    return o


@pytest.mark.parametrize("heads", [(32, 8), (32, 32), (32, 4)], ids=lambda h: f"{h[0]}x{h[1]}")
def test_prefix_matches_reference(heads, monkeypatch):
    """30 requests: every (prefix, extend) of ``PREFIXES`` x ``EXTENDS``; group 4 also against
    the Triton kernel."""
    hq, hkv = heads
    sm_scale = 1.0 / math.sqrt(D)
    c = _batch(CROSS, hq, hkv, seed=hkv)
    o = _gluon(c, sm_scale)
    ref = _reference(c, sm_scale)
    errs = _errors(o, ref, c)
    _check_reference(errs, CROSS, 2.0**-8)
    if hq // hkv != 4:
        return
    monkeypatch.setenv("ATTNSERVE_EXTEND_GLUON", "0")
    monkeypatch.delenv("ATTNSERVE_EXTEND_GLUON_PREFIX", raising=False)
    tr_errs = _errors(_extend(c, sm_scale), ref, c)
    for (mx, rms, rmax, _, _), (mx_t, rms_t, _, _, _), (p, e) in zip(errs, tr_errs, CROSS):
        assert rms <= RMS_RATIO * rms_t + 1e-12, f"(P {p}, E {e}): rms error {rms:.3e} vs Triton's {rms_t:.3e}"
        assert mx <= 2 * mx_t + 2.0**-10 * rmax, f"(P {p}, E {e}): max error {mx:.3e} vs Triton's {mx_t:.3e}"


def test_prefix_fp16_peaked_int64_fused_pool():
    """fp16, large scores (q x 4: the running max moves between new and prefix tiles), int64
    index tensors, K and V as strided halves of one pool."""
    reqs = [(300, 700), (4096, 1), (5, 129), (129, 2048)]
    c = _batch(reqs, 32, 8, seed=7, dtype=torch.float16, q_scale=4.0, idx_dtype=torch.int64, fused_pool=True)
    sm_scale = 1.0 / math.sqrt(D)
    errs = _errors(_gluon(c, sm_scale), _reference(c, sm_scale), c)
    _check_reference(errs, reqs, 2.0**-11)  # fp16: 10 stored mantissa bits


def test_extend_attention_prefix_switch(monkeypatch):
    """By default (and with ``ATTNSERVE_EXTEND_GLUON_PREFIX=1``) `extend_attention_fwd` with
    ``has_prefix`` runs the Gluon kernel (the direct call's bits) for new-token lengths >= the
    length rule; switched off (``0``), or short extends: the Triton kernel (other bits).
    (Scales != 1: the CPU test of the predicate.)"""
    from attnserve.attention.triton_ops.prefill_gluon import GLUON_PREFILL_MIN_LEN

    reqs = [(1000, 2048), (4096, 333)]
    c = _batch(reqs, 32, 8, seed=3)
    sm_scale = 1.0 / math.sqrt(D)
    gl_out = _gluon(c, sm_scale).clone()
    monkeypatch.delenv("ATTNSERVE_EXTEND_GLUON", raising=False)
    monkeypatch.delenv("ATTNSERVE_EXTEND_GLUON_PREFIX", raising=False)
    assert torch.equal(_extend(c, sm_scale), gl_out)  # default: prefixes take Gluon
    monkeypatch.setenv("ATTNSERVE_EXTEND_GLUON_PREFIX", "0")
    assert not torch.equal(_extend(c, sm_scale), gl_out)
    monkeypatch.setenv("ATTNSERVE_EXTEND_GLUON_PREFIX", "1")
    assert torch.equal(_extend(c, sm_scale), gl_out)
    assert c["max_e"] >= GLUON_PREFILL_MIN_LEN
    short = _batch([(4096, 333)], 32, 8, seed=4)
    short_gl = _gluon(short, sm_scale).clone()
    assert not torch.equal(_extend(short, sm_scale), short_gl)  # 333 < the length rule: Triton
    monkeypatch.setenv("ATTNSERVE_EXTEND_GLUON", "1")
    assert torch.equal(_extend(short, sm_scale), short_gl)
