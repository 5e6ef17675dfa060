"""`FusedMoE`: the routed experts of one mixture-of-experts layer, stored fused.

All ``E`` experts' weights live in two 3-D parameters (the SGLang/vLLM layout):
``w13_weight`` ``[E, 2*I_local, H]`` (gate rows, then up rows) and ``w2_weight``
``[E, H, I_local]``. Under tensor parallelism each rank holds rows
``[rank*I_local, (rank+1)*I_local)`` of every expert's gate and up projections and the
same columns of its down projection, so a rank's output is a partial sum and one
all-reduce completes it (Megatron-LM's MLP split, arXiv:1909.08053, section 3, applied to
every expert). Both parameters carry a `ShardSpec` (``tp_shard``): `load_param` with a full
(tp 1) ``[E, 2I, H]`` / ``[E, H, I]`` tensor, and so `init_dummy_weights`, give every tp
size the same model.

FP8 experts (issue 37): built inside `quantization.quantized_construction`, the two weights
are ``meta`` placeholders (``quant_pending``) until `quantization.apply` gives the layer an
`Fp8MoEMethod` (``quant_method``): e4m3 weights with per-channel or 128 x 128 block scales,
loaded by `load_expert_weight` (weights and their ``weight_scale`` / ``weight_scale_inv``)
and computed W8A16 by both backends.
"""

from __future__ import annotations

import os
from typing import List, Optional, Set, Tuple

import torch
from torch import nn

from attnserve.distributed.group import TPGroup
from attnserve.distributed.partition import HeadRange
from attnserve.models.layers.moe.native import fused_experts_native
from attnserve.models.layers.parallel import ShardSpec, head_shard_spec

#: the checkpoint pieces of one expert: gate (HF ``gate_proj``/Mixtral ``w1``), up
#: (``up_proj``/``w3``), down (``down_proj``/``w2``)
SHARD_IDS = ("w1", "w3", "w2")
MOE_BACKENDS = ("auto", "native", "triton")


def moe_backend_from_env() -> str:
    """``ATTNSERVE_MOE_BACKEND`` (``native`` | ``triton``; unset or empty = ``auto``: Triton
    on CUDA tensors, native otherwise).

    Raises:
        ValueError: any other value.
    """
    value = os.environ.get("ATTNSERVE_MOE_BACKEND", "").strip().lower() or "auto"
    if value not in MOE_BACKENDS:
        raise ValueError(f"ATTNSERVE_MOE_BACKEND={value!r}: expected one of native, triton (or unset)")
    return value


