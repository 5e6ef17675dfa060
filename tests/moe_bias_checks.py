"""Float64 references of gpt-oss's routed experts (per-expert biases, ``swigluoai``) with an
element-wise rounding bound, shared by tests/models/test_fused_moe_bias.py (CPU, Triton
interpreter) and tests/gpu/test_fused_moe_bias_gpu.py (gpt-oss-20b shapes).

The formula is HF transformers' ``GptOssExperts`` (``models/gpt_oss/modeling_gpt_oss.py``;
OpenAI's gpt-oss model card, arXiv:2508.10925), in our ``[gate; up]`` row layout:

    g = x W_g^T + b_g,  u = x W_u^T + b_u,  g' = min(g, L),  u' = clamp(u, -L, L)
    a = (u' + 1) * g' * sigmoid(alpha g'),  y = a W_d^T + b_d,  out[t] = sum_j w[t, j] y_{e_j}(x_t)

`hf_formula_reference` is that formula literally, token by token over the chosen experts;
`oai_moe_reference` computes the same values expert by expert (fast at real shapes) and the
bound. The bound is that of ``tests/moe_checks.py`` (the fused Triton path, the one with the
most roundings; the native path rounds less) extended to the biases and the clamped
activation, in units of the storage dtype's roundoff ``u_s`` and of ``gamma_n = n u / (1 - n
u)``, ``u = 2**-24`` (float32 accumulation of ``n`` terms in any order; Higham, *Accuracy and
Stability of Numerical Algorithms*, 2nd ed., eq. 3.5). For each slot (token, expert, weight w):

* ``g``, ``u``: float32 dots of ``H`` terms, plus the bias and possibly an FP8 scale (two
  more roundings): ``dg <= gamma_{H+2} (|x| @ |W_g|^T + |b_g|)``, ``du`` likewise; so the
  error is relative to the *magnitudes* of the terms, not to the (possibly cancelling) sum.
* ``a``: the clamps are 1-Lipschitz and ``h(g) = g sigmoid(alpha g)`` has
  ``|h'| = |silu'(alpha g)| <= 1.1``, so ``da <= 1.1 dg |u'+1| + |h(g')| du + 1.1 dg du``,
  plus the float32 evaluation (``exp``, the sigmoid's division, ``u + 1``, two products:
  ``8 u (|u'| + 1) |h(g')|``, relative to the operands of ``u' + 1``) and the one rounding of
  ``a`` to the storage dtype (``u_s |a|``).
* ``y``: ``dy <= da @ |W_d|^T + gamma_{I+2} ((|a| + da) @ |W_d|^T + |b_d|)``.
* the slot ``w y`` rounded to the storage dtype: ``|w| (dy + u_s (|y| + dy)) + u |w y|``;
  the top-k sum (float32) and the final rounding: ``gamma_k sum |w y| + u_s |out|``.

The sum is doubled (`SAFETY`) for the second-order terms left out. A missing clamp, bias or
routed weight on the bias moves outputs by the size of a slot, far above the bound (the
tests check that the inputs make it so).

That bound is rigorous but grows linearly with the reduction lengths (it lets every one of
the ``I`` errors of ``a`` push ``y`` the same way), so at real sizes (gpt-oss: H = I = 2880)
it is as large as the outputs themselves and would miss such bugs. ``prob_lambda`` gives
the probabilistic bound of Higham and Mary ("A New Approach to Probabilistic Rounding Error
Analysis", SIAM J. Sci. Comput. 41(5), 2019, Theorem 2.4), which models rounding errors as
independent, mean-zero and bounded: ``gamma_n`` becomes ``lambda sqrt(n) u`` and the
propagation ``da @ |W_d|^T`` becomes ``lambda sqrt(da^2 @ (W_d^2)^T)`` (Hoeffding's
inequality over the ``I`` independent errors). Each holds except with probability at most
``2 n exp(-lambda^2 / 2)`` (``lambda = 8``: ``1e-10`` for ``n = 5760``; ``2.5e-14`` an element,
so ``< 1e-7`` over a million outputs).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

U32 = 2.0**-24
UNIT_ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
SAFETY = 2.0
ALPHA, LIMIT = 1.702, 7.0


def _gamma(n: int, u: float = U32, lam: Optional[float] = None) -> float:
    """``gamma_n``, or with ``lam`` the probabilistic ``lam sqrt(n) u`` (module doc)."""
    return n * u / (1 - n * u) if lam is None else lam * n**0.5 * u


def swiglu_oai64(g: torch.Tensor, u: torch.Tensor, alpha: float = ALPHA, limit: float = LIMIT) -> torch.Tensor:
    """HF ``GptOssExperts._apply_gate`` on de-interleaved halves (float64 in, float64 out)."""
    g = g.clamp(min=None, max=limit)
    u = u.clamp(min=-limit, max=limit)
    return (u + 1) * (g * torch.sigmoid(g * alpha))


def hf_formula_reference(x, w13, w2, b13, b2, topk_weights, topk_ids, alpha=ALPHA, limit=LIMIT) -> torch.Tensor:
    """float64 ``[T, H]``: for each token, for each of its chosen experts,
    ``w * ((swigluoai(x W13^T + b13)) W2^T + b2)`` (``b13`` / ``b2`` may be None)."""
    xd = x.double()
    t_num, h = x.shape
    inter = w13.shape[1] // 2
    out = torch.zeros(t_num, h, dtype=torch.float64, device=x.device)
    for t in range(t_num):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            gu = w13[e].double() @ xd[t] + (0 if b13 is None else b13[e].double())
            y = w2[e].double() @ swiglu_oai64(gu[:inter], gu[inter:], alpha, limit)
            out[t] += float(topk_weights[t, j]) * (y + (0 if b2 is None else b2[e].double()))
    return out


def oai_moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, b13: Optional[torch.Tensor],
                      b2: Optional[torch.Tensor], topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      storage_dtype: Optional[torch.dtype] = None, alpha: float = ALPHA, limit: float = LIMIT,
                      prob_lambda: Optional[float] = None) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, float]]:
    """``(out, bound, clamp_stats)``: the exact (float64) output ``[T, H]`` of the given
    (already rounded) inputs, expert by expert, the element-wise bound of the module doc for
    the storage dtype (``x``'s, or ``storage_dtype`` when ``x`` is float64 / dequantised),
    and the fractions of the routed slots' gate values above ``limit`` (``gate_hi``), up
    values outside ``[-limit, limit]`` (``up_out``) and of neither (``free``).
    ``prob_lambda``: the probabilistic bound of the module doc instead of the worst case."""
    us = UNIT_ROUNDOFF[storage_dtype or x.dtype]
    t_num, h = x.shape
    inter = w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    xd = x.double()
    out = torch.zeros(t_num, h, dtype=torch.float64, device=x.device)
    err, mag = torch.zeros_like(out), torch.zeros_like(out)
    ids = topk_ids.long()
    n_hi = n_out = n_free = n_all = 0
    for e in torch.unique(ids).tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        xs = xd[tok]
        w13e, w2e = w13[e].double(), w2[e].double()
        bias13 = torch.zeros(2 * inter, dtype=torch.float64, device=x.device) if b13 is None else b13[e].double()
        bias2 = torch.zeros(h, dtype=torch.float64, device=x.device) if b2 is None else b2[e].double()
        wg, wu = w13e[:inter], w13e[inter:]
        g, u = xs @ wg.T + bias13[:inter], xs @ wu.T + bias13[inter:]
        gm = xs.abs() @ wg.abs().T + bias13[:inter].abs()
        um = xs.abs() @ wu.abs().T + bias13[inter:].abs()
        n_hi += int((g > limit).sum())
        n_out += int((u.abs() > limit).sum())
        n_free += int(((g <= limit) & (u.abs() <= limit)).sum())
        n_all += g.numel()
        gc, uc = g.clamp(max=limit), u.clamp(-limit, limit)
        hg = gc * torch.sigmoid(alpha * gc)
        a = (uc + 1) * hg
        lam = prob_lambda
        dg, du = _gamma(h + 2, lam=lam) * gm, _gamma(h + 2, lam=lam) * um
        da = (1.1 * dg * (uc + 1).abs() + hg.abs() * du + 1.1 * dg * du
              + 8 * U32 * (uc.abs() + 1) * hg.abs() + us * a.abs())
        y = a @ w2e.T + bias2
        spread = da @ w2e.abs().T if lam is None else lam * ((da * da) @ (w2e * w2e).T).sqrt()
        dy = spread + _gamma(inter + 2, lam=lam) * ((a.abs() + da) @ w2e.abs().T + bias2.abs())
        w = topk_weights[tok, slot].double()[:, None]
        out.index_add_(0, tok, w * y)
        err.index_add_(0, tok, w.abs() * (dy + us * (y.abs() + dy)) + U32 * (w * y).abs())
        mag.index_add_(0, tok, (w * y).abs())
    bound = SAFETY * (err + _gamma(top_k) * mag + us * out.abs()) + 1e-300
    n_all = max(n_all, 1)
    return out, bound, {"gate_hi": n_hi / n_all, "up_out": n_out / n_all, "free": n_free / n_all}


def worst_ratio(out: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> float:
    """``max |out - ref| / bound`` (<= 1 passes)."""
    return ((out.double() - ref).abs() / bound).max().item()
