"""NGRAM speculative decoding against plain decoding. Writes ``<out>/<device>-speculative-<date>.json``.

``python -m attnserve.bench.speculative [--device cpu] [--dtype auto] [--num-draft-tokens 1 2 4 8]
[--max-bfs-breadth 1 10] [--workload edit chat] [--requests 1] [--max-new-tokens 128]``

In one process, the baseline (no speculation) and then every ``--num-draft-tokens`` x
``--max-bfs-breadth`` case (the engine's ``--speculative-num-draft-tokens`` and
``--speculative-ngram-max-bfs-breadth``) each build an `LLM`, run every workload once to
warm up and then ``--repeats`` times timed (greedy, prefix cache flushed before each run;
the median is reported). Workloads: ``edit`` asks to repeat a paragraph with one word
replaced (the drafts, taken from the request's own prompt, mostly match); ``chat`` asks
ordinary questions (drafts match only where the answer repeats itself). ``--requests``
prompts run as one concurrent batch. ``num_draft_tokens`` counts the verified nodes including
the root, so 1 verifies no draft (a plain decode step through the verify path); its breadth
is irrelevant, so it runs once.

Per case and workload:

* ``wall_s`` / ``output_tokens_per_s``: wall time of ``generate`` and output tokens / wall;
* ``accept_length``: SGLang's definition, completion tokens / ``spec_verify_ct`` summed over
  the requests (the first token, sampled by the prefill, is counted, so a run with no
  accepted draft is slightly above 1);
* ``stats_accept_length``: the scheduler's ``SpecStats.mean_accept_length`` (tokens emitted
  by verify steps / request-verifies, the prefill's token not counted);
* ``speedup``: the baseline's median wall / this case's, both measured in this run;
* ``identical``: every request's tokens equal the baseline's (greedy: must be True).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import os
import platform
import statistics
import time

import torch

from attnserve.bench.results import device_slug, write_result

_PARAGRAPHS = [
    ("cat", "dog", "The cat sat on the warm windowsill and watched the birds in the garden. Every morning the cat "
     "waited for the sun to rise, and every evening the cat slept on the old blue chair by the door. When visitors "
     "came, the cat hid under the bed until the house was quiet again, then walked slowly to the kitchen to ask for "
     "dinner. Late at night the cat climbed onto the roof and looked at the moon for a long time before it came "
     "back inside to sleep."),
    ("river", "stream", "A small river runs through the valley below the village. In spring the river is fast and "
     "cold, full of melted snow from the mountains, and children are told to stay away from its banks. In summer "
     "the river becomes slow and shallow, and families bring bread and cheese to eat in the shade of the trees that "
     "grow along the water. In autumn the river carries red and yellow leaves, and in winter it freezes near the "
     "edges."),
    ("train", "bus", "Every weekday Anna takes the early train to the city. The train leaves at seven, and she "
     "usually reads a book or looks out of the window at the fields and the farms. If the train is late, she sends "
     "a message to her team and starts working on her laptop, because the office is only a short walk from the "
     "station. On Fridays the train is crowded, so she leaves home ten minutes earlier to find a seat."),
    ("library", "museum", "The old library in the center of town was built more than a hundred years ago. Its "
     "reading room has tall windows, wooden tables and green lamps, and on rainy afternoons the library is full of "
     "students. Once a month the library invites a local writer to read from a new book and answer questions from "
     "the audience. Children love the library on Saturdays, when a volunteer reads stories aloud in the corner."),
]
EDIT_PROMPTS = [f"Repeat the following paragraph exactly, but replace '{a}' with '{b}':\n\n{p}"
                for a, b, p in _PARAGRAPHS]
CHAT_PROMPTS = [  # questions with long answers, no text to copy (bench.offline's PROMPTS are mostly short)
    "Explain how a hash table works.",
    "How do vaccines train the immune system?",
    "Describe the water cycle in simple terms.",
    "Explain recursion to a ten-year-old.",
]
WORKLOADS = {"edit": EDIT_PROMPTS, "chat": CHAT_PROMPTS}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_case(llm, device: str, prompts, sp, repeats: int) -> dict:
    """Warm up once, then ``repeats`` timed ``generate`` calls; outputs of the last one."""
    from attnserve.engine.speculative.verify import SpecStats

    sched = llm.engine.scheduler
    llm.generate(prompts, sp, chat=True)  # warm-up: the same workload once
    if sched.spec is not None:
        sched.spec.stats = SpecStats()
    walls = []
    for _ in range(repeats):
        sched.flush_prefix_cache()
        _sync(device)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, chat=True)
        _sync(device)
        walls.append(time.perf_counter() - t0)
    wall = statistics.median(walls)
    tokens = sum(len(o.token_ids) for o in outs)
    verify_ct = sum(o.spec_verify_ct for o in outs)
    return {
        "wall_s": wall, "walls_s": walls, "output_tokens": tokens, "output_tokens_per_s": tokens / wall,
        "accept_length": tokens / verify_ct if verify_ct else None,
        "stats_accept_length": sched.spec.stats.mean_accept_length if sched.spec is not None else None,
        "token_ids": [o.token_ids for o in outs],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--load-format", default="auto", choices=["auto", "gguf", "safetensors", "dummy"])
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--dtype", default="auto", help="model dtype (auto: float32 on CPU, bfloat16 on CUDA)")
    ap.add_argument("--requests", type=int, default=1, help="concurrent requests (one batch)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--num-draft-tokens", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--max-bfs-breadth", type=int, nargs="+", default=[1, 10])
    ap.add_argument("--workload", nargs="+", default=["edit", "chat"], choices=sorted(WORKLOADS))
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per case (median)")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)

    import transformers

    from attnserve.engine.llm import LLM
    from attnserve.engine.sampling_params import SamplingParams

    sp = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    prompts = {w: [WORKLOADS[w][i % len(WORKLOADS[w])] for i in range(args.requests)] for w in args.workload}
    cases = [(None, None)]
    for b in args.max_bfs_breadth:
        cases += [(n, b) for n in args.num_draft_tokens if n > 1 or b == args.max_bfs_breadth[0]]
    t_start, load_start = time.perf_counter(), os.getloadavg()
    rows, base, meta = [], {}, {}
    for n, breadth in cases:
        spec = {} if n is None else dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=n,
                                         speculative_ngram_max_bfs_breadth=breadth)
        llm = LLM(args.model, device=args.device, load_format=args.load_format, dtype=args.dtype,
                  max_running_requests=max(args.requests, 1), **spec)
        runner = llm.engine.model_runner
        device = runner.device.type
        meta = {"device": device, "dtype": str(runner.dtype), "attention_backend": runner.backend_choice.decode}
        for w in args.workload:
            r = run_case(llm, device, prompts[w], sp, args.repeats)
            ids = r.pop("token_ids")
            if n is None:
                base[w] = (r["wall_s"], ids)
            row = {"workload": w, "speculative": n is not None, "num_draft_tokens": n, "max_bfs_breadth": breadth,
                   "requests": args.requests, **r, "speedup": base[w][0] / r["wall_s"], "identical": ids == base[w][1]}
            rows.append(row)
            acc = "-" if row["accept_length"] is None else f"{row['accept_length']:.2f}"
            sacc = "-" if row["stats_accept_length"] is None else f"{row['stats_accept_length']:.2f}"
            print(f"{w:5s} {'baseline' if n is None else f'n={n} breadth={breadth}':18s} {r['output_tokens']:4d} tok "
                  f"{r['output_tokens_per_s']:7.1f} tok/s  wall {r['wall_s']:6.2f} s  accept {acc:>5s} "
                  f"(stats {sacc:>5s})  speedup {row['speedup']:.2f}x  identical {row['identical']}", flush=True)
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    device = meta["device"]
    result = {
        "benchmark": "speculative",
        "date": dt.date.today().isoformat(),
        "device": device_slug(device),
        "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "model": args.model,
        "dtype": meta["dtype"],
        "attention_backend": meta["attention_backend"],
        "args": vars(args),
        "total_s": time.perf_counter() - t_start,
        "loadavg_start_end": [load_start, os.getloadavg()],  # 1/5/15-min: other work on the machine skews timings
        "rows": rows,
    }
    write_result(result, args.out, "speculative", device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
