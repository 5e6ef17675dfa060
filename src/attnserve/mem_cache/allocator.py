"""`TokenToKVPoolAllocator`: KV slots handed out in pages, with tensor bookkeeping.

Free pages are an int64 stack (a CPU tensor of capacity ``num_pages`` and a top index):
taking ``n`` pages is a slice of the top, giving pages back writes them above it, so every
call costs O(pages moved), never O(pool size). `alloc_extend` / `alloc_decode` compute the
slots of a whole batch with vectorised tensor ops (no per-token Python), the same rule as
SGLang's paged allocator (``mem_cache/allocator.py``, ``alloc_extend_kernel``): a new token
goes to the slot after its request's last one while that page has room, and opens a fresh
page otherwise.

Why the host: the scheduler decides the batch on the host, so the slot numbers are needed
there anyway (for ``req_to_token``'s host mirror, for freeing without a device read); they
travel to the GPU inside the step's one packed host->device copy. No call here touches the
GPU or waits for it.

Slot layout: page 0 (slots ``0 .. page_size-1``) is never handed out, so slot 0 is a safe
dummy target for padded writes (CUDA-graph padding rows write there). Usable pages are
``1 .. num_pages``.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Union

import torch

IntsLike = Union[Sequence[int], torch.Tensor]


def _as_long(values: IntsLike) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values.to("cpu", torch.int64)
    return torch.tensor(list(values), dtype=torch.int64)


class TokenToKVPoolAllocator:
    """Hands out KV slots in pages of ``page_size`` tokens; page 0 is reserved.

    Args:
        size: usable token slots; rounded down to a multiple of ``page_size``.
        page_size: tokens per page (>= 1).

    Raises:
        ValueError: ``page_size < 1`` or a pool smaller than one page.

    Returned slot tensors are int64 on the host. ``free`` accepts host tensors (or lists)
    of slots; between `free_group_begin` and `free_group_end` the freed pages are collected
    and returned to the stack in one operation.
    """

    def __init__(self, size: int, page_size: int = 1):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.num_pages = size // page_size
        if self.num_pages < 1:
            raise ValueError(f"KV pool of {size} tokens holds no page of {page_size} tokens")
        self.size = self.num_pages * page_size
        self.clear()

    def clear(self) -> None:
        """Every page free again (page 1 handed out first)."""
        # stack bottom .. top-1; alloc takes from the top, so store pages in reverse
        self._stack = torch.arange(self.num_pages, 0, -1, dtype=torch.int64)
        self._top = self.num_pages
        self._page_free = torch.ones(self.num_pages + 1, dtype=torch.bool)
        self._page_free[0] = False
        self._group: Optional[List[torch.Tensor]] = None

    def shuffle_free_pages(self, rnd) -> None:
        """Hand the free pages out in a random order from now on (tests use it to place a
        request's pages non-contiguously). ``rnd``: a `random.Random`."""
        order = list(range(self._top))
        rnd.shuffle(order)
        self._stack[: self._top] = self._stack[: self._top][torch.tensor(order, dtype=torch.int64)]

    # ---- sizes -------------------------------------------------------------------------
    def available_size(self) -> int:
        """Free token slots (whole free pages only)."""
        return self._top * self.page_size

    def num_free_pages(self) -> int:
        return self._top

    def pages_needed(self, prefix_len: int, seq_len: int) -> int:
        """Fresh pages a request needs to grow from ``prefix_len`` to ``seq_len`` tokens."""
        ps = self.page_size
        return -(-seq_len // ps) - (-(-prefix_len // ps))

    # ---- alloc -------------------------------------------------------------------------
    def _take_pages(self, n: int) -> Optional[torch.Tensor]:
        if n > self._top:
            return None
        pages = self._stack[self._top - n: self._top].flip(0)  # a copy (flip), lowest-first order
        self._top -= n
        self._page_free[pages] = False
        return pages

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        """Slots for ``need_size`` tokens on fresh pages, or None when the pool is too full.

        With ``page_size > 1`` the last page may be partly used; its unused slots stay with
        the caller until `free`.
        """
        if need_size < 0:
            raise ValueError(f"need_size must be >= 0, got {need_size}")
        pages = self._take_pages(-(-need_size // self.page_size))
        if pages is None:
            return None
        if self.page_size == 1:
            return pages
        slots = (pages[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)
        return slots[:need_size]

    def alloc_extend(self, prefix_lens: IntsLike, seq_lens: IntsLike, last_loc: IntsLike) -> Optional[torch.Tensor]:
        """Slots for the new tokens ``prefix_lens[i] .. seq_lens[i]-1`` of each request.

        Args:
            prefix_lens: ``bs`` tokens each request already has in the cache.
            seq_lens: ``bs`` tokens each request will have after this step.
            last_loc: ``bs`` slot of each request's last cached token (ignored when its
                prefix length is a multiple of ``page_size``).

        Returns:
            int64 ``[sum(seq_lens - prefix_lens)]`` slots in batch order, or None (nothing
            taken) when the pool lacks pages.
        """
        prefix = _as_long(prefix_lens)
        seq = _as_long(seq_lens)
        ps = self.page_size
        ext = seq - prefix
        if ps == 1:
            return self._take_pages(int(ext.sum()))
        first_new_page = (prefix + ps - 1) // ps  # index (within the request) of its first fresh page
        new_pages = (seq + ps - 1) // ps - first_new_page
        pages = self._take_pages(int(new_pages.sum()))
        if pages is None:
            return None
        total = int(ext.sum())
        if total == 0:
            return torch.empty(0, dtype=torch.int64)
        last = _as_long(last_loc)
        req = torch.repeat_interleave(torch.arange(len(ext)), ext)
        tok_start = torch.cumsum(ext, 0) - ext
        pos = prefix[req] + (torch.arange(total) - tok_start[req])  # absolute position of each new token
        # tokens that still fit the request's partly used last page continue after last_loc
        in_old_page = pos < first_new_page[req] * ps
        cont = last[req] + (pos - prefix[req]) + 1
        page_base = torch.cumsum(new_pages, 0) - new_pages  # first fresh page of each request in `pages`
        k = (pos // ps - first_new_page[req]).clamp_min(0)
        fresh = pages[(page_base[req] + k).clamp_max(max(len(pages) - 1, 0))] * ps + pos % ps if len(pages) else cont
        return torch.where(in_old_page, cont, fresh)

    def alloc_decode(self, seq_lens: IntsLike, last_loc: IntsLike) -> Optional[torch.Tensor]:
        """One new slot per request whose length grows from ``seq_lens[i]-1`` to ``seq_lens[i]``."""
        seq = _as_long(seq_lens)
        if self.page_size == 1:
            return self._take_pages(len(seq))
        last = _as_long(last_loc)
        opens = (seq - 1) % self.page_size == 0
        pages = self._take_pages(int(opens.sum()))
        if pages is None:
            return None
        out = last + 1
        out[opens] = pages * self.page_size
        return out

    # ---- free --------------------------------------------------------------------------
    def free_group_begin(self) -> None:
        """Collect the pages of the following `free` calls until `free_group_end`."""
        self._group = []

    def free_group_end(self) -> None:
        """Return every page freed since `free_group_begin` in one operation."""
        group, self._group = self._group, None
        if group:
            self._push(torch.cat(group))

    def free(self, slots: IntsLike) -> None:
        """Return the pages that hold ``slots`` (all slots of the freed requests).

        Raises:
            ValueError: on a slot of the reserved page 0 or of a page that is already free.
        """
        slots = _as_long(slots)
        if slots.numel() == 0:
            return
        pages = torch.unique(slots // self.page_size)
        if int(pages[0]) < 1 or int(pages[-1]) > self.num_pages or bool(self._page_free[pages].any()):
            bad = [p for p in pages.tolist() if p < 1 or p > self.num_pages or bool(self._page_free[p])]
            raise ValueError(f"TokenToKVPoolAllocator.free: page {bad[0]} is not allocated")
        self._page_free[pages] = True  # marked now, so a second free in the same group is caught
        if self._group is not None:
            self._group.append(pages)
        else:
            self._push(pages)

    def _push(self, pages: torch.Tensor) -> None:
        n = pages.numel()
        self._stack[self._top: self._top + n] = pages.flip(0)
        self._top += n
