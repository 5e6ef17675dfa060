"""An FP8 LM head (``--enable-fp8-lm-head``): the vocabulary projection as an FP8 `Linear`.

By default the LM head (or the tied embedding it reads) stays in the model dtype under FP8
weights, as vLLM and SGLang keep it: its logits feed sampling directly. The flag quantises it
like the other linears (e4m3, one scale per vocabulary row, dynamic per-token activation
scales), so a decode step reads half its bytes: Llama-3-8B's head is 1.05 GB in bf16, about
a quarter of an FP8 step's weight bytes.

* Untied head: the bf16 weight is quantised into the FP8 linear and dropped (the head's
  parameter becomes empty; `CausalLM.compute_logits` uses the FP8 linear).
* Tied embeddings: the embedding stays in the model dtype for the token lookup and the FP8
  linear holds a quantised copy for the head (one more byte per weight).
* Tensor parallelism: each rank quantises its own vocabulary rows; per-row scales make that
  the same as quantising the whole matrix, so every tp size computes the same logits.
* Per-row scales whatever the checkpoint's scheme (a block-scaled checkpoint's vocabulary
  shards need not fall on 128-row blocks).

Logits come back in the model dtype from the FP8 GEMM and are cast to float32 by
`CausalLM.compute_logits`, as the bf16 head's are not: one more rounding of the logits.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn


@torch.no_grad()
def attach_fp8_lm_head(model: nn.Module, config) -> int:
    """Give ``model`` (a `CausalLM`) an FP8 ``lm_head_fp8`` built from its LM head weight.

    Args:
        model: the loaded model (weights in place).
        config: the model's `QuantizationConfig` (its FP8 scheme; the head takes per-row
            weight scales and dynamic activations whatever it says).

    Returns:
        the head's rows on this rank.

    Raises:
        ValueError: the model has no LM head weight to quantise.
    """
    from attnserve.models.layers.linear import Linear
    from attnserve.models.layers.quantization.fp8_linear import Fp8LinearMethod
    from attnserve.models.layers.quantization.fp8_utils import quantize_per_row

    weight = model.lm_head_weight
    if weight is None or weight.dim() != 2 or weight.numel() == 0:
        raise ValueError("--enable-fp8-lm-head: the model has no LM head weight to quantise")
    rows, hidden = weight.shape
    head = Linear(hidden, rows, dtype=weight.dtype)
    head.quant_pending = False
    head_config = dataclasses.replace(config, weight_strategy="channel", weight_block_size=None,
                                      activation_scheme="dynamic", is_checkpoint_fp8=False, checkpoint_format="online")
    method = Fp8LinearMethod(head_config)
    method.create_weights(head, weight.device, weight.dtype)
    q, s = quantize_per_row(weight)
    head.weight.copy_(q)
    head.weight_scale.copy_(s)
    method.process_weights_after_loading(head)
    head.quant_method = method
    model.lm_head_fp8 = head
    if model.lm_head is not None:  # untied: the bf16 rows are no longer read
        model.lm_head.weight = nn.Parameter(weight.new_empty(0, hidden), requires_grad=False)
    return rows