class FusedMoE(nn.Module):
    """Routed experts with SwiGLU MLPs, computed by `fused_experts_triton` or
    `fused_experts_native`.

    Args:
        num_experts: ``E`` (all experts on every rank).
        hidden_size: ``H``.
        intermediate_size: each expert's full intermediate size ``I`` (HF
            ``moe_intermediate_size``; Mixtral ``intermediate_size``).
        dtype: parameter dtype.
        tp: this rank's group (default: one device); ``I_local = I / tp.size``.
        reduce_results: all-reduce the output over ``tp`` (off when the caller adds other
            partial sums first, e.g. DeepSeek's shared experts).

    Shapes: ``hidden_states`` ``[T, H]``, float32 ``topk_weights`` and int32 ``topk_ids``
    ``[T, top_k]`` (`routing.select_experts`) -> ``[T, H]`` in ``hidden_states``' dtype.

    The backend is read from ``ATTNSERVE_MOE_BACKEND`` at construction (`moe_backend_from_env`).

    Raises:
        ValueError: ``tp.size`` does not divide ``intermediate_size`` (names ``--tp-size``),
            non-positive sizes, or a bad ``ATTNSERVE_MOE_BACKEND``.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 dtype: Optional[torch.dtype] = None, tp: Optional[TPGroup] = None, reduce_results: bool = True):
        super().__init__()
        if min(num_experts, hidden_size, intermediate_size) < 1:
            raise ValueError(f"FusedMoE sizes must be >= 1, got num_experts={num_experts}, "
                             f"hidden_size={hidden_size}, intermediate_size={intermediate_size}")
        self.tp = tp or TPGroup.single()
        if intermediate_size % self.tp.size:
            raise ValueError(f"--tp-size {self.tp.size} does not divide the experts' intermediate size "
                             f"{intermediate_size} (moe_intermediate_size); use a tp size that divides it")
        local = intermediate_size // self.tp.size
        rows = (HeadRange(self.tp.rank * local, local, intermediate_size), 1)
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.intermediate_size, self.intermediate_size_per_partition = intermediate_size, local
        self.reduce_results = reduce_results
        self.backend = moe_backend_from_env()
        from attnserve.models.layers.quantization.context import deferring_linear_weights

        self.quant_pending = deferring_linear_weights()  # FP8: weights come from `quantization.apply`
        self.quant_method = None
        wdev = "meta" if self.quant_pending else None
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * local, hidden_size, dtype=dtype, device=wdev),
                                       requires_grad=False)
        self.w13_weight.tp_shard = head_shard_spec(1, [rows, rows])  # two parts: gate | up
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, local, dtype=dtype, device=wdev),
                                      requires_grad=False)
        self.w2_weight.tp_shard = head_shard_spec(2, [rows])
        self._loaded: Set[Tuple[int, str]] = set()

    @torch.no_grad()
    def load_expert_weight(self, shard_id: str, expert_id: int, tensor: torch.Tensor, name: str,
                           kind: str = "weight") -> None:
        """Copy this rank's slice of one expert's full HF tensor (cast to the parameter's
        dtype and device; FP8 experts: quantised, or copied with their scales, by
        ``quant_method``).

        Args:
            shard_id: ``"w1"`` (gate ``[I, H]``), ``"w3"`` (up ``[I, H]``) or ``"w2"``
                (down ``[H, I]``).
            expert_id: in ``[0, E)``.
            tensor: the full (tp 1) 2-D tensor.
            name: checkpoint name (for errors).
            kind: ``"weight"``, or for FP8 experts ``"weight_scale"``,
                ``"weight_scale_inv"`` or ``"input_scale"`` (the checkpoint suffix).

        Raises:
            ValueError: an unknown ``shard_id``, an ``expert_id`` outside ``[0, E)``, a
                shape other than the full one, a scale or FP8 tensor for bf16 experts, or a
                scale that does not fit (`Fp8MoEMethod.load`); each message names ``name``.
        """
        if shard_id not in SHARD_IDS:
            raise ValueError(f"checkpoint tensor {name!r}: unknown expert shard {shard_id!r} (expected w1, w3, w2)")
        if isinstance(expert_id, bool) or not isinstance(expert_id, int) or not 0 <= expert_id < self.num_experts:
            raise ValueError(f"checkpoint tensor {name!r}: expert id {expert_id!r} is outside [0, {self.num_experts})")
        full_i, h = self.intermediate_size, self.hidden_size
        expected = (h, full_i) if shard_id == "w2" else (full_i, h)
        if kind == "weight" and tuple(tensor.shape) != expected:
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {expected} "
                             f"(expert {expert_id}, {shard_id})")
        if self.quant_method is not None:
            self.quant_method.load(self, shard_id, expert_id, tensor, name, kind)
            if kind == "weight":
                self._loaded.add((expert_id, shard_id))
            return
        if kind != "weight" or tensor.dtype == torch.float8_e4m3fn:
            raise ValueError(f"checkpoint tensor {name!r}: an FP8 {kind} for experts that are not FP8 (no "
                             "quantization_config for them, or they are in its ignored layers)")
        if shard_id == "w2":
            spec: ShardSpec = self.w2_weight.tp_shard
            piece, dst, dim = spec.pieces[0], self.w2_weight[expert_id], 1
        else:
            spec = self.w13_weight.tp_shard
            piece, dst, dim = spec.pieces[0 if shard_id == "w1" else 1], self.w13_weight[expert_id], 0
        src = tensor.narrow(dim, piece.src_offset, piece.length)
        dst.narrow(dim, piece.local_offset, piece.length).copy_(src.to(device=dst.device, dtype=dst.dtype))
        self._loaded.add((expert_id, shard_id))

    def missing_expert_weights(self) -> List[Tuple[int, str]]:
        """``(expert_id, shard_id)`` of every expert tensor `load_expert_weight` never
        received, in expert then ``w1, w3, w2`` order (empty when all were loaded)."""
        return [(e, s) for e in range(self.num_experts) for s in SHARD_IDS if (e, s) not in self._loaded]

    def missing_expert_scales(self) -> List[Tuple[int, str]]:
        """``(expert_id, shard_id)`` of FP8 checkpoint scales never received (empty for
        bf16 experts and for experts quantised at load)."""
        return [] if self.quant_method is None else self.quant_method.missing_scales(self)

    def _use_triton(self, hidden_states: torch.Tensor) -> bool:
        if self.backend == "auto":
            return hidden_states.is_cuda
        return self.backend == "triton"

    def forward(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        scales = {} if self.quant_method is None else self.quant_method.kernel_args(self)
        if self._use_triton(hidden_states):
            from attnserve.models.layers.moe.fused_moe_triton import fused_experts_triton

            out = fused_experts_triton(hidden_states, self.w13_weight, self.w2_weight, topk_weights, topk_ids,
                                       **scales)
        else:
            out = fused_experts_native(hidden_states, self.w13_weight, self.w2_weight, topk_weights, topk_ids,
                                       **scales)
        if self.reduce_results and self.tp.size > 1:
            out = self.tp.all_reduce(out)
        return out

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size} "
                f"(local {self.intermediate_size_per_partition}), backend={self.backend}, "
                f"reduce_results={self.reduce_results}"
                + ("" if self.quant_method is None else f", fp8={self.quant_method.scale_kind}"))
