"""Where a burst of requests spends its time on the way into the engine, and what the
engine loop does per step besides `Engine.step` (issue 33 item 5), on the CPU.

    PYTHONPATH=src python benchmarks/serving_intake_cpu.py --out intake.json \\
        [--num-prompts 256] [--input-len 100 400] [--output-len 32 96] [-- extra server flags]

It launches ``attnserve serve`` (``--engine-process on``, a dummy ``llama-tiny`` on the CPU
by default) with this file as the main module of the server process: the file's top level
then installs timing hooks (`_install_hooks`) in the HTTP process and, since 'spawn'
re-imports the main module in the child, in the engine process too. The hooks only read
``time.monotonic()`` (one clock for every process on Linux), ``time.process_time()`` and
``time.thread_time()`` and write each process's records to a JSON file whenever the
server has nothing in flight (never inside the timed burst).

The client sends ``--num-prompts`` completion requests of random token ids at once (half
of them streamed, as ``scripts/serving_vs_offline.sh``), after a warm-up burst. Printed
and written (``--out``):

* ``intake``: client send start -> handler entry (HTTP parse + pydantic validation) ->
  `EngineClient.submit` (after the token-id check in the worker thread) -> the engine
  process's ``add_request`` (the request is in the scheduler's waiting queue) -> the
  acceptance event back in the HTTP process, each as the time of the first and the last
  request after the first client send (ms), the HTTP process's CPU per request over its
  intake window, the messages and commands the engine read during the burst, and the
  engine steps run before the last request reached the waiting queue.
* ``per_step``: the engine loop thread's CPU per iteration that ran a step, split into
  ``Engine.step`` and the serving work around it (reading commands, emitting outputs,
  the state snapshot, pickling and sending the step's message), in ms; and the HTTP
  process's CPU per engine step during the decode phase.

With the tiny model a step costs far less than on a GPU, so compare the intake and
serving times (before/after a change), not the throughput.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

_TRACE_ENV = "ATTNSERVE_INTAKE_TRACE_DIR"


# ---- hooks (server side) -------------------------------------------------------------------
def _dump(path: str, rec: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(rec, f)
    os.replace(tmp, path)


def _install_http_hooks(out_dir: str) -> None:
    from attnserve.server import engine_client as ec
    from attnserve.server import openai_api as oa

    rec = {"connect": [], "asgi": [], "handler": [], "submit": [], "accept": [], "msgs": [], "dirty": False}
    path = os.path.join(out_dir, "http.json")
    try:  # uvicorn's h11 protocol: TCP accept and the start of the ASGI call
        from uvicorn.protocols.http import h11_impl

        made = h11_impl.H11Protocol.connection_made

        def made_hook(self, transport):
            rec["connect"].append(time.monotonic())
            return made(self, transport)

        h11_impl.H11Protocol.connection_made = made_hook
        run_asgi = h11_impl.RequestResponseCycle.run_asgi

        async def run_asgi_hook(self, app):
            if self.scope.get("method") == "POST":
                rec["asgi"].append(time.monotonic())
            return await run_asgi(self, app)

        h11_impl.RequestResponseCycle.run_asgi = run_asgi_hook
    except (ImportError, AttributeError):
        pass
    check = oa._check_model_and_options

    def check_hook(ctx, body):
        rec["handler"].append((time.monotonic(), time.process_time()))
        return check(ctx, body)

    oa._check_model_and_options = check_hook
    submit = ec.EngineClient.submit

    def submit_hook(self, cmd):
        rec["submit"].append((cmd.rid, time.monotonic(), time.process_time()))
        rec["dirty"] = True
        return submit(self, cmd)

    ec.EngineClient.submit = submit_hook
    on_event = ec.EngineClient._on_event

    def on_event_hook(self, now, rid, ev):
        p = self._reqs.get(rid)
        if p is not None and not p.accepted and ev.error is None and ev.finish_reason is None:
            rec["accept"].append((rid, time.monotonic()))
        return on_event(self, now, rid, ev)

    ec.EngineClient._on_event = on_event_hook
    on_message = ec.EngineClient._on_message

    def on_message_hook(self, data):
        t0 = time.process_time()
        on_message(self, data)
        rec["msgs"].append((time.monotonic(), time.process_time() - t0))
        if rec["dirty"] and not self._reqs:
            rec["dirty"] = False
            _dump(path, {k: v for k, v in rec.items() if k != "dirty"})

    ec.EngineClient._on_message = on_message_hook


def _install_engine_hooks(out_dir: str) -> None:
    from attnserve.server import engine_process as epm

    cls = epm.ProcessEngineLoop
    rec = {"recv": [], "add": [], "iters": [], "dirty": False}
    path = os.path.join(out_dir, "engine.json")
    phase = {}

    def timed(name):
        orig = getattr(cls, name, None)
        if orig is None:
            return

        def hook(self, *a, **kw):
            t0 = time.thread_time()
            try:
                return orig(self, *a, **kw)
            finally:
                phase[name] = phase.get(name, 0.0) + time.thread_time() - t0

        setattr(cls, name, hook)

    for name in ("_drain", "_publish_state", "_flush"):
        timed(name)
    step = cls._step

    def step_hook(self):
        s0, t0 = self.step_cpu_s, time.thread_time()
        step(self)
        total = time.thread_time() - t0
        inner = self.step_cpu_s - s0
        phase["engine_step"] = phase.get("engine_step", 0.0) + inner
        phase["emit"] = phase.get("emit", 0.0) + total - inner
        phase["stepped"] = 1

    cls._step = step_hook
    add = cls._add

    def add_hook(self, cmd):
        add(self, cmd)
        rec["add"].append((cmd.rid, time.monotonic(), getattr(self.engine.scheduler, "num_steps", 0)))
        rec["dirty"] = True

    cls._add = add_hook
    for recv_name in ("_command", "_commands_of"):
        orig_cmd = getattr(cls, recv_name, None)
        if orig_cmd is None:
            continue

        def cmd_hook(self, *a, __orig=orig_cmd, **kw):
            rec["recv"].append(time.monotonic())
            return __orig(self, *a, **kw)

        setattr(cls, recv_name, cmd_hook)
    iterate = cls._iterate_once

    def iterate_hook(self):
        phase.clear()
        t0, c0 = time.monotonic(), time.thread_time()
        iterate(self)
        if phase.get("stepped"):
            rec["iters"].append({"t": t0, "wall": time.monotonic() - t0, "cpu": time.thread_time() - c0,
                                 "running": len(self.engine.scheduler.running),
                                 **{k: v for k, v in phase.items() if k != "stepped"}})
        if rec["dirty"] and not self._live:
            rec["dirty"] = False
            _dump(path, {k: v for k, v in rec.items() if k != "dirty"})

    cls._iterate_once = iterate_hook


if os.environ.get(_TRACE_ENV):
    if __name__ == "__mp_main__":  # the engine process ('spawn' re-imports the main module so)
        _install_engine_hooks(os.environ[_TRACE_ENV])
    elif __name__ == "__main__" and "--serve" in sys.argv:  # the HTTP process
        _install_http_hooks(os.environ[_TRACE_ENV])


# ---- client ----------------------------------------------------------------------------------
async def _burst(base_url: str, model: str, work, timeout: float):
    import asyncio

    from attnserve.bench.serving import client_session, send_one

    starts = [0.0] * len(work)
    ends = [0.0] * len(work)
    async with client_session() as client:
        async def one(i, w):
            starts[i] = time.monotonic()
            r = await send_one(client, base_url, model, w, timeout)
            ends[i] = time.monotonic()
            return r

        c0 = time.process_time()
        results = await asyncio.gather(*(one(i, w) for i, w in enumerate(work)))
        cpu = time.process_time() - c0
    return results, starts, ends, cpu


def _wait_file(path: str, newer_than: float, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path) and os.path.getmtime(path) > newer_than:
            time.sleep(0.2)
            with open(path, encoding="utf-8") as f:
                return json.load(f)
        time.sleep(0.1)
    raise RuntimeError(f"{path} was not written after the burst")


def _ms(x: float) -> float:
    return round(1e3 * x, 3)


def _span(times, t0):
    return {"first_ms": _ms(min(times) - t0), "last_ms": _ms(max(times) - t0)} if times else {}


def analyse(http: dict, eng: dict, starts, ends, client_cpu: float, n: int) -> dict:
    """The intake timeline and per-step serving costs of the last burst (see the module
    docstring); every time is in ms after the client's first send."""
    t0 = min(starts)
    handler = [h for h in http["handler"] if h[0] >= t0][-n:]
    rids = {s[0] for s in http["submit"] if s[1] >= t0}
    submit = [s for s in http["submit"] if s[0] in rids]
    accept = [a for a in http["accept"] if a[0] in rids]
    add = [a for a in eng["add"] if a[0] in rids]
    recv = [t for t in eng["recv"] if t >= t0]
    last_add = max(a[1] for a in add)
    recv_msgs = [t for t in recv if t <= last_add]
    intake_cpu = max(s[2] for s in submit) - min(h[1] for h in handler)
    iters = [it for it in eng["iters"] if it["t"] >= t0]
    decode = [it for it in iters if it["t"] > last_add]
    keys = ("cpu", "engine_step", "emit", "_drain", "_publish_state", "_flush")
    per = {k: _ms(sum(it.get(k, 0.0) for it in decode) / max(len(decode), 1)) for k in keys}
    per["serving"] = round(per["cpu"] - per["engine_step"], 3)
    per["wall"] = _ms(sum(it["wall"] for it in decode) / max(len(decode), 1))
    msgs = [m for m in http["msgs"] if m[0] > last_add]
    return {
        "requests": n,
        "intake": {
            "client_send_start": _span(starts, t0),
            "http_tcp_accept": _span([t for t in http["connect"] if t >= t0], t0),
            "http_asgi_call": _span([t for t in http["asgi"] if t >= t0], t0),
            "http_handler_entry": _span([h[0] for h in handler], t0),
            "http_submit": _span([s[1] for s in submit], t0),
            "engine_in_waiting_queue": _span([a[1] for a in add], t0),
            "http_accepted": _span([a[1] for a in accept], t0),
            "http_cpu_ms_per_request": round(1e3 * intake_cpu / max(len(submit), 1), 3),
            "engine_command_events_in_burst": len(recv_msgs),
            "engine_steps_before_last_admitted": max(a[2] for a in add) - min(a[2] for a in add),
        },
        "per_step": {
            "iterations": len(decode),
            "mean_running": round(sum(it["running"] for it in decode) / max(len(decode), 1), 1),
            "engine_loop_ms": per,
            "http_cpu_ms_per_engine_message": round(1e3 * sum(m[1] for m in msgs) / max(len(msgs), 1), 3),
        },
        "end_ms": _ms(max(ends) - t0),
        "client_cpu_s": round(client_cpu, 3),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="JSON result path")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, nargs=2, default=[100, 400])
    p.add_argument("--output-len", type=int, nargs=2, default=[32, 96])
    p.add_argument("--repeats", type=int, default=3, help="timed bursts (each reported; the median is summarized)")
    p.add_argument("--model", default="llama-tiny")
    p.add_argument("--token-range", type=int, nargs=2, default=[3, 250])
    args, extra = p.parse_known_args(argv)
    extra = [x for x in extra if x != "--"]
    import asyncio
    import statistics
    import subprocess
    import tempfile

    from attnserve.bench.serving import (free_port, random_workload, server_facts, set_stream_fraction,
                                         wait_healthy)

    trace_dir = tempfile.mkdtemp(prefix="attnserve-intake-")
    port = free_port()
    cmd = [sys.executable, os.path.abspath(__file__), "--serve", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--model", args.model, "--load-format", "dummy", "--device", "cpu", "--engine-process", "on",
           "--max-running-requests", str(args.num_prompts), "--log-level", "warning", *extra]
    env = dict(os.environ, **{_TRACE_ENV: trace_dir})
    log_path = os.path.join(trace_dir, "server.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    runs = []
    try:
        wait_healthy(base, 300.0, proc)
        model, _ = server_facts(base, None)
        warm = random_workload(64, tuple(args.input_len), (8, 8), 1, tuple(args.token_range))
        set_stream_fraction(warm, 0.5)
        asyncio.run(_burst(base, model, warm, 600.0))
        for rep in range(args.repeats):
            work = random_workload(args.num_prompts, tuple(args.input_len), tuple(args.output_len), rep,
                                   tuple(args.token_range))
            set_stream_fraction(work, 0.5)
            time.sleep(1.0)  # the previous burst's records are on disk before the mark
            t_mark = time.time()
            results, starts, ends, cpu = asyncio.run(_burst(base, model, work, 600.0))
            failed = [r.error for r in results if not r.ok]
            if failed:
                raise RuntimeError(f"{len(failed)} requests failed: {failed[:3]}")
            time.sleep(1.0)  # the server writes its records once idle
            http = _wait_file(os.path.join(trace_dir, "http.json"), t_mark)
            eng = _wait_file(os.path.join(trace_dir, "engine.json"), t_mark)
            runs.append(analyse(http, eng, starts, ends, cpu, len(work)))
            print(json.dumps(runs[-1]), flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    def med(path):
        vals = []
        for r in runs:
            v = r
            for k in path:
                v = v[k]
            vals.append(v)
        return statistics.median(vals)

    summary = {
        "last_in_waiting_queue_ms": med(("intake", "engine_in_waiting_queue", "last_ms")),
        "last_accepted_ms": med(("intake", "http_accepted", "last_ms")),
        "last_handler_entry_ms": med(("intake", "http_handler_entry", "last_ms")),
        "last_client_send_ms": med(("intake", "client_send_start", "last_ms")),
        "http_cpu_ms_per_request": med(("intake", "http_cpu_ms_per_request")),
        "engine_command_events_in_burst": med(("intake", "engine_command_events_in_burst")),
        "serving_ms_per_step": med(("per_step", "engine_loop_ms", "serving")),
        "emit_ms_per_step": med(("per_step", "engine_loop_ms", "emit")),
        "flush_ms_per_step": med(("per_step", "engine_loop_ms", "_flush")),
        "engine_step_ms_per_step": med(("per_step", "engine_loop_ms", "engine_step")),
        "http_cpu_ms_per_engine_message": med(("per_step", "http_cpu_ms_per_engine_message")),
    }
    print("summary (median of %d bursts): %s" % (len(runs), json.dumps(summary, indent=1)))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"benchmark": "serving_intake_cpu", "args": vars(args), "server_flags": extra,
                       "summary": summary, "runs": runs}, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    if "--serve" in sys.argv:
        sys.argv.remove("--serve")
        from attnserve.cli import main as cli_main

        raise SystemExit(cli_main(sys.argv[1:]))
    raise SystemExit(main())
