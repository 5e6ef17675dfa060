"""`RadixAttention`: the attention layer models call; it knows only its own shape."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from attnserve.attention.backend_config import normalize_window
from attnserve.attention.sinks import check_sinks
from attnserve.forward_batch import ForwardBatch


class RadixAttention(nn.Module):
    """One attention layer's shape; the math is done by ``forward_batch.attn_backend``.

    Args:
        num_heads: query heads on this rank (``tp_q_head_num``).
        head_dim: Q/K head size.
        scaling: softmax scale ``sm_scale`` (usually ``head_dim ** -0.5``).
        num_kv_heads: K/V heads on this rank (``tp_k_head_num``); GQA when fewer than
            ``num_heads``, MQA when 1.
        layer_id: index into the KV pool's per-layer buffers.
        logit_cap: if > 0, scores become ``logit_cap * tanh(scores / logit_cap)`` before
            the softmax (Gemma 2 soft-capping).
        v_head_dim: V head size (defaults to ``head_dim``; MLA decode uses kv_lora_rank).
        sliding_window_size: if > 0, a query at position i sees keys at positions j with
            ``i - sliding_window_size <= j <= i`` (SGLang's convention: a model with an HF
            ``sliding_window`` of W passes W - 1); -1 or None: full attention.
        sinks: attention sinks (gpt-oss), or None (default: none); see ``sinks`` below.

    Attributes:
        k_scale / v_scale: per-tensor scales of this layer's K and V in an FP8 KV cache
            (``true = float(stored) * scale``, `attnserve.mem_cache.kv_quant`); 1.0 unless
            the checkpoint carries them (`set_kv_scales`). Ignored by 16/32-bit caches.
        sinks: None, or a float32 (bf16 / fp16 accepted, read as float32) contiguous tensor
            ``[tp_q_head_num]`` on the model's device: query head ``h``'s learned sink logit,
            in the units of the scores after ``scaling`` (not soft-capped), joining every
            softmax of the head as one extra column whose value is 0 (HF transformers'
            gpt_oss ``eager_attention_forward``; OpenAI gpt-oss model card, arXiv:2508.10925;
            `attnserve.attention.sinks`). Set it at construction or later by assignment
            (``layer.sinks = t``, validated by `attnserve.attention.sinks.check_sinks`). The
            layer keeps a reference to the model's tensor and never registers it as its own
            parameter (the model owns the ``nn.Parameter`` and loads it; ``state_dict`` and
            ``named_parameters`` list it once, under the model's name): give the layer this
            rank's slice, or the Parameter itself, and load weights into it in place (or
            rebind ``.data`` of the same Parameter object). Backends read it at every
            forward, so a captured CUDA graph reads it by pointer: assign it before capture
            and update its values in place afterwards. Supported by the MHA paths of
            ``torch_native`` and ``triton`` (decode, extend, speculative modes); the MLA
            paths raise ValueError.

    Raises:
        ValueError: ``num_heads`` not a multiple of ``num_kv_heads``, a window of 0 or
            below -1 (`normalize_window`), or invalid ``sinks`` (`check_sinks`).
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scaling: float,
        num_kv_heads: int,
        layer_id: int,
        logit_cap: float = 0.0,
        v_head_dim: int = -1,
        sliding_window_size: int = -1,
        sinks: Optional[torch.Tensor] = None,
    ):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.tp_q_head_num = num_heads
        self.tp_k_head_num = num_kv_heads
        self.tp_v_head_num = num_kv_heads
        self.head_dim = head_dim
        self.qk_head_dim = head_dim
        self.v_head_dim = head_dim if v_head_dim == -1 else v_head_dim
        self.scaling = scaling
        self.layer_id = layer_id
        self.logit_cap = float(logit_cap or 0.0)
        self.sliding_window_size = normalize_window(sliding_window_size)
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.sinks: Optional[torch.Tensor] = sinks

    def __setattr__(self, name: str, value) -> None:
        # ``sinks`` is a validated reference to the model's tensor, never registered here (an
        # nn.Parameter assigned to a Module attribute would be): see the class doc.
        if name == "sinks":
            if value is not None:
                check_sinks(value, self.tp_q_head_num, f"layer {self.layer_id} sinks")
            object.__setattr__(self, name, value)
            return
        super().__setattr__(name, value)

    def set_kv_scales(self, k_scale: float, v_scale: float) -> None:
        """Set the FP8 KV scales (from a checkpoint's ``k_scale`` / ``v_scale`` or
        ``kv_scale`` tensors).

        Raises:
            ValueError: a scale <= 0 or not finite.
        """
        from attnserve.mem_cache.kv_quant import check_scale

        self.k_scale = check_scale(f"layer {self.layer_id} k_scale", k_scale)
        self.v_scale = check_scale(f"layer {self.layer_id} v_scale", v_scale)

    def forward(
        self,
        q: torch.Tensor,
        k: Optional[torch.Tensor],
        v: Optional[torch.Tensor],
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **kwargs,
    ) -> torch.Tensor:
        """``q`` ``[T, H*D]``, ``k``/``v`` ``[T, Hkv*D]`` -> ``[T, H*v_head_dim]``. ``v`` may
        be None where the backend derives values from keys (MLA's latent layer).

        Raises:
            TypeError: a ``sinks`` keyword (SGLang's way of passing them): sinks are the
                layer's attribute here (``RadixAttention.sinks``), read by the backends.
        """
        if "sinks" in kwargs:
            raise TypeError("RadixAttention.forward takes no 'sinks' argument: set the layer's sinks attribute "
                            "(RadixAttention(..., sinks=t) or layer.sinks = t) instead")
        if k is not None:
            k = k.view(-1, self.tp_k_head_num, self.qk_head_dim)
        if v is not None:
            v = v.view(-1, self.tp_v_head_num, self.v_head_dim)
        return forward_batch.attn_backend.forward(q, k, v, self, forward_batch, save_kv_cache, **kwargs)

    def kv_store_target(self, forward_batch: ForwardBatch, value: torch.Tensor):
        """Where a fused kernel may write this layer's new K/V itself (a
        `attnserve.mem_cache.store_kv.KVStoreTarget`), or None. The caller that uses it
        must then call `forward` with ``save_kv_cache=False``. None for idle steps and for
        pools without a fused store (CPU, ``--disable-fused-kernels``, MLA pools). An FP8
        pool's target carries this layer's ``k_scale`` / ``v_scale``."""
        pool = forward_batch.token_to_kv_pool
        loc = forward_batch.out_cache_loc
        if loc is None or forward_batch.forward_mode.is_idle():
            return None
        return pool.fused_store_target(self.layer_id, loc, value, self.k_scale, self.v_scale)

    def extra_repr(self) -> str:
        return (
            f"layer_id={self.layer_id}, heads={self.tp_q_head_num}/{self.tp_k_head_num}, head_dim={self.head_dim}, "
            f"v_head_dim={self.v_head_dim}, window={self.sliding_window_size}, logit_cap={self.logit_cap}"
            + (", sinks" if self.sinks is not None else "")
        )
