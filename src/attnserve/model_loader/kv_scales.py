"""Per-layer FP8 KV-cache scales stored in a checkpoint.

FP8 checkpoints (e.g. those written by NVIDIA ModelOpt / llm-compressor for vLLM and SGLang)
carry one scalar per attention layer for K and V, under names such as
``model.layers.3.self_attn.k_scale`` / ``.v_scale``, a shared ``...self_attn.kv_scale``, or
``...self_attn.k_proj.output_scale`` / ``v_proj.output_scale``. `KVScaleCollector` takes
them out of the weight stream (they are not parameters) and `apply` hands them to the
layers' `RadixAttention` modules (`RadixAttention.set_kv_scales`).
"""

from __future__ import annotations

import re
from typing import Dict, Iterable, Iterator, Tuple

import torch
from torch import nn

_NAME = re.compile(
    r"layers\.(\d+)\.self_attn\.(?:attn\.)?(?:(?P<proj>[kv])_proj\.output_scale|(?P<which>k|v|kv)_scale)$")


class KVScaleCollector:
    """Wraps a ``(name, tensor)`` weight stream and keeps the KV scales out of it.

    Attributes:
        scales: layer index -> ``{"k": float, "v": float}`` as read so far.
    """

    def __init__(self):
        self.scales: Dict[int, Dict[str, float]] = {}

    def filter(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Iterator[Tuple[str, torch.Tensor]]:
        """The stream without KV-scale tensors (those are recorded).

        Raises:
            ValueError: a KV-scale tensor with more than one element.
        """
        for name, tensor in weights:
            m = _NAME.search(name)
            if m is None:
                yield name, tensor
                continue
            if tensor.numel() != 1:
                raise ValueError(f"{name}: a per-tensor KV scale must have one element, got shape {tuple(tensor.shape)}")
            value = float(tensor.float().item())
            which = m.group("proj") or m.group("which")
            entry = self.scales.setdefault(int(m.group(1)), {})
            for key in ("k", "v") if which == "kv" else (which,):
                entry[key] = value

    def apply(self, model: nn.Module) -> int:
        """Set the recorded scales on every `RadixAttention` of ``model`` by layer id; a
        layer with one of the two scales gets 1.0 for the other. Returns the number of
        layers that received scales.

        Raises:
            ValueError: a scale <= 0 or not finite (`RadixAttention.set_kv_scales`).
        """
        from attnserve.attention.radix_attention import RadixAttention

        done = set()
        for module in model.modules():
            if isinstance(module, RadixAttention) and module.layer_id in self.scales:
                s = self.scales[module.layer_id]
                module.set_kv_scales(s.get("k", 1.0), s.get("v", 1.0))
                done.add(module.layer_id)
        return len(done)
