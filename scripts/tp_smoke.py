"""Smoke test of tensor parallelism on one host: greedy tokens of ``--tp`` ranks vs tp 1 for a
small dummy model, in several engine modes, each under a time limit.

``PYTHONPATH=src python scripts/tp_smoke.py --device cuda --tp 2``; with
``ATTNSERVE_DEBUG_STACKS=20`` every rank prints its threads' stacks every 20 s (to find a hang).
"""

import argparse
import faulthandler
import os
import sys
import time


def run(args, extra):
    from attnserve import LLM, SamplingParams

    kw = dict(load_format="dummy", device=args.device, dtype=args.dtype, max_total_tokens=4096,
              max_running_requests=8, **extra)
    prompts = [[1, 5, 9, 13, 17, 21], [3, 4, 5], list(range(10, 40))]
    sp = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    t = time.time()
    ref = [o.token_ids for o in LLM(args.model, **kw).generate(prompts, sp)]
    llm = LLM(args.model, tp_size=args.tp, **kw)
    try:
        got = [o.token_ids for o in llm.generate(prompts, sp)]
    finally:
        llm.engine.shutdown()
    print(f"{extra}: identical={got == ref} ({time.time() - t:.1f} s)", flush=True)
    return got == ref


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--model", default="llama-tiny")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--mode", default="all", choices=["all", "eager", "graphs", "overlap"])
    args = ap.parse_args()
    if os.environ.get("ATTNSERVE_DEBUG_STACKS"):
        faulthandler.dump_traceback_later(float(os.environ["ATTNSERVE_DEBUG_STACKS"]), repeat=True)
    modes = {"eager": dict(disable_cuda_graph=True, disable_overlap_schedule=True),
             "graphs": dict(disable_overlap_schedule=True),
             "overlap": dict(disable_overlap_schedule=False)}
    if args.device == "cpu":
        modes.pop("graphs")
        modes["eager"].pop("disable_cuda_graph")
    ok = all(run(args, modes[m]) for m in (modes if args.mode == "all" else [args.mode]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
