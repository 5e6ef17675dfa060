"""Hand a row-parallel layer's all-reduce to the RMSNorm after it (tensor parallelism).

A Llama-style decoder layer under tensor parallelism runs ``o_proj`` -> all-reduce -> add +
norm (``post_attention_layernorm``) and ``down_proj`` -> all-reduce -> add + norm (the next
layer's ``input_layernorm``, or the model's final norm). `link_allreduce_fusion` switches
the row-parallel layers to ``reduce_results=False`` and tells the norms after them to sum the
partial results themselves (`RMSNorm.forward_all_reduce`), which on CUDA runs the
all-reduce, the residual add and the norm in one kernel (`distributed.fused_all_reduce`)
and elsewhere the same all-reduce and norm as before. SGLang does the same with FlashInfer's
fused kernels (``--enable-flashinfer-allreduce-fusion``, its layer communicator); ours is on
by default and ``--disable-allreduce-fusion`` leaves every model as it was built.

Only blocks known to return the row-parallel output unchanged take part: a
`LlamaDecoderLayer` whose ``forward`` is Llama's, whose attention / MLP declare
``output_projection`` (the `RowParallelLinear` their ``forward`` returns) without bias, and
whose norms are `RMSNorm`\\ s with a fused form. A layer's MLP output is left partial only
when the next layer (or, after the last layer, the final norm) sums it; the final norm also
sums after a shorter run (``num_layers``), so it must be able to.
"""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

from attnserve.models.layers.norm import RMSNorm
from attnserve.models.layers.parallel import RowParallelLinear


def _fusable_norm(norm: Any) -> bool:
    return isinstance(norm, RMSNorm) and norm.fused_weight_offset is not None


def _row_output(block: Any) -> Optional[RowParallelLinear]:
    """The unbiased `RowParallelLinear` whose output ``block.forward`` returns unchanged, if
    ``block`` declares one (``output_projection``)."""
    name = getattr(type(block), "output_projection", None)
    proj = getattr(block, name, None) if name else None
    if isinstance(proj, RowParallelLinear) and proj.bias is None and proj.tp.size > 1:
        return proj
    return None


def _llama_layer(layer: Any) -> bool:
    from attnserve.models.llama import LlamaDecoderLayer

    return isinstance(layer, LlamaDecoderLayer) and type(layer).forward is LlamaDecoderLayer.forward


def link_allreduce_fusion(layers: nn.ModuleList, final_norm: nn.Module, tp: Any) -> int:
    """Leave the all-reduces of ``layers``' row-parallel outputs to the norms after them.

    Args:
        layers: the decoder layers, in order.
        final_norm: the model's norm after the last layer.
        tp: the rank's `TPGroup`; nothing changes unless ``tp.size > 1`` and
            ``tp.allreduce_fusion``.
    Returns:
        how many all-reduces moved into a norm (2 per Llama layer at most).
    Sets on each layer ``attn_output_partial`` / ``mlp_output_partial`` / ``input_partial``
    (read by `LlamaDecoderLayer.forward` and `DecoderModel.forward`) and ``fusion_tp``.
    """
    if tp is None or tp.size <= 1 or not getattr(tp, "allreduce_fusion", False):
        return 0
    linked = 0
    final_ok = _fusable_norm(final_norm)
    for i, layer in enumerate(layers):
        if not _llama_layer(layer):
            continue
        o_proj = _row_output(layer.self_attn)
        if o_proj is not None and _fusable_norm(layer.post_attention_layernorm):
            o_proj.reduce_results = False
            layer.attn_output_partial = True
            layer.fusion_tp = tp
            linked += 1
        down = _row_output(layer.mlp)
        nxt = layers[i + 1] if i + 1 < len(layers) else None
        next_ok = nxt is None or (_llama_layer(nxt) and _fusable_norm(nxt.input_layernorm))
        if down is not None and final_ok and next_ok:
            down.reduce_results = False
            layer.mlp_output_partial = True
            layer.fusion_tp = tp
            if nxt is not None:
                nxt.input_partial = True
                nxt.fusion_tp = tp
            linked += 1
    return linked
