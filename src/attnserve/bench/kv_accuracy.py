"""Accuracy of an FP8 KV cache against the unquantized cache, teacher-forced.

``python -m attnserve.bench.kv_accuracy [--model smollm2-135m gemma3-270m] [--positions 512]``

The model is loaded once; for each ``--kv-cache-dtype`` (auto, fp8_e4m3, fp8_e5m2) a
`ModelRunner` over it prefills the same ``--positions`` tokens of English text in one
EXTEND step (every query reads every key through the cache, its own included) and returns
the logits of every position. Reported per format, against auto: ``top1_agreement`` (share
of positions whose argmax is the same) and ``mean_kl`` (mean over positions of
KL(p_auto || p_fp8), nats). Scales are 1.0 (the packaged GGUFs carry none). Writes
``<out>/<device>-kv-accuracy-<date>.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import time
from typing import Dict, List

import torch

from attnserve.bench.results import device_slug, write_result

TEXT = (
    "When in the Course of human events, it becomes necessary for one people to dissolve the political bands "
    "which have connected them with another, and to assume among the powers of the earth, the separate and equal "
    "station to which the Laws of Nature and of Nature's God entitle them, a decent respect to the opinions of "
    "mankind requires that they should declare the causes which impel them to the separation. We hold these "
    "truths to be self-evident, that all men are created equal, that they are endowed by their Creator with "
    "certain unalienable Rights, that among these are Life, Liberty and the pursuit of Happiness. "
    "The cat sat on the warm windowsill and watched the birds in the garden. Every morning the cat waited for the "
    "sun to rise, and every evening the cat slept on the old blue chair by the door. When visitors came, the cat "
    "hid under the bed until the house was quiet again, then walked slowly to the kitchen to ask for dinner. "
    "A small river runs through the valley below the village. In spring the river is fast and cold, full of "
    "melted snow from the mountains, and children are told to stay away from its banks. In summer the river "
    "becomes slow and shallow, and families bring bread and cheese to eat in the shade of the trees that grow "
    "along the water. In autumn the river carries red and yellow leaves, and in winter it freezes near the edges. "
    "Every weekday Anna takes the early train to the city. The train leaves at seven, and she usually reads a book "
    "or looks out of the window at the fields and the farms. If the train is late, she sends a message to her team "
    "and starts working on her laptop, because the office is only a short walk from the station. "
    "The old library in the center of town was built more than a hundred years ago. Its reading room has tall "
    "windows, wooden tables and green lamps, and on rainy afternoons the library is full of students. Once a month "
    "the library invites a local writer to read from a new book and answer questions from the audience. "
    "A hash table stores values in an array of buckets. A hash function turns each key into an index, and the "
    "value is placed in the bucket at that index. When two keys land in the same bucket, the table either keeps a "
    "short list in that bucket or probes for the next free one. Lookups are fast on average because only one "
    "bucket, or a few, must be searched, but a poor hash function or a nearly full table makes them slower. "
    "Vaccines train the immune system by showing it a harmless piece or copy of a germ. The body makes antibodies "
    "and memory cells, so that when the real germ arrives later, the defense is ready and the illness is milder "
    "or never starts. The water cycle moves water between the sea, the air and the land: the sun warms the ocean, "
    "water evaporates, rises and cools into clouds, falls as rain or snow, and flows back through rivers."
)


def teacher_forced_logits(runner, ids: List[int]) -> torch.Tensor:
    """float32 logits ``[len(ids), V]`` of one EXTEND over ``ids`` (pool left empty after)."""
    from attnserve.forward_batch import ForwardMode

    r2t, alloc = runner.req_to_token_pool, runner.token_to_kv_pool_allocator
    rows = r2t.alloc(1)
    n = len(ids)
    loc = alloc.alloc_extend([0], [n], [0])
    try:
        r2t.write_host(torch.full((n,), rows[0], dtype=torch.int64), torch.arange(n), loc.to(torch.int32))
        r2t.write_device(torch.full((n,), rows[0], dtype=torch.int64), torch.arange(n), loc.to(torch.int32))
        fb = runner.build_forward_batch(ForwardMode.EXTEND, ids, rows, [0], [n], loc.to(runner.device))
        return runner.forward(fb, return_all_logits=True).float().cpu()
    finally:
        alloc.free(loc)
        r2t.free(rows)


def compare(reference: torch.Tensor, other: torch.Tensor) -> Dict[str, float]:
    """``top1_agreement`` and ``mean_kl`` (KL(reference || other), nats) over positions."""
    lp_ref = torch.log_softmax(reference.double(), -1)
    lp = torch.log_softmax(other.double(), -1)
    kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1)
    agree = (reference.argmax(-1) == other.argmax(-1)).double().mean()
    return {"top1_agreement": float(agree), "mean_kl": float(kl.mean()), "max_kl": float(kl.max())}


def measure(model: str, positions: int, formats=("fp8_e4m3", "fp8_e5m2"), device: str = "cpu",
            dtype: str = "float32", attention_backend: str = None) -> Dict[str, Dict[str, float]]:
    """Load ``model`` once and compare each of ``formats`` with the unquantized cache."""
    from attnserve.engine.model_runner import ModelRunner
    from attnserve.model_loader.loader import load_model
    from attnserve.server_args import ServerArgs

    base = ServerArgs(model=model, device=device, dtype=dtype, max_total_tokens=max(1024, positions + 64),
                      max_running_requests=1, disable_cuda_graph=True, attention_backend=attention_backend)
    base.check()
    loaded = load_model(model, dtype=base.resolved_dtype(), device=base.resolved_device())
    ids = loaded.tokenizer(TEXT)["input_ids"][:positions]
    if len(ids) < positions:
        raise ValueError(f"the text has only {len(ids)} tokens for {model}; ask for fewer positions")
    ref = teacher_forced_logits(ModelRunner(base, loaded), ids)
    out = {}
    for name in formats:
        args = dataclasses.replace(base, kv_cache_dtype=name)
        out[name] = compare(ref, teacher_forced_logits(ModelRunner(args, loaded), ids))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("--positions", type=int, default=512)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows = []
    for model in args.model:
        for fmt, r in measure(model, args.positions, device=args.device).items():
            rows.append({"model": model, "kv_cache_dtype": fmt, "positions": args.positions, **r})
            print(f"{model:14s} {fmt:9s} top-1 agreement {r['top1_agreement']:.4f}  mean KL {r['mean_kl']:.5f}  "
                  f"max KL {r['max_kl']:.4f}", flush=True)
    result = {"benchmark": "kv-accuracy", "date": dt.date.today().isoformat(), "device": device_slug(args.device),
              "torch": torch.__version__, "compute_dtype": "float32", "rows": rows,
              "total_s": time.perf_counter() - t0}
    write_result(result, args.out, "kv-accuracy", args.device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
