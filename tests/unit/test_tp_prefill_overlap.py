"""When `DecoderModel.forward` takes the token-halves overlap (`tp_prefill_overlap`): the
switch, the size threshold and the layer links (the ranks' results are in
tests/engine/test_tensor_parallel.py)."""

from types import SimpleNamespace

import pytest
import torch

from attnserve.models.layers.tp_prefill_overlap import (TP_OVERLAP_ENV, TP_OVERLAP_MIN_HALF_ENV,
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
