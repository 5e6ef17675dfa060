"""`fp8_linear.scaled_mm_padded_rows`: which row counts `scaled_mm_rowwise` pads for
``torch._scaled_mm`` (the product itself is checked on the GPU, tests/gpu/test_fp8_linear_gpu.py)."""

from attnserve.models.layers.quantization.fp8_linear import (PAD_MIN_WEIGHT_ELEMENTS, SCALED_MM_PAD_ENV,
                                                             scaled_mm_padded_rows)


def test_padded_rows_rule(monkeypatch):
    monkeypatch.delenv(SCALED_MM_PAD_ENV, raising=False)
    # unchanged: up to 64 rows, whole multiples of 128, and from 256 rows on (prefill chunks)
    for m in (1, 16, 17, 63, 64, 128, 256, 257, 300, 8192):
        assert scaled_mm_padded_rows(m) == m, m
    for m, want in ((65, 128), (100, 128), (127, 128), (129, 256), (144, 256), (255, 256)):
        assert scaled_mm_padded_rows(m) == want, m
    monkeypatch.setenv(SCALED_MM_PAD_ENV, "0")
    assert scaled_mm_padded_rows(144) == 144


def test_small_weights_are_not_padded(monkeypatch):
    """Only weights of at least PAD_MIN_WEIGHT_ELEMENTS are padded (Llama-3-8B gate_up and down,
    not qkv or o: measured in CUDA graphs, padding only added its copies there)."""
    monkeypatch.delenv(SCALED_MM_PAD_ENV, raising=False)
    assert scaled_mm_padded_rows(144, 4096 * 14336) == 256  # down
    assert scaled_mm_padded_rows(144, 28672 * 4096) == 256  # gate_up
    assert scaled_mm_padded_rows(144, 6144 * 4096) == 144   # qkv
    assert scaled_mm_padded_rows(144, 4096 * 4096) == 144   # o
    assert scaled_mm_padded_rows(144, PAD_MIN_WEIGHT_ELEMENTS) == 256
    assert scaled_mm_padded_rows(144, PAD_MIN_WEIGHT_ELEMENTS - 1) == 144
    assert scaled_mm_padded_rows(144) == 256  # unknown size: as a large weight
