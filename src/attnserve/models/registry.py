"""Model registry: HF architecture name -> model class, imported lazily.

Adding a model is one line in `_MODELS`: ``"HFArchitecture": ("module", "Class",
("hf_model_type", ...))``. The model types let configs without ``architectures`` (e.g. the
ones transformers builds from a GGUF file) find their class.
"""

from __future__ import annotations

import importlib
from typing import Dict, Optional, Tuple, Type

from torch import nn

# architecture -> (module under attnserve.models, class name, HF model_type values)
_MODELS: Dict[str, Tuple[str, str, Tuple[str, ...]]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM", ("llama",)),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM", ("gemma3_text",)),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM", ("qwen3",)),
    "DeepseekV2ForCausalLM": ("deepseek_v2", "DeepseekV2ForCausalLM", ("deepseek_v2",)),
    "DeepseekV3ForCausalLM": ("deepseek_v2", "DeepseekV3ForCausalLM", ("deepseek_v3",)),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM", ("qwen3_moe",)),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM", ("mixtral",)),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM", ("qwen2",)),
    "MistralForCausalLM": ("mistral", "MistralForCausalLM", ("mistral",)),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM", ("phi3",)),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM", ("gemma2",)),
    "GptOssForCausalLM": ("gpt_oss", "GptOssForCausalLM", ("gpt_oss",)),
}

#: architecture -> "module:Class" (static; see `_MODELS`)
MODEL_REGISTRY: Dict[str, str] = {arch: f"attnserve.models.{mod}:{cls}" for arch, (mod, cls, _) in _MODELS.items()}


def supported_architectures() -> list:
    """Sorted HF architecture names that have a model class."""
    return sorted(MODEL_REGISTRY)


def architecture_for_model_type(model_type: Optional[str]) -> Optional[str]:
    """The registered architecture whose HF ``model_type`` is ``model_type``, else None."""
    for arch, (_, _, types) in _MODELS.items():
        if model_type in types:
            return arch
    return None


def get_model_class(architecture: str) -> Type[nn.Module]:
    """Import and return the model class for an HF architecture name.

    Raises:
        ValueError: for an architecture without a model; the message lists supported ones.
    """
    if architecture not in MODEL_REGISTRY:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; supported: {', '.join(supported_architectures())}"
        )
    module_name, cls_name = MODEL_REGISTRY[architecture].split(":")
    return getattr(importlib.import_module(module_name), cls_name)
