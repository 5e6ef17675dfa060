"""FP8 linear methods: how a quantised `Linear` stores its weight and computes ``x W^T``.

A method is attached to a `Linear` as ``layer.quant_method`` (`apply.quantize_model_linears`);
`Linear.matmul` / `Linear.forward_gated` then call `apply` / `apply_gated`. Parameters:

* `Fp8LinearMethod` (per-tensor and per-channel checkpoints, and ``--quantization fp8``):
  ``weight`` e4m3 ``[N, K]``, ``weight_scale`` float32 ``[N]`` (one per output row; a
  per-tensor checkpoint's scale is repeated over the rows of its tensor, so fused q|k|v
  parts keep their own scales exactly), and for static activation schemes ``input_scale``
  float32 ``[1]`` (the largest of the fused parts' scales, as the parts share one input).
  CUDA: decode batches (``M <= w8a16_max_m()``, default 16; fused kernels on, dynamic
  scheme) run `skinny_linear_fp8` (W8A16: the weight widened in the kernel); larger batches quantise
  the activations (per token, `quantize_activation`; static: ``x / input_scale``) and run
  ``torch._scaled_mm`` (row-wise scales, sm 90, rows padded past cuBLASLt's slow sizes:
  `scaled_mm_padded_rows`; tensor-wise when the weight has one scale and the activation
  scale is static) or, where it does not apply, `scaled_fp8_gemm`. A fused ``gate_up``
  whose output feeds a W8A8 ``down_proj`` runs, up to `FOLDED_GATE_MAX_M` rows, a tensor-wise
  ``_scaled_mm`` with unit scales and leaves the token and channel scales to its
  SiLU-and-mul (`Fp8LinearMethod._folded_gate_up`; ``ATTNSERVE_FP8_FOLDED_GATE_SCALES=0``
  keeps the row-wise GEMM); that ``down_proj`` likewise runs, up to `FOLDED_DOWN_MAX_M` rows, the
  tensor-wise GEMM and `scale_rows_cols` (`Fp8LinearMethod._folded_down`;
  ``ATTNSERVE_FP8_FOLDED_DOWN_SCALES=0`` keeps the row-wise GEMM).
* `BlockFp8LinearMethod` (DeepSeek-V3 style): ``weight`` e4m3 ``[N, K]`` and
  ``weight_scale_inv`` float32 ``[cdiv(N, 128), cdiv(K, 128)]``; activations quantised in
  ``1 x 128`` groups; `scaled_fp8_gemm` (Triton) on CUDA.
* CPU (no Triton interpreter): the dequantising reference -- the activation quantised and
  dequantised as on the GPU, the weight dequantised, the product in float32. It is the
  emulation used for accuracy checks.

No method reads device values on the host in its forward, so every path is CUDA-graph
capturable. ``ATTNSERVE_FP8_GEMM=triton`` routes the ``_scaled_mm`` cases to
`scaled_fp8_gemm` (for A/B timing). `fp8_mid_gemm` takes 33..64 rows of the shapes measured
faster on the device (H100: the Llama-3-8B projections; W8A8, the gate fused into
``gate_up``) before ``_scaled_mm`` does; ``ATTNSERVE_FP8_MID_GEMM=off`` keeps ``_scaled_mm``,
``w8a16|w8a8`` routes ``16 < M <= 256`` rows of every shape to it (see its module doc).
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch
from torch import nn

from attnserve.env_options import env_flag
from attnserve.models.layers.activation import act_and_mul
from attnserve.models.layers.quantization import loading
from attnserve.models.layers.quantization.config import QuantizationConfig
from attnserve.models.layers.quantization.fp8_kernels import quantize_activation, scaled_fp8_gemm
from attnserve.models.layers.quantization.fp8_mid_gemm import fp8_mid_apply
from attnserve.models.layers.quantization.fp8_utils import (
    BLOCK_SIZE,
    FP8_DTYPE,
    FP8_E4M3_MAX,
    cdiv,
    dequantize,
)
from attnserve.models.layers.quantization.fused_inputs import Fp8Activation, ScaledProduct, emits_fp8
from attnserve.models.layers.split_k_workspace import SplitKWorkspace
from attnserve.triton_env import triton_interpreting

MAX_SKINNY_M = 16


def w8a16_max_m() -> int:
    """Largest batch (rows) that takes the W8A16 `skinny_linear_fp8` instead of activation
    quantisation + ``_scaled_mm``: 16, or ``ATTNSERVE_FP8_W8A16_MAX_M`` (0..128; for the A/B
    of ``benchmarks/fp8_bench.py``). Read at every call (CUDA graphs bake it in at capture).

    Raises:
        ValueError: a value that is not an integer in 0..128.
    """
    from attnserve.env_options import env_int
    from attnserve.models.layers.skinny_gemm import MAX_SKINNY_FP8_M

    return env_int("ATTNSERVE_FP8_W8A16_MAX_M", MAX_SKINNY_M, 0, MAX_SKINNY_FP8_M)


def _param(t: torch.Tensor, **attrs) -> nn.Parameter:
    p = nn.Parameter(t, requires_grad=False)
    for k, v in attrs.items():
        setattr(p, k, v)
    return p


def _on_gpu_path(x: torch.Tensor) -> bool:
    return x.is_cuda or (x.device.type == "cpu" and triton_interpreting())


def _scaled_mm_ok(x: torch.Tensor, n: int, k: int) -> bool:
    """``torch._scaled_mm`` applies: CUDA sm >= 9.0 (row-wise scales), ``K`` and ``N``
    multiples of 16, and not disabled by ``ATTNSERVE_FP8_GEMM=triton``."""
    if not x.is_cuda or k % 16 or n % 16 or os.environ.get("ATTNSERVE_FP8_GEMM", "").lower() == "triton":
        return False
    return torch.cuda.get_device_capability(x.device) >= (9, 0)


#: ``ATTNSERVE_FP8_SCALED_MM_PAD=0`` keeps `scaled_mm_rowwise` from padding the rows
SCALED_MM_PAD_ENV = "ATTNSERVE_FP8_SCALED_MM_PAD"
#: ``ATTNSERVE_FP8_FOLDED_GATE_SCALES=0`` keeps the row-wise ``_scaled_mm`` for a fused gate_up
FOLDED_GATE_SCALES_ENV = "ATTNSERVE_FP8_FOLDED_GATE_SCALES"
#: most rows that take `Fp8LinearMethod._folded_gate_up` (decode batches; see its doc)
FOLDED_GATE_MAX_M = 512
#: most rows that take `Fp8LinearMethod._folded_down` (see its doc)
FOLDED_DOWN_MAX_M = 256
#: most rows that take the folded route on an attention ``o_proj`` (see `Fp8LinearMethod._folded_down`)
FOLDED_O_MAX_M = 200
#: ``ATTNSERVE_FP8_FOLDED_O_SCALES=0`` (read at load) leaves ``o_proj`` on the row-wise ``_scaled_mm``
FOLDED_O_SCALES_ENV = "ATTNSERVE_FP8_FOLDED_O_SCALES"
#: ``ATTNSERVE_FP8_FOLDED_DOWN_SCALES=0`` keeps the row-wise ``_scaled_mm`` for every linear marked
#: ``fp8_folded_max_m`` (``down_proj``, ``o_proj``)
FOLDED_DOWN_SCALES_ENV = "ATTNSERVE_FP8_FOLDED_DOWN_SCALES"
#: dtype of the unscaled product `Fp8LinearMethod._folded_down` asks cuBLASLt for (float32:
#: the result is rounded once, by `scale_rows_cols`, as the row-wise GEMM rounds it)
FOLDED_DOWN_RAW_DTYPE = torch.float32
#: ``ATTNSERVE_FP8_FAST_ACCUM=0`` runs every ``_scaled_mm`` with exact (promoted) float32 accumulation
FAST_ACCUM_ENV = "ATTNSERVE_FP8_FAST_ACCUM"


def fp8_fast_accum() -> bool:
    """Whether the ``_scaled_mm`` calls use Hopper's fast FP8 accumulation
    (``use_fast_accum=True``: the tensor cores' partial sums are not promoted to float32
    registers every few MMA steps, so they keep fewer mantissa bits; DeepSeek-V3,
    arXiv:2412.19437, section 3.3.2, puts the retained precision near 14 bits). vLLM's CUTLASS
    FP8 GEMMs for Hopper use the fast-accumulation schedules in every M bucket
    (``csrc/quantization/cutlass_w8a8/c3x/scaled_mm_sm90_fp8_dispatch.cuh``). On by default;
    ``ATTNSERVE_FP8_FAST_ACCUM=0`` turns it off (read at every call; CUDA graphs bake it in).

    Measured on one H100 (benchmarks/results/h100-80gb-hbm3-fp8-fast-accum-2026-11-28.json and
    ...-fp8-bench-engine-fast-accum-2026-11-28.json): against the float64 product of the same
    e4m3 operands the RMS error grows from 0.013% to 0.13% (K = 4,096) and 0.29% (K = 14,336)
    of the RMS output, against 3.75% for the FP8 quantisation itself; the Llama-3-8B prefill of
    8,192 tokens takes 139.2 instead of 148.6 ms. The FP8 GPU tests (linears, mid route, mid
    GEMM, fused MoE: 207) pass with it on; those whose bounds are exact accumulation's pin it
    off."""
    return env_flag(FAST_ACCUM_ENV, default=True)


#: smallest weight (``N * K`` elements) whose row-wise ``_scaled_mm`` `scaled_mm_padded_rows` pads
PAD_MIN_WEIGHT_ELEMENTS = 32 << 20


def scaled_mm_padded_rows(m: int, weight_elements: Optional[int] = None) -> int:
    """Rows `scaled_mm_rowwise` hands ``torch._scaled_mm`` for ``m`` rows of a weight of
    ``weight_elements`` (``N * K``; None: unknown, treated as large): ``m`` rounded up to a
    multiple of 128 when ``64 < m < 256`` and the weight has at least
    `PAD_MIN_WEIGHT_ELEMENTS`, else ``m``.

    Why (one H100, Llama-3-8B projections, per-token x per-channel scales): an earlier sweep
    (``benchmarks/NOTES.md`` 2026-11-27) found cuBLASLt's row-wise FP8 kernels slower at 144
    rows than at 256 on ``gate_up`` and ``down`` (µs at 128 / 144 / 256: 53.8 / 87.4 / 72.0 and
    37.1 / 50.0 / 37.2). On the small projections, timed in CUDA graphs with fast
    accumulation (2026-11-28, ``benchmarks/results/h100-80gb-hbm3-fp8-scaled-mm-qkv-o-padding-2026-11-28.json``),
    padding only adds its copies: qkv (25M elements) 14.4 unpadded vs 19.2 µs padded at 144
    rows, o (17M) 13.6 vs 17.8, and the 144-request decode step went 8.55 -> 8.30 ms without
    it (``gate_up`` and ``down`` took their folded routes there). Hence the size rule; the pad
    costs one copy of ``x`` (``m x K`` bytes)."""
    if weight_elements is not None and weight_elements < PAD_MIN_WEIGHT_ELEMENTS:
        return m
    if 64 < m < 256 and m % 128 and env_flag(SCALED_MM_PAD_ENV):
        return -(-m // 128) * 128
    return m


def folded_max_m(layer: nn.Module) -> int:
    """Most rows for which ``layer`` takes the folded route (`Fp8LinearMethod._folded_down`):
    its ``fp8_folded_max_m`` mark (`fused_inputs.enable_fused_producers`: `FOLDED_DOWN_MAX_M`
    on a ``down_proj``, `FOLDED_O_MAX_M` on an ``o_proj``), 0 when unmarked or with
    ``ATTNSERVE_FP8_FOLDED_DOWN_SCALES=0`` (read at every call)."""
    rows = int(getattr(layer, "fp8_folded_max_m", 0))
    return rows if rows and env_flag(FOLDED_DOWN_SCALES_ENV) else 0


def scaled_mm_rowwise(q: torch.Tensor, scale_a: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      out_dtype: torch.dtype) -> torch.Tensor:
    """``torch._scaled_mm(q, weight^T)`` with row-wise scales, ``[M, N]`` in ``out_dtype``.

    ``q`` e4m3 ``[M, K]``, ``scale_a`` float32 ``[M, 1]``, ``weight`` e4m3 ``[N, K]``,
    ``weight_scale`` float32 ``[N]``. Rows are padded to `scaled_mm_padded_rows` (large weights; the pad
    rows' values are never read back: a GEMM's output row depends on its own input row only)
    and the result is the first ``M`` rows, a contiguous view."""
    m, k = q.shape
    mp = scaled_mm_padded_rows(m, weight.numel())
    if mp != m:
        qp = q.new_empty((mp, k))
        qp[:m].copy_(q)
        sp = scale_a.new_ones((mp, 1))
        sp[:m].copy_(scale_a.reshape(m, 1))
        q, scale_a = qp, sp
    y = torch._scaled_mm(q, weight.t(), scale_a=scale_a, scale_b=weight_scale.view(1, -1), out_dtype=torch.bfloat16,
                         use_fast_accum=fp8_fast_accum())
    return (y[:m] if mp != m else y).to(out_dtype)


class Fp8LinearMethod:
    """Per-tensor / per-channel FP8 weights with dynamic per-token or static per-tensor
    activation scales (see the module doc).

    Args:
        config: the model's `QuantizationConfig` (``weight_strategy`` tensor or channel).
        workspace: split-K buffers of the mid GEMM (`fp8_mid_gemm`), shared by the model's
            linears (`split_k_workspace` says why that is safe); None: a new one.
    """

    def __init__(self, config: QuantizationConfig, workspace: Optional[SplitKWorkspace] = None):
        self.config = config
        self.workspace = workspace if workspace is not None else SplitKWorkspace()
        self._unit_scales: dict = {}  # device -> float32 scalar 1.0 (`_unit_scale`)

    def _unit_scale(self, device: torch.device) -> Optional[torch.Tensor]:
        """A float32 scalar 1.0 on ``device``, made once (the unit scales of a tensor-wise
        ``_scaled_mm``); None if it does not exist yet while a CUDA graph is being captured
        (a tensor made then would only be filled when the graph replays)."""
        unit = self._unit_scales.get(device)
        if unit is None and not torch.cuda.is_current_stream_capturing():
            unit = self._unit_scales[device] = torch.ones((), dtype=torch.float32, device=device)
        return unit

    def create_weights(self, layer: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
        """Replace ``layer.weight`` (a meta placeholder that carries the layer's ``tp_shard``)
        with e4m3 ``[N, K]`` on ``device`` and add ``weight_scale`` (and ``input_scale``).
        ``dtype``: the model dtype, of the activations and of an unquantised checkpoint."""
        n, k = layer.out_features, layer.in_features
        spec = getattr(layer.weight, "tp_shard", None)
        online = not self.config.is_checkpoint_fp8
        layer.weight = _param(torch.empty(n, k, dtype=FP8_DTYPE, device=device), source_dtype=dtype)
        layer.weight_scale = _param(torch.ones(n, dtype=torch.float32, device=device), is_quant_scale=True)
        if spec is not None:
            layer.weight.tp_shard = spec
            if spec.dim == 0:
                layer.weight_scale.tp_shard = spec
        if online:
            layer.weight.weight_loader = functools.partial(loading.online_weight_loader, layer, "weight_scale",
                                                           self.config.weight_strategy)
            layer.weight_scale.loaded_with_weight = True
        else:
            layer.weight_scale.weight_loader = loading.per_row_scale_loader
        layer.input_scale = None
        if self.config.activation_scheme == "static":
            layer.input_scale = _param(torch.zeros(1, dtype=torch.float32, device=device), is_quant_scale=True,
                                       weight_loader=loading.input_scale_loader)
        layer.fp8_tensor_scale = None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """After the last tensor: one weight scale for the whole tensor (a per-tensor
        checkpoint with a single part) enables the tensor-wise ``_scaled_mm``; reads the
        scales once on the host (load time, not in the forward)."""
        s = layer.weight_scale
        if self.config.weight_strategy == "tensor" and s.numel() and s.device.type != "meta":
            if bool((s == s[0]).all()):
                layer.fp8_tensor_scale = s[:1].reshape(()).clone()

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        """float32 ``[N, K]`` = ``weight * weight_scale[:, None]``."""
        return dequantize(layer.weight, layer.weight_scale)

    def _quantize_input(self, layer: nn.Module, x2: torch.Tensor):
        if layer.input_scale is not None:
            s = layer.input_scale
            q = (x2.float() / s).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)
            return q, s.reshape(1, 1).expand(x2.shape[0], 1).contiguous()
        return quantize_activation(x2)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor],
              activation: Optional[str] = None) -> torch.Tensor:
        """``x [..., K]`` -> ``[..., N]`` in ``x``'s dtype (``[..., N / 2]`` with a gate
        ``activation``, for a fused ``[gate | up]`` weight)."""
        n, k = layer.weight.shape
        if isinstance(x, Fp8Activation):  # quantised by its producer (fused_inputs)
            return self._apply_prequantized(layer, x, bias, activation)
        shape = x.shape[:-1]
        x2 = x.reshape(-1, k)
        m = x2.shape[0]
        if activation == "silu" and getattr(layer, "fp8_output", False) and emits_fp8(x2, getattr(layer, "use_fused", False)):
            q, sa = self._quantize_input(layer, x2)
            return self._apply_prequantized(layer, Fp8Activation(q, sa, x2.dtype), bias, activation)
        if (x2.is_cuda and getattr(layer, "use_fused", False) and 1 <= m <= w8a16_max_m()
                and layer.input_scale is None):
            from attnserve.models.layers.skinny_gemm import skinny_fp8_supported, skinny_linear_fp8

            if skinny_fp8_supported(x2, layer.weight, layer.weight_scale, bias):
                y = skinny_linear_fp8(x2, layer.weight, layer.weight_scale, bias, activation)
                return y.reshape(*shape, y.shape[-1])
        y = fp8_mid_apply(layer, x2, bias, activation, workspace=self.workspace)  # None outside its route
        if y is not None:
            return y.reshape(*shape, y.shape[-1])
        if not _on_gpu_path(x2):
            y = self._reference(layer, x2, bias)
        elif m == 0:
            y = x2.new_empty((0, n))
        else:
            q, sa = self._quantize_input(layer, x2)
            if _scaled_mm_ok(x2, n, k):
                y = None
                if layer.fp8_tensor_scale is not None and layer.input_scale is not None:
                    y = torch._scaled_mm(q, layer.weight.t(), scale_a=layer.input_scale.reshape(()),
                                         scale_b=layer.fp8_tensor_scale, out_dtype=torch.bfloat16,
                                         use_fast_accum=fp8_fast_accum())
                elif activation is None and bias is None and layer.input_scale is None and m <= folded_max_m(layer):
                    # a marked o_proj: the folded route (None on a graph capture's first call)
                    y = self._folded_down(layer, Fp8Activation(q, sa, x2.dtype), lazy=x.dim() == 2)
                    if isinstance(y, ScaledProduct):
                        return y
                if y is None:
                    y = scaled_mm_rowwise(q, sa, layer.weight, layer.weight_scale, torch.bfloat16)
                y = y.to(x2.dtype)
                if bias is not None:
                    y = y + bias
            else:
                y = scaled_fp8_gemm(q, sa, layer.weight, layer.weight_scale, x2.dtype, bias)
        y = y.reshape(*shape, n)
        if activation is not None:
            y = act_and_mul(y, activation, getattr(layer, "use_fused", False))
        return y

    def _apply_prequantized(self, layer: nn.Module, x, bias: Optional[torch.Tensor],
                            activation: Optional[str]) -> torch.Tensor:
        """``apply`` for an `Fp8Activation` input (2-D, per-token scales): no quantiser
        launch. A gated layer marked ``fp8_output`` (`fused_inputs`) returns its SiLU-and-mul
        quantised, an `Fp8Activation` for ``down_proj``: on the mid GEMM (`fp8_mid_apply`;
        the gate in its epilogue) by `quantize_activation` of its ``[M, I]`` output, after
        ``_scaled_mm`` by the fused `silu_and_mul_quant_fp8` of the ``[M, 2I]`` one."""
        n, k = layer.weight.shape
        fp8_out = activation == "silu" and getattr(layer, "fp8_output", False)
        y = fp8_mid_apply(layer, x.q, bias, activation, x_scale=x.scale, out_dtype=x.dtype,
                          workspace=self.workspace)
        if y is not None:  # gated: act(gate) * up already
            if fp8_out:
                q, s = quantize_activation(y)
                return Fp8Activation(q, s, x.dtype)
            return y
        mm_ok = _scaled_mm_ok(x.q, n, k)
        if (fp8_out and bias is None and x.q.shape[0] <= FOLDED_GATE_MAX_M and mm_ok
                and env_flag(FOLDED_GATE_SCALES_ENV)):
            # the tensor-wise GEMM with unit scales, the token and channel scales applied by the
            # SiLU-and-mul that reads its output (see `_folded_gate_up`)
            out = self._folded_gate_up(layer, x)
            if out is not None:
                return out
        if activation is None and bias is None and mm_ok and x.q.shape[0] <= folded_max_m(layer):
            y = self._folded_down(layer, x)
            if y is not None:
                return y
        if mm_ok:
            y = scaled_mm_rowwise(x.q, x.scale, layer.weight, layer.weight_scale, x.dtype)
            if bias is not None:
                y = y + bias
        else:
            y = scaled_fp8_gemm(x.q, x.scale, layer.weight, layer.weight_scale, x.dtype, bias)
        if fp8_out:
            from attnserve.models.layers.quantization.fp8_kernels import silu_and_mul_quant_fp8

            q, s = silu_and_mul_quant_fp8(y, x.dtype)
            return Fp8Activation(q, s, x.dtype)
        if activation is not None:
            y = act_and_mul(y, activation, getattr(layer, "use_fused", False))
        return y

    def _folded_gate_up(self, layer: nn.Module, x: Fp8Activation) -> Optional[Fp8Activation]:
        """A fused ``gate_up`` whose SiLU-and-mul output feeds a W8A8 ``down_proj``: the
        unscaled product ``q_x @ q_w^T`` from a tensor-wise ``_scaled_mm`` (unit scales; bf16,
        whose range holds any e4m3 product summed over K), then `silu_and_mul_quant_fp8`
        multiplies each entry by its token's and its channel's scale before the gate. Same
        roundings as the row-wise GEMM (one bf16 rounding of the product, in a different
        place), without its kernel: cuBLASLt's tensor-wise FP8 GEMM is faster than the
        row-wise one on the Llama-3-8B ``gate_up`` at decode batches (one H100, µs row-wise as
        the engine pads it / tensor-wise: 144 rows 64 / 52, 200 rows 64 / 55, 320 rows 104 /
        71; 512 rows 103 / 102; benchmarks/results/h100-80gb-hbm3-fp8-scaled-mm-scaling-2026-11-28.json;
        the 144-request decode step 9.43 -> 8.95 ms). Up to `FOLDED_GATE_MAX_M` rows only:
        the SiLU-and-mul then reads the ``[2I]`` float32 channel scales once per row, which at
        prefill sizes costs more than the faster GEMM saves (one 8,192-token prefill 151.0 ->
        153.4 ms with every size folded). None when no unit scale can be made (first call
        inside a graph capture)."""
        from attnserve.models.layers.quantization.fp8_kernels import silu_and_mul_quant_fp8

        raw = self._unscaled_product(layer, x, torch.bfloat16)
        if raw is None:
            return None
        q, s = silu_and_mul_quant_fp8(raw, x.dtype, row_scale=x.scale, col_scale=layer.weight_scale)
        return Fp8Activation(q, s, x.dtype)

    def _folded_down(self, layer: nn.Module, x: Fp8Activation, lazy: bool = True):
        """A ``down_proj`` marked by `fused_inputs.enable_fused_producers` (its input is the
        SiLU-and-mul's `Fp8Activation`): the unscaled product ``q_x @ q_w^T`` from a
        tensor-wise ``_scaled_mm`` with unit scales, in `FOLDED_DOWN_RAW_DTYPE`, then
        `scale_rows_cols` multiplies each entry by its token's and channel's scale and rounds
        once to ``x.dtype``. Why: cuBLASLt's tensor-wise FP8 GEMM is faster than the row-wise
        one on the Llama-3-8B ``down`` (4,096 x 14,336) at decode batches. One H100, fast
        accumulation, CUDA graphs, µs, row-wise as the engine pads it / this route (float32
        product + `scale_rows_cols`): 64 rows 36.7 / 25.8, 96 41.9 / 27.2, 144 43.4 / 28.6,
        200 44.1 / 32.1, 256 37.6 / 34.6, 320 39.1 / 38.6, 512 43.1 / 48.1
        (benchmarks/results/h100-80gb-hbm3-fp8-scaled-mm-down-folded-2026-11-28.json); hence
        up to `FOLDED_DOWN_MAX_M` rows. A bf16 product would save ~0.5 µs and round twice.
        The 144-request decode step went 8.95 -> 8.52 ms. An ``o_proj`` (4,096 x 4,096; its
        16-bit input quantised by `apply` first) takes the same route up to `FOLDED_O_MAX_M`
        rows: row-wise / folded 13.7 / 11.1 µs at 72 rows, 13.6 / 11.6 at 144, 13.9 / 13.6 at
        200, 13.9 / 14.3 at 232 (...-fp8-scaled-mm-qkv-o-padding-2026-11-28.json; ``qkv``
        loses from 96 rows, so it stays row-wise). None when no unit scale can be made (first
        call inside a graph capture). A layer marked ``fp8_lazy_output`` returns the product and
        its scales as a `ScaledProduct` instead (with ``lazy``), for the norm that reads it
        (`fused_inputs`, "Lazy scales")."""
        from attnserve.models.layers.quantization.fp8_kernels import scale_rows_cols

        raw = self._unscaled_product(layer, x, FOLDED_DOWN_RAW_DTYPE)
        if raw is None:
            return None
        if lazy and getattr(layer, "fp8_lazy_output", False):
            return ScaledProduct(raw, x.scale, layer.weight_scale, x.dtype)
        return scale_rows_cols(raw, x.scale, layer.weight_scale, x.dtype)

    def _unscaled_product(self, layer: nn.Module, x: Fp8Activation, out_dtype: torch.dtype) -> Optional[torch.Tensor]:
        """``q_x @ q_w^T`` in ``out_dtype`` from a tensor-wise ``_scaled_mm`` with unit scales
        (the folded routes apply the token and channel scales after it); None when no unit scale
        can be made (first call inside a graph capture, `_unit_scale`)."""
        unit = self._unit_scale(x.q.device)
        if unit is None:
            return None
        return torch._scaled_mm(x.q, layer.weight.t(), scale_a=unit, scale_b=unit, out_dtype=out_dtype,
                                use_fast_accum=fp8_fast_accum())

    def _reference(self, layer: nn.Module, x2: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        q, sa = self._quantize_input(layer, x2)
        y = dequantize(q, sa) @ self.dequantized_weight(layer).t()
        if bias is not None:
            y = y + bias.float()
        return y.to(x2.dtype)


class BlockFp8LinearMethod:
    """128 x 128 block-scaled FP8 weights, ``1 x 128`` dynamic activation groups
    (DeepSeek-V3; see the module doc).

    Args:
        config: the model's `QuantizationConfig` (``weight_strategy == "block"``).
    """

    def __init__(self, config: QuantizationConfig):
        self.config = config
        self.block = tuple(config.weight_block_size or (BLOCK_SIZE, BLOCK_SIZE))

    def create_weights(self, layer: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
        """e4m3 ``weight [N, K]`` and float32 ``weight_scale_inv [cdiv(N, 128), cdiv(K, 128)]``;
        under tensor parallelism the scale's rows (column-parallel) or columns
        (row-parallel) are cut with the weight's (`loading.block_shard_spec`).

        Raises:
            ValueError: a rank's slice (or a fused part) that does not start on a block.
        """
        n, k = layer.out_features, layer.in_features
        br, bc = self.block
        spec = getattr(layer.weight, "tp_shard", None)
        layer.weight = _param(torch.empty(n, k, dtype=FP8_DTYPE, device=device), source_dtype=dtype)
        layer.weight_scale_inv = _param(torch.ones(cdiv(n, br), cdiv(k, bc), dtype=torch.float32, device=device),
                                        is_quant_scale=True)
        if spec is not None:
            layer.weight.tp_shard = spec
            layer.weight_scale_inv.tp_shard = loading.block_shard_spec(spec, br if spec.dim == 0 else bc,
                                                                        type(layer).__name__)
        if not self.config.is_checkpoint_fp8:
            layer.weight.weight_loader = functools.partial(loading.online_weight_loader, layer, "weight_scale_inv",
                                                           "block")
            layer.weight_scale_inv.loaded_with_weight = True
        layer.input_scale = None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Nothing to do (the scales are used as loaded)."""

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        """float32 ``[N, K]``: every block times its scale."""
        return dequantize(layer.weight, layer.weight_scale_inv, block=self.block)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor],
              activation: Optional[str] = None) -> torch.Tensor:
        """``x [..., K]`` -> ``[..., N]`` (``[..., N / 2]`` gated), ``x``'s dtype."""
        n, k = layer.weight.shape
        shape = x.shape[:-1]
        x2 = x.reshape(-1, k)
        q, sa = quantize_activation(x2, self.block[1])
        if _on_gpu_path(x2):
            y = scaled_fp8_gemm(q, sa, layer.weight, layer.weight_scale_inv, x2.dtype, bias)
        else:
            y = dequantize(q, sa, block=(1, self.block[1])) @ self.dequantized_weight(layer).t()
            if bias is not None:
                y = y + bias.float()
            y = y.to(x2.dtype)
        y = y.reshape(*shape, n)
        if activation is not None:
            y = act_and_mul(y, activation, getattr(layer, "use_fused", False))
        return y


def make_linear_method(config: QuantizationConfig, workspace: Optional[SplitKWorkspace] = None):
    """The method for ``config.weight_strategy``; ``workspace``: the model's split-K buffers,
    shared by its `Fp8LinearMethod`s (None: one per method)."""
    if config.weight_strategy == "block":
        return BlockFp8LinearMethod(config)
    return Fp8LinearMethod(config, workspace)
