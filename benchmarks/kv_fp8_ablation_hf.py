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
"""

from __future__ import annotations

import argparse
import datetime as dt
from typing import Optional

import torch


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

    mode = {"k": None, "v": None, "exact": 0}

    def rounded_sdpa(module, query, key, value, attention_mask, **kw):
        return sdpa_attention_forward(module, query, _round_to(key, mode["k"], mode["exact"]),
                                      _round_to(value, mode["v"], mode["exact"]), attention_mask, **kw)

    AttentionInterface.register("kv_rounded_sdpa", rounded_sdpa)
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    cases = [("K+V e4m3", e4, e4, 0), ("K only e4m3", e4, None, 0), ("V only e4m3", None, e4, 0),
             ("K+V e4m3, first 1 exact", e4, e4, 1), ("K+V e4m3, first 4 exact", e4, e4, 4),
             ("K+V e5m2", e5, e5, 0), ("K+V bf16", torch.bfloat16, torch.bfloat16, 0)]
    rows = []
    for name in args.model:
        src = resolve_model(name)
        model = AutoModelForCausalLM.from_pretrained(src.model_path, gguf_file=src.gguf_file, dtype=torch.float32,
                                                     attn_implementation="kv_rounded_sdpa").eval()
        tok = AutoTokenizer.from_pretrained(src.model_path, gguf_file=src.gguf_file)
        ids = torch.tensor([tok(TEXT)["input_ids"][:args.positions]])

        def logits(k, v, exact):
            mode.update(k=k, v=v, exact=exact)
            with torch.no_grad():
                return model(ids).logits[0].float()

        ref = logits(None, None, 0)
        for label, k, v, exact in cases:
            r = compare(ref, logits(k, v, exact))
            rows.append({"model": name, "case": label, "positions": ids.shape[1], **r})
            print(f"{name:14s} {label:26s} top-1 {r['top1_agreement']:.4f}  mean KL {r['mean_kl']:.5f}", flush=True)
    import transformers

    write_result({"benchmark": "kv-fp8-ablation-hf", "date": dt.date.today().isoformat(), "device": "cpu",
                  "torch": torch.__version__, "transformers": transformers.__version__, "compute_dtype": "float32",
                  "scales": 1.0, "rows": rows}, args.out, "kv-fp8-ablation-hf", "cpu")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
