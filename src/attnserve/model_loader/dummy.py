"""Random ("dummy") weights for any config, and named model shapes for speed work.

`--load-format dummy` builds the model directly on the target device and dtype and fills
it in place, so even Llama-3-8B shapes take well under a second on a GPU.
"""

from __future__ import annotations

from typing import Any, Dict

import torch
from torch import nn

#: named shapes -> HF ``LlamaConfig`` keyword arguments (static table)
DUMMY_MODEL_CONFIGS: Dict[str, Dict[str, Any]] = {
    # Meta-Llama-3-8B (config.json of the HF release)
    "llama-3-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        bos_token_id=128000,
        eos_token_id=128001,
    ),
    # SmolLM2-135M-Instruct (matches the config transformers reads from its GGUF)
    "smollm2-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # a few-MB Llama for fast tests of the engine
    "llama-tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # a few-MB DeepSeek-V2 (MLA, dense MLP in every layer) for MLA engine tests
    "deepseek-v2-tiny": dict(
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=16,
        num_key_value_heads=16,
        q_lora_rank=256,
        kv_lora_rank=128,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        first_k_dense_replace=2,  # = num_hidden_layers: no MoE layer
        vocab_size=1000,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # Gemma 3 270M (matches the config transformers reads from the packaged GGUF): 18
    # layers, every 6th global (5, 11, 17), the others sliding with a 512-token window
    "gemma3-270m": dict(
        hidden_size=640,
        intermediate_size=2048,
        num_hidden_layers=18,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        vocab_size=262144,
        sliding_window=512,
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        query_pre_attn_scalar=256,
        hidden_activation="gelu_pytorch_tanh",
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
    ),
    # Qwen3-0.6B (config.json of the HF release)
    "qwen3-0.6b": dict(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    # a few-MB Qwen3 (q/k norms, untied head) for tensor-parallel and engine tests
    "qwen3-tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=301,  # odd: the last tensor-parallel rank pads its vocabulary rows
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    ),
}

# Meta-Llama-3-70B (config.json of the HF release; tensor-parallel runs): Llama-3-8B's
# vocabulary, RoPE and norms in a wider, deeper body
DUMMY_MODEL_CONFIGS["llama-3-70b"] = dict(
    DUMMY_MODEL_CONFIGS["llama-3-8b"], hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
    num_attention_heads=64,
)

# DeepSeek-V3's attention shape (128 heads, kv_lora_rank 512, rope 64, nope 128, v 128) in
# deepseek-v2-tiny's 2 small dense layers: the MLA decode kernels at their production dims
DUMMY_MODEL_CONFIGS["deepseek-v3-mla-tiny"] = dict(
    DUMMY_MODEL_CONFIGS["deepseek-v2-tiny"], num_attention_heads=128, num_key_value_heads=128, kv_lora_rank=512,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=4096,
)

# DeepSeek-V2-Lite's attention shape (16 heads, kv_lora_rank 512, rope 64, nope 128, v 128)
# in the same small body: the few-head MLA decode kernels at their production dims
DUMMY_MODEL_CONFIGS["deepseek-v2-lite-mla-tiny"] = dict(DUMMY_MODEL_CONFIGS["deepseek-v3-mla-tiny"],
                                                        num_attention_heads=16, num_key_value_heads=16)

# ---- mixture-of-experts shapes (config.json of each HF release) ----------------------------
# DeepSeek-V2-Lite: 27 layers (the first dense), 64 routed experts of 1408 (top 6, greedy,
# weights not renormalised) + 2 shared, MLA with 16 heads and no q LoRA, YaRN x40
DUMMY_MODEL_CONFIGS["deepseek-v2-lite"] = dict(
    hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
    num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
    first_k_dense_replace=1, moe_layer_freq=1, topk_method="greedy", n_group=1, topk_group=1, norm_topk_prob=False,
    routed_scaling_factor=1.0, vocab_size=102400, rms_norm_eps=1e-6, max_position_embeddings=163840,
    rope_theta=10000.0, rope_scaling=dict(type="yarn", factor=40.0, original_max_position_embeddings=4096,
                                          beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=0.707),
    tie_word_embeddings=False, bos_token_id=100000, eos_token_id=100001,
)
# Qwen3-30B-A3B: 48 layers, 128 experts of 768, top 8 renormalised; GQA 32/4 heads of 128
DUMMY_MODEL_CONFIGS["qwen3-30b-a3b"] = dict(
    hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936, rope_theta=1000000.0,
    rms_norm_eps=1e-6, max_position_embeddings=40960, tie_word_embeddings=False, bos_token_id=151643,
    eos_token_id=151645,
)
# Mixtral-8x7B-v0.1: 32 layers, 8 experts of 14336, top 2; GQA 32/8 heads of 128
DUMMY_MODEL_CONFIGS["mixtral-8x7b"] = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    head_dim=128, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000, rope_theta=1000000.0,
    rms_norm_eps=1e-5, max_position_embeddings=32768, sliding_window=None, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2,
)
# few-MB MoE models for engine and tensor-parallel tests: every layer but the first sparse
DUMMY_MODEL_CONFIGS["qwen3-moe-tiny"] = dict(
    DUMMY_MODEL_CONFIGS["qwen3-tiny"], moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0],
)
DUMMY_MODEL_CONFIGS["deepseek-v2-moe-tiny"] = dict(
    DUMMY_MODEL_CONFIGS["deepseek-v2-tiny"], first_k_dense_replace=1, moe_intermediate_size=64, n_routed_experts=8,
    n_shared_experts=1, num_experts_per_tok=3, topk_method="group_limited_greedy", n_group=4, topk_group=2,
    norm_topk_prob=False, routed_scaling_factor=1.0,
)

