"""One step's device inputs from one packed host->device copy.

The scheduler decides a step on the host: which requests, how many tokens each, the KV
slots of the new tokens. `StepInputPacker.pack` lays every integer the step needs
(token ids, positions, slots, request rows, lengths, the rows that sample) into one pinned
host buffer and copies it to the device with a single ``non_blocking`` copy; the device
tensors are views of that one transfer. Pinned buffers rotate through a small ring, each
reused only after the event recorded behind its copy has completed, so the host never
overwrites bytes a copy still reads.

On the CPU nothing is copied: the host tensors are the step's tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

#: pinned buffers in the ring (a step is built while at most two earlier copies may be in flight)
RING_SIZE = 4


@dataclass
class StepTensors:
    """Device tensors of one step (``bs`` requests, ``T`` new tokens, ``E`` sampling rows).

    Attributes:
        input_ids: int64 ``[T]``; ``-1`` marks a token still being sampled on the device
            (read from the future-token map before the forward).
        positions / out_cache_loc / token_rows: int64 ``[T]`` (``token_rows``: the
            ``req_to_token`` row of each new token).
        req_pool_indices: int64 ``[bs]``.
        emit_index: int64 ``[E]`` batch rows that sample a token.
        seq_lens / extend_prefix_lens / extend_seq_lens / extend_start_loc: int32 ``[bs]``.
        out_cache_loc_i32: int32 ``[T]`` (the values written into ``req_to_token``).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    token_rows: torch.Tensor
    req_pool_indices: torch.Tensor
    emit_index: torch.Tensor
    seq_lens: torch.Tensor
    extend_prefix_lens: torch.Tensor
    extend_seq_lens: torch.Tensor
    extend_start_loc: torch.Tensor
    out_cache_loc_i32: torch.Tensor


_I64 = ("input_ids", "positions", "out_cache_loc", "token_rows", "req_pool_indices", "emit_index")
_I32 = ("seq_lens", "extend_prefix_lens", "extend_seq_lens", "extend_start_loc", "out_cache_loc_i32")


class StepInputPacker:
    """Builds `StepTensors` for one device.

    Args:
        device: the model's device.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.on_gpu = self.device.type == "cuda"
        self._ring: List[Optional[torch.Tensor]] = [None] * RING_SIZE
        self._events: List[Optional["torch.cuda.Event"]] = [None] * RING_SIZE
        self._next = 0

    def _buffer(self, nbytes: int) -> Tuple[int, torch.Tensor]:
        i = self._next
        self._next = (i + 1) % RING_SIZE
        ev = self._events[i]
        if ev is not None:
            ev.synchronize()  # the copy that last read this buffer has finished (normally long ago)
        buf = self._ring[i]
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, 1 << 16) * 2, dtype=torch.uint8, pin_memory=True)
            self._ring[i] = buf
        return i, buf

    def pack(self, host: dict) -> StepTensors:
        """``host`` maps each `StepTensors` field to a host tensor (int64 for the first six
        fields, int32 for the rest); returns the device tensors."""
        if not self.on_gpu:
            return StepTensors(**host)
        parts64 = [host[k] for k in _I64]
        parts32 = [host[k] for k in _I32]
        n64 = sum(p.numel() for p in parts64)
        n32 = sum(p.numel() for p in parts32)
        nbytes = n64 * 8 + n32 * 4
        i, buf = self._buffer(nbytes)
        v64 = buf[: n64 * 8].view(torch.int64)
        v32 = buf[n64 * 8: nbytes].view(torch.int32)
        torch.cat(parts64, out=v64)
        torch.cat(parts32, out=v32)
        dev = buf[:nbytes].to(self.device, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self._events[i] = ev
        out = {}
        d64 = dev[: n64 * 8].view(torch.int64)
        d32 = dev[n64 * 8:].view(torch.int32)
        off = 0
        for k, p in zip(_I64, parts64):
            out[k] = d64[off: off + p.numel()]
            off += p.numel()
        off = 0
        for k, p in zip(_I32, parts32):
            out[k] = d32[off: off + p.numel()]
            off += p.numel()
        return StepTensors(**out)


def host_step_layout(req_pool_indices: Sequence[int], prefix_lens: Sequence[int],
                     extend_lens: Sequence[int]) -> dict:
    """Host tensors derived from the batch shape alone: ``positions``, ``token_rows``,
    ``extend_start_loc`` and the int32 length tensors (see `StepTensors`)."""
    rpi = torch.tensor(req_pool_indices, dtype=torch.int64)
    prefix = torch.tensor(prefix_lens, dtype=torch.int64)
    ext = torch.tensor(extend_lens, dtype=torch.int64)
    bs = len(req_pool_indices)
    if bs == 0 or bool((ext == 1).all()):  # decode: a token per request
        positions, token_rows = prefix, rpi
        starts = torch.arange(bs, dtype=torch.int64)
    else:
        starts = torch.cumsum(ext, 0) - ext
        owner = torch.repeat_interleave(torch.arange(bs), ext)
        positions = prefix[owner] + torch.arange(int(ext.sum())) - starts[owner]
        token_rows = rpi[owner]
    return {
        "req_pool_indices": rpi, "positions": positions, "token_rows": token_rows,
        "seq_lens": (prefix + ext).to(torch.int32), "extend_prefix_lens": prefix.to(torch.int32),
        "extend_seq_lens": ext.to(torch.int32), "extend_start_loc": starts.to(torch.int32),
    }
