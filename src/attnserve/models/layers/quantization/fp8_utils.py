"""FP8 (e4m3) quantisation in plain PyTorch: the reference the kernels are checked against.

Conventions (those of the published FP8 checkpoints, e.g. DeepSeek-V3's and the
compressed-tensors format):

* a quantised tensor ``q`` (``torch.float8_e4m3fn``) and a float32 *scale* ``s`` hold
  ``x ~= q * s`` (the scale multiplies; DeepSeek-V3 calls it ``weight_scale_inv``);
* ``s = amax(|x|) / FP8_E4M3_MAX`` over the group that shares it, at least ``SCALE_MIN``
  (an all-zero group gets a tiny positive scale, so no division by zero);
* weight groups: one per tensor, per output row (channel) or per ``128 x 128`` block
  (rows x columns; edge blocks are smaller when a size is not a multiple of 128);
  activation groups: one per token (row) or per ``1 x 128`` run of a row.

Micikevicius et al., "FP8 Formats for Deep Learning" (arXiv:2209.05433) define e4m3
(largest finite 448); DeepSeek-AI, "DeepSeek-V3 Technical Report" (arXiv:2412.19437,
section 3.3) the 128 x 128 / 1 x 128 block scaling.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

FP8_DTYPE = torch.float8_e4m3fn
#: largest finite float8_e4m3fn value
FP8_E4M3_MAX = 448.0
#: smallest scale used (an all-zero group still gets a finite, positive scale)
SCALE_MIN = 1e-12
#: DeepSeek-V3's weight block (rows, columns) and activation group size
BLOCK_SIZE = 128


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _quantize_with(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() / scale).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)


def quantize_per_tensor(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x`` any shape -> ``(q, s)``: e4m3 ``q`` of ``x``'s shape, float32 scalar ``s`` (0-d)."""
    s = (x.detach().abs().amax().float() / FP8_E4M3_MAX).clamp_min(SCALE_MIN)
    return _quantize_with(x, s), s


def quantize_per_row(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[R, C]`` -> ``(q [R, C] e4m3, s [R] float32)``: one scale per row (a weight's
    output channel, or an activation's token)."""
    s = (x.detach().abs().amax(dim=-1).float() / FP8_E4M3_MAX).clamp_min(SCALE_MIN)
    return _quantize_with(x, s.unsqueeze(-1)), s


def quantize_per_group(x: torch.Tensor, group: int = BLOCK_SIZE) -> Tuple[torch.Tensor, torch.Tensor]:
    """Activation groups: ``x`` ``[M, K]`` -> ``(q [M, K] e4m3, s [M, cdiv(K, group)] float32)``,
    one scale per ``1 x group`` run of a row (the last run shorter when ``group`` does not
    divide ``K``)."""
    m, k = x.shape
    g = cdiv(k, group)
    padded = torch.zeros(m, g * group, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    blocks = padded.view(m, g, group)
    s = (blocks.abs().amax(dim=-1) / FP8_E4M3_MAX).clamp_min(SCALE_MIN)
    q = _quantize_with(blocks, s.unsqueeze(-1)).view(m, g * group)[:, :k]
    return q.contiguous(), s


def block_scale_expand(s: torch.Tensor, rows: int, cols: int, block: Tuple[int, int]) -> torch.Tensor:
    """Block scales ``[cdiv(rows, br), cdiv(cols, bc)]`` -> one per element ``[rows, cols]``."""
    br, bc = block
    return s.repeat_interleave(br, dim=0)[:rows].repeat_interleave(bc, dim=1)[:, :cols]


def quantize_per_block(w: torch.Tensor, block: Tuple[int, int] = (BLOCK_SIZE, BLOCK_SIZE)
                       ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Weight blocks: ``w`` ``[N, K]`` -> ``(q [N, K] e4m3, s [cdiv(N, br), cdiv(K, bc)] float32)``."""
    n, k = w.shape
    br, bc = block
    gn, gk = cdiv(n, br), cdiv(k, bc)
    padded = torch.zeros(gn * br, gk * bc, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.float()
    s = (padded.view(gn, br, gk, bc).abs().amax(dim=(1, 3)) / FP8_E4M3_MAX).clamp_min(SCALE_MIN)
    q = _quantize_with(w, block_scale_expand(s, n, k, block))
    return q, s


def dequantize(q: torch.Tensor, s: torch.Tensor, block: Optional[Tuple[int, int]] = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * s`` in ``dtype``: ``s`` a scalar, per-row ``[R]`` / ``[R, 1]``, or (``block``
    given) block scales of `quantize_per_block` / `quantize_per_group` (``block=(1, group)``)."""
    qf = q.to(torch.float32)
    if block is not None:
        full = block_scale_expand(s.float(), q.shape[0], q.shape[1], block)
    elif s.numel() == 1:
        full = s.float().reshape(())
    else:
        full = s.float().reshape(-1, 1)
    return (qf * full).to(dtype)


def fp8_supported(device: torch.device) -> Tuple[bool, str]:
    """Whether ``device`` runs FP8 tensor-core GEMMs (compute capability >= 8.9), and a
    description of the device for error messages. CPU: False (the reference path runs)."""
    device = torch.device(device)
    if device.type != "cuda":
        return False, str(device)
    major, minor = torch.cuda.get_device_capability(device)
    name = torch.cuda.get_device_name(device)
    return (major, minor) >= (8, 9), f"{name} (sm {major}{minor})"
