"""Mixture-of-experts models (Qwen3-MoE, Mixtral, DeepSeek-V2/V3) against HF transformers.

Each variant is a random tiny HF model saved with ``save_pretrained`` (per-expert safetensors
names, as the published checkpoints have them) and loaded by our loader. Float32 throughout.
Checked: prefill logits against an HF full forward within `numeric_bounds.forward_bound`, and
32 greedy tokens from our engine (torch_native backend, CPU expert path) equal to HF
``generate``. Router weights are drawn 10x wider than HF's init so that routing decisions
are far from ties (a tie flipped by float32 rounding would be a legitimate difference).
"""

from __future__ import annotations

import pytest
import torch

from attnserve.forward_batch import ForwardMode
from numeric_bounds import assert_within, forward_bound, llama_like_terms, mla_terms
from test_deepseek_v2 import _mla_runner
from tiny_hf import hf_logits as _hf_logits, hf_variant_getter, load_checkpoint as _load, random_prompt

VOCAB = 256
LLAMA_LIKE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  vocab_size=VOCAB, max_position_embeddings=512, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=False)
MLA = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
           q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
           vocab_size=VOCAB, max_position_embeddings=512, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
           tie_word_embeddings=False, first_k_dense_replace=1, moe_intermediate_size=32, n_routed_experts=8,
           n_shared_experts=1)
VARIANTS = {
    # layer 1 dense (mlp_only_layers), experts renormalised
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        LLAMA_LIKE, num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1])),
    "qwen3_moe_unnormalised": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        LLAMA_LIKE, intermediate_size=96, moe_intermediate_size=32, num_experts=6, num_experts_per_tok=3,
        norm_topk_prob=False)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        LLAMA_LIKE, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)),
    "mixtral_window": ("MixtralConfig", "MixtralForCausalLM", dict(
        LLAMA_LIKE, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, sliding_window=8)),
    "deepseek_v2_greedy": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        MLA, num_experts_per_tok=2, topk_method="greedy", norm_topk_prob=False, routed_scaling_factor=1.5)),
    "deepseek_v2_group_limited": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        MLA, num_experts_per_tok=3, topk_method="group_limited_greedy", n_group=4, topk_group=2,
        norm_topk_prob=True, n_shared_experts=2)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        MLA, num_experts_per_tok=3, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)),
}


def _randomise(model, name):
    for pname, p in model.named_parameters():
        if "norm" in pname:
            p.copy_(1.0 + 0.2 * torch.randn_like(p))
        elif pname.endswith("gate.weight"):  # the router, away from ties
            p.normal_(0.0, 0.2)
        elif pname.endswith("e_score_correction_bias"):
            p.copy_(0.05 * torch.randn_like(p))
    for bname, b in model.named_buffers():
        if bname.endswith("e_score_correction_bias"):  # HF keeps it as a buffer
            b.copy_(0.05 * torch.randn_like(b))


@pytest.fixture(scope="module")
def hf_variant(tmp_path_factory):
    """variant -> (checkpoint dir, HF model in eval mode), built once per module."""
    return hf_variant_getter(tmp_path_factory, VARIANTS, 4321, _randomise, VOCAB)


def _prompt(seed, n):
    return random_prompt(seed, n, VOCAB)


def _terms(config, n):
    """Float32 terms summed from embedding to logit (MoE layers sum top_k expert outputs of
    ``moe_intermediate_size`` terms each, fewer than a dense MLP's; the dense count bounds them)."""
    if getattr(config, "kv_lora_rank", None):
        return mla_terms(config, n)
    return llama_like_terms(config, n)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_logits_match_hf(variant, hf_variant, step_runner):
    path, hf = hf_variant(variant)
    loaded = _load(path)
    assert type(loaded.model).__name__ == VARIANTS[variant][1]
    ids = _prompt(7, 29)
    if loaded.model_config.is_mla:
        runner = _mla_runner(step_runner, loaded)
    else:
        runner = step_runner(loaded.model, loaded.model_config)
    logits = runner.step(ForwardMode.EXTEND, [(runner.new_request(), ids)])
    ref = _hf_logits(hf, ids)
    assert_within(logits, ref, forward_bound(ref, _terms(loaded.model_config.hf_config, len(ids))),
                  f"{variant} prefill vs HF")


@pytest.mark.parametrize("variant", ["qwen3_moe", "mixtral_window", "deepseek_v2_group_limited", "deepseek_v3"])
def test_engine_greedy_matches_hf_generate(variant, hf_variant):
    from transformers import GenerationConfig

    from attnserve.engine.llm import LLM
    from attnserve.engine.sampling_params import SamplingParams

    path, hf = hf_variant(variant)
    prompts = [_prompt(21, 17), _prompt(22, 5), _prompt(23, 26)]
    with LLM(model=path, device="cpu", dtype="float32", attention_backend="torch_native", page_size=4,
             max_total_tokens=1024, chunked_prefill_size=16) as llm:  # the 26-token prompt in 2 chunks
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            # no EOS for HF either (ours runs with ignore_eos): HF merges the model's own
            # generation config into the one passed, so its EOS is cleared there
            hf.generation_config.eos_token_id = None
            ref = hf.generate(torch.tensor([prompt]), generation_config=GenerationConfig(
                max_new_tokens=32, do_sample=False, pad_token_id=0))
        assert ref.shape[1] == len(prompt) + 32
        assert out.token_ids == ref[0, len(prompt):].tolist()


def _weights(path):
    import glob

    from safetensors.torch import load_file

    out = {}
    for f in glob.glob(f"{path}/*.safetensors"):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("variant,dropped", [("qwen3_moe", "model.layers.0.mlp.experts.5.up_proj.weight"),
                                             ("mixtral", "model.layers.1.block_sparse_moe.experts.3.w2.weight"),
                                             ("deepseek_v3", "model.layers.2.mlp.experts.0.gate_proj.weight")])
def test_missing_expert_tensor_is_named(variant, dropped, hf_variant):
    path, _ = hf_variant(variant)
    weights = _weights(path)
    assert dropped in weights
    model = _load(path).model
    with pytest.raises(ValueError, match=f"missing 1 expert tensors: {dropped.replace('.', '[.]')}"):
        model.load_weights((k, v) for k, v in weights.items() if k != dropped)


def test_expert_tensor_in_a_dense_layer_is_refused(hf_variant):
    path, _ = hf_variant("qwen3_moe")  # layer 1 is dense (mlp_only_layers)
    weights = _weights(path)
    model = _load(path).model
    extra = ("model.layers.1.mlp.experts.0.gate_proj.weight", weights["model.layers.0.mlp.experts.0.gate_proj.weight"])
    with pytest.raises(KeyError, match="model.layers.1.mlp has no routed experts"):
        model.load_weights(list(weights.items()) + [extra])


def test_unsupported_routing_and_tp_are_refused():
    import transformers

    from attnserve.distributed.group import TPGroup
    from attnserve.models.deepseek_v2 import DeepseekV2ForCausalLM
    from attnserve.models.layers.moe.routing import RoutingConfig
    from attnserve.models.layers.moe.sparse_block import SparseMoeBlock

    bad = transformers.DeepseekV2Config(**dict(MLA, num_experts_per_tok=2, topk_method="random_routing"))
    with pytest.raises(ValueError, match="random_routing"):
        DeepseekV2ForCausalLM(bad, dtype=torch.float32)
    with pytest.raises(ValueError, match="--tp-size 4"):  # 30 intermediate rows over 4 ranks
        SparseMoeBlock(64, 8, 30, RoutingConfig(top_k=2), torch.float32, tp=TPGroup(rank=0, size=4))
