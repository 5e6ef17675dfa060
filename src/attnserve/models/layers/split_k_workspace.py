"""Persistent zeroed workspaces for split-K kernels that leave them zeroed (issue 37).

A split-K launch of `fp8_mid_gemm` adds float32 partial sums into a workspace and counts
its programs in per column block (int32 counters after the sums). Until 2026-11-27 every
call allocated that buffer with ``torch.zeros``: one fill kernel per call, two a Llama
layer (o and down), 85 µs of a 6.5 ms FP8 decode step at 64 rows on an H100. The kernel
now restores what it used: the last program of a column block, after reading the sums,
stores zeros over the slice it read and resets its counter. So one buffer, zeroed once at
allocation, serves every later call.

`SplitKWorkspace` owns those buffers. Why one object per model, shared by its linears:

* **Sharing is safe on one stream.** Kernels of a stream run one after another, and each
  split-K launch ends with the buffer all zero again, whatever shape it had; so any later
  launch (another linear, another ``M``) finds zeros. The engine runs a model's forwards on
  one stream at a time: eager steps on the current stream; CUDA-graph warm-up and capture on
  the capture stream, ordered with it by ``wait_stream`` (`cuda_graph_runner`); replays on
  the current stream. Two streams running the same model concurrently would need a
  workspace each (none does).
* **Graphs captured at different sizes** all hold pointers into these buffers; a buffer is
  never freed or replaced while the object lives (graphs die with the model runner, before
  the model), and replays are sequential, each leaving zeros for the next.
* **Per model, not per layer or per module:** one buffer per size class instead of one per
  linear (128 for Llama-3-8B's 32 layers, up to 7.3 MB each for gate_up at 64 rows); and an
  object owned by the model's linear methods (`apply.quantize_model_linears` makes one and
  hands it to every `Fp8LinearMethod`), not module-level state, so engines in one process,
  tests and benchmarks never see each other's buffers.
* **Size classes:** a request takes the smallest held buffer of at least the asked size on
  its device, else a new one of the next power of two (at least `MIN_NUMEL` floats), kept
  for good; the first (largest) graph capture's warm-up sizes the buffer every smaller
  batch then reuses.
* **Never allocated inside a capture:** a ``torch.zeros`` under capture would record the
  fill as a graph node without running it, leaving an uninitialised buffer for eager calls.
  `get` returns None then, and the caller falls back to a per-call zeroed buffer (the fill
  captured with the kernel: correct, as before). The graph runner's eager warm-up before
  each capture allocates the buffer first, so this does not happen in the engine.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

__all__ = ["MIN_NUMEL", "SplitKWorkspace"]

#: smallest buffer allocated (float32 elements; 256 KiB)
MIN_NUMEL = 1 << 16


class SplitKWorkspace:
    """Zeroed float32 buffers, per device and power-of-two size class, that split-K kernels
    must leave zeroed (see the module doc)."""

    def __init__(self) -> None:
        self._buffers: Dict[Tuple[str, Optional[int]], List[torch.Tensor]] = {}

    def get(self, numel: int, device: torch.device) -> Optional[torch.Tensor]:
        """A zeroed contiguous float32 tensor of at least ``numel`` elements on ``device``
        (the same tensor for later requests of at most its size), or None while the current
        CUDA stream is capturing a graph and no such buffer exists yet.

        The caller's kernels must leave every element they touch zero again.

        Raises:
            ValueError: ``numel < 1``.
        """
        if numel < 1:
            raise ValueError(f"SplitKWorkspace.get: numel must be >= 1, got {numel}")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        held = self._buffers.setdefault((device.type, device.index), [])
        for buf in held:  # ascending sizes
            if buf.numel() >= numel:
                return buf
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = torch.zeros(max(MIN_NUMEL, 1 << (numel - 1).bit_length()), dtype=torch.float32, device=device)
        held.append(buf)
        held.sort(key=torch.Tensor.numel)
        return buf

    def buffers(self, device: torch.device) -> List[torch.Tensor]:
        """The buffers held for ``device`` (ascending sizes; for tests and memory reports)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return list(self._buffers.get((device.type, device.index), []))