# ---- dense families beyond Llama (config.json of each HF release) ---------------------------
# Qwen2.5-7B-Instruct: 28 layers, GQA 28/4 heads of 128, q/k/v bias, untied head, no window
DUMMY_MODEL_CONFIGS["qwen2.5-7b"] = dict(
    hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
    vocab_size=152064, rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=32768,
    use_sliding_window=False, sliding_window=131072, max_window_layers=28, tie_word_embeddings=False,
    bos_token_id=151643, eos_token_id=151645,
)
# Mistral-7B-Instruct-v0.3: 32 layers, GQA 32/8 heads of 128, no sliding window (v0.2 on)
DUMMY_MODEL_CONFIGS["mistral-7b"] = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    head_dim=128, vocab_size=32768, rope_theta=1000000.0, rms_norm_eps=1e-5, max_position_embeddings=32768,
    sliding_window=None, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
)
# Phi-3-mini-4k-instruct: 32 layers, 32 heads of 96 (MHA), fused qkv/gate_up, window 2047, no rope scaling
DUMMY_MODEL_CONFIGS["phi-3-mini"] = dict(
    hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
    vocab_size=32064, rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=4096,
    original_max_position_embeddings=4096, sliding_window=2047, tie_word_embeddings=False, bos_token_id=1,
    eos_token_id=32000, pad_token_id=32000,
)
# gemma-2-9b: 42 layers alternating local (4096 window) / global, GQA 16/8 heads of 256, soft-caps 50/30
DUMMY_MODEL_CONFIGS["gemma-2-9b"] = dict(
    hidden_size=3584, intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8,
    head_dim=256, vocab_size=256000, query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0,
    final_logit_softcapping=30.0, rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=8192,
    hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0,
)
# few-MB Qwen2 (q/k/v bias, layer 1 windowed) and Mistral (windowed) for FP8 and engine tests
DUMMY_MODEL_CONFIGS["qwen2-tiny"] = dict(
    DUMMY_MODEL_CONFIGS["llama-tiny"], use_sliding_window=True, sliding_window=64, max_window_layers=1,
)
DUMMY_MODEL_CONFIGS["mistral-tiny"] = dict(DUMMY_MODEL_CONFIGS["llama-tiny"], sliding_window=64)

# ---- gpt-oss (config.json of openai/gpt-oss-20b and -120b) -----------------------------------
# 64 query / 8 KV heads of 64 with sinks, local (window 128) and global layers in turn, YaRN x32;
# experts of 2880 with biases and the clamped SwiGLU, 4 chosen per token
_GPT_OSS_BASE = dict(
    hidden_size=2880, intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
    num_experts_per_tok=4, sliding_window=128, attention_bias=True, swiglu_alpha=1.702, swiglu_limit=7.0,
    vocab_size=201088, rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=False,
    rope_parameters=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                         original_max_position_embeddings=4096, rope_theta=150000.0),
    bos_token_id=199998, eos_token_id=200002, pad_token_id=199999,
)


def _alternating(n: int) -> list:
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]


DUMMY_MODEL_CONFIGS["gpt-oss-20b"] = dict(_GPT_OSS_BASE, num_hidden_layers=24, num_local_experts=32,
                                          layer_types=_alternating(24))
DUMMY_MODEL_CONFIGS["gpt-oss-120b"] = dict(_GPT_OSS_BASE, num_hidden_layers=36, num_local_experts=128,
                                           layer_types=_alternating(36))
