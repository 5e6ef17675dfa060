"""GPU checks of the Gluon causal prefill kernel (`prefill_gluon.gluon_prefill_fwd`; sm_90 only).

Each case: ragged requests of bf16 q/k/v (Hq 32 with Hkv 32, 8 or 4; D 128), the output
poisoned with NaN first, against a float64 causal reference computed per request from the
same bf16 inputs, and against the Triton extend kernel on the same inputs.

Bounds. The kernel's scores are float32 sums of exact bf16 products (error ~1e-6 relative),
its exp2 is within 2^-22; what matters is bf16 rounding (unit roundoff 2^-8): P is rounded to
bf16 before the PV product (error <= 2^-8 p_j per term, so <= 2^-8 max_j|v_j| after the
division by the row sum) and the output is rounded to bf16 (<= 2^-8 |o|). The worst case is
2^-8 (max|v| + max|o|) per request. Each request's first query sees only key 0, so its
output is V's row 0 for every head: max|o| >= max over heads of |v_0| (about 3.5 for 8 x 128
standard normals), while max|v| over an 8,190-row request is about 5.3. So the worst case is
about 2.5 x 2^-8 max|o|, and ``ERR_TOL`` = 4 x 2^-8 = 2^-6 of max|o| per request leaves a
1.6x margin; a masking or rescaling bug moves outputs by O(max|o|). Against the Triton
kernel (also bf16 P and output), the two are within the sum of their bounds (2^-5), and the
Gluon kernel's root-mean-square error against the reference must not exceed 1.25x the Triton
kernel's (both are dominated by the same final bf16 rounding).

One run: 2-4 minutes on an H100, mostly compiling (the Gluon kernel for groups 1 / 4 / 8, fp16,
int64 and qo_indptr lengths; the Triton kernel's short and long configs).
"""

from __future__ import annotations

import faulthandler
import math
import random

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0),
                       reason="the Gluon prefill kernel is sm_90 only"),
]

ERR_TOL = 2.0**-6
PAIR_TOL = 2.0**-5
RMS_RATIO = 1.25
HANG_S = 240.0
D = 128
HEADS = [(32, 32), (32, 8), (32, 4)]
_rng = random.Random(1234)
LENS = {
    "ragged": [1, 17, 128, 129, 1000, 2048 + 5],
    "long": [8190],
    "many-short": [_rng.randint(1, 300) for _ in range(48)],
    "boundaries": [63, 64, 65, 127, 255, 256, 257, 384],
    "tiny": [1, 5, 3],  # 9 rows in all: every TMA box reaches past the tensor's end
}


