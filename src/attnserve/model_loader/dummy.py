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
}


def dummy_hf_config(name: str) -> Any:
    """HF ``LlamaConfig`` of a named shape (see `DUMMY_MODEL_CONFIGS`).

    Raises:
        ValueError: for an unknown name (lists the known ones).
    """
    if name not in DUMMY_MODEL_CONFIGS:
        raise ValueError(f"unknown dummy model {name!r}; known: {', '.join(sorted(DUMMY_MODEL_CONFIGS))}")
    from transformers import LlamaConfig

    return LlamaConfig(architectures=["LlamaForCausalLM"], **DUMMY_MODEL_CONFIGS[name])


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Fill every parameter in place: norm weights 1 (or the model's ``dummy_norm_fill``,
    e.g. 0 for Gemma's ``1 + w`` norms), biases 0, others ``N(0, std^2)``.

    Deterministic for a given ``seed``, device and dtype (one generator per parameter,
    seeded ``seed + index`` in ``named_parameters`` order). Parameters on the ``meta``
    device are left alone.
    """
    norm_fill = float(getattr(model, "dummy_norm_fill", 1.0))
    for i, (name, param) in enumerate(model.named_parameters()):
        if param.device.type == "meta":
            continue
        module_leaf = name.rsplit(".", 1)[0].rsplit(".", 1)[-1]
        if name.endswith(".weight") and "norm" in module_leaf:
            param.fill_(norm_fill)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            gen = torch.Generator(device=param.device).manual_seed(seed + i)
            param.normal_(0.0, std, generator=gen)
