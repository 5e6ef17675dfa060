"""Float64 reference of the routed-expert MLP, with an element-wise rounding bound, and the
invariants of `moe_align_block_size` (shared by tests/kernels/test_fused_moe.py and
tests/gpu/test_fused_moe_gpu.py).

The bound follows the path of the fused Triton layer (``fused_moe_triton``), in units of
the storage dtype's unit roundoff ``u_s`` (2**-24 float32, 2**-11 float16, 2**-8
bfloat16) and of ``gamma_n = n u / (1 - n u)``, ``u = 2**-24`` (float32 accumulation of
``n`` terms in any order; Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd
ed., eq. 3.5). For each slot (token ``t`` routed to expert ``e`` with weight ``w``):

* gate ``g`` and up ``u`` are float32 dots of ``H`` terms: errors within
  ``gamma_H |x| @ |W_g|^T`` and ``gamma_H |x| @ |W_u|^T``; since ``|silu'| <= 1.1``,
  ``a = silu(g) u`` is off by at most
  ``da = gamma_H (1.1 |u| (|x||W_g|) + |silu(g)| (|x||W_u|)) + (u_s + 4u) |a|``
  (the last term: the one rounding of ``a`` to the storage dtype and the float32 exp-based
  sigmoid);
* ``y = a W_2^T`` (``I`` terms): ``dy <= da @ |W_2|^T + gamma_I (|a| + da) @ |W_2|^T``;
* the slot ``w y`` is rounded to the storage dtype: ``|w| (dy + u_s (|y| + dy)) + u |w y|``;
* the top-k sum (float32, ``k`` terms) and the final rounding: ``gamma_k sum |w y| + u_s |out|``.

The sum of these is doubled (`SAFETY`) for the second-order terms left out. A real bug
(a wrong expert, weight or row, a dropped K tile) moves an output by the size of a slot,
orders of magnitude above the bound.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

U32 = 2.0**-24
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
SAFETY = 2.0


def _gamma(n: int, u: float = U32) -> float:
    return n * u / (1 - n * u)


#: e4m3: half a unit in the last place relative to a normal value (3 mantissa bits), and
#: half the subnormal spacing (2**-9) in units of the scale
E4M3_REL, E4M3_ABS = 2.0**-4, 2.0**-10


def _act_quant_error(a: torch.Tensor, da: torch.Tensor, group: Optional[int]) -> torch.Tensor:
    """Bound on ``|q s - a'|`` when the kernel's ``a'`` (within ``da`` of ``a``) is quantised
    to e4m3 with ``s = amax(|a'|) / 448`` per row (``group`` None) or per ``1 x group`` run:
    ``2**-4 |a'| + 2**-10 s`` (round to nearest: half an ulp of a normal value, or half the
    subnormal spacing ``2**-9 s``)."""
    mag = a.abs() + da
    if group is None:
        amax = mag.amax(dim=1, keepdim=True).expand_as(mag)
    else:
        n, k = mag.shape
        g = -(-k // group)
        padded = torch.zeros(n, g * group, dtype=mag.dtype, device=mag.device)
        padded[:, :k] = mag
        amax = padded.view(n, g, group).amax(dim=2).repeat_interleave(group, dim=1)[:, :k]
    return E4M3_REL * mag + E4M3_ABS * amax / 448.0


def moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, storage_dtype: Optional[torch.dtype] = None,
                  act_fp8: Optional[str] = None, group: int = 128,
                  x_err: Optional[torch.Tensor] = None, acc_u: float = U32) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(out, bound)``: the exact (float64) routed-expert output ``[T, H]`` of the rounded
    inputs, a loop over the experts, and the element-wise bound of the module docstring
    for the fused layer in ``x``'s dtype (or ``storage_dtype``, when ``x`` holds the values
    the kernel multiplies, e.g. dequantised FP8 activations in float64).

    ``act_fp8`` ``"token"`` / ``"group"`` (W8A8): the down GEMM's input is the intermediate
    quantised to e4m3 per row / per ``1 x group`` run; its error (`_act_quant_error`) joins
    ``da``. (The gate-up input's quantisation is the caller's: pass the dequantised ``x``,
    or pass ``x`` and ``x_err`` ``[T, H]``, a bound on how far the kernel's input is from
    ``x``: it moves gate and up by ``dg <= x_err @ |W_g|^T`` / ``du``, so ``a`` by
    ``1.1 dg |u| + |silu(g)| du + 1.1 dg du``.) ``acc_u``: the accumulation's error per
    term in units of the sum of magnitudes, for the GEMMs' ``gamma`` (default float32's
    ``2**-24``; larger for Hopper's FP8 MMA, which keeps fewer bits inside a K step)."""
    us = UNIT_ROUNDOFF[storage_dtype or x.dtype]
    t, h = x.shape
    e_num, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    xd = x.double()
    out = torch.zeros(t, h, dtype=torch.float64, device=x.device)
    err = torch.zeros_like(out)
    mag = torch.zeros_like(out)
    ids = topk_ids.long()
    for e in torch.unique(ids).tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        xs = xd[tok]
        w13e, w2e = w13[e].double(), w2[e].double()
        wg, wu = w13e[:inter], w13e[inter:]
        g, u = xs @ wg.T, xs @ wu.T
        gm, um = xs.abs() @ wg.abs().T, xs.abs() @ wu.abs().T
        sg = g * torch.sigmoid(g)
        a = sg * u
        da = _gamma(h, acc_u) * (1.1 * u.abs() * gm + sg.abs() * um) + (us + 4 * U32) * a.abs()
        if x_err is not None:
            xe = x_err[tok].double()
            dg, du = xe @ wg.abs().T, xe @ wu.abs().T
            da = da + 1.1 * dg * u.abs() + sg.abs() * du + 1.1 * dg * du
        if act_fp8 is not None:
            da = da + _act_quant_error(a, da, None if act_fp8 == "token" else group)
        y = a @ w2e.T
        dy = da @ w2e.abs().T + _gamma(inter, acc_u) * ((a.abs() + da) @ w2e.abs().T)
        w = topk_weights[tok, slot].double()[:, None]
        out.index_add_(0, tok, w * y)
        err.index_add_(0, tok, w.abs() * (dy + us * (y.abs() + dy)) + U32 * (w * y).abs())
        mag.index_add_(0, tok, (w * y).abs())
    bound = SAFETY * (err + _gamma(top_k) * mag + us * out.abs()) + 1e-300
    return out, bound


