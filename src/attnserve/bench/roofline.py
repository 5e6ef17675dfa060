"""The physical floor ("roofline") of an offline workload, and the facts it needs.

``roofline_s`` is the least time any engine could take for a workload of prompts with
input lengths ``isl_r`` and output lengths ``osl_r`` on a device that copies ``BW``
bytes/s (device-to-device copy rate, bytes read + written) and multiplies at ``F``
FLOP/s (bf16 8192^3 matmul), both measured in the same run (FP8 weights: their share of
the linears' FLOPs at ``F8``, the e4m3 8192^3 ``torch._scaled_mm`` rate of the same run):

* **Prefill**: ``sum_r (2 P isl_r + 2 L Hq D isl_r^2) / F`` (the linears' FLOPs, and causal
  attention's ``QK^T`` and ``PV``: ``2 Hq D isl^2 / 2`` FLOPs each per layer).
* **Decode**: every request decodes from step 0, one step for each output token of the
  longest request (``max_r osl_r`` steps). Step ``s`` runs the ``n_s`` requests with
  ``osl_r > s`` at context ``ctx_r = isl_r + s`` and costs
  ``max((W + sum ctx_r * kv_bytes_per_token) / BW, (2 P n_s + 4 L Hq D sum ctx_r) / F)``:
  the weights and every running request's KV read once, or the matmul work, whichever
  is longer.

**Serial floor** (``roofline_serial_s``; a diagnostic beside the rule, not part of it): the
same steps with the attention and the linears each at its own bound, one after the other, as
kernels that run in sequence are: ``max(sum ctx_r * kv_bytes_per_token / BW, 4 L Hq D sum ctx_r / F)
+ max(W / BW, 2 P n_s / F)``. It equals the floor's decode while the linears are memory-bound
(``2 P n_s / F <= W / BW``: below ~200-250 running requests of a dense model on an H100) and
exceeds it once a larger batch makes them compute-bound, where the rule assumes the attention's
memory time hides the linears' compute time (e.g. 486 running Llama-3-8B requests on an H200).

``P`` and ``W`` are the model's parameters and weight bytes (as stored: 1 byte per FP8
weight, plus its float32 scales, which count as bytes but not as parameters) without an untied input
embedding (a lookup reads a few rows, not the matrix; a tied embedding is counted once, as
the LM head). ``L``, ``Hq`` and ``D`` are the layers, query heads and query/key head size;
``kv_bytes_per_token`` is the KV cache's bytes per token over all layers in its storage
dtype (half for FP8). The rule is the one issue 33 fixes for ``bench.offline``; it is a
floor, not a prediction: real kernels reach 80-95% of these rates.

**Mixture of experts** (issue 34): ``P`` and ``W`` hold the dense part only; each of the
``L_moe`` MoE layers adds, per token, ``top_k`` experts of ``p_e`` parameters to the FLOPs
(``P_active = P + L_moe * top_k * p_e``), and a decode step of ``n`` tokens reads the
*distinct* experts its tokens chose: ``L_moe * D(n) * b_e`` bytes, with
``D(n) = E * (1 - (1 - top_k / E) ** n)`` the expected number of distinct experts when every
token picks ``top_k`` of ``E`` uniformly (the routing of random weights; a trained router
is less uniform, so fewer distinct experts and a lower floor).

**Sliding windows**: ``L_w`` of the ``L`` layers may attend to the last ``w`` tokens only
(Gemma 2 / 3, gpt-oss, Mistral with a window). Such a layer reads ``min(ctx_r, w)`` tokens of
KV in a decode step and does ``min(ctx, w)`` key products a query, so each request counts
``((L - L_w) ctx_r + L_w min(ctx_r, w)) / L`` tokens of context in the terms above
(`RooflineModel.effective_ctx`), and its prefill ``((L - L_w) isl^2 + L_w pairs_w(isl)) / L``
in place of ``isl^2``, with ``pairs_w(isl) = isl^2`` up to ``w`` and ``2 w isl - w^2`` past it
(twice the causal key products inside the window). A pool that keeps every layer's KV whole
still reads only the window; the floor counts what must be read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np


@dataclass(frozen=True)
class RooflineModel:
    """What the floor needs to know of a model.

    Attributes:
        params: ``P``, parameters without an untied input embedding.
        weight_bytes: ``W``, their bytes as stored.
        num_layers / num_q_heads / head_dim: ``L``, ``Hq``, ``D`` (query/key head size).
        kv_bytes_per_token: KV cache bytes of one token over all layers.
        moe_layers / num_experts / top_k: ``L_moe``, ``E``, ``top_k`` (0: a dense model).
        expert_params / expert_bytes: ``p_e`` and ``b_e``, one expert of one layer.
        fp8_params: the part of ``params`` stored as FP8 (``--quantization fp8`` or an FP8
            checkpoint): their FLOPs run at the FP8 matmul rate where one is given
            (`workload_roofline`'s ``fp8_matmul_flops_per_s``).
        sliding_layers / sliding_window: ``L_w`` layers that see the last ``w`` tokens (HF
            ``sliding_window``: the query and the ``w - 1`` before it); 0: none.
    """

    params: int
    weight_bytes: int
    num_layers: int
    num_q_heads: int
    head_dim: int
    kv_bytes_per_token: int
    moe_layers: int = 0
    num_experts: int = 0
    top_k: int = 0
    expert_params: int = 0
    expert_bytes: int = 0
    fp8_params: int = 0
    sliding_layers: int = 0
    sliding_window: int = 0

    def effective_ctx(self, ctx) -> float:
        """Context tokens a decode step reads and multiplies by, summed over requests of
        contexts ``ctx`` (array), with the windowed layers' share clipped (module docstring)."""
        ctx = np.asarray(ctx, dtype=np.float64)
        if not self.sliding_layers or not self.sliding_window:
            return float(ctx.sum())
        full = self.num_layers - self.sliding_layers
        return float((full * ctx.sum() + self.sliding_layers * np.minimum(ctx, self.sliding_window).sum())
                     / self.num_layers)

    def prefill_pairs(self, isl) -> np.ndarray:
        """Per prompt, ``isl^2`` with the windowed layers' share clipped (module docstring):
        twice the causal (query, key) products of an average layer."""
        isl = np.asarray(isl, dtype=np.float64)
        if not self.sliding_layers or not self.sliding_window:
            return isl * isl
        w = float(self.sliding_window)
        windowed = np.where(isl <= w, isl * isl, 2.0 * w * isl - w * w)
        full = self.num_layers - self.sliding_layers
        return (full * isl * isl + self.sliding_layers * windowed) / self.num_layers

    @property
    def active_params(self) -> int:
        """Parameters one token multiplies by: the dense part plus ``top_k`` experts a layer."""
        return self.params + self.moe_layers * self.top_k * self.expert_params

    def distinct_experts(self, n: int) -> float:
        """Expected distinct experts one MoE layer reads for ``n`` tokens (uniform routing)."""
        if not self.moe_layers or n <= 0:
            return 0.0
        return self.num_experts * (1.0 - (1.0 - self.top_k / self.num_experts) ** n)

    def step_weight_bytes(self, n: int) -> float:
        """Weight bytes a decode step of ``n`` tokens reads: dense part plus distinct experts."""
        return self.weight_bytes + self.moe_layers * self.distinct_experts(n) * self.expert_bytes

    @classmethod
    def from_runner(cls, runner) -> "RooflineModel":
        """From a `ModelRunner` on one device (`attnserve.engine.model_facts.roofline_facts`:
        its model's parameters, each storage once, the input embedding left out unless it is
        also the LM head, routed experts counted per expert, and the KV pool dtype)."""
        from attnserve.engine.model_facts import roofline_facts

        return cls(**roofline_facts(runner))


@dataclass(frozen=True)
class Roofline:
    """The floor of one workload, in seconds: ``prefill_s + decode_s = roofline_s``;
    ``decode_serial_s``: the decode steps' serial floor (module docstring), ``>= decode_s``."""

    prefill_s: float
    decode_s: float
    decode_steps: int
    decode_serial_s: float = 0.0

    @property
    def roofline_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def roofline_serial_s(self) -> float:
        return self.prefill_s + self.decode_serial_s


def workload_roofline(model: RooflineModel, input_lens: Sequence[int], output_lens: Sequence[int],
                      copy_bytes_per_s: float, matmul_flops_per_s: float,
                      fp8_matmul_flops_per_s: Optional[float] = None) -> Roofline:
    """The floor of a workload (module docstring).

    Args:
        model: `RooflineModel`.
        input_lens / output_lens: per request, prompt and generated tokens (same length).
        copy_bytes_per_s: ``BW``, device-to-device copy rate in bytes/s.
        matmul_flops_per_s: ``F``, bf16 matmul rate in FLOP/s.
        fp8_matmul_flops_per_s: ``F8``, the FP8 (e4m3) matmul rate in FLOP/s measured in the
            same run: the ``model.fp8_params`` part of the linear FLOPs is divided by it
            instead of ``F`` (None: every FLOP at ``F``, which an FP8 model can beat).

    Raises:
        ValueError: mismatched lengths or non-positive rates.
    """
    isl, osl = lengths_arrays(input_lens, output_lens)
    rates = StepRates.of(model, copy_bytes_per_s, matmul_flops_per_s, fp8_matmul_flops_per_s)
    prefill = float(np.sum(rates.linear_s * isl + 2.0 * rates.attn * model.prefill_pairs(isl) / matmul_flops_per_s))
    steps = int(osl.max()) if osl.size else 0
    decode = serial = 0.0
    for s in range(steps):
        running = osl > s
        step, step_serial = rates.step(int(running.sum()), model.effective_ctx(isl[running] + s))
        decode += step
        serial += step_serial
    return Roofline(prefill_s=prefill, decode_s=decode, decode_steps=steps, decode_serial_s=serial)


def lengths_arrays(input_lens: Sequence[int], output_lens: Sequence[int]):
    """``(isl float64, osl int64)`` arrays of a workload; ValueError on mismatched lengths."""
    isl = np.asarray(input_lens, dtype=np.float64)
    osl = np.asarray(output_lens, dtype=np.int64)
    if isl.shape != osl.shape:
        raise ValueError(f"{isl.size} input lengths but {osl.size} output lengths")
    return isl, osl


@dataclass(frozen=True)
class StepRates:
    """A model's decode-step cost at the measured rates (module docstring).

    Attributes:
        model: the `RooflineModel`; copy / flops: ``BW`` and ``F``.
        linear_s: seconds of linear FLOPs per token (FP8 parameters at ``F8`` where known).
        attn: ``L * Hq * D``.
    """

    model: RooflineModel
    copy: float
    flops: float
    linear_s: float
    attn: int

    @classmethod
    def of(cls, model: RooflineModel, copy_bytes_per_s: float, matmul_flops_per_s: float,
           fp8_matmul_flops_per_s: Optional[float] = None) -> "StepRates":
        """Raises ValueError on non-positive rates."""
        if copy_bytes_per_s <= 0 or matmul_flops_per_s <= 0:
            raise ValueError("the copy and matmul rates must be > 0")
        fp8 = model.fp8_params if fp8_matmul_flops_per_s else 0
        linear_s = 2.0 * ((model.active_params - fp8) / matmul_flops_per_s
                          + (fp8 / fp8_matmul_flops_per_s if fp8 else 0.0))
        return cls(model, copy_bytes_per_s, matmul_flops_per_s, linear_s,
                   model.num_layers * model.num_q_heads * model.head_dim)

    def step(self, n: int, ctx: float):
        """``(floor, serial floor)`` seconds of a decode step of ``n`` requests holding
        ``ctx`` tokens of context in all (`RooflineModel.effective_ctx` where layers slide)."""
        weights_mem = self.model.step_weight_bytes(n) / self.copy
        kv_mem = ctx * self.model.kv_bytes_per_token / self.copy
        linear_flops, attn_flops = self.linear_s * n, 4.0 * self.attn * ctx / self.flops
        return (max(weights_mem + kv_mem, linear_flops + attn_flops),
                max(kv_mem, attn_flops) + max(weights_mem, linear_flops))


def random_lengths(num_prompts: int, input_len: int, output_len: int, range_ratio: float, seed: int):
    """SGLang's random dataset lengths: input lengths uniform in ``[R * input_len, input_len]``
    and output lengths in ``[R * output_len, output_len]`` (integers, both ends included, at
    least 1), from a seeded generator.

    Returns:
        ``(input_lens, output_lens)``: int lists of ``num_prompts``.

    Raises:
        ValueError: ``range_ratio`` outside ``[0, 1]`` or non-positive lengths.
    """
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1], got {range_ratio}")
    if input_len < 1 or output_len < 1 or num_prompts < 1:
        raise ValueError("--random-input-len, --random-output-len and --num-prompts must be >= 1")
    rng = np.random.default_rng(seed)
    lo_in, lo_out = max(1, int(range_ratio * input_len)), max(1, int(range_ratio * output_len))
    isl = rng.integers(lo_in, input_len + 1, size=num_prompts)
    osl = rng.integers(lo_out, output_len + 1, size=num_prompts)
    return isl.tolist(), osl.tolist()
