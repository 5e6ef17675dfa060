"""Offline baseline of a serving workload: the same requests through `LLM.generate`.

``python -m attnserve.bench.serving_baseline --workload FILE.json [server flags]``

``FILE.json`` holds ``{"warmup": [[ids, max_tokens], ...], "requests": [[ids, max_tokens],
...]}`` (token-id prompts, ``ignore_eos`` outputs of exactly ``max_tokens`` tokens, greedy),
as `attnserve.bench.serving` writes it for ``--offline-baseline``. The engine is built from
the same flags ``attnserve serve`` gets (`ServerArgs`), runs the warm-up requests, then the
timed ones all at once (one ``generate`` call, as the issue's offline figures were taken),
and prints one JSON line (`run_offline`'s dict).

It runs in a process of its own so that its GPU memory is free again before the server
starts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from attnserve.server_args import ServerArgs


def _params(max_tokens: Sequence[int]):
    from attnserve.engine.sampling_params import SamplingParams

    return [SamplingParams(max_new_tokens=int(n), temperature=0.0, ignore_eos=True) for n in max_tokens]


def run_offline(server_args: ServerArgs, warmup: List[Tuple[List[int], int]],
                requests: List[Tuple[List[int], int]]) -> dict:
    """Warm up, then time ``requests`` through one `LLM.generate` call.

    Returns:
        dict with ``output_tokens`` (generated tokens of the timed run), ``seconds`` (its
        wall time), ``output_tokens_per_s``, ``warmup_seconds``, ``num_steps``,
        ``pool_tokens`` (the KV pool's size, to compare with the server's).
    """
    from attnserve.engine.llm import LLM
    from dataclasses import asdict

    llm = LLM(**asdict(server_args))
    try:
        t0 = time.perf_counter()
        if warmup:
            llm.generate([p for p, _ in warmup], _params([n for _, n in warmup]))
        warm_s = time.perf_counter() - t0
        steps0 = llm.engine.scheduler.num_steps
        t0 = time.perf_counter()
        outs = llm.generate([p for p, _ in requests], _params([n for _, n in requests]))
        secs = time.perf_counter() - t0
        tokens = sum(len(o.token_ids) for o in outs)
        return {"output_tokens": tokens, "seconds": secs, "output_tokens_per_s": tokens / secs,
                "warmup_seconds": warm_s, "num_steps": llm.engine.scheduler.num_steps - steps0,
                "pool_tokens": llm.engine.max_total_tokens}
    finally:
        llm.engine.shutdown()


def run_offline_baseline(server_flags: List[str], warm: Sequence[Tuple[List[int], int]],
                         work: Sequence[Tuple[List[int], int]]) -> Dict[str, Any]:
    """Run ``warm`` then ``work`` (``(prompt ids, max_tokens)`` pairs) through
    `LLM.generate` with ``server_flags`` in a child process (this module's `main`), so its
    device memory is free again before a server starts. Returns `run_offline`'s dict.

    Raises:
        RuntimeError: the child failed (its output is in the message).
    """
    spec = {"warmup": [list(w) for w in warm], "requests": [list(w) for w in work]}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    try:
        r = subprocess.run([sys.executable, "-m", "attnserve.bench.serving_baseline", "--workload", f.name,
                            *server_flags], capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"the offline baseline failed (exit {r.returncode}):\n{r.stdout[-2000:]}{r.stderr[-4000:]}")
    return json.loads(lines[-1])


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m attnserve.bench.serving_baseline", description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", required=True, help="JSON file written by attnserve.bench.serving")
    ServerArgs.add_cli_args(p)
    args = p.parse_args(argv)
    with open(args.workload, encoding="utf-8") as f:
        spec = json.load(f)
    result = run_offline(ServerArgs.from_cli_args(args), [tuple(x) for x in spec.get("warmup", [])],
                         [tuple(x) for x in spec["requests"]])
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
