"""On the GPU: after the start-up warm-up the first batches run as fast as the same
batches again (issue 33, item 7), and without it they compile kernels.

Each measurement is `attnserve.bench.startup` in a fresh process with an empty
``TRITON_CACHE_DIR``, so neither kernels compiled by earlier tests of this process nor
Triton's on-disk cache hide a compilation: Qwen3-0.6B's shape with dummy weights (head
dim 128 and GQA, the kernels of Llama-3-8B's shape), 32 unrelated prompts of 2,080 tokens
-> 16 tokens, then 32 prompts sharing 1,920 tokens with them (prefix-cache hits), each
batch timed twice from the same cache state.
"""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.cuda

#: first batch may take this much longer than the second: 10% (the issue's target) ...
RATIO = 1.10
#: ... plus this many seconds: the batches last ~0.1 s (prefix hits) and ~0.3 s, and two
#: warm runs of the same batch in one process differed by up to 27 ms on an H100 (0.304 vs
#: 0.331 s, `attnserve.bench.startup`, 2026-11); 10% of a 0.1 s batch does not absorb that
SLACK_S = 0.03
NUM_PROMPTS, INPUT_LEN, PREFIX_LEN, OUTPUT_LEN = 32, 2080, 1920, 16


def _measure(tmp_path, *flags) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton-cache"), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "attnserve.bench.startup", "--model", "qwen3-0.6b", "--load-format", "dummy",
           "--device", "cuda", "--num-prompts", str(NUM_PROMPTS), "--input-len", str(INPUT_LEN),
           "--prefix-len", str(PREFIX_LEN), "--output-len", str(OUTPUT_LEN), "--rounds", "2", *flags]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(result, indent=1))  # the figures, for the log
    return result


def _rounds(result, name):
    runs = sorted((b for b in result["batches"] if b["batch"] == name), key=lambda b: b["round"])
    assert [b["round"] for b in runs] == [1, 2]
    return runs


def test_first_batches_after_warmup_run_like_warm_ones(tmp_path):
    result = _measure(tmp_path)
    warm = result["warmup"]
    assert warm is not None and warm["seconds"] > 0 and warm["triton_compiles"] > 0
    assert set(warm["phase_seconds"]) >= {"prefill", "prefix", "mixed", "sampling"}
    for name in ("unrelated", "prefix"):
        first, second = _rounds(result, name)
        assert first["output_tokens"] == second["output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
        assert first["triton_compiles"] == 0, first["compiled"]
        assert first["seconds"] <= RATIO * second["seconds"] + SLACK_S, (name, first["seconds"], second["seconds"])
    hits = [b["cached_tokens"] for b in _rounds(result, "prefix")]
    assert hits == [NUM_PROMPTS * PREFIX_LEN] * 2  # the second batch really is served from the cache


def test_without_warmup_the_first_batches_compile(tmp_path):
    """The control: the measurement sees the compilations that the warm-up moves to
    start-up (graph capture alone leaves the extend kernels uncompiled)."""
    result = _measure(tmp_path, "--skip-server-warmup")
    assert result["warmup"] is None
    for name in ("unrelated", "prefix"):
        first, second = _rounds(result, name)
        assert second["triton_compiles"] == 0, second["compiled"]
    assert _rounds(result, "unrelated")[0]["triton_compiles"] > 0
