"""Host time of speculative decoding steps on a GPU (cProfile over the engine loop).

``PYTHONPATH=src python benchmarks/profile_spec_host.py [--model smollm2-135m]`` runs one
request (a repetitive 512-token prompt, 256 new tokens, NGRAM 8 drafts, dummy weights,
graphs on) once to warm up, then under cProfile, and prints the functions with the most
own time and the wall time per step (host work + the GPU time the host waits for).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import time

import torch

from attnserve.engine.engine import Engine
from attnserve.engine.sampling_params import SamplingParams
from attnserve.server_args import ServerArgs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args(argv)
    engine = Engine(ServerArgs(model=args.model, load_format="dummy", device="cuda", speculative_algorithm="NGRAM",
                               speculative_num_draft_tokens=8, max_running_requests=8, cuda_graph_max_bs=8,
                               context_length=2048))
    rnd = random.Random(0)
    phrase = [rnd.randrange(100, 20000) for _ in range(32)]
    prompt = (phrase * 16)[:512]

    def run():
        req = engine.add_request(list(prompt), SamplingParams(temperature=0.0, max_new_tokens=256, ignore_eos=True))
        steps = 0
        while engine.has_work():
            engine.step()
            steps += 1
        torch.cuda.synchronize()
        return req, steps

    run()
    engine.scheduler.flush_prefix_cache()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    req, steps = run()
    prof.disable()
    wall = time.perf_counter() - t0
    print(f"{steps} steps, {req.spec_verify_ct} verifies, {len(req.output_ids)} tokens, "
          f"{wall / steps * 1e3:.3f} ms per step (profiled)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)
    pstats.Stats(prof).sort_stats("cumulative").print_stats(args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
