"""`fp8_linear.scaled_mm_padded_rows`: which row counts `scaled_mm_rowwise` pads for
``torch._scaled_mm`` (the product itself is checked on the GPU, tests/gpu/test_fp8_linear_gpu.py)."""

from attnserve.models.layers.quantization.fp8_linear import SCALED_MM_PAD_ENV, scaled_mm_padded_rows


def test_padded_rows_rule(monkeypatch):
    monkeypatch.delenv(SCALED_MM_PAD_ENV, raising=False)
    # unchanged: up to 64 rows, whole multiples of 128, and from 256 rows on (prefill chunks)
    for m in (1, 16, 17, 63, 64, 128, 256, 257, 300, 8192):
        assert scaled_mm_padded_rows(m) == m, m
    for m, want in ((65, 128), (100, 128), (127, 128), (129, 256), (144, 256), (255, 256)):
        assert scaled_mm_padded_rows(m) == want, m
    monkeypatch.setenv(SCALED_MM_PAD_ENV, "0")
    assert scaled_mm_padded_rows(144) == 144
