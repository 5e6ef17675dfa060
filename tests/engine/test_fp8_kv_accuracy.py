"""FP8 KV cache with the real weights (CPU, float32 compute, scales 1.0): teacher-forced over
512 positions of English text, every key read back from the FP8 cache, against the
unquantized cache (`attnserve.bench.kv_accuracy`).

Measured on this machine (benchmarks/results/cpu-kv-accuracy-2026-11-24.json): SmolLM2
e4m3 top-1 0.951 / mean KL 0.0209, e5m2 0.891 / 0.075; Gemma 3 e4m3 0.940 / 0.0115, e5m2
0.877 / 0.062. The issue's target (>= 0.97 and <= 0.02) is not met; calibrated per-layer
scales (amax / 448, from another text) did not help (0.961 / 0.028): the error is the
formats' 3 (e4m3) and 2 (e5m2) mantissa bits. The bounds below guard these measurements
against regressions.
"""

import pytest

from attnserve.bench.kv_accuracy import measure

BOUNDS = {  # (top-1 agreement at least, mean KL at most)
    ("smollm2-135m", "fp8_e4m3"): (0.94, 0.03),
    ("smollm2-135m", "fp8_e5m2"): (0.87, 0.10),
    ("gemma3-270m", "fp8_e4m3"): (0.92, 0.02),
    ("gemma3-270m", "fp8_e5m2"): (0.85, 0.09),
}


@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_fp8_kv_accuracy_teacher_forced(model):
    result = measure(model, 512)
    for fmt, r in result.items():
        top1, kl = BOUNDS[(model, fmt)]
        assert r["top1_agreement"] >= top1 and r["mean_kl"] <= kl, (model, fmt, r)
    # e4m3 (3 mantissa bits) is the more accurate format for KV
    assert result["fp8_e4m3"]["mean_kl"] < result["fp8_e5m2"]["mean_kl"]
