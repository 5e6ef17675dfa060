"""`AttentionBackend`: the interface every attention implementation provides (DESIGN.md §4).

A backend is constructed from one `AttentionBackendConfig` (model facts, pools, page size,
device, limits; never the model runner). It turns a `ForwardBatch` into kernel metadata
(`init_forward_metadata`), picks the kernel for the step's phase (`forward` ->
`forward_decode` / `forward_extend`) and, when it can be captured in CUDA graphs, keeps its
metadata in fixed buffers (`init_cuda_graph_state` and the capture/replay hooks).

Capabilities are class attributes every backend declares (and `HybridAttnBackend`
forwards): `supports_cuda_graph`, `supports_verify_cuda_graph`, `replay_hook_is_capturable`,
`supported_archs`.

Tensor conventions for ``forward*``: ``q`` ``[T, tp_q_head_num * head_dim]`` (or already
``[T, H, D]``), ``k``/``v`` ``[T, tp_k_head_num, head_dim / v_head_dim]`` or flattened; the
result is ``[T, tp_q_head_num * v_head_dim]`` in ``q``'s dtype.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Optional, Tuple

import torch

from attnserve.attention.backend_config import AttentionBackendConfig
from attnserve.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:  # pragma: no cover
    from attnserve.attention.radix_attention import RadixAttention


class AttentionBackend(ABC):
    """Base class of all attention backends."""

    #: registry name, set by `register_attention_backend`
    name: str = "abstract"
    #: attention architectures (``AttentionBackendConfig.attention_arch``) it runs
    supported_archs: Tuple[str, ...] = ("mha",)
    #: device types it runs on without the Triton interpreter
    supported_devices: Tuple[str, ...] = ("cuda",)

    def __init__(self, config: AttentionBackendConfig):
        self.config = config

    @classmethod
    def workspace_bytes(cls, config: AttentionBackendConfig) -> int:
        """Device bytes the backend allocates at construction whatever the batch (scratch
        that must be counted before the KV pool is sized); ``config`` may have no pools."""
        return 0

    def release(self) -> None:
        """Drop everything this backend holds: the config with its pools, workspaces, the
        CUDA-graph metadata buffers of `init_cuda_graph_state` and the last step's metadata
        (which may keep a `ForwardBatch` that points back at the backend: a reference cycle).
        The engine calls it at shutdown; the backend cannot run afterwards."""
        self.__dict__.clear()

    def check_config(self) -> None:
        """Refuse a config this backend cannot serve.

        Raises:
            ValueError: the model's attention architecture is not in `supported_archs`.
        """
        if self.config.attention_arch not in self.supported_archs:
            raise ValueError(
                f"attention backend '{self.name}' runs {'/'.join(a.upper() for a in self.supported_archs)} models, "
                f"not {self.config.attention_arch.upper()}"
            )

    @abstractmethod
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Build per-step kernel metadata on the eager path (called once per step)."""

    def forward(
        self,
        q: torch.Tensor,
        k: Optional[torch.Tensor],
        v: Optional[torch.Tensor],
        layer: "RadixAttention",
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **kwargs,
    ) -> torch.Tensor:
        """Dispatch by mode: IDLE -> empty output; DECODE -> `forward_decode`; else extend."""
        mode = forward_batch.forward_mode
        if mode.is_idle():
            return q.new_empty(q.shape[0], layer.tp_q_head_num * layer.v_head_dim)
        if mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)

    @abstractmethod
    def forward_decode(self, q, k, v, layer, forward_batch: ForwardBatch, save_kv_cache: bool = True, **kwargs):
        """One query token per request attends to its whole cached sequence."""

    @abstractmethod
    def forward_extend(self, q, k, v, layer, forward_batch: ForwardBatch, save_kv_cache: bool = True, **kwargs):
        """New tokens attend causally to the cached prefix and to each other."""

    # ---- CUDA graphs -------------------------------------------------------------------
    def _no_graphs(self):
        return NotImplementedError(
            f"attention backend '{self.name}' cannot be captured in CUDA graphs; "
            "use --disable-cuda-graph or a capturable backend such as 'triton'"
        )

    #: decode steps can be captured in CUDA graphs (the hooks below are implemented)
    supports_cuda_graph: bool = False
    #: TARGET_VERIFY steps (a fixed node count per request, node-only masks) can be
    #: captured too (the capture/replay hooks accept that mode)
    supports_verify_cuda_graph: bool = False
    #: reads FP8 KV caches (``--kv-cache-dtype fp8_*``) with the layers' ``k_scale`` / ``v_scale``
    supports_fp8_kv: bool = False
    #: the replay hook only launches device work on fixed buffers (no host reads, no
    #: allocation), so `CudaGraphRunner` may record it inside the graph
    replay_hook_is_capturable: bool = False

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Allocate the fixed metadata buffers that captured graphs read."""
        raise self._no_graphs()

    def init_forward_metadata_capture_cuda_graph(
        self, bs, num_tokens, req_pool_indices, seq_lens, encoder_lens, forward_mode: ForwardMode, spec_info
    ) -> None:
        """Point the metadata at the fixed buffers for a capture of batch size ``bs``."""
        raise self._no_graphs()

    def init_forward_metadata_replay_cuda_graph(
        self, bs, req_pool_indices, seq_lens, seq_lens_sum, encoder_lens, forward_mode: ForwardMode, spec_info,
        seq_lens_cpu,
    ) -> None:
        """Refill the fixed buffers in place before a replay (no allocation, no host sync)."""
        raise self._no_graphs()

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """``seq_lens`` value of padded rows in a replayed batch (0 or 1)."""
        raise self._no_graphs()
