"""The contract between the engine and the attention layer.

`ForwardMode` says what kind of step a batch is; `ForwardBatch` carries every tensor a
model and an attention backend need for one step (names follow SGLang's
``forward_batch_info``). Nothing here imports the engine: the engine builds a
`ForwardBatch`, the attention layer only reads it.

Conventions (all per request ``i`` of the batch, in batch order):

* ``seq_lens[i]`` -- tokens of request ``i`` whose K/V are in the cache *after* this step
  (cached prefix + the tokens computed now), int32.
* ``extend_prefix_lens[i]`` -- tokens already cached before this step; ``extend_seq_lens[i]``
  -- tokens computed in this step (1 for a decode request), so
  ``seq_lens = extend_prefix_lens + extend_seq_lens``.
* ``input_ids``/``positions``/``out_cache_loc`` -- one entry per token computed in this
  step, requests concatenated in batch order (``sum(extend_seq_lens)`` entries).
* ``req_to_token_pool.req_to_token[req_pool_indices[i], :seq_lens[i]]`` -- the KV slot of
  every token of request ``i``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, List, Optional

import torch

if TYPE_CHECKING:  # pragma: no cover
    from attnserve.attention.base import AttentionBackend
    from attnserve.mem_cache.memory_pool import KVCache, ReqToTokenPool


@dataclass
class VerifyInput:
    """Speculative-decoding inputs of a TARGET_VERIFY (or masked draft) step
    (``ForwardBatch.spec_info``), built by `attnserve.engine.speculative.tree`.

    Attributes:
        custom_mask: bool, requests' blocks concatenated: row-major ``[n_i, P_i + n_i]``
            (query token, key position; ``P_i`` cached tokens) when ``mask_covers_prefix``,
            else ``[n_i, n_i]`` over the new tokens with every cached key visible.
        mask_indptr: int64 ``[>= bs]`` offset of each request's block.
        positions: int64 ``[sum n_i]`` RoPE positions (``P_i`` + tree depth), or None.
        draft_token_num: ``n_i`` per request (host list).
        mask_covers_prefix: the block layout (above).
    """

    custom_mask: torch.Tensor
    mask_indptr: torch.Tensor
    positions: Optional[torch.Tensor]
    draft_token_num: List[int]
    mask_covers_prefix: bool = True


class ForwardMode(enum.IntEnum):
    """Kind of a forward step (SGLang ``ForwardMode``)."""

    EXTEND = enum.auto()  # prefill, possibly on top of a cached prefix
    DECODE = enum.auto()  # one new token per request
    MIXED = enum.auto()  # extend requests and decode requests in one batch
    IDLE = enum.auto()  # no tokens (kept for data-parallel symmetry)
    TARGET_VERIFY = enum.auto()  # speculative decoding: target model scores draft tokens
    DRAFT_EXTEND = enum.auto()  # speculative decoding: draft model extends accepted tokens

    def is_extend(self) -> bool:
        """True for every mode that computes several tokens per request with a prefix."""
        return self in (
            ForwardMode.EXTEND,
            ForwardMode.MIXED,
            ForwardMode.TARGET_VERIFY,
            ForwardMode.DRAFT_EXTEND,
        )

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_mixed(self) -> bool:
        return self == ForwardMode.MIXED

    def is_idle(self) -> bool:
        return self == ForwardMode.IDLE

    def is_decode_or_idle(self) -> bool:
        return self in (ForwardMode.DECODE, ForwardMode.IDLE)

    def is_target_verify(self) -> bool:
        return self == ForwardMode.TARGET_VERIFY

    def is_draft_extend(self) -> bool:
        return self == ForwardMode.DRAFT_EXTEND

    def is_cuda_graph(self) -> bool:
        """Modes a decode CUDA graph may replay."""
        return self in (ForwardMode.DECODE, ForwardMode.IDLE, ForwardMode.TARGET_VERIFY)


@dataclass
class ForwardBatch:
    """All device tensors of one model step (built once per step by the engine).

    Shapes: ``bs`` requests, ``T = sum(extend_seq_lens)`` tokens computed in this step.

    Attributes:
        forward_mode: the step's `ForwardMode`.
        batch_size: ``bs``.
        input_ids: int64 ``[T]`` token ids.
        positions: int64 ``[T]`` absolute positions (prefix length + offset).
        req_pool_indices: int64 ``[bs]`` rows of ``req_to_token``.
        seq_lens: int32 ``[bs]`` cached tokens after this step (see module doc).
        seq_lens_cpu: the same on the host, for backends that plan on the CPU.
        seq_lens_sum: ``int(seq_lens.sum())``.
        out_cache_loc: int64 ``[T]`` KV slots the new tokens' K/V are written to.
        extend_prefix_lens / extend_seq_lens: int32 ``[bs]`` (also for DECODE, where
            ``extend_seq_lens`` is all ones), with host copies ``*_cpu`` (lists of int).
        extend_start_loc: int32 ``[bs]`` offset of each request's first token in ``[T]``.
        req_to_token_pool / token_to_kv_pool: the two levels of the paged KV cache.
        attn_backend: the `AttentionBackend` that runs this step.
        spec_info: speculative-decoding metadata (custom masks, draft tokens) or None.
        sampling_info: engine-side sampling state, opaque to the attention layer.
        capture_hidden_mode: unused placeholder for speculative decoding heads.
        mla_prefix_plan: MLA models' decision for an extend step with cached prefixes,
            made by the first layer (`attention.mla_expanded_prefix`): None undecided,
            False absorbed, else the `ExpandedPrefixPlan`.
    """

    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    seq_lens_cpu: Optional[torch.Tensor] = None
    seq_lens_sum: int = 0
    extend_prefix_lens: Optional[torch.Tensor] = None
    extend_seq_lens: Optional[torch.Tensor] = None
    extend_prefix_lens_cpu: Optional[List[int]] = None
    extend_seq_lens_cpu: Optional[List[int]] = None
    extend_start_loc: Optional[torch.Tensor] = None
    req_to_token_pool: Optional["ReqToTokenPool"] = None
    token_to_kv_pool: Optional["KVCache"] = None
    attn_backend: Optional["AttentionBackend"] = None
    spec_info: Any = None
    sampling_info: Any = None
    mla_prefix_plan: Any = None

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def init_new(
        cls,
        forward_mode: ForwardMode,
        input_ids: List[int],
        req_pool_indices: List[int],
        prefix_lens: List[int],
        extend_lens: List[int],
        out_cache_loc: torch.Tensor,
        req_to_token_pool: "ReqToTokenPool",
        token_to_kv_pool: "KVCache",
        attn_backend: "AttentionBackend",
        device: torch.device | str,
        spec_info: Any = None,
        sampling_info: Any = None,
    ) -> "ForwardBatch":
        """Build the device tensors of one step from host lists (one host->device copy each).

        Args:
            forward_mode: kind of step.
            input_ids: ``T`` token ids, requests concatenated in batch order.
            req_pool_indices: ``bs`` rows of ``req_to_token``.
            prefix_lens: ``bs`` tokens already cached per request.
            extend_lens: ``bs`` tokens computed now per request (sum == T).
            out_cache_loc: int64 ``[T]`` slots for the new tokens (already written into
                ``req_to_token`` by the engine).

        Raises:
            ValueError: when the list lengths disagree.
        """
        bs = len(req_pool_indices)
        if len(prefix_lens) != bs or len(extend_lens) != bs:
            raise ValueError("req_pool_indices, prefix_lens and extend_lens must have equal length")
        if sum(extend_lens) != len(input_ids):
            raise ValueError(f"sum(extend_lens)={sum(extend_lens)} != len(input_ids)={len(input_ids)}")
        device = torch.device(device)
        seq_lens_list = [p + e for p, e in zip(prefix_lens, extend_lens)]
        positions: List[int] = []
        starts: List[int] = []
        for p, e in zip(prefix_lens, extend_lens):
            starts.append(len(positions))
            positions.extend(range(p, p + e))
        seq_lens_cpu = torch.tensor(seq_lens_list, dtype=torch.int32)

        def dev(values, dtype):
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        return cls(
            forward_mode=forward_mode,
            batch_size=bs,
            input_ids=dev(input_ids, torch.int64),
            positions=dev(positions, torch.int64),
            req_pool_indices=dev(req_pool_indices, torch.int64),
            seq_lens=seq_lens_cpu.to(device, non_blocking=True),
            seq_lens_cpu=seq_lens_cpu,
            seq_lens_sum=int(sum(seq_lens_list)),
            out_cache_loc=out_cache_loc.to(device=device, dtype=torch.int64),
            extend_prefix_lens=dev(prefix_lens, torch.int32),
            extend_seq_lens=dev(extend_lens, torch.int32),
            extend_prefix_lens_cpu=list(prefix_lens),
            extend_seq_lens_cpu=list(extend_lens),
            extend_start_loc=dev(starts, torch.int32),
            req_to_token_pool=req_to_token_pool,
            token_to_kv_pool=token_to_kv_pool,
            attn_backend=attn_backend,
            spec_info=spec_info,
            sampling_info=sampling_info,
        )
