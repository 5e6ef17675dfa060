"""`ModelConfig`: the engine's view of an HF config (what the KV pool and scheduler need)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Tuple

import torch

from attnserve.models.registry import architecture_for_model_type, supported_architectures


def _eos_ids(value: Any) -> Tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


@dataclass
class ModelConfig:
    """Shape and attention metadata of a model, derived from its HF config.

    Attributes:
        architecture: HF architecture name (``"LlamaForCausalLM"``); from
            ``config.architectures[0]`` or, when absent (GGUF-derived configs), from
            ``config.model_type``.
        hidden_size, num_hidden_layers, num_attention_heads, vocab_size: as in HF.
        num_key_value_heads: KV heads per layer as stored in the KV cache (1 for MLA,
            whose cache holds one latent "head" per token).
        head_dim: query/key head size used in the attention math (MLA:
            ``qk_nope_head_dim + qk_rope_head_dim``).
        v_head_dim: value head size (``head_dim`` for MHA).
        context_len: ``max_position_embeddings`` (tokens).
        attention_arch: ``"mha"`` (MHA/GQA/MQA) or ``"mla"`` (config has ``kv_lora_rank``).
        kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim: MLA sizes (0 for MHA).
        sliding_window: HF ``sliding_window`` in tokens (a query sees itself and the
            ``sliding_window - 1`` tokens before it), or None. `RadixAttention` takes
            ``sliding_window - 1`` (the `sliding_window_size` property).
        is_sliding_layer: per layer, whether it uses the window (all False without one).
        eos_token_ids: end-of-sequence ids from the config (the loader adds the
            tokenizer's).
        hf_config: the HF config itself (text config for multimodal wrappers).
    """

    architecture: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    v_head_dim: int
    vocab_size: int
    context_len: int
    attention_arch: str = "mha"
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    sliding_window: Optional[int] = None
    is_sliding_layer: Tuple[bool, ...] = ()
    eos_token_ids: Tuple[int, ...] = ()
    hf_config: Any = field(default=None, repr=False)

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> "ModelConfig":
        """Build from an HF ``PretrainedConfig`` (or an object with the same attributes).

        Raises:
            ValueError: when neither ``architectures`` nor a known ``model_type`` names an
                architecture (the message lists the supported ones).
        """
        archs = getattr(hf_config, "architectures", None)
        text = getattr(hf_config, "text_config", None) or hf_config
        if getattr(hf_config, "hidden_size", None) is not None:
            text = hf_config
        arch = archs[0] if archs else architecture_for_model_type(getattr(hf_config, "model_type", None))
        if arch is None:
            raise ValueError(
                f"cannot tell the architecture of model_type {getattr(hf_config, 'model_type', None)!r} "
                f"(config has no 'architectures'); supported: {', '.join(supported_architectures())}"
            )
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        v_head_dim = head_dim
        kv_lora_rank = int(getattr(text, "kv_lora_rank", None) or 0)
        rope, nope = 0, 0
        attention_arch = "mha"
        if kv_lora_rank:
            attention_arch = "mla"
            rope = int(text.qk_rope_head_dim)
            nope = int(text.qk_nope_head_dim)
            head_dim = rope + nope
            v_head_dim = int(text.v_head_dim)
            kv_heads = 1
        num_layers = text.num_hidden_layers
        window = getattr(text, "sliding_window", None)
        if getattr(text, "use_sliding_window", True) is False:
            window = None
        layer_types = getattr(text, "layer_types", None)
        if not window:
            window, sliding = None, (False,) * num_layers
        elif layer_types:
            sliding = tuple(t == "sliding_attention" for t in layer_types)
        else:
            sliding = (True,) * num_layers
        return cls(
            architecture=arch,
            hidden_size=text.hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            v_head_dim=v_head_dim,
            vocab_size=text.vocab_size,
            context_len=int(getattr(text, "max_position_embeddings", None) or 2048),
            attention_arch=attention_arch,
            kv_lora_rank=kv_lora_rank,
            qk_rope_head_dim=rope,
            qk_nope_head_dim=nope,
            sliding_window=int(window) if window else None,
            is_sliding_layer=sliding,
            eos_token_ids=_eos_ids(getattr(hf_config, "eos_token_id", None) or getattr(text, "eos_token_id", None)),
            hf_config=text,
        )

    @property
    def is_mla(self) -> bool:
        return self.attention_arch == "mla"

    @property
    def sliding_window_size(self) -> int:
        """Window in `RadixAttention`'s convention (keys ``i - size .. i`` visible):
        ``sliding_window - 1``, or -1 without a window."""
        return self.sliding_window - 1 if self.sliding_window else -1

    def kv_cache_bytes_per_token(self, dtype: torch.dtype, num_kv_heads: Optional[int] = None) -> int:
        """Bytes of KV cache one token takes across all layers in ``dtype``
        (MHA: K and V heads, ``num_kv_heads`` of them when given, e.g. one tensor-parallel
        rank's; MLA: ``kv_lora_rank + qk_rope_head_dim`` latent)."""
        elem = torch.empty((), dtype=dtype).element_size()
        if self.is_mla:
            per_layer = self.kv_lora_rank + self.qk_rope_head_dim
        else:
            heads = self.num_key_value_heads if num_kv_heads is None else num_kv_heads
            per_layer = heads * (self.head_dim + self.v_head_dim)
        return per_layer * self.num_hidden_layers * elem
