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
* ``fp8-w8a8/float32`` (``--all``) -- W8A8 with float32 activations, against float32;
* ``fp8-w8a8+head/bfloat16``, ``fp8-w8a16+head/bfloat16`` (``--lm-head``) -- the two FP8
  variants with the LM head FP8 too (``--enable-fp8-lm-head``).

On the CPU the FP8 methods take their dequantising reference (`fp8_linear`), which rounds
weights and activations to e4m3 as the GPU kernels do and multiplies in float32: FP8
numerics, not FP8 speed (the W8A16 row replaces the reference's activation quantiser by
the identity, `_activations_unquantised`). Per variant and position ``t < positions`` the
logits predict token ``t + 1``; against the variant's ``baseline``: ``top1_agreement``
(share of positions whose argmax is the same), ``mean_kl`` (KL(p_base || p), nats),
``perplexity`` of the text and ``perplexity_ratio`` (variant / baseline). Issue 37's
targets for FP8 against bf16: agreement >= 0.97, ratio <= 1.02. Writes
``<out>/<device>-fp8-accuracy-<date>.json``.

``--schemes`` instead loads each model once unquantised (bf16) and emulates a table of FP8
schemes on it (`fp8_schemes`: per-channel / per-group / block weights, W8A8 or W8A16, one
linear type alone, layers kept in bf16), each compared with the bf16 model; a row
``bf16 weights, reference GEMM`` (the same weights through the emulation's float32 GEMM)
gives the baseline's own noise floor. With ``--sensitivity`` the model is also loaded in
float32, each decoder layer quantised alone (W8A16) against float32 ranks the layers, and
the ``k`` least sensitive are quantised (the rest bf16) for ``k`` in ``--greedy-layers``
fractions. Writes ``<out>/<device>-fp8-accuracy-schemes-<date>.json``.
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
#: ``--lm-head``: the same two FP8 variants with the LM head FP8 too (``--enable-fp8-lm-head``)
LM_HEAD_VARIANTS = (("fp8-w8a8+head/bfloat16", "bfloat16", "fp8", "bfloat16", True),
                    ("fp8-w8a16+head/bfloat16", "bfloat16", "fp8", "bfloat16", False))
TARGET_TOP1, TARGET_PPL_RATIO = 0.97, 1.02


def token_nll(logits: torch.Tensor, ids: List[int]) -> torch.Tensor:
    """float64 ``[len(ids) - 1]``: negative log-likelihood of each of ``ids[1:]`` under
    ``logits[:-1]`` (``logits [len(ids), V]``), nats."""
    lp = torch.log_softmax(logits[:-1].double(), -1)
    return -lp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)


def perplexity(logits: torch.Tensor, ids: List[int]) -> float:
    """``exp`` of the mean of `token_nll`."""
    return float(math.exp(token_nll(logits, ids).mean()))


def perplexity_ratio_se(base: torch.Tensor, other: torch.Tensor, ids: List[int]) -> float:
    """Standard error of ``log(perplexity ratio)`` over the text's tokens: ``std(nll_other -
    nll_base) / sqrt(tokens)`` (the ratio's sampling noise on one text of this length)."""
    d = token_nll(other, ids) - token_nll(base, ids)
    return float(d.std() / math.sqrt(d.numel()))


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
                            quantization=quant, fp8_lm_head="+head" in name)
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


def _load_runner(model: str, dtype: str, positions: int, device: str):
    """Load ``model`` unquantised; returns ``(loaded, ids, runner)``: the first ``positions + 1``
    token ids of the evaluation text and a `ModelRunner` whose pool holds at least 1,024 tokens."""
    from attnserve.bench.kv_accuracy import TEXT
    from attnserve.engine.model_runner import ModelRunner
    from attnserve.model_loader.loader import load_model
    from attnserve.server_args import ServerArgs

    args = ServerArgs(model=model, device=device, dtype=dtype, max_total_tokens=max(1024, positions + 64),
                      max_running_requests=1, disable_cuda_graph=True)
    args.check()
    loaded = load_model(model, dtype=args.resolved_dtype(), device=args.resolved_device(), progress=False)
    ids = loaded.tokenizer(TEXT)["input_ids"][:positions + 1]
    if len(ids) < positions + 1:
        raise ValueError(f"the text has only {len(ids)} tokens for {model}; ask for fewer positions")
    return loaded, ids, ModelRunner(args, loaded)


def _forward_fn(model: str, dtype: str, positions: int, device: str):
    """`_load_runner`; returns ``(loaded, ids, forward)`` where ``forward()`` is the
    teacher-forced float32 logits ``[positions + 1, V]`` of the model as it stands."""
    from attnserve.bench.kv_accuracy import teacher_forced_logits

    loaded, ids, runner = _load_runner(model, dtype, positions, device)
    return loaded, ids, lambda: teacher_forced_logits(runner, ids)


