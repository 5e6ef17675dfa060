"""Overlap a large prefill batch's tensor-parallel all-reduces with the other half's GEMMs.

Under tensor parallelism a Llama-style layer all-reduces ``o_proj``'s and ``down_proj``'s
partial sums (`allreduce_fusion` leaves them to the norms after them). A prefill chunk of
8,192 tokens makes each message 64 MiB at hidden size 4,096: NCCL then takes ~1.06 ms a
call on four H100s and ~0.4 ms on four H200s, and the stream waits for it; a tp-4 prefill of
64 x 512 tokens spent 275 of its 464 ms of kernels in these all-reduces
(``benchmarks/NOTES.md``, 2026-11-27).

Everything between a layer's attention and the next layer's norm works token by token
(residual add, RMSNorm, the MLP), so the tokens can go in two halves: the first half's
all-reduce runs on NCCL's stream while the compute stream works on the second half::

    attention (all tokens) -> o_proj (all tokens, partial sums)
    all-reduce(o[:s]) and all-reduce(o[s:])           (async, NCCL's stream, in order)
    wait o[:s] -> add + norm -> MLP -> all-reduce(mlp[:s])   (async)
    wait o[s:] -> add + norm -> MLP -> all-reduce(mlp[s:])   (async)
    wait both: the layer's output is summed; the next layer's input norm adds it plainly

(the pattern of SGLang's and Megatron-LM's compute/communication overlap, on token halves
as in "two-batch overlap"; no code of theirs is used). It applies to a model whose layers
are all linked by `allreduce_fusion` (both outputs partial), when each half's message is
at least the custom all-reduce's two-shot ceiling (16 MiB at 2 and 4 ranks: smaller messages
run the custom kernels on the compute stream, which cannot overlap), or at least
``ATTNSERVE_TP_OVERLAP_MIN_HALF_MB`` MiB where that is set. It is opt-in
(``ATTNSERVE_TP_PREFILL_OVERLAP=1``): on four H200s it took a 64 x 512 prefill from 0.361 to
0.337 s, but on four H100s it made it slower (0.577-0.611 s off, 0.674-0.695 s on, two runs
each; ``benchmarks/NOTES.md``, 2026-11-27).

NCCL's CTAs and cuBLAS's compete for SMs. ``ATTNSERVE_TP_OVERLAP_SM_CARVEOUT=N`` runs the
overlapped MLPs on cuBLASLt with ``N`` SMs left free (`gemm_sm_carveout`). Four H200s, 64 x 512
prefill at tp 4, two runs each (s): overlap off 0.383 / 0.404, on 0.401 / 0.381, on with 24 SMs
free 0.383 / 0.373, with 32 0.353 / 0.366 (``benchmarks/results/h200x4-tp4-8b-prefill-overlap-carveout-2026-11-28.json``).
The interleaved A/B that followed (three rounds of fresh processes, off and 32 SMs free in turn,
``...-tp4-8b-prefill-overlap-carveout-rounds-2026-11-28.json``) settled it: prefill medians 0.3725
(off) / 0.3726 s, and the decode steps after it 3.31 / 3.41 ms in every round (not explained).
It stays opt-in. NCCL sums each half on its own, so the bits may differ from one all-reduce of
the whole message (the ring's order per element depends on the chunking); at two ranks a sum
of two terms is the same either way.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional, Sequence, Tuple

import torch

from attnserve.env_options import env_bytes, env_flag, env_int

__all__ = ["TP_OVERLAP_CARVEOUT_ENV", "TP_OVERLAP_ENV", "TP_OVERLAP_MIN_HALF_ENV", "gemm_sm_carveout",
           "overlap_min_half_bytes", "tp_overlap_applies", "overlapped_layer_forward"]

TP_OVERLAP_ENV = "ATTNSERVE_TP_PREFILL_OVERLAP"
TP_OVERLAP_MIN_HALF_ENV = "ATTNSERVE_TP_OVERLAP_MIN_HALF_MB"
TP_OVERLAP_CARVEOUT_ENV = "ATTNSERVE_TP_OVERLAP_SM_CARVEOUT"


@contextlib.contextmanager
def gemm_sm_carveout(device: torch.device):
    """Leave ``ATTNSERVE_TP_OVERLAP_SM_CARVEOUT`` SMs free of the GEMMs issued inside (0 or
    unset: nothing changes), so that NCCL's CTAs on the side stream run beside them.

    PyTorch's carveout (``torch._C._set_sm_carveout_experimental``) reaches cuBLAS only through
    cuBLASLt, where it sets ``CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET`` (PyTorch's
    ``aten/src/ATen/cuda/CUDABlas.cpp``); plain cuBLAS ignores it (two H200s, 2026-11-28), so the
    preferred BLAS library is switched to cuBLASLt for the block and restored after it.
    """
    carveout = env_int(TP_OVERLAP_CARVEOUT_ENV, 0, 0, 4096)
    if carveout <= 0 or device.type != "cuda":
        yield
        return
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    torch._C._set_sm_carveout_experimental(carveout)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(None)
        torch.backends.cuda.preferred_blas_library(before)


def overlap_min_half_bytes(tp: Any) -> int:
    """Least bytes of a half's message for the overlap: ``ATTNSERVE_TP_OVERLAP_MIN_HALF_MB``
    where set, else the two-shot ceiling of ``tp``'s custom all-reduce (of
    `custom_all_reduce.default_config` for its size when it has none), above which the
    all-reduce is NCCL's anyway.

    Raises:
        ValueError: the variable is set but not a number >= 0.
    """
    size = env_bytes(TP_OVERLAP_MIN_HALF_ENV, 1 << 20)
    if size is not None:
        return size
    custom = getattr(tp, "custom_all_reduce", None)
    if custom is not None:
        return custom.config.two_shot_max_bytes
    from attnserve.distributed.custom_all_reduce import default_config

    return default_config(tp.size).two_shot_max_bytes


def tp_overlap_applies(layers: Sequence[Any], hidden_states: torch.Tensor, tp: Any) -> bool:
    """Whether `DecoderModel.forward` runs ``layers`` through `overlapped_layer_forward`:
    not switched off, not inside a CUDA-graph capture, a group of more than one rank with a
    device group, every layer's attention and MLP outputs left partial (`allreduce_fusion`),
    at least 2 tokens, and each half's ``[T / 2, hidden]`` message at least
    `overlap_min_half_bytes`."""
    if not env_flag(TP_OVERLAP_ENV, default=False):
        return False
    if tp is None or tp.size <= 1 or tp.device_group is None or not layers:
        return False
    if hidden_states.is_cuda and torch.cuda.is_current_stream_capturing():
        return False  # a captured decode step: its all-reduces stay on the captured stream
    if not all(getattr(layer, "attn_output_partial", False) and getattr(layer, "mlp_output_partial", False)
               for layer in layers):
        return False
    t = hidden_states.shape[0]
    half_bytes = (t // 2) * hidden_states[0].numel() * hidden_states.element_size()
    return t >= 2 and half_bytes >= overlap_min_half_bytes(tp)


def _all_reduce_async(x: torch.Tensor, tp: Any):
    import torch.distributed as dist

    return dist.all_reduce(x, group=tp.device_group, async_op=True)


def overlapped_layer_forward(layer: Any, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch: Any,
                             residual: Optional[torch.Tensor], input_summed: bool) -> Tuple[torch.Tensor,
                                                                                            torch.Tensor]:
    """`LlamaDecoderLayer.forward` with its two all-reduces on token halves, overlapped.

    Args:
        layer: a `LlamaDecoderLayer` linked by `allreduce_fusion` (``attn_output_partial`` and
            ``mlp_output_partial``).
        positions / forward_batch: as the layer's ``forward``.
        hidden_states: ``[T, hidden]``, the previous layer's output (or the embedding).
        residual: ``[T, hidden]`` or None (the first layer).
        input_summed: ``hidden_states`` is already summed over the ranks (the previous layer
            ran here); otherwise a partial input is summed by the input norm as usual.
    Returns:
        ``(block output, residual)``, both ``[T, hidden]``; the block output is summed over
        the ranks (unlike the linked ``forward``, which leaves it partial).
    """
    tp = layer.fusion_tp
    if residual is None:
        residual = hidden_states
        x = layer.input_layernorm.forward(hidden_states)
    elif layer.input_partial and not input_summed:
        x, residual = layer.input_layernorm.forward_all_reduce(hidden_states, residual, tp)
    else:
        x, residual = layer.input_layernorm.forward(hidden_states, residual)
    attn = layer.self_attn.forward(positions, x, forward_batch)  # partial sums
    s = attn.shape[0] // 2
    halves = (slice(0, s), slice(s, attn.shape[0]))
    parts = [attn[h] for h in halves]
    works = [_all_reduce_async(p, tp) for p in parts]
    outs, res = [], []
    for part, h, work in zip(parts, halves, works):
        work.wait()  # the compute stream waits for this half's sum only
        y, r = layer.post_attention_layernorm.forward(part, residual[h])
        with gemm_sm_carveout(y.device):  # NCCL sums the other half meanwhile
            m = layer.mlp.forward(y)  # partial sums
        outs.append((m, _all_reduce_async(m, tp)))
        res.append(r)
    for _, work in outs:
        work.wait()
    return torch.cat([m for m, _ in outs]), torch.cat(res)
