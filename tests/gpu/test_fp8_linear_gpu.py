"""FP8 linears (issue 37) on sm 89+: each path against the float64 product of its
dequantised operands, the activation quantiser against the PyTorch reference, checkpoint
formats through the engine with CUDA graphs, and FP8 weights with the FP8 KV cache."""

from __future__ import annotations

import pytest
import torch

from attnserve.models.layers.linear import Linear
from attnserve.models.layers.parallel import load_param
from attnserve.models.layers.quantization import QuantizationConfig, quantized_construction
from attnserve.models.layers.quantization.apply import quantize_model_linears
from attnserve.models.layers.quantization.fp8_kernels import quantize_activation
from attnserve.models.layers.quantization.fp8_utils import dequantize, quantize_per_group, quantize_per_row

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available() or
                                                   torch.cuda.get_device_capability() < (8, 9), reason="FP8 GPU")]
CFGS = {"channel": QuantizationConfig("channel"), "tensor": QuantizationConfig("tensor"),
        "block": QuantizationConfig("block", (128, 128))}


def _layer(k, n, cfg):
    with torch.device("cuda"), quantized_construction(cfg):
        layer = Linear(k, n, dtype=torch.bfloat16)
    quantize_model_linears(layer, cfg, "cuda", torch.bfloat16)
    return layer


@pytest.mark.parametrize("strategy", list(CFGS))
@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (16, 512, 1024), (64, 384, 200), (300, 1024, 4096)])
def test_paths_match_float64(strategy, m, n, k):
    g = torch.Generator(device="cuda").manual_seed(m + k)
    layer = _layer(k, n, CFGS[strategy])
    load_param(layer.weight, torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.05, "w")
    x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
    y = layer(x).double()
    w = layer.quant_method.dequantized_weight(layer).double()
    if strategy != "block" and m <= 16:  # decode: W8A16 skinny kernel, x unquantised
        ref = x.double() @ w.t()
    elif strategy == "block":
        q, s = quantize_per_group(x)
        ref = dequantize(q, s, block=(1, 128)).double() @ w.t()
    else:
        q, s = quantize_per_row(x)
        ref = dequantize(q, s).double() @ w.t()
    # bf16 output rounding (2**-9 relative) and float32 accumulation
    assert (y - ref).abs().max() <= 8e-3 * ref.abs().max()


@pytest.mark.parametrize("group", [None, 128])
def test_activation_quant_kernel_matches_reference(group):
    x = torch.randn(37, 1000, device="cuda", dtype=torch.bfloat16) * 3
    q, s = quantize_activation(x, group)
    qr, sr = quantize_per_row(x) if group is None else quantize_per_group(x, group)
    sr = sr.unsqueeze(1) if group is None else sr
    torch.testing.assert_close(s, sr, rtol=1e-6, atol=0)
    mismatch = (q.float() != qr.float()).float().mean().item()
    assert mismatch < 1e-3  # division rounding may flip a rare tie


def test_gated_skinny_fp8_matches_unfused():
    cfg = CFGS["channel"]
    layer = _layer(4096, 2 * 1024, cfg)
    load_param(layer.weight, torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16) * 0.05, "w")
    x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)
    fused = layer.forward_gated(x, "silu").float()
    full = x.float() @ layer.quant_method.dequantized_weight(layer).t()
    ref = torch.nn.functional.silu(full[:, :1024]) * full[:, 1024:]
    assert (fused - ref).abs().max() <= 1e-2 * ref.abs().max()


def _save_tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(500)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t1", eos_token="t2", unk_token="t0").save_pretrained(path)


@pytest.mark.parametrize("fmt", ["fp8-block", "fp8-tensor", "compressed-tensors"])
def test_checkpoint_formats_in_the_engine_with_graphs(fmt, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from attnserve.engine.llm import LLM
    from attnserve.engine.sampling_params import SamplingParams
    from attnserve.models.layers.quantization.export import export_fp8_checkpoint, fp8_format_config

    src = tmp_path / "src"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2,
                                 num_key_value_heads=2, head_dim=128, vocab_size=500,
                                 max_position_embeddings=512)).save_pretrained(src)
    export_fp8_checkpoint(str(src), str(tmp_path / fmt), fmt)
    for d in (src, tmp_path / fmt):  # the engine loads a tokenizer: a word-level one of the vocabulary
        _save_tokenizer(str(d))
    prompts = [[1, 5, 9, 200, 3, 77], [4, 8, 15, 16, 23, 42, 99]]
    sp = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    outs = []
    for path, q in ((str(tmp_path / fmt), None), (str(src), fp8_format_config(fmt))):
        llm = LLM(path, device="cuda", dtype="bfloat16", kv_cache_dtype="fp8_e4m3", quantization=q)
        assert llm.engine.model_runner.cuda_graph_runner is not None
        outs.append([o.token_ids for o in llm.generate(prompts, sp)])
        llm.shutdown()
    assert outs[0] == outs[1]


def test_dummy_llama_fp8_decode_graph_matches_eager():
    from attnserve.engine.llm import LLM
    from attnserve.engine.sampling_params import SamplingParams

    sp = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    res = []
    for graphs_off in (False, True):
        llm = LLM("llama-tiny", load_format="dummy", device="cuda", quantization="fp8", disable_cuda_graph=graphs_off)
        res.append([o.token_ids for o in llm.generate(prompts, sp)])
        llm.shutdown()
    assert res[0] == res[1]