@pytest.fixture(autouse=True)
def _abort_on_hang():
    """A barrier deadlock in the kernel would hang the GPU run: after ``HANG_S`` seconds in one
    test, dump the tracebacks and end the process."""
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def _inputs(lens, hq, hkv, seed, dtype=torch.bfloat16, q_scale=1.0, gaps=None):
    """q/k/v for requests of ``lens`` (optionally ``gaps[i]`` unowned rows after request i),
    o poisoned with NaN, starts / lengths int32."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    gaps = gaps or [0] * len(lens)
    starts, pos = [], 0
    for n, gap in zip(lens, gaps):
        starts.append(pos)
        pos += n + gap
    t = pos
    q = (torch.randn(t, hq, D, generator=g, device="cuda") * q_scale).to(dtype)
    k = torch.randn(t, hkv, D, generator=g, device="cuda").to(dtype)
    v = torch.randn(t, hkv, D, generator=g, device="cuda").to(dtype)
    o = torch.full((t, hq, D), float("nan"), dtype=dtype, device="cuda")
    dev = dict(device="cuda", dtype=torch.int32)
    return q, k, v, o, torch.tensor(starts, **dev), torch.tensor(lens, **dev)


def _reference(q, k, v, starts, lens, sm_scale):
    """float64 causal attention per request: list of ``[n, Hq, D]``."""
    hq, hkv = q.shape[1], k.shape[1]
    out = []
    for s, n in zip(starts.tolist(), lens.tolist()):
        qi = q[s:s + n].double().transpose(0, 1)  # [Hq, n, D]
        ki = k[s:s + n].double().transpose(0, 1).repeat_interleave(hq // hkv, 0)
        vi = v[s:s + n].double().transpose(0, 1).repeat_interleave(hq // hkv, 0)
        res = torch.empty(hq, n, D, dtype=torch.float64, device=q.device)
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        for h0 in range(0, hq, 8):  # 8 heads at a time: 8 x 8190^2 float64 is 4.3 GB
            sc = (qi[h0:h0 + 8] @ ki[h0:h0 + 8].transpose(1, 2)) * sm_scale
            sc = sc.masked_fill(~mask, float("-inf"))
            res[h0:h0 + 8] = torch.softmax(sc, dim=-1) @ vi[h0:h0 + 8]
        out.append(res.transpose(0, 1))
    return out


def _errors(o, ref, starts, lens):
    """Per request: (max |o - ref| / max |ref|, rms(o - ref)); no NaN allowed."""
    errs = []
    for r, s, n in zip(ref, starts.tolist(), lens.tolist()):
        oi = o[s:s + n].double()
        assert not torch.isnan(oi).any(), "NaN in a request's output (unwritten rows or bad math)"
        diff = oi - r
        errs.append(((diff.abs().max() / r.abs().max()).item(), diff.pow(2).mean().sqrt().item()))
    return errs


def _triton(q, k, v, starts, lens, sm_scale, monkeypatch):
    from attnserve.attention.triton_ops.extend_attention import extend_attention_fwd

    monkeypatch.setenv("ATTNSERVE_EXTEND_GLUON", "0")  # the Triton kernel whatever the lengths
    hkv = k.shape[1]
    qo_indptr = torch.zeros(len(lens) + 1, dtype=torch.int32, device="cuda")
    qo_indptr[1:] = torch.cumsum(lens, 0)
    assert torch.equal(qo_indptr[:-1], starts), "the Triton kernel needs contiguous requests"
    kv_indptr = torch.zeros_like(qo_indptr)
    buf = torch.zeros(1, hkv, D, dtype=q.dtype, device="cuda")
    o = torch.full_like(q, float("nan"))
    extend_attention_fwd(q, k, v, o, buf, buf, qo_indptr, kv_indptr, kv_indptr[:1], None, True, None,
                         int(lens.max()), sm_scale, has_prefix=False)
    return o


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}x{h[1]}")
@pytest.mark.parametrize("case", list(LENS))
def test_matches_reference_and_triton(case, heads, monkeypatch):
    from attnserve.attention.triton_ops.prefill_gluon import gluon_prefill_fwd

    hq, hkv = heads
    lens = LENS[case]
    sm_scale = 1.0 / math.sqrt(D)
    q, k, v, o, starts, seq_lens = _inputs(lens, hq, hkv, seed=len(lens) * 7 + hkv)
    gluon_prefill_fwd(q, k, v, o, starts, seq_lens, max(lens), sm_scale)
    torch.cuda.synchronize()
    ref = _reference(q, k, v, starts, seq_lens, sm_scale)
    errs = _errors(o, ref, starts, seq_lens)
    worst = max(e for e, _ in errs)
    assert worst <= ERR_TOL, f"max error {worst:.3e} of max|o| (bound {ERR_TOL:.3e}); per request {errs}"

    o_tr = _triton(q, k, v, starts, seq_lens, sm_scale, monkeypatch)
    tr_errs = _errors(o_tr, ref, starts, seq_lens)
    for (e_g, rms_g), (e_t, rms_t), r, s, n in zip(errs, tr_errs, ref, starts.tolist(), lens):
        pair = ((o[s:s + n].double() - o_tr[s:s + n].double()).abs().max() / r.abs().max()).item()
        assert pair <= PAIR_TOL, f"request of {n}: Gluon vs Triton {pair:.3e} of max|o|"
        assert rms_g <= RMS_RATIO * rms_t + 1e-12, f"request of {n}: rms error {rms_g:.3e} vs Triton's {rms_t:.3e}"


def test_peaked_scores_fp16_and_int64_lengths():
    """Large scores (q x 4: softmax nearly one-hot, the running max moves across tiles), fp16,
    int64 start / length tensors."""
    from attnserve.attention.triton_ops.prefill_gluon import gluon_prefill_fwd

    lens = [700, 3000, 5]
    q, k, v, o, starts, seq_lens = _inputs(lens, 32, 8, seed=5, dtype=torch.float16, q_scale=4.0)
    sm_scale = 1.0 / math.sqrt(D)
    gluon_prefill_fwd(q, k, v, o, starts.long(), seq_lens.long(), max(lens), sm_scale)
    torch.cuda.synchronize()
    errs = _errors(o, _reference(q, k, v, starts, seq_lens, sm_scale), starts, seq_lens)
    assert max(e for e, _ in errs) <= ERR_TOL, errs


def test_rows_outside_requests_untouched():
    """Requests with unowned rows between them (finite K/V there): those output rows keep
    their poison (only rows < each request's length are written) and the requests are right."""
    from attnserve.attention.triton_ops.prefill_gluon import gluon_prefill_fwd

    lens, gaps = [150, 300, 129, 1], [50, 200, 71, 3]
    q, k, v, o, starts, seq_lens = _inputs(lens, 32, 8, seed=9, gaps=gaps)
    sm_scale = 0.1
    gluon_prefill_fwd(q, k, v, o, starts, seq_lens, max(lens), sm_scale)
    torch.cuda.synchronize()
    errs = _errors(o, _reference(q, k, v, starts, seq_lens, sm_scale), starts, seq_lens)
    assert max(e for e, _ in errs) <= ERR_TOL, errs
    for s, n, gap in zip(starts.tolist(), lens, gaps):
        assert torch.isnan(o[s + n:s + n + gap]).all(), f"rows {s + n}..{s + n + gap} were written"


def test_extend_attention_switch(monkeypatch):
    """``ATTNSERVE_EXTEND_GLUON=1``: the extend entry point's plain causal prefill runs the Gluon
    kernel (the same bits as calling it directly, through ``qo_indptr``); unset: the Triton
    kernel (other bits: other tiles)."""
    from attnserve.attention.triton_ops.extend_attention import extend_attention_fwd
    from attnserve.attention.triton_ops.prefill_gluon import gluon_prefill_fwd

    lens = [2048, 333]
    q, k, v, o, starts, seq_lens = _inputs(lens, 32, 8, seed=3)
    sm_scale = 1.0 / math.sqrt(D)
    gluon_prefill_fwd(q, k, v, o, starts, seq_lens, max(lens), sm_scale)
    qo_indptr = torch.tensor([0, 2048, 2381], dtype=torch.int32, device="cuda")
    buf = torch.zeros(1, 8, D, dtype=q.dtype, device="cuda")

    def run():
        out = torch.full_like(q, float("nan"))
        extend_attention_fwd(q, k, v, out, buf, buf, qo_indptr, qo_indptr * 0, qo_indptr[:1], None, True, None,
                             max(lens), sm_scale, has_prefix=False)
        return out

    monkeypatch.setenv("ATTNSERVE_EXTEND_GLUON", "1")
    assert torch.equal(run(), o)
    monkeypatch.setenv("ATTNSERVE_EXTEND_GLUON", "0")
    assert not torch.equal(run(), o)
    # unset: by length (2,048 >= GLUON_PREFILL_MIN_LEN), but never for batch-invariant launches
    monkeypatch.delenv("ATTNSERVE_EXTEND_GLUON", raising=False)
    assert torch.equal(run(), o)
    out = torch.full_like(q, float("nan"))
    extend_attention_fwd(q, k, v, out, buf, buf, qo_indptr, qo_indptr * 0, qo_indptr[:1], None, True, None,
                         max(lens), sm_scale, has_prefix=False, batch_invariant=True)
    assert not torch.equal(out, o)


def test_cuda_graph_replay():
    """Captured once; replayed with new q/k/v values and new lengths (same grid): no host
    synchronisation inside, the descriptors' addresses stay valid."""
    from attnserve.attention.triton_ops.prefill_gluon import gluon_prefill_fwd

    max_len, hq, hkv = 1024, 32, 8
    t = 2048
    sm_scale = 1.0 / math.sqrt(D)
    q = torch.zeros(t, hq, D, dtype=torch.bfloat16, device="cuda")
    k = torch.zeros(t, hkv, D, dtype=torch.bfloat16, device="cuda")
    v = torch.zeros_like(k)
    o = torch.zeros_like(q)
    starts = torch.tensor([0, 1024], dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor([1024, 1024], dtype=torch.int32, device="cuda")
    gluon_prefill_fwd(q, k, v, o, starts, seq_lens, max_len, sm_scale)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gluon_prefill_fwd(q, k, v, o, starts, seq_lens, max_len, sm_scale)
    for seed, lens in ((11, [1024, 1000]), (12, [17, 1024]), (13, [513, 0])):
        nq, nk, nv, _, _, _ = _inputs([t], hq, hkv, seed=seed)
        q.copy_(nq)
        k.copy_(nk)
        v.copy_(nv)
        o.fill_(float("nan"))
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        keep = [i for i, n in enumerate(lens) if n > 0]
        st, ln = starts[keep], seq_lens[keep]
        errs = _errors(o, _reference(q, k, v, st, ln, sm_scale), st, ln)
        assert max(e for e, _ in errs) <= ERR_TOL, (lens, errs)
        if lens[1] < 1024:  # rows past the second request's end are not written
            assert torch.isnan(o[1024 + lens[1]:]).all()
