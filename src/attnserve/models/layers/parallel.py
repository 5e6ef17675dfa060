"""Tensor-parallel layers and how a rank's parameters are cut from full checkpoint tensors.

* `ColumnParallelLinear`: output rows split. A fused weight (QKV, gate|up) is a list of
  *parts*, each of ``units x unit_size`` rows (heads x head_dim, or MLP rows x 1); a rank
  holds its units of every part, concatenated (`HeadRange`: replicated KV heads included).
* `RowParallelLinear`: input columns split the same way; its partial products are summed
  with one all-reduce, then the bias is added once.
* `VocabParallelEmbedding`: vocabulary rows split (padded); ids of other ranks give zeros,
  summed by an all-reduce. The LM head uses the same rows and `gather_logits`.

Each parameter of these layers carries a `ShardSpec` (``param.tp_shard``): the mapping
from the full (tp 1) tensor, or one part of it, to the rank's slice. Loaders call
`load_param` with full tensors one at a time, so no rank ever holds the whole model
(Megatron-LM, arXiv:1909.08053, section 3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from attnserve.distributed.group import TPGroup
from attnserve.distributed.partition import HeadRange, vocab_range
from attnserve.models.layers.linear import Linear


@dataclass(frozen=True)
class ShardPiece:
    """One contiguous run of a rank's slice: ``length`` elements along the split dim that
    start at ``part_offset + src_offset`` of the full tensor (``src_offset`` of part
    ``part``'s own tensor) and at ``local_offset`` of the rank's parameter."""

    part: int
    part_offset: int
    src_offset: int
    local_offset: int
    length: int


@dataclass(frozen=True)
class ShardSpec:
    """How a rank's parameter is cut from the full tensor along ``dim``.

    Attributes:
        dim: the split dimension (0 rows, 1 columns).
        full_size: the full tensor's size along ``dim``.
        pieces: one `ShardPiece` per fused part (in part order).
    """

    dim: int
    full_size: int
    pieces: Tuple[ShardPiece, ...]

    def full_shape(self, local_shape: Sequence[int]) -> Tuple[int, ...]:
        shape = list(local_shape)
        shape[self.dim] = self.full_size
        return tuple(shape)


def head_shard_spec(dim: int, parts: Sequence[Tuple[HeadRange, int]]) -> ShardSpec:
    """`ShardSpec` of a fused weight whose parts are ``(HeadRange, unit_size)``."""
    pieces, part_off, local_off = [], 0, 0
    for i, (rng, unit) in enumerate(parts):
        n = rng.count * unit
        pieces.append(ShardPiece(i, part_off, rng.start * unit, local_off, n))
        part_off += rng.total * unit
        local_off += n
    return ShardSpec(dim, part_off, tuple(pieces))


def _check_shape(dst_shape, src: torch.Tensor, name: str) -> None:
    if tuple(dst_shape) != tuple(src.shape):
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(src.shape)}, expected {tuple(dst_shape)}")


def source_shape(param: torch.Tensor, name: str, part: Optional[int] = None) -> Tuple[int, ...]:
    """The full (tp 1) shape a checkpoint tensor for ``param`` (or its fused ``part``) has.

    Raises:
        ValueError: ``part`` given for a parameter without parts, or a part it lacks.
    """
    spec: Optional[ShardSpec] = getattr(param, "tp_shard", None)
    if spec is None:
        if part is not None:
            raise ValueError(f"checkpoint tensor {name!r} is a part of a parameter that has no parts")
        return tuple(param.shape)
    if part is None:
        return spec.full_shape(param.shape)
    pieces = [p for p in spec.pieces if p.part == part]
    if not pieces:
        raise ValueError(f"checkpoint tensor {name!r}: no part {part}")
    nxt = [p.part_offset for p in spec.pieces if p.part == part + 1]
    part_size = (nxt[0] if nxt else spec.full_size) - pieces[0].part_offset
    return spec.full_shape(param.shape)[: spec.dim] + (part_size,) + tuple(param.shape[spec.dim + 1:])


@torch.no_grad()
def copy_shards(param: torch.Tensor, tensor: torch.Tensor, name: str, part: Optional[int] = None) -> None:
    """`load_param` without the parameter's own ``weight_loader``: check the shape and copy
    this rank's slice (cast to ``param``'s dtype and device)."""
    _check_shape(source_shape(param, name, part), tensor, name)
    spec: Optional[ShardSpec] = getattr(param, "tp_shard", None)
    if spec is None:
        param.copy_(tensor.to(device=param.device, dtype=param.dtype))
        return
    pieces = spec.pieces if part is None else [p for p in spec.pieces if p.part == part]
    for p in pieces:
        src_off = p.src_offset if part is not None else p.part_offset + p.src_offset
        src = tensor.narrow(spec.dim, src_off, p.length)
        param.narrow(spec.dim, p.local_offset, p.length).copy_(src.to(device=param.device, dtype=param.dtype))


@torch.no_grad()
def load_param(param: torch.Tensor, tensor: torch.Tensor, name: str, part: Optional[int] = None) -> None:
    """Copy a checkpoint tensor into ``param`` (cast to its dtype and device).

    Args:
        param: a parameter; with a ``tp_shard`` `ShardSpec` only the rank's slice is taken;
            with a ``weight_loader`` attribute (FP8 weights and scales,
            `attnserve.models.layers.quantization.loading`) that function does the load.
        tensor: the full tensor, or with ``part`` the full tensor of one fused part.
        name: checkpoint name (for errors).
        part: index of the fused part (e.g. 0 = q, 1 = k, 2 = v), or None for the whole.

    Raises:
        ValueError: a shape that does not match the full (tp 1) shape.
    """
    loader = getattr(param, "weight_loader", None)
    if loader is not None:
        loader(param, tensor, name, part)
        return
    copy_shards(param, tensor, name, part)


def _attach(param: Optional[nn.Parameter], spec: ShardSpec) -> None:
    if param is not None:
        param.tp_shard = spec


class ColumnParallelLinear(Linear):
    """`Linear` whose output rows are split over the ranks.

    Args:
        in_features: input size (full, every rank).
        parts: fused output parts as ``(HeadRange, unit_size)``; a plain split of ``n`` rows
            is ``[(HeadRange(rank * n // size, n // size, n), 1)]`` (`even_parts`).
        bias, dtype: as `Linear`.

    Shapes: ``x`` ``[..., in_features]`` -> ``[..., local rows]``.
    """

    def __init__(self, in_features: int, parts: Sequence[Tuple[HeadRange, int]], bias: bool = False,
                 dtype: Optional[torch.dtype] = None):
        spec = head_shard_spec(0, parts)
        local = sum(p.length for p in spec.pieces)
        super().__init__(in_features, local, bias=bias, dtype=dtype)
        _attach(self.weight, spec)
        _attach(self.bias, spec)


class RowParallelLinear(Linear):
    """`Linear` whose input columns are split over the ranks; the outputs are summed with an
    all-reduce and the bias is added once, after it.

    Args:
        parts: the input split as ``(HeadRange, unit_size)`` (one part).
        out_features: output size (full, every rank).
        tp: the rank's `TPGroup`.
        reduce_results: False: return this rank's partial sums, the caller sums them (e.g.
            `TPGroup.fused_all_reduce_add_rmsnorm`, `models.layers.allreduce_fusion`; it
            may also be switched off after construction). Needs ``bias=False`` (the bias is
            added once, after the sum).
    """

    def __init__(self, parts: Sequence[Tuple[HeadRange, int]], out_features: int, tp: TPGroup,
                 bias: bool = False, dtype: Optional[torch.dtype] = None, reduce_results: bool = True):
        spec = head_shard_spec(1, parts)
        super().__init__(sum(p.length for p in spec.pieces), out_features, bias=bias, dtype=dtype)
        self.tp = tp
        if not reduce_results and bias:
            raise ValueError("RowParallelLinear: reduce_results=False needs bias=False (the bias follows the sum)")
        self.reduce_results = reduce_results
        _attach(self.weight, spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(x)
        out = self.matmul(x, None)
        if not self.reduce_results:
            return out
        out = self.tp.all_reduce(out)
        return out if self.bias is None else out + self.bias


def even_parts(n: int, tp: TPGroup, unit: int = 1) -> list:
    """One part of ``n`` units split evenly (``n % tp.size == 0``; raises ValueError)."""
    if n % tp.size:
        raise ValueError(f"--tp-size {tp.size} does not divide {n}")
    per = n // tp.size
    return [(HeadRange(tp.rank * per, per, n), unit)]


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows; also the LM head's weight.

    Args:
        num_embeddings: vocabulary size (full).
        embedding_dim: hidden size.
        tp: the rank's `TPGroup`.

    Shapes: int64 ``ids`` ``[...]`` -> ``[..., embedding_dim]``.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TPGroup, dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.tp = tp
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.vocab_start, self.local_rows, valid = vocab_range(num_embeddings, tp.size, tp.rank)
        self.weight = nn.Parameter(torch.empty(self.local_rows, embedding_dim, dtype=dtype), requires_grad=False)
        if valid < self.local_rows:  # padding rows of the last rank: zeros (logits cut off)
            self.weight.data[valid:].zero_()
        self.weight.tp_shard = ShardSpec(0, num_embeddings, (ShardPiece(0, 0, self.vocab_start, 0, valid),))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.local_rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows {self.vocab_start}+{self.local_rows}"


def gather_logits(local_logits: torch.Tensor, vocab_size: int, tp: TPGroup) -> torch.Tensor:
    """Each rank's ``[N, local_rows]`` logits -> ``[N, vocab_size]`` on every rank."""
    if tp.size == 1:
        return local_logits
    return tp.all_gather_last_dim(local_logits)[..., :vocab_size]
