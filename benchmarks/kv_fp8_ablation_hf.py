"""Where an fp8 KV cache loses accuracy, measured outside the engine (HF transformers).

``PYTHONPATH=src python benchmarks/kv_fp8_ablation_hf.py [--model smollm2-135m gemma3-270m]``

An independent check of `attnserve.bench.kv_accuracy` (issue 21's accuracy line): the HF
model (float32, from the same GGUF) runs the same 512 teacher-forced positions of
`kv_accuracy.TEXT` with an attention function registered through transformers'
``AttentionInterface`` that rounds the post-RoPE keys and/or values to a storage dtype and
back before SDPA — what an fp8 cache with per-tensor scale 1.0 does to every key a query
reads (its own included). Rows: K and V in e4m3, only K, only V, K and V with the first
1 / 4 positions exact (attention-sink tokens kept unrounded), e5m2, and bf16 as a
reference point. Compared with the unrounded run by `kv_accuracy.compare` (top-1
agreement, mean KL(p_ref || p), nats). Writes ``<out>/cpu-kv-fp8-ablation-hf-<date>.json``.

Two more rows try quantizer-side fixes that keep a per-tensor fp8 cache and leave the
scores unchanged in exact arithmetic, each with K and V in e4m3:

* K centred: store ``k - mu`` with ``mu`` the per-layer, per-head channel mean of the
  post-RoPE keys over a *different* text (`CALIBRATION_TEXT`); ``q . mu`` is the same for
  every key of a query, so softmax is unchanged (SageAttention's K smoothing,
  arXiv:2410.02367, with a calibrated instead of per-block mean);
* q/k rotated: post-RoPE queries and keys multiplied by a normalised Hadamard matrix
  before the keys are rounded (the online rotation QuaRot applies to its KV cache,
  arXiv:2404.00456), spreading outlier channels over all channels.
"""

from __future__ import annotations

import argparse
import datetime as dt
from typing import Optional

import torch

#: calibration text for the K-centred row (not the evaluation text)
CALIBRATION_TEXT = (
    "The history of the steam engine begins in the first century, when Hero of Alexandria described a device "
    "that spun when heated. Centuries later, engineers in England built pumps to drain water from mines. "
    "Thomas Newcomen's atmospheric engine of 1712 was inefficient but reliable, and James Watt's separate "
    "condenser cut its fuel use by three quarters. Railways, factories and ships followed. "
) * 6


def _hadamard(n: int) -> torch.Tensor:
    """Sylvester's normalised Hadamard matrix ``[n, n]`` (``n`` a power of two): orthogonal."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n ** 0.5


def _round_to(x: torch.Tensor, dtype: Optional[torch.dtype], exact_prefix: int) -> torch.Tensor:
    """``x`` [B, H, T, D] rounded to ``dtype`` and back (positions < exact_prefix untouched)."""
    if dtype is None:
        return x
    y = x.to(dtype).to(x.dtype)
    if exact_prefix:
        y[:, :, :exact_prefix] = x[:, :, :exact_prefix]
    return y


def main(argv=None) -> int:
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from attnserve.bench.kv_accuracy import TEXT, compare
    from attnserve.bench.results import write_result
    from attnserve.model_loader.loader import resolve_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("--positions", type=int, default=512)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)

    mode = {"k": None, "v": None, "exact": 0, "mu": None, "rot": False, "collect": None}

    def rounded_sdpa(module, query, key, value, attention_mask, **kw):
        layer = module.layer_idx
        if mode["collect"] is not None:  # calibration pass: per-head channel means [H, D]
            mode["collect"][layer] = key[0].mean(dim=1)
        if mode["rot"]:
            h = _hadamard(query.shape[-1]).to(query.dtype)
            query, key = query @ h, key @ h
        mu = mode["mu"][layer][None, :, None, :] if mode["mu"] is not None else None
        if mu is not None:
            key = _round_to(key - mu, mode["k"], mode["exact"]) + mu
        else:
            key = _round_to(key, mode["k"], mode["exact"])
        return sdpa_attention_forward(module, query, key, _round_to(value, mode["v"], mode["exact"]),
                                      attention_mask, **kw)

    AttentionInterface.register("kv_rounded_sdpa", rounded_sdpa)
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    cases = [("K+V e4m3", e4, e4, 0), ("K only e4m3", e4, None, 0), ("V only e4m3", None, e4, 0),
             ("K+V e4m3, first 1 exact", e4, e4, 1), ("K+V e4m3, first 4 exact", e4, e4, 4),
             ("K+V e5m2", e5, e5, 0), ("K+V bf16", torch.bfloat16, torch.bfloat16, 0),
             ("K+V e4m3, K centred (calibrated)", e4, e4, "centred"), ("K+V e4m3, q/k rotated", e4, e4, "rotated")]
    rows = []
    for name in args.model:
        src = resolve_model(name)
        model = AutoModelForCausalLM.from_pretrained(src.model_path, gguf_file=src.gguf_file, dtype=torch.float32,
                                                     attn_implementation="kv_rounded_sdpa").eval()
        tok = AutoTokenizer.from_pretrained(src.model_path, gguf_file=src.gguf_file)
        ids = torch.tensor([tok(TEXT)["input_ids"][:args.positions]])

        def logits(k, v, exact, x=ids, **extra):
            mode.update({"k": k, "v": v, "exact": exact, "mu": None, "rot": False, "collect": None, **extra})
            with torch.no_grad():
                return model(x).logits[0].float()

        ref = logits(None, None, 0)
        means = {}
        logits(None, None, 0, torch.tensor([tok(CALIBRATION_TEXT)["input_ids"][:args.positions]]), collect=means)
        for label, k, v, exact in cases:
            extra = {"centred": dict(exact=0, mu=means), "rotated": dict(exact=0, rot=True)}.get(exact, dict(exact=exact))
            r = compare(ref, logits(k, v, **extra))
            rows.append({"model": name, "case": label, "positions": ids.shape[1], **r})
            print(f"{name:14s} {label:26s} top-1 {r['top1_agreement']:.4f}  mean KL {r['mean_kl']:.5f}", flush=True)
    import transformers

    write_result({"benchmark": "kv-fp8-ablation-hf", "date": dt.date.today().isoformat(), "device": "cpu",
                  "torch": torch.__version__, "transformers": transformers.__version__, "compute_dtype": "float32",
                  "scales": 1.0, "rows": rows}, args.out, "kv-fp8-ablation-hf", "cpu")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
