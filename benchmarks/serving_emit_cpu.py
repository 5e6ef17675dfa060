"""Host cost of the engine process's serving work per generated token (issue 33 item 5),
on the CPU, without HTTP: the engine process's loop (`ProcessEngineLoop`) around a real
engine of a cheap model, its messages read and decoded by a child process as the HTTP
process reads them (`EngineClient._dispatch`, with no HTTP requests behind it).

    PYTHONPATH=src python benchmarks/serving_emit_cpu.py [--num-prompts 256] \\
        [--input-len 50 150] [--output-len 100 300] [--stream-fraction 0.5] \\
        [--profile out.prof] [--out r.json]

The loop thread runs here (the main thread calls `_iterate` as the loop thread would), so
its CPU counters (`EngineLoop.loop_cpu_s`, `step_cpu_s`) split each iteration into
`Engine.step` and the serving work around it (commands, per-request entries, the state
snapshot, pickling and sending the step's message). Printed and written (``--out``): steps,
output tokens, the serving CPU in ms per step and in µs per output token, the messages and
bytes sent, and the reader process's CPU per 1k output tokens (unpickling and per-entry
bookkeeping of the HTTP side). ``--profile`` writes a cProfile of the loop (step included).

Counts and CPU seconds, not wall time, so they hold on a loaded machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import random
import sys
import time


def _reader(conn, out_q) -> None:
    """The HTTP side's decode of the engine's messages: unpickle and walk every entry."""
    msgs = nbytes = entries = 0
    t0 = time.process_time()
    try:
        while True:
            data = conn.recv_bytes()
            msgs += 1
            nbytes += len(data)
            msg = pickle.loads(data)
            if msg[0] == "out":
                entries += len(msg[1])
            elif msg[0] == "closed":
                break
    except EOFError:
        pass
    out_q.put({"messages": msgs, "bytes": nbytes, "entries": entries, "cpu_s": time.process_time() - t0})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, nargs=2, default=[50, 150])
    p.add_argument("--output-len", type=int, nargs=2, default=[100, 300])
    p.add_argument("--model", default="llama-tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stream-fraction", type=float, default=0.5,
                   help="share of the requests streamed (every other one at 0.5, as bench.serving); the others "
                        "are submitted as a client that waits for the whole answer sends them")
    p.add_argument("--profile", default=None, help="cProfile output of the loop")
    p.add_argument("--out", default=None)
    args, extra = p.parse_known_args(argv)
    import multiprocessing as mp

    import torch

    from attnserve.engine.engine import Engine
    from attnserve.engine.sampling_params import SamplingParams
    from attnserve.server.engine_process import ProcessEngineLoop
    from attnserve.server_args import ServerArgs

    torch.set_num_threads(1)
    sa = ServerArgs(model=args.model, load_format="dummy", device="cpu", max_running_requests=args.num_prompts)
    engine = Engine(sa)
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe(duplex=True)
    q = ctx.Queue()
    reader = ctx.Process(target=_reader, args=(theirs, q), daemon=True)
    reader.start()
    theirs.close()
    loop = ProcessEngineLoop(engine, ours)
    rng = random.Random(args.seed)
    for i in range(args.num_prompts):  # submits as the HTTP process sends them (one message)
        ids = [rng.randrange(3, 250) for _ in range(rng.randint(*args.input_len))]
        sp = SamplingParams(max_new_tokens=rng.randint(*args.output_len), temperature=0.0, ignore_eos=True)
        streamed = math.floor((i + 1) * args.stream_fraction) > math.floor(i * args.stream_fraction)
        cmd = ("submit", f"cmpl-{os.urandom(12).hex()}", ids, sp)
        loop._command(cmd if streamed else cmd + (False,))
    loop._flush()
    sends = {"n": 0}
    send = ours.send_bytes

    def counted(data):
        sends["n"] += 1
        return send(data)

    ours.send_bytes = counted  # type: ignore[method-assign]
    prof = None
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    wall0 = time.perf_counter()
    steps0 = engine.scheduler.num_steps
    while engine.has_work() or loop._live:
        loop._iterate()
    wall = time.perf_counter() - wall0
    if prof is not None:
        prof.disable()
        prof.dump_stats(args.profile)
    steps = engine.scheduler.num_steps - steps0
    ours.send_bytes(pickle.dumps(("closed", "shutting_down")))
    side = q.get(timeout=60)
    reader.join(10)
    serving = loop.loop_cpu_s - loop.step_cpu_s
    n_tok = _output_tokens(args)
    rec = {
        "benchmark": "serving_emit_cpu", "args": vars(args), "server_flags": extra,
        "engine_steps": steps, "output_tokens": n_tok, "wall_s": wall,
        "loop_cpu_s": loop.loop_cpu_s, "step_cpu_s": loop.step_cpu_s, "serving_cpu_s": serving,
        "serving_cpu_ms_per_step": 1e3 * serving / max(steps, 1),
        "serving_cpu_us_per_output_token": 1e6 * serving / max(n_tok, 1),
        "messages_sent_in_loop": sends["n"], "messages_per_step": sends["n"] / max(steps, 1),
        "reader": side, "reader_cpu_ms_per_1k_tokens": 1e6 * side["cpu_s"] / max(n_tok, 1),
        "bytes_per_output_token": side["bytes"] / max(n_tok, 1),
    }
    print(json.dumps(rec, indent=1))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(rec, f, indent=1)
    engine.shutdown()
    return 0


def _output_tokens(args) -> int:
    rng = random.Random(args.seed)
    n = 0
    for _ in range(args.num_prompts):
        [rng.randrange(3, 250) for _ in range(rng.randint(*args.input_len))]
        n += rng.randint(*args.output_len)
    return n


if __name__ == "__main__":
    sys.exit(main())
