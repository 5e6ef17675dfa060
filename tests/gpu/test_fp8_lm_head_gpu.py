"""``--enable-fp8-lm-head`` on sm 89+: the FP8 head's logits against the float64 product of
its operands on every route a decode or prefill batch takes (the one-row W8A16 GEMV with
unquantised activations, the W8A8 ``_scaled_mm`` with per-token scales), and the engine's
greedy tokens with CUDA graphs equal to eager ones."""

from __future__ import annotations

import pytest
import torch

from attnserve.models.layers.quantization.fp8_utils import dequantize

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available() or
                                                   torch.cuda.get_device_capability() < (8, 9), reason="FP8 GPU")]


@pytest.fixture(scope="module")
def model():
    from attnserve.model_loader.loader import load_model

    return load_model("qwen3-0.6b", load_format="dummy", dtype=torch.bfloat16, device="cuda", load_tokenizer=False,
                      progress=False, quantization="fp8", fp8_lm_head=True).model


@pytest.mark.parametrize("rows", [1, 8, 64, 200, 1000])
def test_fp8_head_logits_match_float64(model, rows):
    from attnserve.models.layers.quantization.fp8_linear import w8a16_max_m

    layer = model.lm_head_fp8
    assert layer.weight.dtype == torch.float8_e4m3fn
    assert model.lm_head is None or model.lm_head.weight.numel() == 0  # Qwen3-0.6B ties its embeddings
    g = torch.Generator(device="cuda").manual_seed(rows)
    h = torch.randn(rows, layer.in_features, device="cuda", generator=g).to(torch.bfloat16)
    got = model.compute_logits(h)
    if rows <= w8a16_max_m():  # the one-row route reads bf16 activations
        x = h.double()
    else:
        q, s = layer.quant_method._quantize_input(layer, h)
        x = dequantize(q, s).double()
    want = (x @ dequantize(layer.weight, layer.weight_scale).double().t())[:, : model.config.vocab_size]
    assert got.dtype == torch.float32 and got.shape == want.shape
    # logits rounded once to bf16 (2^-8 relative) after a float32 accumulation over 1,024 terms
    err = (got.double() - want).abs()
    assert (err <= 2 ** -7 * want.abs() + 1e-3 * want.abs().max()).all(), err.max().item()


def test_engine_greedy_tokens_graphs_equal_eager():
    from attnserve.engine.llm import LLM
    from attnserve.engine.sampling_params import SamplingParams

    # 16 requests decode together to the end and a graph of exactly 16 rows is captured, so the
    # graph replays the eager step's kernels at the same row count (the FP8 GEMV's tiles depend
    # on it, and a dummy model's near-tied logits would expose any other difference)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 150000, (int(n),), generator=g).tolist() for n in torch.randint(8, 200, (16,))]
    sp = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    outs = {}
    for graphs in (True, False):
        graph_args = dict(cuda_graph_bs=[16]) if graphs else dict(disable_cuda_graph=True)
        with LLM("qwen3-0.6b", load_format="dummy", device="cuda", dtype="bfloat16", quantization="fp8",
                 enable_fp8_lm_head=True, max_total_tokens=8192, max_running_requests=16, context_length=512,
                 **graph_args) as llm:
            assert (llm.engine.model_runner.cuda_graph_runner is not None) == graphs
            outs[graphs] = [o.token_ids for o in llm.generate(prompts, sp)]
    assert outs[True] == outs[False]
