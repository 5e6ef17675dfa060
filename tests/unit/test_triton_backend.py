"""The `triton` backend end to end (metadata + kernels) against `torch_native`, on CPU under
the Triton interpreter (small shapes) and on CUDA when present."""

import os

import pytest
import torch

from attention_harness import backend_config, make_batch, naive_reference
from attnserve.attention.hybrid import HybridAttnBackend
from attnserve.attention.torch_native import TorchNativeAttnBackend
from attnserve.forward_batch import ForwardMode

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs CUDA or TRITON_INTERPRET=1")


def _run(case, backend):
    case.fb.attn_backend = backend
    backend.init_forward_metadata(case.fb)
    out = case.layer(case.q.reshape(case.q.shape[0], -1), case.k.reshape(case.k.shape[0], -1),
                     case.v.reshape(case.v.shape[0], -1), case.fb)
    return out.view(case.q.shape[0], case.layer.tp_q_head_num, case.layer.v_head_dim)


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DECODE])
@pytest.mark.parametrize("page_size,hq,hkv,window,cap", [(1, 4, 4, -1, 0.0), (4, 6, 2, 5, 0.0), (16, 8, 1, -1, 5.0),
                                                          (4, 4, 2, 3, 3.0)])
def test_triton_backend_matches_reference(mode, page_size, hq, hkv, window, cap):
    from attnserve.attention.triton_backend import TritonAttnBackend

    if mode == ForwardMode.DECODE:
        prefix, ext = [0, 9, 30, 3], [1, 1, 1, 1]
    elif mode == ForwardMode.MIXED:
        prefix, ext = [0, 12, 7], [9, 1, 1]
    else:
        prefix, ext = [0, 7, 20], [5, 3, 12]
    case = make_batch(mode, prefix, ext, hq, hkv, 16, page_size, window=window, logit_cap=cap,
                      seed=page_size * 31 + hq, device=DEVICE)
    out = _run(case, TritonAttnBackend(backend_config(case)))
    assert not torch.isnan(out).any()
    ref = naive_reference(case)
    err = (out.double().cpu() - ref).norm() / ref.norm()
    assert err < 1e-4, err


def test_hybrid_routes_by_mode():
    from attnserve.attention.triton_backend import TritonAttnBackend

    case = make_batch(ForwardMode.DECODE, [4, 9], [1, 1], 4, 2, 16, 1, seed=5, device=DEVICE)
    calls = []

    class Spy(TorchNativeAttnBackend):
        def forward_decode(self, *a, **k):
            calls.append("decode")
            return super().forward_decode(*a, **k)

        def forward_extend(self, *a, **k):
            calls.append("extend")
            return super().forward_extend(*a, **k)

    hybrid = HybridAttnBackend(TritonAttnBackend(backend_config(case)), Spy(backend_config(case)))
    out = _run(case, hybrid)
    assert calls == ["decode"]
    assert torch.allclose(out.double().cpu(), naive_reference(case), atol=1e-4)
    assert hybrid._select(ForwardMode.EXTEND) is hybrid.prefill_backend
    assert hybrid._select(ForwardMode.TARGET_VERIFY) is hybrid.prefill_backend
    hybrid.speculative_attention_mode = "decode"
    assert hybrid._select(ForwardMode.DRAFT_EXTEND) is hybrid.decode_backend


@pytest.mark.parametrize("prefix,expect", [([0, 0], False), ([0, 7], True)])
def test_extend_metadata_has_prefix_hint(prefix, expect):
    """The extend metadata tells the kernel (from host lengths) whether any request has a
    cached prefix: a plain prefill launches without the separate prefix tile."""
    from attnserve.attention.triton_backend import TritonAttnBackend

    case = make_batch(ForwardMode.EXTEND, prefix, [5, 9], 4, 2, 16, 4, seed=11, device=DEVICE)
    backend = TritonAttnBackend(backend_config(case))
    out = _run(case, backend)
    assert backend.forward_metadata.has_prefix is expect
    ref = naive_reference(case)
    assert (out.double().cpu() - ref).norm() / ref.norm() < 1e-4
