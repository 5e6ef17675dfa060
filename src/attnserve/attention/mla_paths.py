"""The two ways an MLA model calls a backend, shared by ``torch_native`` and ``triton_mla``.

DeepSeek-V2 (arXiv:2405.04434 §2.1) caches only the latent ``[c_kv | k_pe]`` per token. A
model calls the backend through one of two `RadixAttention` layers (SGLang's split between
its "MLA" and "MHA" DeepSeek paths):

* the **latent layer** (one KV head of width ``kv_lora_rank + rope``, ``v_head_dim =
  kv_lora_rank``): absorbed queries ``[q_nope W_UK | q_pe]`` and the new tokens' latent
  as ``k`` (``v`` None: values are the first ``kv_lora_rank`` columns). The backend stores
  the latent and attends over the cached prefix and the new tokens in the latent pool.
  Used for decode and for every extend with a cached prefix.
* the **expanded layer** (``H`` KV heads, ``nope + rope`` / ``v_head_dim``): per-head K/V
  the model up-projected for the new tokens; the model has stored the latent itself.
  Without ``prefix_kv`` allowed only when no request of the step has a cached prefix (a
  plain prefill); with it (`mla_expanded_prefix.ExpandedPrefix`: the cached prefixes'
  latent rows up-projected by the model as well) on any plain extend step. Cheaper than the
  absorbed form where the step has many more (query, key) pairs than prefix tokens (head
  dims 192/128 instead of 576/512).
"""

from __future__ import annotations

from attnserve.forward_batch import ForwardBatch


def is_latent_layer(layer, config) -> bool:
    """True for the latent (absorbed) layer of an MLA model built from ``config``."""
    return layer.tp_k_head_num == 1 and layer.qk_head_dim == config.head_dim and layer.v_head_dim == config.v_head_dim


def check_prefix_free(layer, fb: ForwardBatch, backend: str) -> None:
    """Raise ValueError when the expanded layer is used on a step with a cached prefix."""
    if any(fb.extend_prefix_lens_cpu):
        raise ValueError(
            f"{backend}: MLA layer {layer.layer_id} called with expanded per-head K/V on a step whose requests "
            "have cached prefixes; use the latent layer (absorbed queries) when any prefix is cached, "
            "or pass the prefixes expanded as prefix_kv"
        )

