"""`TokenBitmask`: next-token masks of the constrained rows, filled on the host, applied on
the device.

xgrammar's mask of one row is ``ceil(V / 32)`` int32 words, bit ``t`` set when token ``t``
may come next (`GrammarMatcher.fill_next_token_bitmask`; token ids the tokenizer lacks,
i.e. a padded LM head, and special tokens other than the stop tokens are always 0). A step
with ``k`` constrained rows among ``n`` sampled rows:

* **CPU**: the masks are filled straight into rows of an ``[n, W]`` buffer at the logits'
  row indices and applied in place by xgrammar's C++ kernel (``indices`` = those rows).
* **CUDA**: the ``k`` masks are filled compactly (``[k, W]``, pinned), copied with one
  non-blocking H2D copy (``k * W * 4`` bytes: 0.5 MB for 32 rows of a 128,256-token
  vocabulary), and applied in place by xgrammar's Triton kernel (one launch); when
  ``k < n`` the compact rows are first scattered to their logits rows in a device buffer
  (``index_copy_``, one kernel) and the kernel visits those rows only. Two pinned host
  buffers alternate; before one is refilled, the event recorded after its last copy is
  waited on (it has always completed by then in practice: a step later).

Filling uses xgrammar's ``BatchGrammarMatcher`` (C++ threads, half the host's cores by
default) for two rows or more. A batch goes through `reserve` (scheduler thread: takes a
host buffer), `fill` (any thread: xgrammar releases the GIL while it fills) and
`apply_filled` (scheduler thread: copy and kernel), so the fill can overlap the
scheduler's other work (`attnserve.engine.step_sampling`). Nothing here runs for a batch
without constrained rows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from attnserve.engine.constrained.spec import import_xgrammar


@dataclass
class BitmaskStats:
    """``steps``: batches masked; ``rows``: rows masked; ``fill_seconds``: host time filling
    masks; ``apply_seconds``: host time enqueueing copies and the kernel (device time is
    not measured here)."""

    steps: int = 0
    rows: int = 0
    fill_seconds: float = 0.0
    apply_seconds: float = 0.0


@dataclass
class FilledMask:
    """The host masks of one batch (`TokenBitmask.reserve`, then `fill`).

    Attributes:
        slot: the host buffer's slot.
        rows: the ``k`` constrained row indices of the batch, ascending.
        n: the batch's sampling rows.
        host: int32 ``[>= k, W]`` (compact) or ``[>= n, W]`` masks (pinned on CUDA).
        host_rows: int64 ``[>= k]`` staging for the row indices (compact path).
    """

    slot: int
    rows: List[int]
    n: int
    host: torch.Tensor
    host_rows: torch.Tensor


class TokenBitmask:
    """Host and device buffers of the token masks, and the fill/apply of one batch.

    Args:
        vocab_size: V, the grammar's vocabulary (the model's logits width, padding included).
        device: the logits' device.
        fill_threads: xgrammar batch-fill threads (``"auto"``: half the host's cores).
        compact: fill ``k`` compact rows and scatter them on the device (default: on CUDA;
            tests force it on the CPU to check that path's indexing).
    """

    def __init__(self, vocab_size: int, device, fill_threads="auto", compact=None):
        self._xgr = import_xgrammar()
        self.vocab_size = int(vocab_size)
        self.words = (self.vocab_size + 31) // 32
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.compact = self.cuda if compact is None else bool(compact)
        self.stats = BitmaskStats()
        self._batch = self._xgr.BatchGrammarMatcher(fill_threads)
        self._host: List[Optional[torch.Tensor]] = [None, None]  # [cap, W] int32 (pinned on CUDA)
        self._host_rows: List[Optional[torch.Tensor]] = [None, None]  # [cap] int64 (pinned)
        self._events: List[Optional[torch.cuda.Event]] = [None, None]
        self._slot = 0
        self._dev_mask: Optional[torch.Tensor] = None  # [cap, W] compact masks
        self._dev_full: Optional[torch.Tensor] = None  # [cap, W] masks at their logits rows
        self._dev_rows: Optional[torch.Tensor] = None  # [cap] int64

    # ---- buffers ---------------------------------------------------------------------------
    @staticmethod
    def _capacity(n: int) -> int:
        return max(64, 1 << (max(n, 1) - 1).bit_length())

    def _host_buffers(self, n: int):
        """The next host slot ``(mask [>= n, W], rows [>= n])``, free to overwrite."""
        slot = self._slot
        self._slot ^= 1
        ev = self._events[slot]
        if ev is not None:
            ev.synchronize()  # the copy that last read this buffer has finished
            self._events[slot] = None
        buf = self._host[slot]
        if buf is None or buf.shape[0] < n:
            cap = self._capacity(n)
            pin = self.cuda
            self._host[slot] = torch.empty((cap, self.words), dtype=torch.int32, pin_memory=pin)
            self._host_rows[slot] = torch.empty(cap, dtype=torch.int64, pin_memory=pin)
        return slot, self._host[slot], self._host_rows[slot]

    def _device_buffers(self, n: int) -> None:
        if self._dev_mask is None or self._dev_mask.shape[0] < n:
            cap = self._capacity(n)
            self._dev_mask = torch.empty((cap, self.words), dtype=torch.int32, device=self.device)
            self._dev_full = torch.empty((cap, self.words), dtype=torch.int32, device=self.device)
            self._dev_rows = torch.empty(cap, dtype=torch.int64, device=self.device)

    # ---- one batch ----------------------------------------------------------------------
    def _fill(self, matchers: Sequence, mask: torch.Tensor, indices: Optional[List[int]]) -> None:
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(mask, indices[0] if indices else 0)
        else:
            self._batch.batch_fill_next_token_bitmask(list(matchers), mask, indices)

    def reserve(self, rows: List[int], n: int) -> FilledMask:
        """Take the next host buffer for the masks of ``rows`` (``k`` ascending row indices
        of an ``n``-row batch; the fill may drop some: ``FilledMask.rows``); scheduler
        thread only."""
        k = len(rows)
        slot, host, host_rows = self._host_buffers(k if self.compact else n)
        return FilledMask(slot, list(rows), n, host, host_rows)

    def fill(self, filled: FilledMask, matchers: Sequence) -> FilledMask:
        """Fill ``filled``'s host masks from ``matchers`` (one per row, not terminated).
        Touches only the matchers and that host buffer, so it may run on a worker thread
        (xgrammar releases the GIL while it fills) while the scheduler thread goes on."""
        t0 = time.perf_counter()
        self._fill(matchers, filled.host, None if self.compact else filled.rows)
        self.stats.fill_seconds += time.perf_counter() - t0
        return filled

    def apply_filled(self, logits: torch.Tensor, filled: FilledMask) -> None:
        """Mask ``logits`` (float ``[n, V']`` on `device`, ``V' >= V``) in place with the
        masks `fill` wrote: every token the row's matcher cannot accept next gets -inf in
        that row (columns past V too); the other rows are untouched. Scheduler thread."""
        t1 = time.perf_counter()
        rows, n, k, host = filled.rows, filled.n, len(filled.rows), filled.host
        if not k:
            return
        if not self.compact:
            self._mask(logits, host[:n], None if k == n else rows, rows)
        else:
            self._device_buffers(n)
            dev_mask = self._dev_mask[:k]
            dev_mask.copy_(host[:k], non_blocking=True)
            if k == n:
                self._mask(logits, dev_mask, None, rows)
            else:
                filled.host_rows[:k].copy_(torch.tensor(rows, dtype=torch.int64))
                dev_rows = self._dev_rows[:k]
                dev_rows.copy_(filled.host_rows[:k], non_blocking=True)
                full = self._dev_full[:n]
                full.index_copy_(0, dev_rows, dev_mask)
                self._mask(logits, full, dev_rows, dev_rows)
            if self.cuda:
                ev = torch.cuda.Event()
                ev.record()
                self._events[filled.slot] = ev
        st = self.stats
        st.steps += 1
        st.rows += k
        st.apply_seconds += time.perf_counter() - t1

    def apply(self, logits: torch.Tensor, rows: List[int], matchers: Sequence) -> None:
        """`reserve`, `fill` and `apply_filled` at once.

        Args:
            logits: float ``[n, V']`` on `device` (``V' >= V``; columns past V are masked
                for the constrained rows, since no token of the grammar has such an id).
            rows: ``k`` distinct row indices of ``logits``, ascending.
            matchers: ``k`` xgrammar ``GrammarMatcher`` (not terminated), one per row.
        """
        self.apply_filled(logits, self.fill(self.reserve(rows, logits.shape[0]), matchers))

    def only_stop_allowed(self, filled: FilledMask, i: int, stop_token_ids: Sequence[int]) -> bool:
        """Whether the ``i``-th mask of ``filled`` (after `fill`) allows no token but
        ``stop_token_ids``: the grammar can only end there."""
        row = filled.host[i if self.compact else filled.rows[i]].clone()
        for t in stop_token_ids:
            word = int(row[t >> 5]) & 0xFFFFFFFF
            word &= ~(1 << (t & 31))
            row[t >> 5] = word - (1 << 32) if word >= 1 << 31 else word
        return not bool(row.any())

    def _mask(self, logits: torch.Tensor, mask: torch.Tensor, indices, rows) -> None:
        width = logits.shape[-1]
        self._xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=min(width, self.vocab_size), indices=indices)
        if width > self.vocab_size:  # ids past the grammar's vocabulary: never valid
            if isinstance(rows, torch.Tensor):
                logits[rows, self.vocab_size:] = float("-inf")
            else:
                logits[torch.tensor(rows, dtype=torch.int64), self.vocab_size:] = float("-inf")
