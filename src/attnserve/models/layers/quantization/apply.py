"""Turn a model built under `context.quantized_construction` into an FP8 model, and finish
it after its weights are loaded.

`quantize_model_linears` walks the model's `Linear` layers by name: skipped ones
(`QuantizationConfig.is_ignored`) get their ordinary weight in the model dtype, the others
their linear method's FP8 parameters (`fp8_linear`), all on the load device; the routed
experts of each `FusedMoE` get FP8 weights and scales (`fp8_moe.Fp8MoEMethod`) unless the
config ignores them.
`finish_quantized_model` runs each method's ``process_weights_after_loading``.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from attnserve.models.layers.quantization.config import QuantizationConfig
from attnserve.models.layers.quantization.fp8_linear import make_linear_method
from attnserve.models.layers.quantization.fp8_moe import Fp8MoEMethod

logger = logging.getLogger(__name__)


def quantize_model_linears(model: nn.Module, config: QuantizationConfig, device, dtype: torch.dtype) -> int:
    """Give every pending `Linear` of ``model`` its parameters on ``device``.

    Returns:
        the number of quantised linears (FP8 MoE layers are logged, not counted).
    """
    from attnserve.models.layers.linear import Linear
    from attnserve.models.layers.moe.layer import FusedMoE

    from attnserve.models.layers.split_k_workspace import SplitKWorkspace

    mapping = getattr(model, "packed_modules_mapping", {}) or {}
    device = torch.device(device)
    workspace = SplitKWorkspace()  # the model's split-K buffers, shared by its linears (split_k_workspace)
    count = 0
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or not getattr(module, "quant_pending", False):
            continue
        module.quant_pending = False
        if config.is_ignored(name, mapping):
            spec = getattr(module.weight, "tp_shard", None)
            module.weight = nn.Parameter(torch.empty(module.out_features, module.in_features, dtype=dtype,
                                                     device=device), requires_grad=False)
            if spec is not None:
                module.weight.tp_shard = spec
            continue
        method = make_linear_method(config, workspace)
        method.create_weights(module, device, dtype)
        module.quant_method = method
        count += 1
    experts = 0
    for name, module in model.named_modules():
        if not isinstance(module, FusedMoE) or not module.quant_pending:
            continue
        module.quant_pending = False
        if config.is_ignored(name, mapping):
            for attr in ("w13_weight", "w2_weight"):
                old = getattr(module, attr)
                new = nn.Parameter(torch.empty(old.shape, dtype=dtype, device=device), requires_grad=False)
                new.tp_shard = old.tp_shard
                setattr(module, attr, new)
            continue
        Fp8MoEMethod(config).create_weights(module, device, dtype)
        experts += 1
    if experts:
        logger.info("FP8: %d MoE layers with FP8 experts (W8A16, %s scales)", experts,
                    "128 x 128 block" if config.weight_strategy == "block" else "per-channel")
    return count


def finish_quantized_model(model: nn.Module) -> None:
    """Run ``process_weights_after_loading`` of every quantised linear (after loading)."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
    from attnserve.models.layers.quantization.fused_inputs import enable_fused_producers, fused_producers_requested

    if fused_producers_requested():
        logger.info("FP8: %d producers quantise their outputs (ATTNSERVE_FP8_FUSED_PRODUCERS=0 turns this off)",
                    enable_fused_producers(model))
