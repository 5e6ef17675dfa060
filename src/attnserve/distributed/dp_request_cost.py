"""What one request costs a data-parallel replica, from what the host knows before it runs.

The load balancer (`attnserve.distributed.dp_balancer`) balances the *work* in flight on
each replica, not the number of requests: on ``bench.offline``'s random workload (1,024
requests, prompt and output lengths uniform in [100, 1024]) four replicas that take 256
requests each in turn differ by 3 % (Llama-3-8B) to 5 % (Qwen3-0.6B) in the floor of their
share, and the slowest replica sets the wall time.

`RequestCost` is the request's own share of `attnserve.bench.roofline`'s floor, in seconds,
from its prompt length ``i`` and its ``max_new_tokens`` ``o`` (an upper bound of the output):

* prefill, compute-bound: ``(2 P i + 2 L Hq D i^2) / F`` (linears and causal attention);
* decode, memory-bound: the request's KV is read once per decode step it runs, at contexts
  ``i, i + 1, ..., i + o - 1``: ``kv_bytes_per_token * (i o + o (o - 1) / 2) / BW``.

The weights a decode step reads are shared by the batch and do not depend on which replica
a request goes to (every replica runs about as many steps as its longest request), so they
are left out, and so are the decode linears' FLOPs: a decode step costs the larger of its
bytes and its FLOPs, and with thousands of context tokens per request the bytes win. Only
the ratios of costs matter to the balancer, so nominal H100 rates are the defaults.
Without model facts, `RequestCost.tokens` counts prompt plus output tokens.

``max_new_tokens`` is counted up to ``output_cap`` (4,096 by default): a request without
``max_tokens`` gets the rest of the context as its limit (`attnserve.server.openai_api`),
tens of thousands of tokens it seldom generates, and would otherwise weigh as hundreds of
ordinary requests (the decode term grows with the square of the output).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

#: nominal H100 SXM rates for the cost ratios (device-to-device copy bytes/s; dense bf16 FLOP/s)
NOMINAL_COPY_BYTES_PER_S = 3.0e12
NOMINAL_MATMUL_FLOPS_PER_S = 7.0e14


@dataclass(frozen=True)
class RequestCost:
    """A request's cost ``c(i, o)`` (module doc), linear in its coefficients.

    Attributes:
        prefill_per_token: cost per prompt token (``2 P / F`` seconds).
        prefill_per_token_sq: cost per squared prompt token (``2 L Hq D / F`` seconds).
        decode_per_token: cost per output token, whatever its context (0 from the roofline).
        kv_read_per_token: cost of reading one context token's KV once (``kv_bytes / BW`` s).
        output_cap: most output tokens counted (module doc).
    """

    prefill_per_token: float = 1.0
    prefill_per_token_sq: float = 0.0
    decode_per_token: float = 1.0
    kv_read_per_token: float = 0.0
    output_cap: int = 4096

    def __call__(self, prompt_tokens: int, max_new_tokens: int) -> float:
        """The cost of a request of ``prompt_tokens`` prompt tokens and at most
        ``max_new_tokens`` output tokens (both >= 0; same unit as the coefficients; the
        output counted up to ``output_cap``)."""
        i, o = float(max(prompt_tokens, 0)), float(min(max(max_new_tokens, 0), self.output_cap))
        return (self.prefill_per_token * i + self.prefill_per_token_sq * i * i + self.decode_per_token * o
                + self.kv_read_per_token * (i * o + o * (o - 1.0) / 2.0))

    @classmethod
    def tokens(cls) -> "RequestCost":
        """Prompt tokens plus output tokens (no model facts)."""
        return cls()

    @classmethod
    def from_roofline_facts(cls, facts: Optional[Mapping[str, Any]],
                            copy_bytes_per_s: float = NOMINAL_COPY_BYTES_PER_S,
                            matmul_flops_per_s: float = NOMINAL_MATMUL_FLOPS_PER_S) -> "RequestCost":
        """Seconds of floor per request (module doc) from `RooflineModel` fields (a replica's
        ``info["roofline_model"]``, `attnserve.engine.model_facts.roofline_facts`); FP8
        linears counted at the bf16 rate (ratios only). `tokens` when ``facts`` is None.

        Raises:
            ValueError: non-positive rates.
        """
        if copy_bytes_per_s <= 0 or matmul_flops_per_s <= 0:
            raise ValueError("the copy and matmul rates must be > 0")
        if not facts:
            return cls.tokens()
        active = int(facts["params"]) + (int(facts.get("moe_layers", 0)) * int(facts.get("top_k", 0))
                                         * int(facts.get("expert_params", 0)))
        attn = int(facts["num_layers"]) * int(facts["num_q_heads"]) * int(facts["head_dim"])
        return cls(prefill_per_token=2.0 * active / matmul_flops_per_s,
                   prefill_per_token_sq=2.0 * attn / matmul_flops_per_s, decode_per_token=0.0,
                   kv_read_per_token=int(facts["kv_bytes_per_token"]) / copy_bytes_per_s)