def _scheme_row(model: str, scheme, loaded, lins, forward, base, ids, positions: int) -> Dict:
    import fp8_schemes as fs
    from attnserve.bench.kv_accuracy import compare

    t0 = time.perf_counter()
    size = fs.apply_scheme(lins, scheme)
    try:
        lg = forward()
    finally:
        fs.clear_scheme(lins)
    row = {"model": model, "scheme": scheme.name, "weight": scheme.weight, "activation": scheme.activation,
           "gpu_kernel": scheme.kernel, **compare(base[:positions], lg[:positions]),
           "perplexity_ratio": perplexity(lg, ids) / perplexity(base, ids),
           "log_perplexity_ratio_se": perplexity_ratio_se(base, lg, ids), **size,
           "model_bytes_rel": fs.model_bytes_rel(loaded.model, lins, size["linear_bytes_rel"])}
    row["meets_targets"] = row["top1_agreement"] >= TARGET_TOP1 and row["perplexity_ratio"] <= TARGET_PPL_RATIO
    print(f"{model:14s} {scheme.name:60s} top-1 {row['top1_agreement']:.4f}  ppl ratio "
          f"{row['perplexity_ratio']:.4f} (log se {row['log_perplexity_ratio_se']:.4f})  mean KL {row['mean_kl']:.5f}"
          f"  linear bytes {row['linear_bytes_rel']:.3f}"
          f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
    return row


def run_schemes(model: str, positions: int, device: str = "cpu", sensitivity: bool = False,
                greedy_fractions=(0.5, 0.75, 0.9)) -> Dict:
    """The scheme table of one model (see the module doc): ``{"rows": [...], "layer_kl_f32": {...}}``."""
    import fp8_schemes as fs
    from attnserve.bench.kv_accuracy import compare

    out: Dict = {"rows": []}
    order = None
    if sensitivity:
        loaded, ids, forward = _forward_fn(model, "float32", positions, device)
        lins = fs.linears(loaded.model)
        base = forward()
        kl = {}
        for i, scheme in enumerate(fs.per_layer_schemes(fs.num_decoder_layers(lins))):
            fs.apply_scheme(lins, scheme)
            try:
                kl[i] = compare(base[:positions], forward()[:positions])["mean_kl"]
            finally:
                fs.clear_scheme(lins)
        order = sorted(kl, key=kl.get)
        out["layer_kl_f32"] = kl
        print(f"{model}: layers by float32 KL, most sensitive first: {order[::-1]}", flush=True)
        del loaded, lins, forward
    loaded, ids, forward = _forward_fn(model, "bfloat16", positions, device)
    lins = fs.linears(loaded.model)
    nl = fs.num_decoder_layers(lins)
    base = forward()
    schemes = list(fs.base_schemes(nl))
    if order is not None:
        counts = sorted({max(1, min(nl - 1, round(f * nl))) for f in greedy_fractions})
        schemes += list(fs.greedy_schemes(order, nl, counts, "none"))
        schemes += list(fs.greedy_schemes(order, nl, counts[:1], "token"))
    for scheme in schemes:
        out["rows"].append(_scheme_row(model, scheme, loaded, lins, forward, base, ids, positions))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("--positions", type=int, default=512)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--all", action="store_true", help="also W8A8 with float32 activations")
    ap.add_argument("--lm-head", action="store_true", help="also both FP8 variants with the LM head FP8 "
                    "(--enable-fp8-lm-head)")
    ap.add_argument("--schemes", action="store_true", help="the emulated scheme table (fp8_schemes) instead")
    ap.add_argument("--sensitivity", action="store_true", help="with --schemes: rank layers in float32 and "
                    "keep the most sensitive in bf16")
    ap.add_argument("--greedy-layers", type=float, nargs="+", default=[0.5, 0.75, 0.9],
                    help="with --sensitivity: fractions of the decoder layers quantised")
    args = ap.parse_args(argv)
    from attnserve.triton_env import triton_interpreting

    if args.device == "cpu" and triton_interpreting():
        raise SystemExit("unset TRITON_INTERPRET: on the CPU the FP8 reference path is the emulation measured "
                         "(the interpreter would run every GEMM in Python)")
    import transformers

    from attnserve.bench.results import write_result

    t0 = time.perf_counter()
    meta = {"date": dt.date.today().isoformat(), "device": args.device, "torch": torch.__version__,
            "transformers": transformers.__version__,
            "command": "benchmarks/fp8_accuracy.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "text": "attnserve.bench.kv_accuracy.TEXT", "positions": args.positions,
            "targets": {"top1_agreement_min": TARGET_TOP1, "perplexity_ratio_max": TARGET_PPL_RATIO}}
    if args.schemes:
        per_model = {m: run_schemes(m, args.positions, args.device, args.sensitivity, args.greedy_layers)
                     for m in args.model}
        result = {"benchmark": "fp8-accuracy-schemes", **meta,
                  "fp8": "emulated (benchmarks/fp8_schemes.py): weights e4m3 quantised from the bf16 model, "
                  "float32 scales, float32 GEMM of the dequantised values, bf16 activations; against the bf16 "
                  "model (F.linear)", "rows": [r for m in per_model.values() for r in m["rows"]],
                  "layer_kl_f32": {m: v["layer_kl_f32"] for m, v in per_model.items() if "layer_kl_f32" in v},
                  "total_s": round(time.perf_counter() - t0, 1)}
        write_result(result, args.out, "fp8-accuracy-schemes", args.device)
        return 0
    rows = []
    for model in args.model:
        rows.extend(run_model(model, args.positions, args.device, VARIANTS + (EXTRA_VARIANTS if args.all else ())
                              + (LM_HEAD_VARIANTS if args.lm_head else ())))
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
