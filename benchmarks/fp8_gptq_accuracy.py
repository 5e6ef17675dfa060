"""Does GPTQ-style rounding close issue 37's FP8 accuracy gap on the small models? (CPU, real weights.)

``PYTHONPATH=src:benchmarks python benchmarks/fp8_gptq_accuracy.py [--model smollm2-135m] [--positions 512]
[--calib-tokens 1024] [--damp 0.01] [--out DIR]``

`fp8_accuracy.py --schemes` found that round-to-nearest e4m3 weights (per output channel, the
format of ``--quantization fp8``) cost SmolLM2-135M / Gemma 3 270M 6-9 points of top-1
agreement against bf16, with no outlier layer and no cheaper scale layout that helps (NOTES,
2026-11-26). GPTQ (Frantar et al., arXiv:2210.17323) chooses *which* grid value each weight
rounds to, column by column, pushing each column's rounding error onto the columns not yet
rounded through the inverse Hessian ``H = X^T X`` of the layer's calibration inputs, so the
layer's output error on inputs like the calibration ones shrinks. The stored format is
unchanged (the same e4m3 values and per-row float32 scales, amax / 448), so every FP8 kernel
would serve such weights at the same speed: only the load (a calibration pass and one
``K x K`` Cholesky per linear) would cost.

Here: the model is loaded once in bf16 (`fp8_accuracy._load_runner`). One EXTEND over
``--calib-tokens`` tokens of a calibration text that the evaluation never sees (this
repository's README, English prose and tables; sequences of `CALIB_CHUNK` tokens) records
each linear's ``H`` (the bf16 model's inputs: one shot, not layer by layer). Each linear is then rounded both ways
(round to nearest; GPTQ with 128-column blocks and 1% damping of the mean diagonal), and the
FP8 numerics are emulated (`fp8_schemes.EmulatedFp8Method`: e4m3 values dequantised, float32
product, W8A16 or W8A8 with dynamic per-token activations) over the first ``--positions +
1`` tokens of `attnserve.bench.kv_accuracy.TEXT`, against the bf16 model: top-1 agreement,
mean KL, perplexity ratio, as `fp8_accuracy.py`. Writes
``<out>/cpu-fp8-gptq-accuracy-<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import time
from typing import Dict

import torch

FP8_MAX = 448.0
#: calibration tokens per EXTEND (the evaluation runner's KV pool holds >= 1,024)
CALIB_CHUNK = 1000


def e4m3_round(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``w`` (float32 ``[N, ...]``) rounded to the e4m3 grid of per-row ``scale`` ``[N, 1]`` (clamped,
    round to nearest even), returned dequantised in float32."""
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale


def row_scales(w: torch.Tensor) -> torch.Tensor:
    """Per-row e4m3 scales ``amax / 448`` (float32 ``[N, 1]``), as `fp8_utils.quantize_per_row`."""
    return (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)


