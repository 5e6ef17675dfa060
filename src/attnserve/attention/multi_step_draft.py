"""`TritonMultiStepDraftBackend`: the attention metadata of ``S`` draft decode steps,
computed once.

A draft model that proposes a chain runs ``S`` DECODE steps back to back over the same
requests; step ``j`` only sees ``j`` more keys than step 0. Building each step's metadata
on its own (``seq_lens`` to int32, a cumulative sum, a gather of ``req_to_token`` rows into
``kv_indices``, split counts, the same again per sliding window) repeats the same work
``S`` times (SGLang's multi-step draft backends, seed 003 "precompute once, copy N times").
Here the ``S`` steps are laid out as ``S * bs`` virtual requests -- step ``j``'s lengths are
``seq_lens + min(j, step_limits)`` -- and one cumulative sum and one index kernel fill the
indices of every step; step ``j``'s CSR is the slice ``kv_indptr[j * bs : (j + 1) * bs + 1]``
of the shared one (the kernels read ``kv_indices`` at absolute offsets, so a slice needs no
rebasing). Split counts are computed once, for the longest step, and shared (they only
partition the keys; the deterministic mode, whose splits depend on each length alone, gets
them per step from the same single launch).

There is one `TritonAttnBackend` per step (SGLang's layout), each holding the metadata
slice of its step, all of them views of the same buffers; a CUDA graph of the ``S`` steps
records the one metadata launch at its head (`replay_hook_is_capturable`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from attnserve.attention.backend_config import AttentionBackendConfig
from attnserve.attention.triton_backend import TritonAttnBackend, TritonForwardMetadata, WindowIndices


def draft_step_lens(seq_lens: torch.Tensor, step_limits: Optional[torch.Tensor], steps: torch.Tensor) -> torch.Tensor:
    """int32 ``[S, bs]``: keys of draft step ``j``, ``seq_lens + min(j, step_limits)``.

    Args:
        seq_lens: ``[bs]`` keys of step 0; step_limits: ``[bs]`` or None (no limit);
        steps: int32 ``[S, 1]`` = ``0 .. S - 1``.
    """
    if step_limits is not None:
        steps = torch.minimum(steps, step_limits.to(torch.int32).view(1, -1))
    return seq_lens.to(torch.int32).view(1, -1) + steps


@dataclass
class MultiStepBuffers:
    """Buffers shared by the steps (fixed when CUDA graphs replay them).

    Attributes:
        kv_indptr: int32 ``[S * max_bs + 1]``; kv_indices: int32, every step's slots.
        num_kv_splits: int32 ``[S * max_bs]`` (only the first ``max_bs`` are used unless
            deterministic); attn_logits / attn_lse: float32 split scratch of one step.
        win_*: the same per sliding window (``kv_start`` ``[S * max_bs]``).
    """

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    num_kv_splits: torch.Tensor
    attn_logits: torch.Tensor
    attn_lse: torch.Tensor
    steps: torch.Tensor  # int32 [S, 1] = 0 .. S-1
    win_indptr: dict
    win_indices: dict
    win_start: dict
    win_splits: dict


class TritonMultiStepDraftBackend:
    """``num_steps`` `TritonAttnBackend` s of one draft model sharing their metadata.

    Args:
        config: the draft model's `AttentionBackendConfig` (pools attached).
        num_steps: ``S``, decode steps per drafting round (>= 1).
        max_bs: largest batch (sizes the fixed buffers).

    Raises:
        ValueError: ``num_steps`` < 1; the errors of `TritonAttnBackend` (no Triton, MLA).
    """

    #: the metadata launch only writes the fixed buffers, so a graph may record it
    replay_hook_is_capturable = True

    def __init__(self, config: AttentionBackendConfig, num_steps: int, max_bs: int):
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        self.config = config
        self.num_steps = int(num_steps)
        self.max_bs = int(max_bs)
        self.backends: List[TritonAttnBackend] = [TritonAttnBackend(config) for _ in range(self.num_steps)]
        b = self.backends[0]
        dev, s = config.device, self.num_steps
        cap = s * (b.max_total_num_tokens + self.max_bs * (b.page_size + s))

        def i32(n, fill=0):
            return torch.full((n,), fill, dtype=torch.int32, device=dev)

        self.buffers = MultiStepBuffers(
            kv_indptr=i32(s * self.max_bs + 1), kv_indices=i32(cap), num_kv_splits=i32(s * self.max_bs, 1),
            attn_logits=torch.zeros(self.max_bs, b.num_q_heads, b.max_kv_splits, b.v_head_dim, dtype=torch.float32,
                                    device=dev),
            attn_lse=torch.zeros(self.max_bs, b.num_q_heads, b.max_kv_splits, dtype=torch.float32, device=dev),
            steps=torch.arange(s, dtype=torch.int32, device=dev).view(s, 1),
            win_indptr={w: i32(s * self.max_bs + 1) for w in b.window_sizes},
            win_indices={w: i32(s * self.max_bs * (w + 1)) for w in b.window_sizes},
            win_start={w: i32(s * self.max_bs) for w in b.window_sizes},
            win_splits={w: i32(s * self.max_bs, 1) for w in b.window_sizes},
        )

    def init_forward_metadata(self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                              step_limits: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Metadata of all steps at once; afterwards ``backends[j]`` runs step ``j``.

        Args:
            bs: requests (rows of every step).
            req_pool_indices: int64 ``[>= bs]`` rows of ``req_to_token``.
            seq_lens: int32/int64 ``[>= bs]`` tokens step 0 attends to (its new token
                included); step ``j`` attends to ``seq_lens + min(j, step_limits)``.
            step_limits: int ``[>= bs]`` or None (no limit): a request with fewer steps
                left stops growing there (its later steps are the caller's to discard).
                Lengths must stay within each request's ``req_to_token`` row.

        Returns:
            int32 ``[S, bs]``, the keys of every step (`draft_step_lens`).

        Raises:
            ValueError: ``bs`` above ``max_bs``.
        """
        if bs > self.max_bs:
            raise ValueError(f"batch of {bs} above the multi-step draft backend's max_bs {self.max_bs}")
        from attnserve.attention.triton_ops.kv_indices import compute_kv_indptr, create_kv_indices

        g, s = self.buffers, self.num_steps
        lead = self.backends[0]
        rows = req_pool_indices[:bs]
        lens = draft_step_lens(seq_lens[:bs], None if step_limits is None else step_limits[:bs], g.steps)  # [S, bs]
        flat_lens = lens.reshape(-1)
        flat_rows = rows.repeat(s)
        indptr = compute_kv_indptr(flat_lens, g.kv_indptr)
        create_kv_indices(lead.req_to_token, flat_rows, flat_lens, indptr, None, g.kv_indices)
        splits = self._splits(lens, g.num_kv_splits)
        windows = {}
        for w in lead.window_sizes:
            win_lens = torch.clamp(flat_lens, max=w + 1)
            start = g.win_start[w][: s * bs]
            torch.sub(flat_lens, win_lens, out=start)
            win_indptr = compute_kv_indptr(win_lens, g.win_indptr[w])
            create_kv_indices(lead.req_to_token, flat_rows, win_lens, win_indptr, start, g.win_indices[w])
            windows[w] = (win_indptr, start, self._splits(win_lens.view(s, bs), g.win_splits[w]))
        for j, backend in enumerate(self.backends):
            sl = slice(j * bs, (j + 1) * bs + 1)
            md = TritonForwardMetadata(indptr[sl], g.kv_indices, num_kv_splits=splits[j],
                                       attn_logits=g.attn_logits[:bs], attn_lse=g.attn_lse[:bs])
            for w, (win_indptr, start, win_splits) in windows.items():
                md.windows[w] = WindowIndices(win_indptr[sl], g.win_indices[w], start[j * bs: (j + 1) * bs],
                                              win_splits[j])
            backend.forward_metadata = md
        return lens

    def _splits(self, lens: torch.Tensor, out: torch.Tensor) -> List[torch.Tensor]:
        """Split counts per step (views of ``out``): once for the longest step, or per step
        in one launch when deterministic (each count depends on its own length only)."""
        lead = self.backends[0]
        s, bs = lens.shape
        if lead.deterministic:
            flat = out[: s * bs]
            lead._num_kv_splits(lens.reshape(-1), flat)
            return [flat[j * bs: (j + 1) * bs] for j in range(s)]
        last = out[:bs]
        lead._num_kv_splits(lens[-1].contiguous(), last)
        return [last] * s
