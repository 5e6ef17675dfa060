"""`HybridAttnBackend`: one backend for prefill-like steps, another for decode steps.

Capabilities are the decode backend's (CUDA graphs capture DECODE steps only).

Routing (SGLang's ``--prefill-attention-backend`` / ``--decode-attention-backend``):
EXTEND and MIXED go to the prefill backend, DECODE and IDLE to the decode backend, and the
speculative modes TARGET_VERIFY / DRAFT_EXTEND to whichever ``speculative_attention_mode``
("prefill" or "decode") names. Every method, CUDA-graph hooks included, is delegated.
"""

from __future__ import annotations

from attnserve.attention.base import AttentionBackend
from attnserve.forward_batch import ForwardBatch, ForwardMode


class HybridAttnBackend(AttentionBackend):
    name = "hybrid"

    def __init__(self, prefill_backend: AttentionBackend, decode_backend: AttentionBackend,
                 speculative_attention_mode: str = "prefill"):
        if speculative_attention_mode not in ("prefill", "decode"):
            raise ValueError("speculative_attention_mode must be 'prefill' or 'decode'")
        if prefill_backend.config.attention_arch != decode_backend.config.attention_arch:
            raise ValueError("prefill and decode backends were built for different models")
        super().__init__(decode_backend.config)
        self.prefill_backend = prefill_backend
        self.decode_backend = decode_backend
        self.speculative_attention_mode = speculative_attention_mode
        self.supported_archs = tuple(a for a in decode_backend.supported_archs if a in prefill_backend.supported_archs)
        self.supports_cuda_graph = decode_backend.supports_cuda_graph
        self.replay_hook_is_capturable = decode_backend.replay_hook_is_capturable
        self.supports_fp8_kv = prefill_backend.supports_fp8_kv and decode_backend.supports_fp8_kv
        verify = self._select(ForwardMode.TARGET_VERIFY)
        self.supports_verify_cuda_graph = verify.supports_verify_cuda_graph and (
            verify.replay_hook_is_capturable or not self.replay_hook_is_capturable)

    def release(self) -> None:
        """Release both backends, then this one (`AttentionBackend.release`); idempotent."""
        children = (self.__dict__.get("prefill_backend"), self.__dict__.get("decode_backend"))
        for backend in {id(b): b for b in children if b is not None}.values():
            backend.release()
        super().release()

    def _select(self, mode: ForwardMode) -> AttentionBackend:
        if mode.is_decode_or_idle():
            return self.decode_backend
        if mode.is_target_verify() or mode.is_draft_extend():
            return self.decode_backend if self.speculative_attention_mode == "decode" else self.prefill_backend
        return self.prefill_backend

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        self._select(forward_batch.forward_mode).init_forward_metadata(forward_batch)

    def forward(self, q, k, v, layer, forward_batch: ForwardBatch, save_kv_cache: bool = True, **kwargs):
        return self._select(forward_batch.forward_mode).forward(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self.decode_backend.forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._select(forward_batch.forward_mode).forward_extend(
            q, k, v, layer, forward_batch, save_kv_cache, **kwargs
        )

    # CUDA graphs capture decode-like modes: route by the captured mode.
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.decode_backend.init_cuda_graph_state(max_bs, max_num_tokens)
        if self.speculative_attention_mode == "prefill" and self.prefill_backend.supports_cuda_graph:
            self.prefill_backend.init_cuda_graph_state(max_bs, max_num_tokens)

    def init_forward_metadata_capture_cuda_graph(self, bs, num_tokens, req_pool_indices, seq_lens, encoder_lens,
                                                 forward_mode, spec_info) -> None:
        self._select(forward_mode).init_forward_metadata_capture_cuda_graph(
            bs, num_tokens, req_pool_indices, seq_lens, encoder_lens, forward_mode, spec_info
        )

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, seq_lens_sum, encoder_lens,
                                                forward_mode, spec_info, seq_lens_cpu) -> None:
        self._select(forward_mode).init_forward_metadata_replay_cuda_graph(
            bs, req_pool_indices, seq_lens, seq_lens_sum, encoder_lens, forward_mode, spec_info, seq_lens_cpu
        )

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return self.decode_backend.get_cuda_graph_seq_len_fill_value()
