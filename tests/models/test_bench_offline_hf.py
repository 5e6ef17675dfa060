"""The HF baseline of `attnserve.bench.offline` times every prompt once, in batches."""

import torch

from attnserve.bench.offline import PROMPTS, bench_hf


def test_hf_baseline_generates_for_every_prompt(smollm2_source):
    # 5 prompts in batches of 2: [0:2], [2:4], [4:5] after a warm-up batch that is not counted.
    r = bench_hf(smollm2_source.model_path, smollm2_source.gguf_file, PROMPTS[:5], max_new_tokens=3, batch=2,
                 dtype=torch.float32, device="cpu", repeat=3)
    assert r["requests"] == 5 and r["batch"] == 2
    assert r["generated_tokens"] == 5 * 3  # per pass
    assert len(r["seconds_all"]) == 3 and r["seconds"] == sorted(r["seconds_all"])[1]  # the median pass
    assert r["seconds"] > 0 and abs(r["tokens_per_s"] - 15 / r["seconds"]) < 1e-9