def gptq_e4m3(w: torch.Tensor, h: torch.Tensor, block: int = 128, damp: float = 0.01) -> torch.Tensor:
    """GPTQ rounding of ``w`` (float32 ``[N, K]``) to the per-row e4m3 grid of `row_scales`,
    with ``h`` (float64 ``[K, K]``, ``X^T X`` of the calibration inputs): columns in order,
    each one's error ``(w - q) / Hinv[k, k]`` subtracted from the later columns through the
    upper Cholesky factor of ``H^-1`` (arXiv:2210.17323, algorithm 1). Returns the dequantised
    float32 weight."""
    w = w.clone().double()
    scale = row_scales(w.float()).double()
    h = h.clone()
    k = h.shape[0]
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += damp * torch.diag(h).mean() * torch.eye(k, dtype=h.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.zeros_like(w)
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1, err1, hinv1 = w[:, i1:i2].clone(), torch.zeros_like(w[:, i1:i2]), hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = w1[:, i]
            qc = e4m3_round(col.float().unsqueeze(1), scale.float()).squeeze(1).double()
            q[:, i1 + i] = qc
            e = (col - qc) / hinv1[i, i]
            w1[:, i:] -= e.unsqueeze(1) * hinv1[i, i:].unsqueeze(0)
            err1[:, i] = e
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    return q.float()


class _Capture:
    """A ``quant_method`` that adds ``x^T x`` of each call's input to ``self.h`` and returns the
    unquantised product (the bf16 model's own output)."""

    def __init__(self, k: int):
        self.h = torch.zeros(k, k, dtype=torch.float64)

    def apply(self, layer, x, bias, activation=None):
        from attnserve.models.layers.activation import act_and_mul

        x2 = x.reshape(-1, x.shape[-1]).double()
        self.h += x2.t() @ x2
        y = torch.nn.functional.linear(x, layer.weight, bias)
        return act_and_mul(y, activation, False) if activation is not None else y


def calibration_ids(tokenizer, n: int):
    """``n`` tokens of this repository's README (never part of the evaluation text)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "README.md")
    with open(path) as f:
        ids = tokenizer(f.read())["input_ids"]
    if len(ids) < n:
        raise ValueError(f"README.md has only {len(ids)} tokens; ask for fewer --calib-tokens")
    return ids[:n]


def run(model: str, positions: int, calib_tokens: int, damp: float = 0.01) -> Dict:
    import fp8_schemes as fs
    from fp8_accuracy import _load_runner, perplexity, perplexity_ratio_se

    from attnserve.bench.kv_accuracy import compare, teacher_forced_logits

    loaded, ids, runner = _load_runner(model, "bfloat16", positions, "cpu")

    def forward():
        return teacher_forced_logits(runner, ids)

    lins = fs.linears(loaded.model)
    base = forward()
    t0 = time.perf_counter()
    caps = {}
    for name, m in lins.items():
        caps[name] = m.quant_method = _Capture(m.weight.shape[1])
    calib = calibration_ids(loaded.tokenizer, calib_tokens)
    for i in range(0, len(calib), CALIB_CHUNK):  # sequences of at most CALIB_CHUNK tokens (the runner's pool)
        teacher_forced_logits(runner, calib[i:i + CALIB_CHUNK])
    fs.clear_scheme(lins)
    rounded = {}
    for name, m in lins.items():
        w = m.weight.float()
        rounded[name] = {"rtn": e4m3_round(w, row_scales(w)), "gptq": gptq_e4m3(w, caps[name].h, damp=damp)}
    prep_s = time.perf_counter() - t0
    rows = []
    for rounding in ("rtn", "gptq"):
        for act in ("none", "token"):
            for name, m in lins.items():
                meth = fs.EmulatedFp8Method(m.weight, "channel", act)
                meth.weight_f32 = rounded[name][rounding]
                m.quant_method = meth
            try:
                lg = forward()
            finally:
                fs.clear_scheme(lins)
            row = {"model": model, "rounding": rounding, "activation": act, **compare(base[:positions], lg[:positions]),
                   "perplexity_ratio": perplexity(lg, ids) / perplexity(base, ids),
                   "log_perplexity_ratio_se": perplexity_ratio_se(base, lg, ids)}
            rows.append(row)
            print(f"{model:14s} {rounding:5s} w8a{'16' if act == 'none' else '8'}: top-1 {row['top1_agreement']:.4f}  "
                  f"mean KL {row['mean_kl']:.5f}  ppl ratio {row['perplexity_ratio']:.4f} "
                  f"(log se {row['log_perplexity_ratio_se']:.4f})", flush=True)
    return {"rows": rows, "prep_seconds": prep_s, "damp": damp}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", nargs="+", default=["smollm2-135m"])
    ap.add_argument("--positions", type=int, default=512)
    ap.add_argument("--calib-tokens", type=int, default=1024)
    ap.add_argument("--damp", type=float, default=0.01, help="GPTQ damping, a fraction of H's mean diagonal")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    result = {"benchmark": "fp8_gptq_accuracy", "date": dt.date.today().isoformat(), "device": "cpu",
              "torch": torch.__version__, "positions": args.positions, "calib_tokens": args.calib_tokens,
              "calibration_text": "README.md", "text": "attnserve.bench.kv_accuracy.TEXT", "models": {}}
    for model in args.model:
        result["models"][model] = run(model, args.positions, args.calib_tokens, args.damp)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"cpu-fp8-gptq-accuracy-{result['date']}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
