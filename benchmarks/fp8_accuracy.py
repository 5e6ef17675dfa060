"""Accuracy of FP8 linears (``--quantization fp8``, issue 37) on real weights, teacher-forced.

``PYTHONPATH=src python benchmarks/fp8_accuracy.py [--model smollm2-135m gemma3-270m] [--positions 512]``

Each model (the packaged GGUFs, dequantised at load) runs one EXTEND step over the first
``--positions + 1`` tokens of `attnserve.bench.kv_accuracy.TEXT` (public-domain and plain
English prose, ~600 tokens) in these variants, one `ModelRunner` each:

* ``float32`` -- the reference;
* ``bfloat16`` -- the model in bf16 (what the GPU serves unquantised);
* ``fp8-w8a8/bfloat16`` -- ``--quantization fp8`` (per-channel e4m3 weights, dynamic
  per-token e4m3 activations; LM head, embeddings and norms unquantised), bf16
  activations: the numerics of the GPU's prefill / large-batch path (``_scaled_mm``);
* ``fp8-w8a16/bfloat16`` -- the same weights, activations not quantised: the numerics of
  the GPU's decode path (`skinny_linear_fp8`, batches of up to 16 rows);
* ``fp8-w8a8/float32`` (``--all``) -- W8A8 with float32 activations, against float32.

On the CPU the FP8 methods take their dequantising reference (`fp8_linear`), which rounds
weights and activations to e4m3 as the GPU kernels do and multiplies in float32: FP8
numerics, not FP8 speed (the W8A16 row replaces the reference's activation quantiser by
the identity, `_activations_unquantised`). Per variant and position ``t < positions`` the
logits predict token ``t + 1``; against the variant's ``baseline``: ``top1_agreement``
(share of positions whose argmax is the same), ``mean_kl`` (KL(p_base || p), nats),
``perplexity`` of the text and ``perplexity_ratio`` (variant / baseline). Issue 37's
targets for FP8 against bf16: agreement >= 0.97, ratio <= 1.02. Writes
``<out>/<device>-fp8-accuracy-<date>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import math
import sys
import time
from typing import Dict, List

import torch

#: (name, model dtype, quantization, baseline variant, activations quantised)
VARIANTS = (
    ("float32", "float32", None, None, False),
    ("bfloat16", "bfloat16", None, "float32", False),
    ("fp8-w8a8/bfloat16", "bfloat16", "fp8", "bfloat16", True),
    ("fp8-w8a16/bfloat16", "bfloat16", "fp8", "bfloat16", False),
)
EXTRA_VARIANTS = (("fp8-w8a8/float32", "float32", "fp8", "float32", True),)
TARGET_TOP1, TARGET_PPL_RATIO = 0.97, 1.02


def perplexity(logits: torch.Tensor, ids: List[int]) -> float:
    """``exp`` of the mean negative log-likelihood of ``ids[1:]`` under ``logits[:-1]``
    (``logits [len(ids), V]``)."""
    lp = torch.log_softmax(logits[:-1].double(), -1)
    nll = -lp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).mean()
    return float(math.exp(nll))


@contextlib.contextmanager
def _activations_unquantised():
    """The FP8 reference path with its activation quantiser replaced by the identity
    (W8A16 numerics; `Fp8LinearMethod._reference` multiplies ``q * s`` by the weight)."""
    from attnserve.models.layers.quantization.fp8_linear import Fp8LinearMethod

    original = Fp8LinearMethod._quantize_input
    Fp8LinearMethod._quantize_input = lambda self, layer, x2: (x2.float(), x2.new_ones((x2.shape[0], 1),
                                                                                      dtype=torch.float32))
    try:
        yield
    finally:
        Fp8LinearMethod._quantize_input = original


def run_model(model: str, positions: int, device: str = "cpu", variants=VARIANTS) -> List[Dict]:
    """Rows of one model: each variant's perplexity and its comparison with its baseline.

    Raises:
        ValueError: the text has fewer than ``positions + 1`` tokens under the model's tokenizer.
    """
    from attnserve.bench.kv_accuracy import TEXT, compare, teacher_forced_logits
    from attnserve.engine.model_runner import ModelRunner
    from attnserve.model_loader.loader import load_model
    from attnserve.server_args import ServerArgs

    logits: Dict[str, torch.Tensor] = {}
    rows = []
    ids: List[int] = []
    for name, dtype, quant, base, act_quant in variants:
        args = ServerArgs(model=model, device=device, dtype=dtype, max_total_tokens=max(1024, positions + 64),
                          max_running_requests=1, disable_cuda_graph=True, quantization=quant)
        args.check()
        t0 = time.perf_counter()
        loaded = load_model(model, dtype=args.resolved_dtype(), device=args.resolved_device(), progress=False,
                            quantization=quant)
        if not ids:
            ids = loaded.tokenizer(TEXT)["input_ids"][:positions + 1]
            if len(ids) < positions + 1:
                raise ValueError(f"the text has only {len(ids)} tokens for {model}; ask for fewer positions")
        with contextlib.nullcontext() if act_quant or quant is None else _activations_unquantised():
            logits[name] = teacher_forced_logits(ModelRunner(args, loaded), ids)
        row = {"model": model, "variant": name, "dtype": dtype, "quantization": quant,
               "activations_quantised": act_quant, "positions": positions,
               "perplexity": perplexity(logits[name], ids), "seconds": round(time.perf_counter() - t0, 1)}
        if base is not None:
            row["baseline"] = base
            row.update(compare(logits[base][:positions], logits[name][:positions]))
            row["perplexity_ratio"] = row["perplexity"] / perplexity(logits[base], ids)
            if quant == "fp8":
                row["meets_targets"] = (row["top1_agreement"] >= TARGET_TOP1
                                        and row["perplexity_ratio"] <= TARGET_PPL_RATIO)
        rows.append(row)
        msg = f"{model:14s} {name:19s} ppl {row['perplexity']:8.4f}"
        if base is not None:
            msg += (f"  vs {base:9s} top-1 {row['top1_agreement']:.4f}  ppl ratio {row['perplexity_ratio']:.4f}  "
                    f"mean KL {row['mean_kl']:.5f}")
        print(msg + f"  ({row['seconds']} s)", flush=True)
        del loaded
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("--positions", type=int, default=512)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--all", action="store_true", help="also W8A8 with float32 activations")
    args = ap.parse_args(argv)
    from attnserve.triton_env import triton_interpreting

    if args.device == "cpu" and triton_interpreting():
        raise SystemExit("unset TRITON_INTERPRET: on the CPU the FP8 reference path is the emulation measured "
                         "(the interpreter would run every GEMM in Python)")
    import transformers

    from attnserve.bench.results import write_result

    t0 = time.perf_counter()
    rows = []
    for model in args.model:
        rows.extend(run_model(model, args.positions, args.device, VARIANTS + (EXTRA_VARIANTS if args.all else ())))
    result = {"benchmark": "fp8-accuracy", "date": dt.date.today().isoformat(), "device": args.device,
              "torch": torch.__version__, "transformers": transformers.__version__,
              "command": "benchmarks/fp8_accuracy.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "text": "attnserve.bench.kv_accuracy.TEXT", "fp8": "per-channel e4m3 weights, dynamic per-token e4m3 "
              "activations (--quantization fp8); CPU: dequantising reference (FP8 numerics); w8a16: activations "
              "unquantised (the GPU decode path)",
              "targets": {"top1_agreement_min": TARGET_TOP1, "perplexity_ratio_max": TARGET_PPL_RATIO},
              "rows": rows, "total_s": round(time.perf_counter() - t0, 1)}
    write_result(result, args.out, "fp8-accuracy", args.device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
