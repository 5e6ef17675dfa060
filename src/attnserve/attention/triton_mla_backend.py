"""`triton_mla`: the Triton backend of MLA models (DeepSeek-V2/V3 latent KV cache).

* DECODE (latent layer): a block table of page ids and per-request split counts built on
  the device, then the paged MLA decode kernel over the latent pool
  (`attnserve.attention.mla_triton.TritonMLADecode`).
* EXTEND-like steps with a cached prefix (latent layer): the backend stores the new
  tokens' latent and runs the regular extend kernel over the latent pool (one KV head,
  ``Dk = kv_lora_rank + rope``, ``Dv = kv_lora_rank``, values a view of the key rows),
  through the same prefix indices the ``triton`` backend builds.
* EXTEND without any cached prefix (expanded layer): the extend kernel over the new
  tokens' per-head K/V only (`attnserve.attention.mla_paths`); with cached prefixes that
  the model expanded too (``prefix_kv``, `attnserve.attention.mla_expanded_prefix`), over
  those rows as the prefix.

The split workspace is allocated once at construction for ``config.max_batch_size``
requests; `workspace_bytes` lets the model runner count it before sizing the KV pool.
Attention sinks (`RadixAttention.sinks`) are not implemented: a layer with sinks is a
ValueError (`attnserve.attention.sinks.refuse_sinks`).
CUDA graphs capture DECODE; the replay hook refills fixed buffers without host reads and
is launched from the host before each replay (``replay_hook_is_capturable`` False: its
recording inside the graph has not been validated for the MLA split/work-list kernels).
"""

from __future__ import annotations

from typing import Union

import torch

from attnserve.attention.backend_config import AttentionBackendConfig
from attnserve.attention.mla_paths import check_prefix_free, is_latent_layer
from attnserve.attention.mla_triton import MLADecodeMetadata, MLASplitPolicy, TritonMLADecode
from attnserve.attention.registry import register_attention_backend
from attnserve.attention.sinks import refuse_sinks
from attnserve.attention.triton_backend import TritonAttnBackend, TritonForwardMetadata
from attnserve.forward_batch import ForwardBatch, ForwardMode


def mla_split_policy(config: AttentionBackendConfig) -> MLASplitPolicy:
    """The decode split policy of ``config`` (device SMs, heads, ``num_kv_splits``, cache dtype)."""
    return MLASplitPolicy(config.resolved_num_sms(), config.num_q_heads, config.num_kv_splits, config.deterministic,
                          config.dtype)


@register_attention_backend("triton_mla")
class TritonMLAAttnBackend(TritonAttnBackend):
    """Triton backend for MLA models.

    Args:
        config: `AttentionBackendConfig` of an MLA model (``attention_arch == "mla"``,
            one latent KV head) with pools attached.

    Raises:
        ValueError: an MHA model (use ``triton``) or sliding windows (not supported).
        RuntimeError: no Triton / no GPU (see `TritonAttnBackend`).
    """

    supported_archs = ("mla",)
    supports_verify_cuda_graph = False  # verify runs eager (the latent extend has no graph buffers)
    replay_hook_is_capturable = False

    def __init__(self, config: AttentionBackendConfig):
        if config.window_sizes:
            raise ValueError(f"triton_mla does not support sliding windows (layers have {config.window_sizes})")
        super().__init__(config)
        self.mla = TritonMLADecode(self.device, self.req_to_token, self.page_size, config.kv_lora_rank,
                                   mla_split_policy(config), self.split_tile_size, config.max_batch_size)
        self.forward_metadata: Union[TritonForwardMetadata, MLADecodeMetadata, None] = None

    @classmethod
    def workspace_bytes(cls, config: AttentionBackendConfig) -> int:
        """Bytes of the decode split workspace for ``config.max_batch_size`` requests."""
        return mla_split_policy(config).workspace_bytes(config.max_batch_size, config.kv_lora_rank)

    # ---- metadata ----------------------------------------------------------------------
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        if fb.forward_mode.is_decode():
            seq_lens = fb.seq_lens.to(torch.int32)
            max_len = int(fb.seq_lens_cpu.max()) if fb.seq_lens_cpu is not None else int(seq_lens.max())
            self.forward_metadata = self.mla.metadata(fb.req_pool_indices, seq_lens, max_len)
            return
        super().init_forward_metadata(fb)

    # ---- kernels -----------------------------------------------------------------------
    def forward_decode(self, q, k, v, layer, forward_batch: ForwardBatch, save_kv_cache: bool = True, **kwargs):
        """Latent layer only: ``q`` ``[bs, H * (kv_lora_rank + rope)]``, ``k`` the new
        latent ``[bs, 1, kv_lora_rank + rope]`` or None -> ``[bs, H * kv_lora_rank]``.
        A layer with attention sinks is a ValueError."""
        refuse_sinks(layer, self.name)
        pool = forward_batch.token_to_kv_pool
        if save_kv_cache and k is not None:
            pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, None)
        return self.mla.forward(q, layer, pool, self.forward_metadata)

    def forward_extend(self, q, k, v, layer, forward_batch: ForwardBatch, save_kv_cache: bool = True,
                       prefix_kv=None, **kwargs):
        """Latent layer: absorbed attention over the latent pool (``v`` ignored). Expanded
        layer: the new tokens, plus the cached prefixes when the model passes them
        expanded (``prefix_kv``, `mla_expanded_prefix.ExpandedPrefix`); a step with a
        cached prefix and no ``prefix_kv`` is a ValueError, and so is a layer with attention
        sinks."""
        refuse_sinks(layer, self.name)
        fb = forward_batch
        pool = fb.token_to_kv_pool
        md = self.forward_metadata
        if is_latent_layer(layer, self.config):
            k = k.view(-1, 1, layer.qk_head_dim)
            if save_kv_cache:
                pool.set_kv_buffer(layer, fb.out_cache_loc, k, None)
            return self._extend(q, k, k[..., : layer.v_head_dim], layer, pool.get_key_buffer(layer.layer_id),
                                pool.get_value_buffer(layer.layer_id), md)
        k3 = k.view(-1, layer.tp_k_head_num, layer.qk_head_dim)
        v3 = v.view(-1, layer.tp_v_head_num, layer.v_head_dim)
        if prefix_kv is not None:
            plan = prefix_kv.plan
            return self._extend(q, k3, v3, layer, prefix_kv.k, prefix_kv.v, md, kv_indices=plan.kv_indices,
                                kv_indptr=plan.kv_indptr)
        check_prefix_free(layer, fb, self.name)
        return self._extend(q, k3, v3, layer, k3, v3, md)  # no prefix: the buffers are never read

    # ---- CUDA graphs -------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.mla.init_graph_state(max_bs)

    def _graph_metadata(self, bs: int, req_pool_indices, seq_lens) -> None:
        self.forward_metadata = self.mla.graph_metadata(bs, req_pool_indices, seq_lens)

    def init_forward_metadata_capture_cuda_graph(self, bs, num_tokens, req_pool_indices, seq_lens, encoder_lens,
                                                 forward_mode: ForwardMode, spec_info) -> None:
        if not forward_mode.is_decode_or_idle():
            raise NotImplementedError(f"{self.name} backend captures DECODE graphs only, not {forward_mode.name}")
        self._graph_metadata(bs, req_pool_indices, seq_lens)
