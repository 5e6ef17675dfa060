"""The opt-in K-major weight layout (`models.layers.weight_layout`): which weights it
re-lays, that their values and shapes stay, that a model computes the same, and its errors."""

import pytest
import torch

from attnserve.model_loader.loader import load_model
from attnserve.models.layers.weight_layout import WEIGHT_LAYOUT_ENV, apply_weight_layout, weight_layout_requested


def test_layout_flag_values(monkeypatch):
    monkeypatch.delenv(WEIGHT_LAYOUT_ENV, raising=False)
    assert weight_layout_requested() == "nk"
    monkeypatch.setenv(WEIGHT_LAYOUT_ENV, " KN ")
    assert weight_layout_requested() == "kn"
    monkeypatch.setenv(WEIGHT_LAYOUT_ENV, "mn")
    with pytest.raises(ValueError, match="'nk' .*'kn'"):
        weight_layout_requested()


def test_kn_layout_keeps_values_and_outputs(monkeypatch):
    """On a bf16 llama-tiny (CPU standing in for CUDA): every decoder projection (2 layers x
    qkv / o / gate_up / down) becomes K-major with the same values, the LM head and embedding
    stay row-major, and a forward of each projection gives the same result (bf16 products
    summed in float32 either way: equal within one bf16 rounding)."""
    loaded = load_model("llama-tiny", load_format="dummy", load_tokenizer=False, progress=False,
                        dtype=torch.bfloat16)
    model = loaded.model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    layer = model.model.layers[0]
    x = torch.randn(5, layer.self_attn.qkv_proj.in_features, dtype=torch.bfloat16,
                    generator=torch.Generator().manual_seed(0))
    want = [m(x) for m in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj)]
    monkeypatch.setenv(WEIGHT_LAYOUT_ENV, "nk")
    assert apply_weight_layout(model, device_types=("cpu",)) == 0
    monkeypatch.setenv(WEIGHT_LAYOUT_ENV, "kn")
    assert apply_weight_layout(model, device_types=("cpu",)) == 8
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
        relaid = name.endswith(("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight"))
        assert p.is_contiguous() != relaid, name
        if relaid:
            assert p.stride() == (1, p.shape[0]), name
    got = [m(x) for m in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj)]
    for w, g in zip(want, got):
        assert ((w.float() - g.float()).abs() <= 2 ** -8 * w.float().abs() + 1e-6).all()
    assert apply_weight_layout(model, device_types=("cpu",)) == 0  # already K-major: left alone
