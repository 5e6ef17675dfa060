"""FP8 routed experts (issue 37): how a `FusedMoE` stores e4m3 expert weights, loads them and
their scales, and what the kernels are given.

W8A16: the expert weights are float8_e4m3fn with float32 scales (``w ~= q * s``) and the
activations stay 16-bit; the fused Triton kernel widens each weight tile in registers and
applies the scales (`fused_moe_triton`), the native path dequantises the experts it runs
(`dequantize_expert`). No activation is quantised, so there is no ``input_scale`` to use
(a checkpoint's expert ``input_scale`` tensors are read and dropped).

Parameters, for ``E`` experts, hidden size ``H`` and this rank's intermediate size ``I``:

* per output channel (``--quantization fp8``; per-tensor and per-channel checkpoints, a
  per-tensor scale repeated over its rows): ``w13_weight`` e4m3 ``[E, 2I, H]`` with
  ``w13_weight_scale`` ``[E, 2I]``, ``w2_weight`` e4m3 ``[E, H, I]`` with
  ``w2_weight_scale`` ``[E, H]``;
* 128 x 128 blocks (HF ``quant_method: fp8`` with ``weight_block_size``, DeepSeek-V3):
  ``w13_weight_scale_inv`` ``[E, 2 cdiv(I, 128), cdiv(H, 128)]`` (gate row blocks, then up
  row blocks) and ``w2_weight_scale_inv`` ``[E, cdiv(H, 128), cdiv(I, 128)]``.

Loading (`Fp8MoEMethod.load`) takes one expert's full (tp 1) HF tensor at a time: an
unquantised one is quantised over the full tensor (so every tensor-parallel size computes
the same model) and only the rank's rows / columns of values and scales are kept, so the
peak memory is the FP8 model plus one expert matrix. Scales are cut with their rows (gate,
up: rows ``[rank I, (rank + 1) I)``; block rows ``rank I / 128 ...``) or columns (down).
A scale whose shape does not fit its weight raises a ValueError naming the tensor.
"""

from __future__ import annotations

import functools
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from attnserve.models.layers.quantization.config import QuantizationConfig
from attnserve.models.layers.quantization.fp8_utils import (
    BLOCK_SIZE,
    FP8_DTYPE,
    cdiv,
    dequantize,
    quantize_per_block,
    quantize_per_row,
    quantize_per_tensor,
)

#: checkpoint suffixes an expert tensor may have
EXPERT_TENSOR_KINDS = ("weight", "weight_scale", "weight_scale_inv", "input_scale")


def _param(t: torch.Tensor, **attrs) -> nn.Parameter:
    p = nn.Parameter(t, requires_grad=False)
    for k, v in attrs.items():
        setattr(p, k, v)
    return p


def dequantize_expert(w: torch.Tensor, scale: torch.Tensor, expert: int,
                      block_shape: Optional[Tuple[int, int]] = None, gated: bool = False) -> torch.Tensor:
    """float32 ``[rows, cols]`` of expert ``expert`` of an e4m3 ``w`` ``[E, rows, cols]``.

    Args:
        scale: per row ``[E, rows]``, or with ``block_shape`` block scales (layout of the
            module doc; ``gated``: ``w`` is ``w13``, whose gate and up halves have their own
            row blocks).
    """
    q, s = w[expert], scale[expert]
    if block_shape is None:
        return dequantize(q, s)
    if not gated:
        return dequantize(q, s, block=tuple(block_shape))
    half = q.shape[0] // 2
    nb = cdiv(half, block_shape[0])
    return torch.cat([dequantize(q[:half], s[:nb], block=tuple(block_shape)),
                      dequantize(q[half:], s[nb:], block=tuple(block_shape))])


