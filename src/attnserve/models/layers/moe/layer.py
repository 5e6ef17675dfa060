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

gpt-oss experts (``has_bias=True, activation="swigluoai"``; HF ``GptOssExperts``, model
card arXiv:2508.10925): ``w13_bias`` ``[E, 2*I_local]`` (this rank's gate biases, then its
up biases: cut exactly like ``w13_weight``'s rows, ``tp_shard`` on dim 1) and ``w2_bias``
``[E, H]`` (whole on every rank). A rank's down projection is a partial sum over its slice
of ``I``, so ``b_d`` must be added once across the ranks: rank 0 adds it, the others hold it
but pass no down bias to the kernels (scaling it by ``1 / tp`` on every rank would work too
but rounds differently). Loaded per expert by `load_expert_bias`, or as full (tp 1)
``[E, 2I]`` (gate columns then up columns) / ``[E, H]`` tensors by `load_expert_biases` or
`load_param` (and so `init_dummy_weights`); both compute paths add them in float32.
"""

from __future__ import annotations

import functools
import os
from typing import List, Optional, Set, Tuple

import torch
from torch import nn

from attnserve.distributed.group import TPGroup
from attnserve.distributed.partition import HeadRange
from attnserve.models.layers.moe.native import SWIGLU_ALPHA, SWIGLU_LIMIT, check_activation, fused_experts_native
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
    """Routed experts with SwiGLU MLPs (or gpt-oss's biased, clamped ones), computed by
    `fused_experts_triton` or `fused_experts_native`.

    Args:
        num_experts: ``E`` (all experts on every rank).
        hidden_size: ``H``.
        intermediate_size: each expert's full intermediate size ``I`` (HF
            ``moe_intermediate_size``; Mixtral ``intermediate_size``).
        dtype: parameter dtype.
        tp: this rank's group (default: one device); ``I_local = I / tp.size``.
        reduce_results: all-reduce the output over ``tp`` (off when the caller adds other
            partial sums first, e.g. DeepSeek's shared experts).
        has_bias: per-expert biases ``w13_bias`` ``[E, 2*I_local]`` and ``w2_bias``
            ``[E, H]`` in ``dtype`` (gpt-oss; see the module doc for tensor parallelism).
        activation: ``"silu"`` (SwiGLU) or ``"swigluoai"`` (gpt-oss:
            ``(clamp(u, -limit, limit) + 1) * g' sigmoid(alpha g')``, ``g' = min(g, limit)``,
            ``native.swiglu_oai``).
        swiglu_alpha, swiglu_limit: ``swigluoai``'s ``alpha`` and ``limit`` (HF config
            ``swiglu_alpha`` 1.702, ``swiglu_limit`` 7.0); ignored for ``silu``.

    Shapes: ``hidden_states`` ``[T, H]``, float32 ``topk_weights`` and int32 ``topk_ids``
    ``[T, top_k]`` (`routing.select_experts`) -> ``[T, H]`` in ``hidden_states``' dtype.

    The backend is read from ``ATTNSERVE_MOE_BACKEND`` at construction (`moe_backend_from_env`).

    Raises:
        ValueError: ``tp.size`` does not divide ``intermediate_size`` (names ``--tp-size``),
            non-positive sizes, a bad ``ATTNSERVE_MOE_BACKEND``, or an unknown activation
            (names the valid ones).
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 dtype: Optional[torch.dtype] = None, tp: Optional[TPGroup] = None, reduce_results: bool = True,
                 has_bias: bool = False, activation: str = "silu", swiglu_alpha: float = SWIGLU_ALPHA,
                 swiglu_limit: float = SWIGLU_LIMIT):
        super().__init__()
        check_activation(activation, swiglu_alpha, swiglu_limit)
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
        self.activation, self.swiglu_alpha, self.swiglu_limit = activation, float(swiglu_alpha), float(swiglu_limit)
        self.has_bias = bool(has_bias)
        if self.has_bias:  # model dtype, never FP8: real tensors even while the weights are pending
            self.w13_bias = nn.Parameter(torch.empty(num_experts, 2 * local, dtype=dtype), requires_grad=False)
            self.w13_bias.tp_shard = head_shard_spec(1, [rows, rows])  # gate | up, as w13_weight's rows
            self.w2_bias = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype), requires_grad=False)
            for which in ("w13", "w2"):  # `load_param` of a full [E, 2I] / [E, H] bias: expert by expert
                getattr(self, f"{which}_bias").weight_loader = functools.partial(self._load_full_bias, which)
        else:
            self.w13_bias = self.w2_bias = None
        self._loaded_bias: Set[Tuple[int, str]] = set()

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

    @torch.no_grad()
    def load_expert_bias(self, shard_id: str, expert_id: int, tensor: torch.Tensor, name: str) -> None:
        """Copy this rank's slice of one expert's full (tp 1) bias (cast to the parameter's
        dtype and device).

        Args:
            shard_id: ``"w1"`` (gate bias ``[I]``), ``"w3"`` (up bias ``[I]``) or ``"w2"``
                (down bias ``[H]``; every rank keeps all of it, rank 0 adds it).
            expert_id: in ``[0, E)``.
            tensor: the full 1-D bias (gpt-oss: a row of ``gate_up_proj_bias``, de-interleaved
                -- gate at even columns, up at odd -- or of ``down_proj_bias``).
            name: checkpoint name (for errors).

        Raises:
            ValueError: a layer built without ``has_bias``, an unknown ``shard_id``, an
                ``expert_id`` outside ``[0, E)`` or a shape other than the full one; each
                message names ``name``.
        """
        if not self.has_bias:
            raise ValueError(f"checkpoint tensor {name!r}: an expert bias for experts built without has_bias")
        if shard_id not in SHARD_IDS:
            raise ValueError(f"checkpoint tensor {name!r}: unknown expert shard {shard_id!r} (expected w1, w3, w2)")
        if isinstance(expert_id, bool) or not isinstance(expert_id, int) or not 0 <= expert_id < self.num_experts:
            raise ValueError(f"checkpoint tensor {name!r}: expert id {expert_id!r} is outside [0, {self.num_experts})")
        expected = (self.hidden_size,) if shard_id == "w2" else (self.intermediate_size,)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {expected} "
                             f"(bias of expert {expert_id}, {shard_id})")
        if shard_id == "w2":
            dst, src = self.w2_bias[expert_id], tensor
        else:
            piece = self.w13_bias.tp_shard.pieces[0 if shard_id == "w1" else 1]
            dst = self.w13_bias[expert_id].narrow(0, piece.local_offset, piece.length)
            src = tensor.narrow(0, piece.src_offset, piece.length)
        dst.copy_(src.to(device=dst.device, dtype=dst.dtype))
        self._loaded_bias.add((expert_id, shard_id))

    def load_expert_biases(self, which: str, tensor: torch.Tensor, name: str) -> None:
        """Every expert's bias from one full (tp 1) tensor (`load_expert_bias` per expert).

        Args:
            which: ``"w13"``: ``[E, 2I]``, gate biases in columns ``[0, I)`` and up biases in
                ``[I, 2I)`` (our layout: HF gpt-oss's ``gate_up_proj_bias`` interleaves them,
                gate at even columns, so de-interleave first); ``"w2"``: ``[E, H]`` (HF
                ``down_proj_bias``).
            tensor, name: the tensor and its checkpoint name (for errors).

        Raises:
            ValueError: an unknown ``which``, a shape other than the full one, or a layer
                built without ``has_bias``.
        """
        self._load_full_bias(which, None, tensor, name)

    def _load_full_bias(self, which: str, param: Optional[torch.Tensor], tensor: torch.Tensor, name: str,
                        part: Optional[int] = None) -> None:
        """`load_expert_biases`; also the ``weight_loader`` of the bias parameters, so that
        `load_param` (and `init_dummy_weights`) of a whole bias lands here."""
        if which not in ("w13", "w2"):
            raise ValueError(f"checkpoint tensor {name!r}: unknown expert bias {which!r} (expected w13, w2)")
        full_i = self.intermediate_size
        want = (self.num_experts, 2 * full_i) if which == "w13" else (self.num_experts, self.hidden_size)
        if part is not None or tuple(tensor.shape) != want:
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {want}")
        for e in range(self.num_experts):
            if which == "w13":
                self.load_expert_bias("w1", e, tensor[e, :full_i], name)
                self.load_expert_bias("w3", e, tensor[e, full_i:], name)
            else:
                self.load_expert_bias("w2", e, tensor[e], name)

    def missing_expert_biases(self) -> List[Tuple[int, str]]:
        """``(expert_id, shard_id)`` of every bias `load_expert_bias` never received (empty
        without ``has_bias``)."""
        if not self.has_bias:
            return []
        return [(e, s) for e in range(self.num_experts) for s in SHARD_IDS if (e, s) not in self._loaded_bias]

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
        if self.has_bias:  # the down bias once across the ranks (module doc)
            scales.update(w13_bias=self.w13_bias, w2_bias=self.w2_bias if self.tp.rank == 0 else None)
        if self.activation != "silu":
            scales.update(activation=self.activation, swiglu_alpha=self.swiglu_alpha, swiglu_limit=self.swiglu_limit)
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
                + (", bias" if self.has_bias else "")
                + ("" if self.activation == "silu" else
                   f", activation={self.activation}(alpha={self.swiglu_alpha}, limit={self.swiglu_limit})")
                + ("" if self.quant_method is None else f", fp8={self.quant_method.scale_kind}"))
