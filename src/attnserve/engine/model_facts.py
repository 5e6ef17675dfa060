"""What a benchmark's physical floor needs to know of a loaded model (`attnserve.bench.roofline`).

Here, below the server, so that an engine process (a data-parallel replica) can report the
facts to a benchmark in another process (``bench.offline --dp-size``).
"""

from __future__ import annotations

from typing import Any, Dict


def roofline_facts(runner) -> Dict[str, Any]:
    """The `attnserve.bench.roofline.RooflineModel` fields of a `ModelRunner`'s model.

    ``params`` / ``weight_bytes``: each storage once, the input embedding left out unless it is
    also the LM head, routed experts left out (counted per expert: ``expert_params`` /
    ``expert_bytes`` of one expert of one layer, ``moe_layers``, ``num_experts``, ``top_k``), FP8
    scales counted as bytes, not parameters (``fp8_params``: the parameters stored in one byte);
    ``num_layers`` / ``num_q_heads`` / ``head_dim``;
    ``kv_bytes_per_token`` of the KV pool's dtype. Under tensor parallelism: rank 0's shard.
    """
    from attnserve.models.layers.moe.layer import FusedMoE
    from attnserve.models.layers.moe.sparse_block import SparseMoeBlock

    model, mc = runner.model, runner.model_config
    skip = set()
    inner = getattr(model, "model", None)
    embed = getattr(inner, "embed_tokens", None)
    # the embedding is read whole each step only when it is the LM head (tied, no FP8 head)
    tied = getattr(model, "lm_head", None) is None and getattr(model, "lm_head_fp8", None) is None
    if embed is not None and not tied:
        skip = {p.data_ptr() for p in embed.parameters()}
    moe = [m for m in model.modules() if isinstance(m, FusedMoE)]
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    expert_params = expert_bytes = 0
    for m in moe:
        for p in (m.w13_weight, m.w2_weight):
            skip.add(p.data_ptr())
    if moe:
        first = moe[0]
        expert_params = (first.w13_weight[0].numel() + first.w2_weight[0].numel())
        expert_bytes = expert_params * first.w13_weight.element_size()
    seen, params, nbytes, fp8_params = set(), 0, 0, 0
    for p in model.parameters():
        ptr = p.data_ptr()
        if ptr in seen or ptr in skip:
            continue
        seen.add(ptr)
        if not getattr(p, "is_quant_scale", False):  # FP8 scales: bytes, not parameters
            params += p.numel()
            if p.element_size() == 1 and p.dtype.is_floating_point:
                fp8_params += p.numel()
        nbytes += p.numel() * p.element_size()
    # under tensor parallelism: rank 0's shard of the weights, heads and KV (every rank
    # works in parallel on its own, so this is the floor of the whole group)
    heads = getattr(runner, "tp_q_head_num", mc.num_attention_heads)
    kv_heads = getattr(runner, "tp_k_head_num", None) if not mc.is_mla else None
    window = getattr(mc, "sliding_window", None)
    return dict(params=params, weight_bytes=nbytes, num_layers=mc.num_hidden_layers,
                num_q_heads=heads, head_dim=mc.head_dim,
                kv_bytes_per_token=mc.kv_cache_bytes_per_token(runner.kv_cache_dtype, kv_heads),
                moe_layers=len(moe), num_experts=moe[0].num_experts if moe else 0,
                top_k=blocks[0].routing.top_k if blocks else 0, expert_params=expert_params,
                expert_bytes=expert_bytes, fp8_params=fp8_params,
                sliding_layers=sum(getattr(mc, "is_sliding_layer", ())) if window else 0,
                sliding_window=int(window or 0))