class Fp8MoEMethod:
    """FP8 expert weights of one `FusedMoE` (see the module doc).

    Args:
        config: the model's `QuantizationConfig`: ``weight_strategy`` ``"block"`` gives block
            scales, ``"channel"`` / ``"tensor"`` per-channel scales.
    """

    def __init__(self, config: QuantizationConfig):
        self.config = config
        self.block_shape: Optional[Tuple[int, int]] = (
            tuple(config.weight_block_size or (BLOCK_SIZE, BLOCK_SIZE)) if config.weight_strategy == "block" else None)
        self.scale_kind = "weight_scale_inv" if self.block_shape is not None else "weight_scale"

    # ---------------------------------------------------------------- parameters
    def create_weights(self, moe: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
        """Give ``moe`` (built with ``meta`` weights) its e4m3 weights and float32 scales on
        ``device``; ``dtype`` is the model dtype (of the activations and of an unquantised
        checkpoint).

        Raises:
            ValueError: block scales under a tensor-parallel size whose slice of the
                intermediate size does not start on a 128 block (names ``--tp-size``).
        """
        e, h, i_loc = moe.num_experts, moe.hidden_size, moe.intermediate_size_per_partition
        tp = moe.tp
        spec13, spec2 = moe.w13_weight.tp_shard, moe.w2_weight.tp_shard
        moe.w13_weight = _param(torch.empty(e, 2 * i_loc, h, dtype=FP8_DTYPE, device=device), source_dtype=dtype,
                                tp_shard=spec13)
        moe.w2_weight = _param(torch.empty(e, h, i_loc, dtype=FP8_DTYPE, device=device), source_dtype=dtype,
                               tp_shard=spec2)
        if self.block_shape is None:
            s13 = torch.ones(e, 2 * i_loc, dtype=torch.float32, device=device)
            s2 = torch.ones(e, h, dtype=torch.float32, device=device)
        else:
            b = self.block_shape[0]
            if tp.size > 1 and i_loc % b:
                raise ValueError(f"block-scaled FP8 experts: --tp-size {tp.size} gives each rank {i_loc} of the "
                                 f"{moe.intermediate_size} intermediate rows, not a multiple of the {b}-row scale "
                                 "blocks; choose a --tp-size that splits it on block boundaries")
            s13 = torch.ones(e, 2 * cdiv(i_loc, b), cdiv(h, b), dtype=torch.float32, device=device)
            s2 = torch.ones(e, cdiv(h, b), cdiv(i_loc, b), dtype=torch.float32, device=device)
        online = not self.config.is_checkpoint_fp8
        setattr(moe, f"w13_{self.scale_kind}", _param(s13, is_quant_scale=True, loaded_with_weight=online))
        setattr(moe, f"w2_{self.scale_kind}", _param(s2, is_quant_scale=True, loaded_with_weight=online))
        for which in ("w13", "w2"):  # a full [E, rows, cols] tensor (dummy weights): expert by expert
            getattr(moe, f"{which}_weight").weight_loader = functools.partial(self._load_full, moe, which)
        moe.quant_method = self
        self._scales_loaded = set()

    def scales(self, moe: nn.Module) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(w13 scale, w2 scale)`` parameters of ``moe``."""
        return getattr(moe, f"w13_{self.scale_kind}"), getattr(moe, f"w2_{self.scale_kind}")

    def kernel_args(self, moe: nn.Module) -> Dict[str, object]:
        """Keyword arguments of `fused_experts_triton` / `fused_experts_native` for the scales."""
        s13, s2 = self.scales(moe)
        return {"w13_scale": s13, "w2_scale": s2, "block_shape": self.block_shape}

    def process_weights_after_loading(self, moe: nn.Module) -> None:
        """Nothing to do: the scales are used as loaded (`missing_scales` reports gaps)."""

    def missing_scales(self, moe: nn.Module) -> List[Tuple[int, str]]:
        """``(expert, shard id)`` whose checkpoint scale never came (pre-quantised only)."""
        if not self.config.is_checkpoint_fp8:
            return []
        return [(e, s) for e in range(moe.num_experts) for s in ("w1", "w3", "w2") if (e, s) not in self._scales_loaded]

    # ---------------------------------------------------------------- loading
    @torch.no_grad()
    def _load_full(self, moe: nn.Module, which: str, param: torch.Tensor, tensor: torch.Tensor, name: str,
                   part: Optional[int] = None) -> None:
        e, h, full_i = moe.num_experts, moe.hidden_size, moe.intermediate_size
        want = (e, 2 * full_i, h) if which == "w13" else (e, h, full_i)
        if part is not None or tuple(tensor.shape) != want:
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {want}")
        for x in range(e):
            if which == "w13":
                self.load(moe, "w1", x, tensor[x, :full_i], name, "weight")
                self.load(moe, "w3", x, tensor[x, full_i:], name, "weight")
            else:
                self.load(moe, "w2", x, tensor[x], name, "weight")

    def _rows(self, moe: nn.Module, shard_id: str) -> Tuple[int, int, int]:
        """``(source offset, length, local offset)`` of this rank's output rows of a part
        (gate / up: a slice of ``I``; down: all ``H``)."""
        if shard_id == "w2":
            return 0, moe.hidden_size, 0
        i_loc = moe.intermediate_size_per_partition
        return moe.tp.rank * i_loc, i_loc, 0 if shard_id == "w1" else i_loc

    @torch.no_grad()
    def load(self, moe: nn.Module, shard_id: str, expert: int, tensor: torch.Tensor, name: str, kind: str) -> None:
        """Load one expert's checkpoint tensor of ``kind`` (`EXPERT_TENSOR_KINDS`); the caller
        has checked ``shard_id`` and ``expert``, and the shape of a ``weight``.

        Raises:
            ValueError: naming ``name``: a 16-bit weight in an FP8 checkpoint, an FP8 weight
                without a ``quantization_config``, a scale of the other kind, or a scale
                whose shape does not fit the weight.
        """
        if kind == "input_scale":
            return  # W8A16: the activations are not quantised
        if kind == "weight":
            self._load_weight(moe, shard_id, expert, tensor, name)
            return
        if not self.config.is_checkpoint_fp8 or kind != self.scale_kind:
            raise ValueError(f"checkpoint tensor {name!r}: a {kind} does not fit FP8 experts "
                             f"{'quantised at load' if not self.config.is_checkpoint_fp8 else 'with ' + self.scale_kind}")
        rows, cols = (moe.hidden_size, moe.intermediate_size) if shard_id == "w2" else (moe.intermediate_size,
                                                                                           moe.hidden_size)
        self._copy_scale(moe, shard_id, expert, self._full_scale(tensor, rows, cols, name), name)
        self._scales_loaded.add((expert, shard_id))

    def _full_scale(self, tensor: torch.Tensor, rows: int, cols: int, name: str) -> torch.Tensor:
        """A checkpoint scale as the full (tp 1) float32 scale of this method's layout."""
        if self.block_shape is not None:
            want = (cdiv(rows, self.block_shape[0]), cdiv(cols, self.block_shape[1]))
            if tuple(tensor.shape) != want:
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}; the block scales of a "
                                 f"[{rows}, {cols}] expert weight are {list(want)}")
            return tensor.float()
        if tensor.numel() == 1:
            return tensor.reshape(1).float().expand(rows)
        if tensor.dim() in (1, 2) and tensor.shape[0] == rows and tensor.numel() == rows:
            return tensor.reshape(rows).float()
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}; a weight scale of an expert "
                         f"weight with {rows} rows must be a scalar, [{rows}] or [{rows}, 1]")

    def _load_weight(self, moe: nn.Module, shard_id: str, expert: int, tensor: torch.Tensor, name: str) -> None:
        param = moe.w2_weight if shard_id == "w2" else moe.w13_weight
        if self.config.is_checkpoint_fp8:
            if tensor.dtype != FP8_DTYPE:
                raise ValueError(f"checkpoint tensor {name!r} is {tensor.dtype}; the checkpoint's quantization_config "
                                 "makes its experts float8_e4m3fn")
            q, s = tensor, None
        else:
            if tensor.dtype == FP8_DTYPE:
                raise ValueError(f"checkpoint tensor {name!r} is already FP8 but the checkpoint has no "
                                 "quantization_config")
            t = tensor.to(device=param.device)
            if self.block_shape is not None:
                q, s = quantize_per_block(t, self.block_shape)
            elif self.config.weight_strategy == "tensor":
                q, s = quantize_per_tensor(t)
                s = s.expand(t.shape[0])
            else:
                q, s = quantize_per_row(t)
            del t
        src_off, length, local_off = self._rows(moe, shard_id)
        dst = param[expert]
        if shard_id == "w2":  # down: this rank's columns of I
            i_loc = moe.intermediate_size_per_partition
            dst.copy_(q.narrow(1, moe.tp.rank * i_loc, i_loc).to(dst.device))
        else:
            dst.narrow(0, local_off, length).copy_(q.narrow(0, src_off, length).to(dst.device))
        if s is not None:
            self._copy_scale(moe, shard_id, expert, s, name)

    def _copy_scale(self, moe: nn.Module, shard_id: str, expert: int, s: torch.Tensor, name: str) -> None:
        """Copy this rank's part of a full (tp 1) scale of one expert part."""
        s13, s2 = self.scales(moe)
        i_loc = moe.intermediate_size_per_partition
        if self.block_shape is None:
            src_off, length, local_off = self._rows(moe, shard_id)
            dst = (s2 if shard_id == "w2" else s13)[expert]
            dst.narrow(0, local_off, length).copy_(s.narrow(0, src_off, length).to(dst.device))
            return
        b = self.block_shape[0]
        nb, start = cdiv(i_loc, b), moe.tp.rank * i_loc // b
        if shard_id == "w2":  # columns: blocks of I
            s2[expert].copy_(s.narrow(1, start, nb).to(s2.device))
        else:
            s13[expert].narrow(0, 0 if shard_id == "w1" else nb, nb).copy_(s.narrow(0, start, nb).to(s13.device))
