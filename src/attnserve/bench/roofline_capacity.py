"""The decode floor of a workload when the KV pool cannot hold every request at once.

`roofline.workload_roofline` (issue 33's rule) lets every request decode from step 0, so its
floor assumes a KV pool that holds the whole workload. A model whose weights leave little
memory cannot run that way: on an 80 GB H100, Qwen3-30B-A3B's 61 GB of bf16 weights leave
~112k KV tokens, so 256 requests of up to 2,048 tokens decode ~75 at a time, each step reads
the experts for fewer tokens, and no engine reaches the rule's floor (share 0.46; 0.84 of this
floor, `benchmarks/NOTES.md`). This **capacity floor** (a diagnostic beside the rule, like the serial
floor) runs the same per-step cost (`roofline.StepRates`) over the batches an ideal scheduler
with that pool could run: requests are admitted first come, first served while their whole
footprint (prompt + every output token) fits ``max_total_tokens`` and fewer than
``max_running_requests`` run; a finished request frees its tokens for the next. (A scheduler
that admits on current rather than final lengths packs more requests but then retracts some;
reserving the final length is SGLang's conservative bound with ``new_token_ratio`` 1.)

Where the pool holds the workload (and the request cap does not bind) it equals the rule's
decode floor. The prefill part is unchanged: the same prompts are prefilled, in other groups.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import numpy as np

from attnserve.bench.roofline import RooflineModel, StepRates, lengths_arrays


def capacity_decode_s(model: RooflineModel, input_lens: Sequence[int], output_lens: Sequence[int],
                      copy_bytes_per_s: float, matmul_flops_per_s: float, max_total_tokens: int,
                      max_running_requests: Optional[int] = None,
                      fp8_matmul_flops_per_s: Optional[float] = None) -> Tuple[float, int]:
    """``(seconds, decode steps)`` of the capacity floor's decode (module docstring).

    Args:
        model / input_lens / output_lens / rates: as `roofline.workload_roofline`.
        max_total_tokens: the KV pool's token capacity (> 0).
        max_running_requests: most requests decoding at once (None: no cap).

    Raises:
        ValueError: mismatched lengths, non-positive rates or capacity. A request larger than
            the whole pool runs alone (an engine would refuse it; the floor stays finite).
    """
    if max_total_tokens <= 0:
        raise ValueError(f"max_total_tokens must be > 0, got {max_total_tokens}")
    isl, osl = lengths_arrays(input_lens, output_lens)
    rates = StepRates.of(model, copy_bytes_per_s, matmul_flops_per_s, fp8_matmul_flops_per_s)
    cap = max_running_requests if max_running_requests else len(isl)
    footprint = isl + osl
    ctx = np.zeros(0)
    left = np.zeros(0, dtype=np.int64)
    size = np.zeros(0)
    nxt, used, total, steps = 0, 0.0, 0.0, 0
    while nxt < len(isl) or left.size:
        admit = []
        while (nxt < len(isl) and left.size + len(admit) < cap
               and (used + footprint[nxt] <= max_total_tokens or (not left.size and not admit))):
            admit.append(nxt)
            used += footprint[nxt]
            nxt += 1
        if admit:
            ctx = np.concatenate([ctx, isl[admit]])
            left = np.concatenate([left, osl[admit]])
            size = np.concatenate([size, footprint[admit]])
        total += rates.step(int(left.size), model.effective_ctx(ctx))[0]
        steps += 1
        ctx += 1.0
        left -= 1
        done = left <= 0
        if done.any():
            used -= float(size[done].sum())
            ctx, left, size = ctx[~done], left[~done], size[~done]
    return total, steps
