"""Qwen2, Mistral, Phi-3 (longrope past its original context) and Gemma 2 (soft-caps, local and
global layers) on a GPU: the Triton backend with CUDA graphs against torch_native eager on
the same random tiny HF checkpoints as tests/models/test_model_families.py; float32 with
IEEE matmuls, greedy tokens equal. Prompts are longer than the windows (8 tokens) and than
Phi-3's ``original_max_position_embeddings`` (32).
"""

import os
import random
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
from test_model_families import VARIANTS, VOCAB, hf_variant  # noqa: E402,F401  (the fixture)

pytestmark = pytest.mark.cuda


def _tokens(path, prompts, **kw):
    from attnserve.engine.llm import LLM
    from attnserve.engine.sampling_params import SamplingParams

    with LLM(model=path, device="cuda", dtype="float32", max_total_tokens=4096, context_length=128,
             chunked_prefill_size=32, **kw) as llm:
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True))
        graphs = llm.engine.model_runner.cuda_graph_runner is not None
    return [o.token_ids for o in outs], graphs


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_triton_with_graphs_matches_torch_native(variant, hf_variant, no_tf32):
    path, _ = hf_variant(variant)
    rnd = random.Random(3)
    # phi3_longrope: context 128 at most; the longest prompts cross 32 before decoding
    prompts = [[rnd.randrange(3, VOCAB) for _ in range(n)] for n in (3, 9, 20, 33, 50, 64)]
    want, _ = _tokens(path, prompts, attention_backend="torch_native", disable_cuda_graph=True)
    got, graphs = _tokens(path, prompts, attention_backend="triton")
    assert graphs
    assert got == want
