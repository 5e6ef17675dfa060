"""Defaults sized from memory: KV pool tokens, running requests, CUDA-graph batch, prefill chunk.

SGLang sizes its serving limits from the GPU rather than from fixed numbers (its
``ServerArgs`` picks ``chunked_prefill_size`` and ``cuda_graph_max_bs`` from the card's
memory; its model runner derives the request-slot count from the KV pool), so a user who
passes no flag still fills the GPU. attnserve does the same, with these rules:

* **KV pool** (`kv_pool_tokens`): every byte of the static budget that the weights and the
  attention workspace leave, ``free - total * (1 - mem_fraction_static) - workspace``,
  divided by the KV bytes of one token. It does not depend on ``max_running_requests``.
* **Static fraction** (`default_mem_fraction_static`): the card's memory less a reserve for
  activations, CUDA graphs and the allocator, by card size as SGLang's ``ServerArgs``
  reserves it (H100 80 GB: 9.5 GiB + 0.5 GiB per rank, so 0.874 at tp 1; 141 GB cards
  12 GiB + 0.5 per rank; 2 GiB more with a draft model). A fixed 0.8 left a 61 GB MoE
  model (Qwen3-30B-A3B) 4 GB of KV on an 80 GB card.
* **Running requests** (`default_max_running_requests`): ``pool_tokens // 64`` (room for
  every running request to hold 64 tokens of KV), at least 1 and at most
  `MAX_RUNNING_REQUESTS_CAP` (1024) and, on a GPU, at most the card's graph batch. Admission
  still checks each request's KV need, so the count only bounds how many requests can share
  a step; the cap bounds the host-side work per step and the ``req_to_token`` table
  (``cap x context_len`` int32). A decode step above the graph batch runs eagerly, and an
  eager Llama-3-8B step costs the host ~35 ms (32 layers at `PREFILL_HOST_SECONDS_PER_LAYER`),
  more than the GPU needs for it: with 1024 prompts on an H200 (graphs up to 512, 1024
  running requests allowed) 576 of 1199 decode steps ran eagerly and the host time per
  decode step averaged 17.9 ms against 3.0 ms with 512 prompts (issue 38's dp 1 row;
  the schedule reproduced on the CPU by ``benchmarks/host_step_cpu.py``). So by default
  every running batch has a graph.
* **CUDA-graph batch and prefill chunk** (`gpu_batch_defaults`): a table over the card's
  total memory (`GPU_MEMORY_TIERS`), in the spirit of SGLang's (80 GB cards: 8192-token
  prefill chunks), with graphs up to 512 requests on 80 GB cards and 1024 on larger ones
  (the KV pool of an 8B model holds ~430 requests of 1,100 tokens on an H100 and ~800 on
  an H200). The graph batch never exceeds the running request count.
* **Small models' prefill chunk** (`host_bound_prefill_chunk`): an eager prefill step costs the
  host about `PREFILL_HOST_SECONDS_PER_LAYER` per layer to launch its kernels (measured with
  cProfile on the H100 machine's host: Qwen3-0.6B, 28 layers, ~31 ms per step), while the GPU
  needs ``2 * params * chunk / F``. Below ``chunk = layers * host_s * F / (2 * params)`` the
  step is host-bound, so the chunk is raised to the next power of two above that, at most
  twice the tier's chunk. On the H100 this gives Qwen3-0.6B 16384 (mixed 256-request
  workload: prefill share of the roofline 0.32 -> 0.51, whole workload 0.74 -> 0.77) and
  leaves Llama-3-8B at 8192 (16384 measured 0.81 vs 0.82 there).
* **Speculative decoding** (GPU): at most `SPECULATIVE_MAX_RUNNING_REQUESTS` (48) running
  requests by default, as SGLang resets them, so the verify graphs (``bs x nodes`` rows of
  logits each) stay small: at 512 requests NGRAM's 8-node trees would need a 2.1 GB logits
  buffer for Llama-3-8B.
* **CPU**: 64 running requests, 8192-token chunks, no graphs: the values measured best on
  the 2-core CPU machines (`CPU_MAX_RUNNING_REQUESTS`, `CPU_CHUNKED_PREFILL_SIZE`).

Explicit flags always win; `resolve_serving_limits` fills only the ``None`` ones and
returns what it chose, which the model runner logs once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

#: most running requests the memory rule picks on its own (``--max-running-requests`` may go higher)
MAX_RUNNING_REQUESTS_CAP = 1024
#: default running requests on a GPU with speculative decoding (SGLang's ``ServerArgs`` resets
#: an unset ``--max-running-requests`` to 48 for every speculative algorithm: speculation pays
#: at small batches, and each request holds ``nodes`` verify rows); the graph batch follows
SPECULATIVE_MAX_RUNNING_REQUESTS = 48
#: KV tokens reserved per running request by the memory rule (pool_tokens // this)
TOKENS_PER_RUNNING_REQUEST = 64
#: CPU defaults (measured best on the 2-core machines)
CPU_MAX_RUNNING_REQUESTS = 64
CPU_CHUNKED_PREFILL_SIZE = 8192

#: (total GPU memory below this many GiB, chunked_prefill_size, cuda_graph_max_bs), first match wins
#: ``(card GiB below, reserve GiB, reserve GiB per rank)`` (SGLang's ``ServerArgs`` reserve)
MEMORY_RESERVE_TIERS: Tuple[Tuple[float, float, float], ...] = (
    (35.0, 2.8, 0.1),
    (90.0, 9.5, 0.5),  # H100 80 GB, A100
    (160.0, 12.0, 0.5),  # H200 141 GB, H20
    (float("inf"), 32.0, 0.0),  # B200, MI300
)
#: fraction on the CPU (its "memory" is the KV budget of `CPU_DEFAULT_MAX_TOTAL_TOKENS`)
CPU_MEM_FRACTION_STATIC = 0.8
#: extra reserve for a draft model's graphs and buffers (GiB)
SPECULATIVE_RESERVE_GIB = 2.0


def default_mem_fraction_static(total_gpu_bytes: int, tp_size: int = 1, speculative: bool = False) -> float:
    """``(total - reserve) / total`` for a card of ``total_gpu_bytes`` (`MEMORY_RESERVE_TIERS`),
    rounded to 3 digits; `CPU_MEM_FRACTION_STATIC` when ``total_gpu_bytes`` is 0 (CPU)."""
    if total_gpu_bytes <= 0:
        return CPU_MEM_FRACTION_STATIC
    gib = total_gpu_bytes / 2**30
    for below, base, per_rank in MEMORY_RESERVE_TIERS:
        if gib < below:
            reserve = base + per_rank * tp_size + (SPECULATIVE_RESERVE_GIB if speculative else 0.0)
            return round(max(gib - reserve, 0.1 * gib) / gib, 3)
    raise AssertionError("unreachable: the last tier has no bound")


GPU_MEMORY_TIERS: Tuple[Tuple[float, int, int], ...] = (
    (20.0, 2048, 32),
    (36.0, 4096, 96),
    (64.0, 4096, 160),
    (100.0, 8192, 512),  # H100 80 GB
    (float("inf"), 16384, 1024),  # H200 141 GB, B200
)


#: host seconds to launch one layer's kernels in an eager prefill step (see the module doc)
PREFILL_HOST_SECONDS_PER_LAYER = 1.1e-3
#: bf16 matmul rate assumed by the chunk rule (the H100's measured 8192^3 rate, FLOP/s)
PREFILL_MATMUL_FLOPS = 6.8e14


def host_bound_prefill_chunk(tier_chunk: int, params: int, num_layers: int) -> int:
    """The prefill chunk for a model of ``params`` parameters and ``num_layers`` layers:
    the smallest power of two at or above ``num_layers * PREFILL_HOST_SECONDS_PER_LAYER *
    PREFILL_MATMUL_FLOPS / (2 * params)`` tokens, within ``[tier_chunk, 2 * tier_chunk]``
    (``tier_chunk`` itself when ``params`` is unknown, 0)."""
    if params <= 0 or num_layers <= 0:
        return tier_chunk
    need = num_layers * PREFILL_HOST_SECONDS_PER_LAYER * PREFILL_MATMUL_FLOPS / (2.0 * params)
    chunk = tier_chunk
    while chunk < need and chunk < 2 * tier_chunk:
        chunk *= 2
    return chunk


@dataclass(frozen=True)
class ServingLimits:
    """The limits one engine runs with, and which of them were chosen by rule.

    Attributes:
        max_total_tokens: KV pool size in tokens.
        max_running_requests: most requests in one step (``req_to_token`` rows).
        chunked_prefill_size: most prompt tokens prefilled in one step.
        cuda_graph_max_bs: largest captured decode batch (0: no graphs).
        chosen: names of the fields the rules filled (the others came from flags).
        chunk_prompts: False under ``--chunked-prefill-size -1`` (SGLang's "disabled"): a
            prompt is prefilled whole in one step, never split across steps
            (``chunked_prefill_size`` is then the context length, the step's token budget).
    """

    max_total_tokens: int
    max_running_requests: int
    chunked_prefill_size: int
    cuda_graph_max_bs: int
    chosen: Tuple[str, ...] = ()
    chunk_prompts: bool = True

    def describe(self) -> str:
        """One log line: each value, marked ``(auto)`` where a rule chose it."""
        parts = []
        for name in ("max_total_tokens", "max_running_requests", "chunked_prefill_size", "cuda_graph_max_bs"):
            parts.append(f"{name}={getattr(self, name)}{' (auto)' if name in self.chosen else ''}")
        return ", ".join(parts)


def kv_pool_tokens(free_bytes: int, total_bytes: int, mem_fraction_static: float, workspace_bytes: int,
                   kv_bytes_per_token: int) -> int:
    """KV tokens that fit in the static memory budget left after the weights.

    Args:
        free_bytes / total_bytes: ``torch.cuda.mem_get_info()`` once the weights are loaded.
        mem_fraction_static: share of the card for weights + KV pool (``--mem-fraction-static``).
        workspace_bytes: attention workspace allocated whatever the batch.
        kv_bytes_per_token: KV bytes of one token over all layers (plus a draft model's).

    Returns:
        tokens (>= 0; the caller refuses a pool below two pages).
    """
    if kv_bytes_per_token <= 0:
        raise ValueError(f"kv_bytes_per_token must be > 0, got {kv_bytes_per_token}")
    budget = free_bytes - total_bytes * (1.0 - mem_fraction_static) - workspace_bytes
    return int(max(budget, 0) // kv_bytes_per_token)


def default_max_running_requests(pool_tokens: int) -> int:
    """``clamp(pool_tokens // TOKENS_PER_RUNNING_REQUEST, 1, MAX_RUNNING_REQUESTS_CAP)``."""
    return max(1, min(MAX_RUNNING_REQUESTS_CAP, pool_tokens // TOKENS_PER_RUNNING_REQUEST))


def gpu_batch_defaults(total_gpu_bytes: int) -> Tuple[int, int]:
    """``(chunked_prefill_size, cuda_graph_max_bs)`` for a card of ``total_gpu_bytes``
    (`GPU_MEMORY_TIERS`)."""
    gib = total_gpu_bytes / 2**30
    for below, chunk, graph_bs in GPU_MEMORY_TIERS:
        if gib < below:
            return chunk, graph_bs
    raise AssertionError("the last tier is unbounded")


def resolve_serving_limits(pool_tokens: int, device_type: str, total_gpu_bytes: int = 0,
                           max_running_requests: Optional[int] = None,
                           chunked_prefill_size: Optional[int] = None,
                           cuda_graph_max_bs: Optional[int] = None,
                           max_total_tokens_chosen: bool = True, params: int = 0,
                           num_layers: int = 0, speculative: bool = False) -> ServingLimits:
    """Fill the limits the user left at ``None``.

    Args:
        pool_tokens: the KV pool's size in tokens (already decided).
        device_type: ``"cuda"`` or ``"cpu"``.
        total_gpu_bytes: the card's total memory (CUDA only).
        max_running_requests / chunked_prefill_size / cuda_graph_max_bs: the flags (None: choose).
        max_total_tokens_chosen: whether ``pool_tokens`` came from the memory rule.
        params / num_layers: the model's parameters and layers (`host_bound_prefill_chunk`; 0: unknown).
        speculative: a speculative algorithm is on: on a GPU the default running requests (and
            so the graph batch, which covers the verify graphs too) is at most
            `SPECULATIVE_MAX_RUNNING_REQUESTS`.

    Returns:
        `ServingLimits`; ``cuda_graph_max_bs`` is capped at ``max_running_requests`` and is 0 on CPU.
    """
    chosen = ["max_total_tokens"] if max_total_tokens_chosen else []
    if device_type == "cuda":
        chunk_default, graph_default = gpu_batch_defaults(total_gpu_bytes)
        chunk_default = host_bound_prefill_chunk(chunk_default, params, num_layers)
        mrr_default = min(default_max_running_requests(pool_tokens), graph_default)  # every batch has a graph
        if speculative:
            mrr_default = min(mrr_default, SPECULATIVE_MAX_RUNNING_REQUESTS)
    else:
        chunk_default, graph_default, mrr_default = CPU_CHUNKED_PREFILL_SIZE, 0, CPU_MAX_RUNNING_REQUESTS
    if max_running_requests is None:
        max_running_requests = mrr_default
        chosen.append("max_running_requests")
    if chunked_prefill_size is None:
        chunked_prefill_size = chunk_default
        chosen.append("chunked_prefill_size")
    if cuda_graph_max_bs is None:
        cuda_graph_max_bs = graph_default
        chosen.append("cuda_graph_max_bs")
    cuda_graph_max_bs = min(cuda_graph_max_bs, max_running_requests) if device_type == "cuda" else 0
    return ServingLimits(int(pool_tokens), int(max_running_requests), int(chunked_prefill_size),
                         int(cuda_graph_max_bs), tuple(chosen))
