"""One output buffer shared by a family of CUDA graphs captured largest batch first.

A graph's output tensor lives in the graph's memory pool for as long as the graph is kept:
with one logits tensor per captured size, the outputs sum to ``Σ rows × vocab × 4`` bytes
(decode graphs of Llama-3-8B's 51 sizes up to 512: 5.4 GB). Instead the largest graph's
output is kept as the buffer, and every smaller graph copies its logits into the buffer's
leading rows inside its own capture (the copy is part of the graph), so its own output can
be dropped after its capture and its pool blocks serve the next capture. The copy costs
``rows × vocab × 8`` bytes of device traffic a replay.

Where the model can write its logits straight into that view (`target`, passed to
``compute_logits(..., out=)``: the LM head's GEMM writes float32 rows into it), the graph
records no copy at all; `bind` then returns the view as it is.

Every graph then returns a view of the same memory: a replay overwrites what the previous
replay (of any size) returned, so a caller must be done with a step's logits (or have
copied them) before the next replay. Replays of one size already had this rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class SharedGraphOutput:
    """The buffer (None until the first, largest, output is bound)."""

    buffer: Optional[torch.Tensor] = None

    def target(self, rows: int) -> Optional[torch.Tensor]:
        """``buffer[:rows]``, the tensor a graph of ``rows`` output rows may write its output
        into (None before the first bind, or when ``rows`` exceeds the buffer)."""
        if self.buffer is None or rows > self.buffer.shape[0]:
            return None
        return self.buffer[:rows]

    def bind(self, out: torch.Tensor) -> torch.Tensor:
        """The tensor a graph should return for its output ``out`` (``[rows, ...]``), called
        inside the graph's capture, largest graph first: the first call keeps ``out`` as the
        buffer and returns it; a later call copies ``out`` into ``buffer[:rows]`` (recorded
        in the graph being captured) and returns that view, after which the caller drops
        ``out``; an ``out`` that already is that view (written through `target`) is returned
        without a copy.

        Raises:
            ValueError: ``out`` has more rows than the buffer, or another trailing shape,
                dtype or device (graphs must be captured largest first, with one output layout).
        """
        if self.buffer is None:
            self.buffer = out
            return out
        buf = self.buffer
        if (out.dim() != buf.dim() or out.shape[0] > buf.shape[0] or out.shape[1:] != buf.shape[1:]
                or out.dtype != buf.dtype or out.device != buf.device):
            raise ValueError(f"a graph output {tuple(out.shape)} {out.dtype} on {out.device} does not fit the shared "
                             f"buffer {tuple(buf.shape)} {buf.dtype} on {buf.device} (capture the largest graph first)")
        view = buf[: out.shape[0]]
        if out.data_ptr() == view.data_ptr() and out.stride() == view.stride():
            return out  # written in place through `target`: nothing to copy
        view.copy_(out)
        return view

    @property
    def nbytes(self) -> int:
        """The buffer's size in bytes (0 before the first bind)."""
        return 0 if self.buffer is None else self.buffer.numel() * self.buffer.element_size()
