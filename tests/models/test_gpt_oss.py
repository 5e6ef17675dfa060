"""gpt-oss against HF transformers: a random tiny ``GptOssForCausalLM`` (eager attention, so HF
runs its sink formula) saved with ``save_pretrained`` and as an MXFP4 checkpoint, loaded by our
loader. Float32 throughout.

Checked: prefill logits within `numeric_bounds.forward_bound`; 32 greedy tokens through the
paged KV cache and through the engine equal to HF's; MXFP4 dequantisation bit-equal to
transformers' own; tp 2 on CPU ranks equal to tp 1; the sinks, the clamps and the windows each
change the result (so none could be left out unnoticed); the published shapes' parameter counts.
The weights HF initialises to constants or near zero (biases, norms, sinks, router) are drawn
wide: sinks of a few units compete with the scores, and ``swiglu_limit`` is 1 so both clamps bite.
"""

from __future__ import annotations

import json

import pytest
import torch

from attnserve.forward_batch import ForwardMode
from numeric_bounds import assert_within, forward_bound, llama_like_terms
from test_model_families import _greedy, _hf_greedy
from tiny_hf import (assert_tp2_matches_tp1, hf_logits as _hf_logits, hf_variant_getter, load_checkpoint as _load,
                     random_prompt)

VOCAB = 256
WINDOW = 8
CONFIG = dict(
    hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, num_local_experts=4, num_experts_per_tok=2, vocab_size=VOCAB, sliding_window=WINDOW,
    max_position_embeddings=256, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    rope_parameters=dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                         original_max_position_embeddings=64, rope_theta=10000.0),
    swiglu_limit=1.0, attn_implementation="eager", bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
VARIANTS = {"gpt_oss": ("GptOssConfig", "GptOssForCausalLM", CONFIG)}
PREFILL_LEN = 41  # past the window of 8 and past the 64-position YaRN original length only in decode


def _randomise(model, name):
    for pname, p in model.named_parameters():
        if "norm" in pname:
            p.copy_(1.0 + 0.2 * torch.randn_like(p))
        elif pname.endswith("sinks"):
            p.normal_(0.0, 2.0)
        elif pname.endswith("bias"):  # wider biases swamp the tokens: every position then argmaxes alike
            p.normal_(0.0, 0.05)
        elif pname.endswith("router.weight"):  # away from routing ties
            p.normal_(0.0, 0.2)
        elif pname.endswith(("q_proj.weight", "k_proj.weight")):
            p.normal_(0.0, 0.25)
        elif "experts" in pname:
            p.normal_(0.0, 0.15)


@pytest.fixture(scope="module")
def hf_variant(tmp_path_factory):
    return hf_variant_getter(tmp_path_factory, VARIANTS, 4100, _randomise, VOCAB)


def _prefill(loaded, ids, step_runner, page_size=1):
    runner = step_runner(loaded.model, loaded.model_config, page_size=page_size)
    return runner.step(ForwardMode.EXTEND, [(runner.new_request(), ids)])


def test_prefill_logits_and_greedy_match_hf(hf_variant, step_runner):
    path, hf = hf_variant("gpt_oss")
    loaded = _load(path)
    assert type(loaded.model).__name__ == "GptOssForCausalLM"
    assert loaded.model_config.is_sliding_layer == (True, False, True)
    runner = step_runner(loaded.model, loaded.model_config, page_size=4)
    for ids in (random_prompt(7, PREFILL_LEN, VOCAB), random_prompt(8, 6, VOCAB)):
        logits = runner.step(ForwardMode.EXTEND, [(runner.new_request(), ids)])
        ref = _hf_logits(hf, ids)
        assert_within(logits, ref, forward_bound(ref, llama_like_terms(hf.config, len(ids))),
                      f"gpt-oss prefill of {len(ids)} vs HF")
    prompts = [random_prompt(21, 20, VOCAB), random_prompt(22, 40, VOCAB)]  # decode crosses position 64
    want = [_hf_greedy(hf, p) for p in prompts]
    assert min(len(set(w)) for w in want) > 8  # a model that repeats one token would prove little
    assert _greedy(runner, prompts) == want


