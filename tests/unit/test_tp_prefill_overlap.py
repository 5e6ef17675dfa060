"""When `DecoderModel.forward` takes the token-halves overlap (`tp_prefill_overlap`): the
switch, the size threshold and the layer links (the ranks' results are in
tests/engine/test_tensor_parallel.py)."""

from types import SimpleNamespace

import pytest
import torch

from attnserve.models.layers import tp_prefill_overlap as ovl
from attnserve.models.layers.tp_prefill_overlap import (TP_OVERLAP_CARVEOUT_ENV, TP_OVERLAP_ENV,
                                                        TP_OVERLAP_MIN_HALF_ENV, gemm_sm_carveout,
                                                        overlap_min_half_bytes, tp_overlap_applies)

TP = SimpleNamespace(size=2, device_group=object())
LINKED = SimpleNamespace(attn_output_partial=True, mlp_output_partial=True)


def test_threshold_switch_and_links(monkeypatch):
    monkeypatch.delenv(TP_OVERLAP_ENV, raising=False)
    monkeypatch.delenv(TP_OVERLAP_MIN_HALF_ENV, raising=False)
    big = torch.empty(8192, 4096, dtype=torch.bfloat16, device="meta")  # halves of 32 MiB
    assert not tp_overlap_applies([LINKED] * 3, big, TP)  # opt-in: off while unset
    monkeypatch.setenv(TP_OVERLAP_ENV, "1")
    assert overlap_min_half_bytes(TP) == 16 << 20  # the custom all-reduce's two-shot ceiling at 2 ranks
    custom = SimpleNamespace(config=SimpleNamespace(two_shot_max_bytes=64 << 20))
    assert overlap_min_half_bytes(SimpleNamespace(size=4, custom_all_reduce=custom)) == 64 << 20
    small = torch.empty(4096, 4096, dtype=torch.bfloat16, device="meta")  # halves of 16 MiB: at the line
    tiny = torch.empty(4000, 4096, dtype=torch.bfloat16, device="meta")
    assert tp_overlap_applies([LINKED] * 3, big, TP)
    assert tp_overlap_applies([LINKED], small, TP)
    assert not tp_overlap_applies([LINKED], tiny, TP)
    half_linked = SimpleNamespace(attn_output_partial=True, mlp_output_partial=False)
    assert not tp_overlap_applies([LINKED, half_linked], big, TP)
    assert not tp_overlap_applies([LINKED], big, SimpleNamespace(size=1, device_group=None))
    assert not tp_overlap_applies([], big, TP)
    monkeypatch.setenv(TP_OVERLAP_ENV, "off")
    assert not tp_overlap_applies([LINKED], big, TP)
    monkeypatch.setenv(TP_OVERLAP_ENV, "1")
    monkeypatch.setenv(TP_OVERLAP_MIN_HALF_ENV, "0")
    assert tp_overlap_applies([LINKED], torch.empty(2, 8, device="meta"), TP)
    assert not tp_overlap_applies([LINKED], torch.empty(1, 8, device="meta"), TP)  # one token: no halves
    for bad in ("-1", "big"):
        monkeypatch.setenv(TP_OVERLAP_MIN_HALF_ENV, bad)
        with pytest.raises(ValueError, match=TP_OVERLAP_MIN_HALF_ENV):
            overlap_min_half_bytes(TP)


def test_gemm_sm_carveout_sets_and_restores(monkeypatch):
    """``ATTNSERVE_TP_OVERLAP_SM_CARVEOUT``: unset or 0 and CPU tensors change nothing; on a CUDA
    device the block runs with cuBLASLt preferred and the carveout set, and both are restored after
    it, also when the block raises; a negative or non-integer value is refused, naming the
    variable. (The CUDA calls are recorded, not made: this build may lack cuBLASLt.)"""
    calls = []
    state = {"blas": "cublas"}

    def blas(backend=None):
        if backend is not None:
            calls.append(("blas", backend))
            state["blas"] = backend
        return state["blas"]

    monkeypatch.setattr(ovl.torch.backends.cuda, "preferred_blas_library", blas)
    monkeypatch.setattr(ovl.torch._C, "_set_sm_carveout_experimental", lambda n: calls.append(("carveout", n)))
    cuda = torch.device("cuda", 0)
    monkeypatch.delenv(TP_OVERLAP_CARVEOUT_ENV, raising=False)
    with gemm_sm_carveout(cuda):
        pass
    monkeypatch.setenv(TP_OVERLAP_CARVEOUT_ENV, "0")
    with gemm_sm_carveout(cuda):
        pass
    monkeypatch.setenv(TP_OVERLAP_CARVEOUT_ENV, "32")
    with gemm_sm_carveout(torch.device("cpu")):
        pass
    assert calls == []
    with gemm_sm_carveout(cuda):
        assert calls == [("blas", "cublaslt"), ("carveout", 32)]
    assert calls[2:] == [("carveout", None), ("blas", "cublas")] and state["blas"] == "cublas"
    calls.clear()
    with pytest.raises(KeyError):
        with gemm_sm_carveout(cuda):
            raise KeyError("inside")
    assert calls[-2:] == [("carveout", None), ("blas", "cublas")]
    for bad in ("-1", "many"):
        monkeypatch.setenv(TP_OVERLAP_CARVEOUT_ENV, bad)
        with pytest.raises(ValueError, match=TP_OVERLAP_CARVEOUT_ENV):
            with gemm_sm_carveout(cuda):
                pass
