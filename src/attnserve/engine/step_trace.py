"""Opt-in per-step trace of an `Engine`: what each step admitted and ran (issue 33, item 5:
why the server path runs more steps than ``LLM.generate`` on the same workload).

Turned on by the environment variable ``ATTNSERVE_STEP_TRACE=PREFIX``: every `Engine` built
in a process that sees it (the offline baseline's, the server's engine process, inherited
from the benchmark) writes one JSON line per `Engine.step` to ``PREFIX.<pid>.jsonl``. Off
(the default), nothing is attached and a step costs nothing more: `attach_step_trace` wraps
the engine *instance*'s ``step`` and ``add_request`` and its scheduler's ``_schedule``.

A line: ``t`` (``time.monotonic()`` at the step's end, seconds; one clock for every process
of the machine), ``dt`` (the step's wall time, s), ``mode`` (``extend``, ``decode``,
``mixed``, ``verify`` or None when the step launched nothing), ``bs`` (requests in the
launched batch), ``extend_reqs`` / ``extend_tokens`` (prefill chunks in it and their
tokens), ``arrived`` (requests added since the previous step; ``arrive_t``: the times of
the first and last of them, when any), ``running`` / ``waiting``
(after the step), ``returned`` (requests the step reported as touched).

`summarize_trace` turns a list of lines into the numbers the benchmark comparison needs;
``python -m attnserve.engine.step_trace 256 PREFIX.*.jsonl`` prints them per file.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, List, Optional, Sequence

ENV = "ATTNSERVE_STEP_TRACE"


class StepTrace:
    """The recorder of one engine (see the module docstring); ``path`` is the JSONL file."""

    def __init__(self, engine, path: str):
        self.engine = engine
        self.path = path
        self._f = open(path, "a", buffering=1, encoding="utf-8")
        self._arrived = 0
        self._arrive_t: List[float] = []
        self._batch = None
        sched = engine.scheduler
        step, add, schedule = engine.step, engine.add_request, sched._schedule

        def traced_schedule(touched):
            self._batch = schedule(touched)
            return self._batch

        def traced_add(*args, **kwargs):
            req = add(*args, **kwargs)
            self._arrived += 1
            self._arrive_t.append(time.monotonic())
            return req

        def traced_step():
            self._batch = None
            t0 = time.monotonic()
            touched = step()
            self._record(t0, touched)
            return touched

        sched._schedule = traced_schedule
        engine.add_request = traced_add
        engine.step = traced_step

    def _record(self, t0: float, touched) -> None:
        from attnserve.forward_batch import ForwardMode

        t = time.monotonic()
        b = self._batch
        sched = self.engine.scheduler
        row: Dict[str, Any] = {"t": t, "dt": t - t0, "mode": None, "bs": 0, "extend_reqs": 0, "extend_tokens": 0,
                               "arrived": self._arrived, "running": len(sched.running),
                               "waiting": len(sched.waiting), "returned": len(touched)}
        if self._arrive_t:
            row["arrive_t"] = [self._arrive_t[0], self._arrive_t[-1]]
        self._arrived, self._arrive_t = 0, []
        if b is not None:
            names = {ForwardMode.EXTEND: "extend", ForwardMode.DECODE: "decode", ForwardMode.MIXED: "mixed",
                     ForwardMode.TARGET_VERIFY: "verify"}
            row["mode"] = names.get(b.forward_mode, str(b.forward_mode))
            row["bs"] = len(b.reqs)
            if b.forward_mode in (ForwardMode.EXTEND, ForwardMode.MIXED):
                ext = [(r, e) for r, p, e in zip(b.reqs, b.prefix_lens, b.extend_lens) if p < r.prefill_target]
                row["extend_reqs"] = len(ext)
                row["extend_tokens"] = int(sum(e for _, e in ext))
        self._f.write(json.dumps(row) + "\n")

    def close(self) -> None:
        self._f.close()


def attach_step_trace(engine, prefix: Optional[str] = None) -> Optional[StepTrace]:
    """Attach a `StepTrace` to ``engine`` when ``prefix`` (default: ``$ATTNSERVE_STEP_TRACE``)
    is set; returns it, or None (nothing attached)."""
    prefix = prefix if prefix is not None else os.environ.get(ENV)
    if not prefix:
        return None
    return StepTrace(engine, f"{prefix}.{os.getpid()}.jsonl")


def read_trace(path: str) -> List[Dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def summarize_trace(rows: Sequence[Dict[str, Any]], num_requests: int) -> Dict[str, Any]:
    """Numbers of the last burst of ``num_requests`` requests in a trace (the timed run of a
    benchmark; warm-up bursts before it are skipped): its steps from the first step that
    saw one of its requests arrive to the last step that launched a batch.

    Returns:
        dict: ``steps`` (that launched a batch), ``extend_steps`` / ``decode_steps``,
        ``arrival_steps`` (steps from the first arrival to the last, both counted),
        ``arrival_ms`` (from the first request's `Engine.add_request` to the last one's),
        ``max_running``, ``extend_tokens``, ``mean_extend_tokens``,
        ``seconds`` (first arrival step's start to the last step's end), ``idle_steps``
        (steps that launched nothing).

    Raises:
        ValueError: the trace does not hold ``num_requests`` arrivals.
    """
    total, start = 0, None
    for i in range(len(rows) - 1, -1, -1):  # the last burst: walk back until it is whole
        total += rows[i]["arrived"]
        if total >= num_requests:
            start = i
            break
    if start is None:
        raise ValueError(f"the trace holds {total} arrivals, fewer than {num_requests}")
    burst = rows[start:]
    arrivals = [i for i, r in enumerate(burst) if r["arrived"]]
    launched = [r for r in burst if r["mode"] is not None]
    last = max(i for i, r in enumerate(burst) if r["mode"] is not None)
    ext = [r for r in launched if r["extend_reqs"]]
    return {
        "steps": len(launched),
        "extend_steps": len(ext),
        "decode_steps": sum(r["mode"] == "decode" for r in launched),
        "arrival_steps": arrivals[-1] - arrivals[0] + 1,
        "arrival_ms": 1e3 * (burst[arrivals[-1]]["arrive_t"][1] - burst[arrivals[0]]["arrive_t"][0]),
        "max_running": max(r["running"] for r in burst),
        "extend_tokens": sum(r["extend_tokens"] for r in ext),
        "mean_extend_tokens": sum(r["extend_tokens"] for r in ext) / max(len(ext), 1),
        "seconds": burst[last]["t"] - (burst[0]["t"] - burst[0]["dt"]),
        "idle_steps": len(burst[: last + 1]) - len(launched),
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m attnserve.engine.step_trace NUM_REQUESTS FILE.jsonl ...``: one JSON line of
    `summarize_trace` per file (the offline baseline's and the engine process's traces)."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    n = int(args[0])
    for path in args[1:]:
        print(json.dumps({"file": path, **summarize_trace(read_trace(path), n)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