# gpt-oss-20b's attention (heads, sinks, window 128) and experts of 2880 in 4 layers with 8 experts
# and a small vocabulary: engine tests of every gpt-oss kernel at its production dims
DUMMY_MODEL_CONFIGS["gpt-oss-tiny"] = dict(_GPT_OSS_BASE, num_hidden_layers=4, num_local_experts=8,
                                           layer_types=_alternating(4), vocab_size=4096, bos_token_id=1,
                                           eos_token_id=2, pad_token_id=0)

#: named shapes that are not Llama: name -> (transformers config class, architecture)
_DUMMY_CONFIG_CLASSES: Dict[str, Any] = {
    "deepseek-v2-tiny": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
    "deepseek-v3-mla-tiny": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
    "deepseek-v2-lite-mla-tiny": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
    "gemma3-270m": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "qwen3-0.6b": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3-tiny": ("Qwen3Config", "Qwen3ForCausalLM"),
    "deepseek-v2-lite": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
    "deepseek-v2-moe-tiny": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
    "qwen3-30b-a3b": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "qwen3-moe-tiny": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral-8x7b": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2.5-7b": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral-7b": ("MistralConfig", "MistralForCausalLM"),
    "qwen2-tiny": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral-tiny": ("MistralConfig", "MistralForCausalLM"),
    "phi-3-mini": ("Phi3Config", "Phi3ForCausalLM"),
    "gemma-2-9b": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gpt-oss-20b": ("GptOssConfig", "GptOssForCausalLM"),
    "gpt-oss-120b": ("GptOssConfig", "GptOssForCausalLM"),
    "gpt-oss-tiny": ("GptOssConfig", "GptOssForCausalLM"),
}


def dummy_hf_config(name: str) -> Any:
    """HF config of a named shape (see `DUMMY_MODEL_CONFIGS`; ``LlamaConfig`` unless listed
    in `_DUMMY_CONFIG_CLASSES`).

    Raises:
        ValueError: for an unknown name (lists the known ones).
    """
    if name not in DUMMY_MODEL_CONFIGS:
        raise ValueError(f"unknown dummy model {name!r}; known: {', '.join(sorted(DUMMY_MODEL_CONFIGS))}")
    import transformers

    cls_name, arch = _DUMMY_CONFIG_CLASSES.get(name, ("LlamaConfig", "LlamaForCausalLM"))
    return getattr(transformers, cls_name)(architectures=[arch], **DUMMY_MODEL_CONFIGS[name])


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Fill every parameter in place: norm weights 1 (or the model's ``dummy_norm_fill``,
    e.g. 0 for Gemma's ``1 + w`` norms), biases 0, others ``N(0, std^2)``.

    Deterministic for a given ``seed``, device and dtype (one generator per parameter,
    seeded ``seed + index`` in ``named_parameters`` order). A tensor-parallel parameter
    (``tp_shard``, `attnserve.models.layers.parallel`) draws its full (tp 1) tensor and keeps
    its rank's slice, so every tp size computes the same model. Parameters on the ``meta``
    device are left alone.
    """
    from attnserve.models.layers.parallel import load_param

    norm_fill = float(getattr(model, "dummy_norm_fill", 1.0))
    # FP8 scales computed with their weight are skipped (and not counted), so a quantised
    # model draws the same full-precision weights as the unquantised one
    named = [(n, p) for n, p in model.named_parameters() if not getattr(p, "loaded_with_weight", False)]
    for i, (name, param) in enumerate(named):
        if param.device.type == "meta":
            continue
        module_leaf = name.rsplit(".", 1)[0].rsplit(".", 1)[-1]
        if name.endswith(".weight") and "norm" in module_leaf:
            param.fill_(norm_fill)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            gen = torch.Generator(device=param.device).manual_seed(seed + i)
            spec = getattr(param, "tp_shard", None)
            source_dtype = getattr(param, "source_dtype", None)  # an FP8 weight: drawn, then quantised
            if source_dtype is not None:
                shape = spec.full_shape(param.shape) if spec is not None else param.shape
                full = torch.empty(shape, dtype=source_dtype, device=param.device)
                load_param(param, full.normal_(0.0, std, generator=gen), name)
            elif spec is None:
                param.normal_(0.0, std, generator=gen)
            else:  # one full tensor at a time
                full = torch.empty(spec.full_shape(param.shape), dtype=param.dtype, device=param.device)
                load_param(param, full.normal_(0.0, std, generator=gen), name)
