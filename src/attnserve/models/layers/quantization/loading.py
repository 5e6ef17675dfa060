"""How FP8 weights and scales are loaded: ``weight_loader`` functions set on the parameters
(`attnserve.models.layers.parallel.load_param` calls them) and the shard specs of scales.

* ``--quantization fp8`` (online): `online_weight_loader` receives each full bf16/float32
  tensor (or fused part) as it is read, moves it to the parameter's device, quantises it
  (per row, per tensor or per 128 x 128 block, over the *full* tensor so every tensor
  parallel size computes the same model) and copies the rank's slice of the e4m3 values
  and of the scales. Only one source tensor exists at a time, so the peak memory is the
  FP8 model plus the largest tensor.
* Pre-quantised checkpoints: e4m3 weights are copied as published; `per_row_scale_loader`
  takes ``weight_scale`` as a scalar (repeated over the tensor's rows), ``[N]`` or
  ``[N, 1]``; `input_scale_loader` keeps the largest of the fused parts' ``input_scale``;
  ``weight_scale_inv`` blocks are cut by `block_shard_spec`.
* `check_fp8_checkpoint_tensor` refuses 8-bit float formats other than e4m3fn (FP8 MoE
  experts load through `fp8_moe`).

Every shape mismatch raises a ValueError naming the checkpoint tensor.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from attnserve.models.layers.parallel import ShardPiece, ShardSpec, copy_shards, source_shape
from attnserve.models.layers.quantization.fp8_utils import (
    BLOCK_SIZE,
    FP8_DTYPE,
    cdiv,
    quantize_per_block,
    quantize_per_row,
    quantize_per_tensor,
)

_OTHER_FP8 = tuple(getattr(torch, n) for n in ("float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz") if hasattr(torch, n))


def block_shard_spec(spec: ShardSpec, block: int, layer: str = "layer") -> ShardSpec:
    """The `ShardSpec` of block scales for a weight cut by ``spec``: offsets and lengths in
    blocks of ``block`` along ``spec.dim``; each fused part's scale has ``cdiv(part size,
    block)`` blocks.

    Raises:
        ValueError: a piece that does not start on a block boundary, or that ends inside a
            block without ending its part (the rank's blocks would mix parts).
    """
    pieces, part_off = [], 0
    totals = {}
    for i, p in enumerate(spec.pieces):
        nxt = spec.pieces[i + 1].part_offset if i + 1 < len(spec.pieces) else spec.full_size
        totals[p.part] = nxt - p.part_offset
    for p in spec.pieces:
        total = totals[p.part]
        if p.src_offset % block or p.local_offset % block or (p.length % block and p.src_offset + p.length != total):
            raise ValueError(
                f"block-scaled FP8 {layer}: a tensor-parallel slice (part {p.part}: rows/cols {p.src_offset}.."
                f"{p.src_offset + p.length} of {total}) is not aligned to the {block}-wide scale blocks; "
                "choose a --tp-size that splits it on block boundaries")
        pieces.append(ShardPiece(p.part, part_off, p.src_offset // block, p.local_offset // block,
                                 cdiv(p.length, block)))
        part_off += cdiv(total, block)
    return ShardSpec(spec.dim, part_off, tuple(pieces))


@torch.no_grad()
def online_weight_loader(layer: nn.Module, scale_attr: str, strategy: str, param: torch.Tensor,
                         tensor: torch.Tensor, name: str, part: Optional[int] = None) -> None:
    """Quantise an unquantised checkpoint tensor into ``param`` (e4m3) and ``layer.<scale_attr>``.

    Args:
        layer: the `Linear` that owns ``param``.
        scale_attr: ``"weight_scale"`` (per row) or ``"weight_scale_inv"`` (blocks).
        strategy: ``"channel"``, ``"tensor"`` or ``"block"``.
        param, tensor, name, part: as `load_param` (``tensor`` the full tensor or part).

    Raises:
        ValueError: ``tensor``'s shape does not match (named), or an FP8 ``tensor`` (a
            quantised checkpoint without a ``quantization_config``).
    """
    expected = source_shape(param, name, part)
    if tuple(tensor.shape) != expected:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {expected}")
    if tensor.dtype == FP8_DTYPE:
        raise ValueError(f"checkpoint tensor {name!r} is already FP8 but the checkpoint has no quantization_config")
    t = tensor.to(device=param.device)
    if strategy == "block":
        q, s = quantize_per_block(t)
    elif strategy == "tensor":
        q, s = quantize_per_tensor(t)
        s = s.expand(t.shape[0]).contiguous()
    else:
        q, s = quantize_per_row(t)
    del t
    copy_shards(param, q, name, part)
    copy_shards(getattr(layer, scale_attr), s, f"{name} ({scale_attr})", part)


@torch.no_grad()
def per_row_scale_loader(param: torch.Tensor, tensor: torch.Tensor, name: str, part: Optional[int] = None) -> None:
    """Load a per-tensor (scalar / ``[1]``) or per-channel (``[N]`` / ``[N, 1]``)
    ``weight_scale`` into the per-row float32 ``param``.

    Raises:
        ValueError: any other shape (named, with the rows expected).
    """
    rows = source_shape(param, name, part)[0]
    if tensor.numel() == 1:
        tensor = tensor.reshape(1).expand(rows)
    elif tensor.dim() in (1, 2) and tensor.shape[0] == rows and tensor.numel() == rows:
        tensor = tensor.reshape(rows)
    else:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}; a weight scale of a weight "
                         f"with {rows} rows must be a scalar, [{rows}] or [{rows}, 1]")
    copy_shards(param, tensor.float(), name, part)


@torch.no_grad()
def input_scale_loader(param: torch.Tensor, tensor: torch.Tensor, name: str, part: Optional[int] = None) -> None:
    """Static activation scale: keep the largest of the scales loaded (fused parts share
    their input, so the largest keeps every part within range).

    Raises:
        ValueError: a tensor that is not a single value (named).
    """
    if tensor.numel() != 1:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}; an input_scale is one value")
    param.copy_(torch.maximum(param, tensor.reshape(1).to(device=param.device, dtype=torch.float32)))


def check_fp8_checkpoint_tensor(name: str, tensor: torch.Tensor) -> None:
    """Refuse 8-bit float tensors of another format than float8_e4m3fn (e5m2, the
    ``fnuz`` variants): no method reads them.

    Raises:
        ValueError: naming the tensor and its dtype.
    """
    if tensor.dtype in _OTHER_FP8:
        raise ValueError(f"checkpoint tensor {name!r} is {tensor.dtype}; FP8 checkpoints must hold float8_e4m3fn")


__all__ = ["BLOCK_SIZE", "block_shard_spec", "online_weight_loader", "per_row_scale_loader", "input_scale_loader",
           "check_fp8_checkpoint_tensor"]