def test_engine_greedy_matches_hf_generate(hf_variant):
    from attnserve.engine.llm import LLM
    from attnserve.engine.sampling_params import SamplingParams

    path, hf = hf_variant("gpt_oss")
    prompts = [random_prompt(31, 33, VOCAB), random_prompt(32, 12, VOCAB)]
    with LLM(model=path, device="cpu", dtype="float32", attention_backend="torch_native", page_size=4,
             max_total_tokens=1024) as llm:
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == [_hf_greedy(hf, p) for p in prompts]


def test_sinks_clamps_and_windows_change_the_result(hf_variant, step_runner):
    """Each feature moves these logits by far more than the bound the checks above use."""
    path, hf = hf_variant("gpt_oss")
    ids = random_prompt(7, PREFILL_LEN, VOCAB)
    loaded = _load(path)
    base = _prefill(loaded, ids, step_runner)
    bound = forward_bound(base, llama_like_terms(hf.config, len(ids)))
    layers = loaded.model.model.layers

    saved = [layer.self_attn.sinks.clone() for layer in layers]
    for layer in layers:
        layer.self_attn.sinks.fill_(-1e4)  # exp(-1e4 - m) == 0: no sink
    assert (base - _prefill(loaded, ids, step_runner)).abs().max() > 100 * bound
    for layer, s in zip(layers, saved):
        layer.self_attn.sinks.copy_(s)

    for layer in layers:
        layer.mlp.experts.swiglu_limit = 1e6
    assert (base - _prefill(loaded, ids, step_runner)).abs().max() > 100 * bound
    for layer in layers:
        layer.mlp.experts.swiglu_limit = 1.0

    for layer in layers:
        layer.self_attn.attn.sliding_window_size = -1
    assert (base - _prefill(loaded, ids, step_runner)).abs().max() > 100 * bound


# ---- MXFP4 ---------------------------------------------------------------------------------
def _random_mxfp4(shape_rows, cols, gen):
    """uint8 blocks ``[*rows, cols / 32, 16]`` and e8m0 scales ``[*rows, cols / 32]``."""
    groups = cols // 32
    blocks = torch.randint(0, 256, (*shape_rows, groups, 16), generator=gen, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(120, 128, (*shape_rows, groups), generator=gen, dtype=torch.int32).to(torch.uint8)
    return blocks, scales


def test_dequantize_mxfp4_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from attnserve.models.gpt_oss import dequantize_mxfp4

    gen = torch.Generator().manual_seed(5)
    blocks, scales = _random_mxfp4((3, 24), 96, gen)
    ours = dequantize_mxfp4(blocks, scales, torch.float32)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    assert ours.shape == (3, 24, 96)
    assert torch.equal(ours, theirs.transpose(1, 2))
    assert ours.abs().max() > 0 and ours.unique().numel() > 20  # not all zeros / one value
    with pytest.raises(ValueError, match=r"MXFP4 scales of shape \(3, 24, 2\) do not fit blocks"):
        dequantize_mxfp4(blocks, scales[..., :2])


def _write_mxfp4_checkpoint(hf, path, drop=None):
    """Our MXFP4 file of ``hf`` with random experts; returns the HF model's expert values
    replaced by their dequantised weights (so the HF model is the file's model)."""
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(9)
    cfg = hf.config
    e, h, inter = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    tensors = {}
    for name, t in hf.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            rows = (e, 2 * inter) if name.endswith("gate_up_proj") else (e, h)
            cols = h if name.endswith("gate_up_proj") else inter
            blocks, scales = _random_mxfp4(rows, cols, gen)
            t.copy_(convert_moe_packed_tensors(blocks, scales, dtype=t.dtype))  # the HF model takes the file's values
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        else:
            tensors[name] = t.contiguous()
    if drop:
        del tensors[drop]
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"))
    config = cfg.to_dict()
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(config))


