"""Attention sinks (OpenAI gpt-oss): one learned logit per query head that joins every softmax.

Formula (HF transformers, ``models/gpt_oss/modeling_gpt_oss.py``, ``eager_attention_forward``;
OpenAI, "gpt-oss-120b & gpt-oss-20b Model Card", arXiv:2508.10925): for query head
``h`` with sink ``s_h`` and scaled (optionally soft-capped), masked scores ``z_j``,

    out = sum_j exp(z_j - m) v_j / (sum_j exp(z_j - m) + exp(s_h - m)),  m = max(max_j z_j, s_h)

i.e. the sink is one extra column appended to each query row's scores before the softmax
and dropped after it: a virtual key whose logit is ``s_h`` and whose value vector is 0.
``s_h`` is in the units of the scores *after* ``sm_scale`` (natural log units); a logit
cap, where a layer has one, applies to the scores only, never to the sink. A large sink
shrinks the output towards 0; a very negative one leaves it unchanged.

How the kernels add it (`attnserve.attention.triton_ops`):

* split-K decode (`decode_attention` / `decode_merge`): one more partial with
  log-sum-exp ``s_h`` and output 0 in the stage-2 merge; a request of one split, finished
  by stage 1, is scaled there by ``1 / (1 + exp(s_h - lse))``.
* one-pass extend (`extend_attention`): ``exp2(s_h * log2(e) - m)`` joins the final
  denominator (the kernel's running max ``m`` is in log2 units).

Everything is behind a ``HAS_SINK`` constexpr, so layers without sinks run the kernels
they ran before. The MLA backends refuse sinks (`refuse_sinks`).
"""

from __future__ import annotations

from typing import Optional

import torch

#: dtypes a sinks tensor may have (the kernels read it as float32; bf16 / fp16 -> float32 is exact)
SINK_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_sinks(sinks: torch.Tensor, num_heads: int, what: str = "sinks") -> torch.Tensor:
    """Validate a sinks tensor and return it unchanged (the same object, no copy).

    Args:
        sinks: ``[num_heads]`` float32 (or bf16 / fp16), contiguous: per query head of this
            rank, the sink logit in the units of the scaled scores.
        num_heads: query heads on this rank (``tp_q_head_num``).
        what: name used in the error message.

    Raises:
        ValueError: not a tensor, not 1-D of ``num_heads`` entries, another dtype, or a
            stride other than 1.
    """
    if not isinstance(sinks, torch.Tensor):
        raise ValueError(f"{what} must be a torch.Tensor of {num_heads} floats, got {type(sinks).__name__}")
    if sinks.dim() != 1 or sinks.shape[0] != num_heads:
        raise ValueError(f"{what} must have shape [{num_heads}] (this rank's query heads), got {tuple(sinks.shape)}")
    if sinks.dtype not in SINK_DTYPES:
        raise ValueError(f"{what} must be float32, bfloat16 or float16, got {sinks.dtype}")
    if num_heads > 1 and sinks.stride(0) != 1:
        raise ValueError(f"{what} must be contiguous (stride 1), got stride {sinks.stride(0)}")
    return sinks


def layer_sinks(layer) -> Optional[torch.Tensor]:
    """The sinks of a `RadixAttention` layer (its ``sinks`` attribute): a tensor or None."""
    return layer.sinks


def check_kernel_sinks(sinks: Optional[torch.Tensor], num_heads: int, device: torch.device) -> None:
    """Host check of a kernel launcher's ``sinks`` argument (None passes).

    Raises:
        ValueError: `check_sinks`' errors, or ``sinks`` on another device than the queries.
    """
    if sinks is None:
        return
    check_sinks(sinks, num_heads)
    if sinks.device != device:
        raise ValueError(f"sinks are on {sinks.device}, the queries on {device}")


def refuse_sinks(layer, backend: str) -> None:
    """Raise ValueError when ``layer`` has sinks: for paths that do not implement them (MLA).

    Raises:
        ValueError: ``layer.sinks`` is not None.
    """
    if layer_sinks(layer) is not None:
        raise ValueError(
            f"attention backend '{backend}': layer {layer.layer_id} has attention sinks, which "
            "its MLA path does not implement (sinks are supported by the MHA paths of 'torch_native' and 'triton')"
        )


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """``softmax`` over the last axis of ``scores`` with one extra column ``sinks``, which is
    dropped from the result (HF gpt-oss's ``torch.cat`` / ``softmax`` / ``[..., :-1]``).

    Args:
        scores: ``[..., Lk]`` scaled, masked (``-inf``) scores in the compute dtype.
        sinks: broadcastable to ``[..., 1]`` (one logit per row), same dtype as ``scores``.

    Returns:
        ``[..., Lk]`` probabilities; rows sum to ``1 - p_sink``. A fully masked row gives
        zeros (the sink takes the whole mass), never NaN, for a finite sink.
    """
    col = sinks.expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, col], dim=-1), dim=-1)[..., :-1]