def check_alignment(topk_ids: torch.Tensor, block_size: int, num_experts: int, sorted_token_ids: torch.Tensor,
                    expert_ids: torch.Tensor, num_tokens_post_padded: torch.Tensor) -> None:
    """Assert every property `moe_align_block_size` promises (slots with ids outside
    ``[0, E)`` must be listed nowhere)."""
    ids = topk_ids.reshape(-1).long().cpu()
    s = ids.numel()
    st, ex, ntpp = sorted_token_ids.cpu().long(), expert_ids.cpu().long(), int(num_tokens_post_padded.cpu()[0])
    assert sorted_token_ids.dtype == torch.int32 and expert_ids.dtype == torch.int32
    assert num_tokens_post_padded.dtype == torch.int32 and num_tokens_post_padded.shape == (1,)
    max_len = s + min(num_experts, s) * (block_size - 1)
    assert st.shape == (max_len,) and ex.shape == (max_len // block_size,)
    valid = (ids >= 0) & (ids < num_experts)
    counts = torch.bincount(ids[valid], minlength=num_experts)
    padded = (counts + block_size - 1) // block_size * block_size
    starts = torch.cumsum(padded, 0) - padded
    assert ntpp == int(padded.sum()), (ntpp, int(padded.sum()))
    listed = st[st < s]
    assert ((st == s) | (st < s)).all(), "entries must be slots or the sentinel"
    # every valid slot exactly once, invalid ones never
    assert torch.equal(torch.sort(listed).values, torch.nonzero(valid).flatten())
    assert (st[ntpp:] == s).all()
    for e in range(num_experts):
        run = st[starts[e]:starts[e] + padded[e]]
        c = int(counts[e])
        assert (ids[run[:c]] == e).all(), f"expert {e}: foreign slot in its run"
        assert (run[c:] == s).all(), f"expert {e}: padding must be the sentinel"
        blocks = ex[starts[e] // block_size:(starts[e] + padded[e]) // block_size]
        assert (blocks == e).all(), f"expert {e}: block ids {blocks.tolist()}"
    assert (ex[ntpp // block_size:] == -1).all()