def test_mxfp4_checkpoint_loads_dequantised(hf_variant, tmp_path, step_runner):
    import copy

    _, hf = hf_variant("gpt_oss")
    hf = copy.deepcopy(hf)
    with torch.no_grad():
        _write_mxfp4_checkpoint(hf, tmp_path / "mxfp4")
    loaded = _load(str(tmp_path / "mxfp4"))
    ids = random_prompt(11, 30, VOCAB)
    ref = _hf_logits(hf, ids)
    assert_within(_prefill(loaded, ids, step_runner), ref,
                  forward_bound(ref, llama_like_terms(hf.config, len(ids))), "gpt-oss MXFP4 prefill vs HF")

    with pytest.raises(ValueError, match="--quantization fp8 cannot be combined with this mxfp4 checkpoint"):
        _load(str(tmp_path / "mxfp4"), quantization="fp8")
    with torch.no_grad():
        _write_mxfp4_checkpoint(hf, tmp_path / "no_scales", drop="model.layers.1.mlp.experts.down_proj_scales")
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.experts.down_proj_blocks but no down_proj_scales"):
        _load(str(tmp_path / "no_scales"))


def test_missing_expert_bias_is_named(hf_variant, tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = hf_variant("gpt_oss")
    import pathlib
    import shutil

    dst = tmp_path / "nobias"
    shutil.copytree(path, dst)
    files = list(pathlib.Path(dst).glob("*.safetensors"))
    for f in files:
        t = load_file(str(f))
        t.pop("model.layers.2.mlp.experts.down_proj_bias", None)
        save_file(t, str(f), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing 4 expert tensors: model.layers.2.mlp.experts.0.down_proj.bias, "):
        _load(str(dst))


def test_tp2_matches_tp1(hf_variant):
    """tp 2 on CPU ranks: heads with their sinks and biases, every expert's rows (and their
    biases) split over the ranks, the down bias added once."""
    path, _ = hf_variant("gpt_oss")
    assert_tp2_matches_tp1(path, [random_prompt(41, 36, VOCAB), random_prompt(42, 5, VOCAB)])


def test_dummy_shapes_match_hf_parameter_counts():
    """The named shapes build (on ``meta``) with HF's parameter count for the same config,
    and the published totals (model card, arXiv:2508.10925, table 1: 20.9B and 116.8B)."""
    import transformers

    from attnserve.model_loader.dummy import dummy_hf_config
    from attnserve.model_loader.loader import load_model

    counts = {}
    for name in ("gpt-oss-20b", "gpt-oss-120b"):
        loaded = load_model(name, load_format="dummy", device="meta", load_tokenizer=False)
        ours = sum(p.numel() for p in loaded.model.parameters())
        with torch.device("meta"):
            hf = transformers.AutoModelForCausalLM.from_config(dummy_hf_config(name))
        assert ours == sum(p.numel() for p in hf.parameters()), name
        counts[name] = ours
    assert round(counts["gpt-oss-20b"] / 1e9, 1) == 20.9
    assert round(counts["gpt-oss-120b"] / 1e9, 1) == 116.8


def test_generation_config_eos_ids_join_the_stop_ids(hf_variant, tmp_path):
    """gpt-oss's config.json names one end (``<|return|>``), its generation_config.json also
    ``<|call|>``: the loader stops at both, as HF ``generate`` does; a malformed file is ignored."""
    import shutil

    from attnserve.engine.llm import LLM
    from attnserve.engine.sampling_params import SamplingParams
    from attnserve.model_loader.loader import generation_config_eos_ids

    path, hf = hf_variant("gpt_oss")
    prompt = random_prompt(31, 33, VOCAB)
    want = _hf_greedy(hf, prompt, n=8)
    stop_at = want[3]
    dst = tmp_path / "gen_eos"
    shutil.copytree(path, dst)
    (dst / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, stop_at]}))
    assert generation_config_eos_ids(str(dst)) == (2, stop_at)
    loaded = _load(str(dst))
    assert stop_at in loaded.model_config.eos_token_ids and 2 in loaded.model_config.eos_token_ids
    with LLM(model=str(dst), device="cpu", dtype="float32", attention_backend="torch_native", page_size=4,
             max_total_tokens=1024) as llm:
        out = llm.generate([prompt], SamplingParams(max_new_tokens=8, temperature=0.0))[0]
    assert out.token_ids[-1] == stop_at and len(out.token_ids) <= 4 and out.finish_reason == "stop"
    (dst / "generation_config.json").write_text("{not json")
    assert generation_config_eos_ids(str(dst)) == ()
