"""The first batches after start-up against the same batches run again (issue 33, item 7).

``python -m attnserve.bench.startup [engine flags] [--num-prompts N --input-len I --output-len O
--prefix-len P --rounds R]``

Builds an engine from the flags (the start-up warm-up of `attnserve.engine.warmup` runs
unless ``--skip-server-warmup``), then runs ``R`` rounds of two batches, each submitted
at once and run to completion (greedy, ``ignore_eos``):

1. ``unrelated``: the prefix cache is flushed, then ``N`` prompts of ``I`` random tokens
   -> ``O`` tokens;
2. ``prefix``: ``N`` prompts made of the first ``P`` tokens of one ``unrelated`` prompt
   each and ``I - P`` new tokens -> ``O`` tokens: ``P`` tokens of each are prefix-cache hits.

Every round runs the same requests from the same cache state, so round 1 against round 2
is the first batch after start-up against the same batch warm. Prints one JSON line:
``engine_seconds`` (construction, warm-up included), ``warmup`` (`WarmupReport` fields,
or null), and per batch and round ``seconds``, ``triton_compiles`` (Triton kernel
specialisations compiled during it, `TritonCompileCounter`; null when not countable) and
``compiled`` (the first few of them, as Triton names them).

Run each configuration in a fresh process with an empty ``TRITON_CACHE_DIR``: Triton's
on-disk cache would otherwise turn most compilations into cache loads.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
from typing import List, Optional

from attnserve.server_args import ServerArgs

#: compiled kernels listed per batch in the output (the count is always complete)
MAX_LISTED = 64


def workload(num_prompts: int, input_len: int, prefix_len: int, vocab_size: int, seed: int = 0):
    """``(unrelated, prefix)`` prompt lists (token ids) as the module docstring describes.

    Raises:
        ValueError: ``prefix_len`` not in ``[1, input_len)``.
    """
    if not 1 <= prefix_len < input_len:
        raise ValueError(f"--prefix-len must be in [1, --input-len), got {prefix_len} with {input_len}")
    rnd = random.Random(seed)
    unrelated = [[rnd.randrange(vocab_size) for _ in range(input_len)] for _ in range(num_prompts)]
    prefixed = [p[:prefix_len] + [rnd.randrange(vocab_size) for _ in range(input_len - prefix_len)] for p in unrelated]
    return unrelated, prefixed


def run(server_args: ServerArgs, num_prompts: int, input_len: int, output_len: int, prefix_len: int,
        rounds: int = 2) -> dict:
    """Build the engine and time the batches (see the module docstring)."""
    from attnserve.engine.llm import LLM
    from attnserve.engine.sampling_params import SamplingParams
    from attnserve.engine.warmup import TritonCompileCounter

    t0 = time.perf_counter()
    llm = LLM(**dataclasses.asdict(server_args))
    engine_s = time.perf_counter() - t0
    try:
        report = llm.engine.warmup_report
        unrelated, prefixed = workload(num_prompts, input_len, prefix_len, llm.engine.model_config.vocab_size)
        params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
        batches: List[dict] = []
        for r in range(1, rounds + 1):
            if not llm.engine.scheduler.flush_prefix_cache():
                raise RuntimeError("the engine is not idle between rounds")
            for name, prompts in (("unrelated", unrelated), ("prefix", prefixed)):
                with TritonCompileCounter() as compiles:
                    t = time.perf_counter()
                    outs = llm.generate(prompts, params)
                    secs = time.perf_counter() - t
                batches.append({
                    "batch": name, "round": r, "seconds": secs, "triton_compiles": compiles.count,
                    "compiled": compiles.kernels[:MAX_LISTED],
                    "cached_tokens": sum(o.cached_tokens for o in outs),
                    "output_tokens": sum(len(o.token_ids) for o in outs),
                })
        return {"model": server_args.model, "skip_server_warmup": server_args.skip_server_warmup,
                "num_prompts": num_prompts, "input_len": input_len, "output_len": output_len,
                "prefix_len": prefix_len, "engine_seconds": engine_s,
                "warmup": None if report is None else dataclasses.asdict(report), "batches": batches}
    finally:
        llm.engine.shutdown()


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=2080)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--prefix-len", type=int, default=1920)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    out = run(ServerArgs.from_cli_args(args), args.num_prompts, args.input_len, args.output_len, args.prefix_len,
              args.rounds)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
