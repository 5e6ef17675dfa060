"""Online serving benchmark: replay a workload against an OpenAI-compatible server.

``python -m attnserve.bench.serving --launch --max-concurrency 1 16 [server flags]``
``python -m attnserve.bench.serving --base-url http://127.0.0.1:30000 --request-rate 4``

* Workload: ``--num-prompts`` requests with random prompt lengths (uniform in
  ``--input-len MIN MAX`` tokens, random token ids) and output lengths (``--output-len MIN
  MAX``, generated with ``ignore_eos`` so each request makes exactly that many tokens), or
  a JSONL file (``--dataset``) whose lines are ``{"prompt": str | [ids], "max_tokens": n}``
  or ``{"messages": [...], "max_tokens": n}`` (the latter go to ``/v1/chat/completions``).
* Arrivals: a Poisson process at ``--request-rate`` requests/s (``inf``: all at once),
  optionally capped at ``--max-concurrency`` requests in flight. Several concurrency values
  run one after the other against the same server.
* Requests are greedy and stream (SSE) unless ``--stream-fraction`` sends some whole.
  Measured per request: TTFT (send -> first chunk with output) and inter-token latency (gaps
  between chunks with output) of streamed requests, end-to-end latency, and the server's
  token counts (``stream_options.include_usage``, or the whole response's ``usage``). A
  chunk has output when a completion choice without ``finish_reason`` carries ``text``
  (empty from a model without a tokenizer, e.g. a dummy shape: attnserve then sends one
  empty chunk per report of new tokens) or a chat delta carries content, reasoning or tool
  calls. Requests sent whole have no TTFT or ITL: the summary gives the number of requests
  (and gaps) each metric is computed over.
* ``--offline-baseline`` (with ``--launch``) first runs the same warm-up and workload
  through ``LLM.generate`` with the same server flags, in a process of its own
  (`attnserve.bench.serving_baseline`), and reports server / offline output tok/s.
* Report: a table on stdout; ``benchmarks/results/<device>-serving-<date>.json`` (date,
  device, versions, args, server facts, per-run metrics: mean/P50/P90/P99 in ms); a PNG
  beside it with the latency distributions (CDFs).
* ``--launch`` starts ``python -m attnserve serve`` on a free loopback port with every
  flag this script does not know (``--page-size 16``, ``--model ...``) and stops it at the
  end; otherwise ``--base-url`` names a running server.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import os
import platform
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from attnserve.bench.serving_baseline import run_offline_baseline
from attnserve.bench.serving_host import cpu_delta, cpu_snapshot


@dataclass
class Workload:
    """One request: ``payload`` is the JSON body minus ``model``/``stream``; ``path`` is the
    endpoint; ``prompt_len`` the prompt length in tokens when known in advance."""

    path: str
    payload: Dict[str, Any]
    prompt_len: Optional[int] = None
    stream: bool = True


@dataclass
class Result:
    """Outcome of one request; times in seconds (``itl``: gaps between chunks with output;
    ``ttft`` NaN and ``itl`` empty for a request sent whole)."""

    ok: bool = False
    stream: bool = True
    ttft: float = float("nan")
    itl: List[float] = field(default_factory=list)
    e2e: float = float("nan")
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""


# ---- workload ------------------------------------------------------------------------------
def random_workload(num: int, input_len: Tuple[int, int], output_len: Tuple[int, int], seed: int,
                    token_range: Tuple[int, int]) -> List[Workload]:
    """``num`` completion requests of random token ids; lengths uniform in the given ranges."""
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        n_in = rng.randint(*input_len)
        n_out = rng.randint(*output_len)
        ids = [rng.randrange(*token_range) for _ in range(n_in)]
        out.append(Workload("/v1/completions", {"prompt": ids, "max_tokens": n_out, "ignore_eos": True}, n_in))
    return out


def file_workload(path: str, num: Optional[int], ignore_eos: bool) -> List[Workload]:
    """Requests from a JSONL file (see the module docstring); ``num`` limits how many."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            body = {"max_tokens": int(row.get("max_tokens", 128)), "ignore_eos": ignore_eos}
            if "messages" in row:
                out.append(Workload("/v1/chat/completions", {**body, "messages": row["messages"]}))
            elif "prompt" in row:
                prompt = row["prompt"]
                out.append(Workload("/v1/completions", {**body, "prompt": prompt},
                                    len(prompt) if isinstance(prompt, list) else None))
            else:
                raise ValueError(f"{path}:{line_no}: a line needs 'prompt' or 'messages'")
            if num is not None and len(out) >= num:
                break
    if not out:
        raise ValueError(f"{path} holds no requests")
    return out


# ---- one request -------------------------------------------------------------------------------
async def send_one(session, base_url: str, model: str, work: Workload, timeout: float) -> Result:
    """Send one request (streamed when ``work.stream``) on an ``aiohttp.ClientSession`` and
    time it (never raises: failures are ``Result.ok=False``). A non-streamed request has no
    TTFT or ITL; its token counts come from the response's ``usage``."""
    if not work.stream:
        return await _send_whole(session, base_url, model, work, timeout)
    body = {**work.payload, "model": model, "stream": True, "temperature": 0.0,
            "stream_options": {"include_usage": True}}
    res = Result(prompt_tokens=work.prompt_len or 0, stream=True)
    t0 = time.perf_counter()
    last = None
    try:
        async with session.post(base_url + work.path, json=body, timeout=_client_timeout(timeout)) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.read()).decode('utf-8', 'replace')[:200]}"
                return res
            async for raw in resp.content:  # one line a time (SSE: "data: {...}" then a blank line)
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"].get("message"))
                    return res
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    if carries_output(choice):
                        now = time.perf_counter()
                        if last is None:
                            res.ttft = now - t0
                        else:
                            res.itl.append(now - last)
                        last = now
        res.e2e = time.perf_counter() - t0
        res.ok = True
    except Exception as e:  # network errors, timeouts, bad JSON: the request failed
        res.error = f"{type(e).__name__}: {e}"
    return res


def carries_output(choice: Dict[str, Any]) -> bool:
    """Whether a streamed choice reports generated tokens: a completion choice without
    ``finish_reason`` (its ``text`` may be empty when the model has no tokenizer), or a chat
    delta with content, reasoning or tool calls (not the first chunk's bare role)."""
    if "text" in choice:
        return choice.get("finish_reason") is None or bool(choice["text"])
    delta = choice.get("delta") or {}
    return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"))


async def _send_whole(session, base_url: str, model: str, work: Workload, timeout: float) -> Result:
    body = {**work.payload, "model": model, "stream": False, "temperature": 0.0}
    res = Result(prompt_tokens=work.prompt_len or 0, stream=False)
    t0 = time.perf_counter()
    try:
        async with session.post(base_url + work.path, json=body, timeout=_client_timeout(timeout)) as resp:
            data = await resp.read()
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {data.decode('utf-8', 'replace')[:200]}"
                return res
        usage = json.loads(data).get("usage") or {}
        res.prompt_tokens = usage.get("prompt_tokens", res.prompt_tokens)
        res.output_tokens = usage.get("completion_tokens", 0)
        res.e2e = time.perf_counter() - t0
        res.ok = True
    except Exception as e:  # network errors, timeouts, bad JSON: the request failed
        res.error = f"{type(e).__name__}: {e}"
    return res


def _client_timeout(seconds: float):
    import aiohttp

    return aiohttp.ClientTimeout(total=seconds)


def client_session(api_key: Optional[str] = None, max_connections: Optional[int] = None):
    """The benchmark's HTTP client: an ``aiohttp.ClientSession`` (as SGLang's and vLLM's
    serving benchmarks use) with at most ``max_connections`` open connections (None: no
    limit) and a 1 MiB read buffer (a streamed line may be up to twice that; aiohttp's
    default of 64 KiB is too small for a chunk with many logprobs).

    aiohttp, not httpx: on this project's 2-core CPU machine, 256 requests sent at once cost
    httpx's client 0.54-0.65 s of CPU against aiohttp's 0.10-0.18 s (a stub server answering
    after 0.3 s, 500-token bodies), time the burst spent in the client before it reached the
    server, counted against the server.

    Raises:
        ImportError: aiohttp is missing (``pip install attnserve[bench]``).
    """
    try:
        import aiohttp
    except ImportError as e:
        raise ImportError("the serving benchmark needs aiohttp: pip install 'attnserve[bench]'") from e
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    connector = aiohttp.TCPConnector(limit=max_connections or 0, limit_per_host=0)
    return aiohttp.ClientSession(connector=connector, headers=headers, read_bufsize=1 << 20)


def set_stream_fraction(work: Sequence[Workload], fraction: float) -> None:
    """Stream ``fraction`` of the requests, spread evenly (0.5: every other one, the first
    streamed); the rest are sent whole."""
    for i, w in enumerate(work):
        w.stream = math.floor((i + 1) * fraction) > math.floor(i * fraction)


async def run_load(base_url: str, model: str, api_key: Optional[str], work: Sequence[Workload],
                   request_rate: float, max_concurrency: Optional[int], seed: int, timeout: float
                   ) -> Tuple[List[Result], float]:
    """Send ``work`` with Poisson arrivals at ``request_rate`` (req/s; inf = at once), at most
    ``max_concurrency`` in flight. Returns the results (in workload order) and the wall time."""
    rng = random.Random(seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async with client_session(api_key, max_concurrency) as client:
        async def guarded(w):
            if sem is None:
                return await send_one(client, base_url, model, w, timeout)
            async with sem:
                return await send_one(client, base_url, model, w, timeout)

        t0 = time.perf_counter()
        tasks = []
        for w in work:
            tasks.append(asyncio.create_task(guarded(w)))
            if math.isfinite(request_rate) and request_rate > 0:
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - t0


# ---- statistics ----------------------------------------------------------------------------------
def _stats_ms(values: Sequence[float]) -> Dict[str, float]:
    import numpy as np

    v = np.asarray([x for x in values if not math.isnan(x)], dtype=np.float64) * 1000.0
    if v.size == 0:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    return {"mean": float(v.mean()), "p50": float(np.percentile(v, 50)), "p90": float(np.percentile(v, 90)),
            "p99": float(np.percentile(v, 99))}


def summarize(results: Sequence[Result], duration: float) -> Dict[str, Any]:
    """Throughput and latency percentiles (ms) of one run. ``ttft_ms``, ``itl_ms`` and
    ``e2e_ms`` each say over how many completed requests (``requests``; ITL also over how
    many gaps, ``gaps``) they are computed: TTFT over the streamed requests that produced
    output, ITL over those with two chunks or more, E2E over all."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    timed = [r for r in ok if not math.isnan(r.ttft)]
    return {
        "completed": len(ok),
        "completed_streamed": sum(r.stream for r in ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "input_throughput": in_tokens / duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "ttft_ms": {**_stats_ms([r.ttft for r in timed]), "requests": len(timed)},
        "itl_ms": {**_stats_ms([x for r in ok for x in r.itl]), "requests": sum(bool(r.itl) for r in ok),
                   "gaps": sum(len(r.itl) for r in ok)},
        "e2e_ms": {**_stats_ms([r.e2e for r in ok]), "requests": len(ok)},
    }


def jsonable(obj):
    """``obj`` with non-finite floats replaced (inf -> "inf", NaN -> None) for strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None if math.isnan(obj) else str(obj)
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj


def format_table(runs: Sequence[Dict[str, Any]]) -> str:
    head = (f"{'conc':>5} {'rate':>6} {'ok/fail':>8} {'req/s':>7} {'out tok/s':>10} | "
            + " | ".join(f"{m:^27}" for m in ("TTFT ms mean/p50/p90/p99", "ITL ms mean/p50/p90/p99",
                                               "E2E ms mean/p50/p90/p99")))
    lines = [head, "-" * len(head)]
    for r in runs:
        s = r["summary"]
        cols = []
        for key in ("ttft_ms", "itl_ms", "e2e_ms"):
            st = s[key]
            cols.append(" ".join(f"{st[k]:6.0f}" for k in ("mean", "p50", "p90", "p99")))
        conc = "-" if r["max_concurrency"] is None else str(r["max_concurrency"])
        lines.append(f"{conc:>5} {r['request_rate']:>6} {s['completed']:>4}/{s['failed']:<3} "
                     f"{s['request_throughput']:7.2f} {s['output_throughput']:10.1f} | " + " | ".join(cols))
    return "\n".join(lines)


def plot(runs: Sequence[Dict[str, Any]], raw: Sequence[Sequence[Result]], path: str, title: str) -> None:
    """CDFs of TTFT, inter-token latency and end-to-end latency, one line per run (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for run, results in zip(runs, raw):
        ok = [r for r in results if r.ok]
        label = f"concurrency {run['max_concurrency'] or 'inf'}, rate {run['request_rate']}"
        for ax, values in zip(axes, ([r.ttft for r in ok], [x for r in ok for x in r.itl], [r.e2e for r in ok])):
            v = np.sort(np.asarray([x for x in values if not math.isnan(x)]) * 1000.0)
            if v.size:
                ax.plot(v, np.arange(1, v.size + 1) / v.size, label=label)
    for ax, name in zip(axes, ("time to first token", "inter-token latency", "end-to-end latency")):
        ax.set_title(name)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if name != "inter-token latency" else "fraction of tokens")
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- server handling -------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base_url: str, timeout: float, proc: Optional[subprocess.Popen] = None) -> None:
    """Poll ``/health`` until 200.

    Raises:
        RuntimeError: the launched server exited, or ``timeout`` seconds passed.
    """
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before it was ready")
        try:
            if httpx.get(base_url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server at {base_url} was not healthy after {timeout:.0f} s")


def launch(server_flags: List[str], api_key: Optional[str], log_path: str) -> Tuple[subprocess.Popen, str]:
    """Start ``python -m attnserve serve`` on a free loopback port; returns (process, base URL)."""
    port = free_port()
    cmd = [sys.executable, "-m", "attnserve", "serve", "--host", "127.0.0.1", "--port", str(port), *server_flags]
    if api_key:
        cmd += ["--api-key", api_key]
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    return proc, f"http://127.0.0.1:{port}"


def server_facts(base_url: str, api_key: Optional[str]) -> Tuple[str, Dict[str, Any]]:
    """(model id, server facts from ``/debug/state`` or {} for servers without it)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    models = httpx.get(base_url + "/v1/models", headers=headers, timeout=10.0)
    models.raise_for_status()
    model = models.json()["data"][0]["id"]
    facts: Dict[str, Any] = {}
    try:
        r = httpx.get(base_url + "/debug/state", headers=headers, timeout=10.0)
        if r.status_code == 200:
            facts = {k: v for k, v in r.json().items() if k in (
                "model", "device", "device_name", "dtype", "context_len", "attention_backend", "page_size",
                "versions", "kv_slots_total", "event_loop")}
    except Exception:
        pass
    return model, facts


def device_slug(facts: Dict[str, Any]) -> str:
    device = str(facts.get("device", ""))
    if device.startswith("cuda"):
        name = str(facts.get("device_name", "gpu")).lower().replace("nvidia ", "")
        return re.sub(r"[^a-z0-9]+", "-", name).strip("-")
    return "cpu" if device == "cpu" else "unknown"


def result_path(out_dir: str, device: str, date: str) -> str:
    """``<out_dir>/<device>-serving-<date>.json``, with ``-2``, ``-3`` ... when taken."""
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, f"{device}-serving-{date}")
    path, n = base + ".json", 2
    while os.path.exists(path):
        path, n = f"{base}-{n}.json", n + 1
    return path


# ---- main ----------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m attnserve.bench.serving", description=__doc__.split("\n\n")[0],
                                epilog="With --launch, unknown flags go to 'attnserve serve'.")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--base-url", help="a running server, e.g. http://127.0.0.1:30000")
    where.add_argument("--launch", action="store_true", help="start 'attnserve serve' on a free port")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"),
                   help="random prompt length range in tokens")
    p.add_argument("--output-len", type=int, nargs=2, default=[16, 64], metavar=("MIN", "MAX"),
                   help="random output length range in tokens")
    p.add_argument("--token-range", type=int, nargs=2, default=[1000, 30000], metavar=("LO", "HI"),
                   help="random prompt token ids are drawn from [LO, HI)")
    p.add_argument("--dataset", default=None, help="JSONL workload instead of random prompts")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="with --dataset: generate max_tokens tokens regardless of EOS")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrival rate, req/s")
    p.add_argument("--max-concurrency", type=int, nargs="+", default=[None],
                   help="requests in flight at most; several values run one after another")
    p.add_argument("--warmup", type=int, default=2, help="requests sent (and not measured) first")
    p.add_argument("--warmup-like-workload", action="store_true",
                   help="warm-up prompts drawn from the workload's length range (another seed), each making "
                        "--warmup-output-len tokens (default: 8-token prompts making 4)")
    p.add_argument("--warmup-output-len", type=int, default=16)
    p.add_argument("--stream-fraction", type=float, default=1.0,
                   help="share of the requests streamed, spread evenly (the rest are sent whole)")
    p.add_argument("--offline-baseline", action="store_true",
                   help="with --launch: first run the same workload (and warm-up) through LLM.generate with "
                        "the same server flags in a process of its own; report server / offline tok/s")
    p.add_argument("--output-file", default=None, help="result JSON path (default: under --output-dir)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, s")
    p.add_argument("--launch-timeout", type=float, default=600.0, help="seconds to wait for a launched server")
    p.add_argument("--output-dir", default=os.path.join("benchmarks", "results"))
    p.add_argument("--device-label", default=None, help="device name in the result file (default: from server)")
    p.add_argument("--no-save", action="store_true", help="print only; write no JSON/PNG")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args, server_flags = parser.parse_known_args(argv)
    if server_flags and not args.launch:
        parser.error(f"unrecognized arguments: {' '.join(server_flags)} (server flags need --launch)")
    if args.dataset:
        work = file_workload(args.dataset, args.num_prompts, args.ignore_eos)
    else:
        if args.input_len[0] < 1 or args.input_len[0] > args.input_len[1]:
            parser.error("--input-len needs 1 <= MIN <= MAX")
        if args.output_len[0] < 1 or args.output_len[0] > args.output_len[1]:
            parser.error("--output-len needs 1 <= MIN <= MAX")
        work = random_workload(args.num_prompts, tuple(args.input_len), tuple(args.output_len), args.seed,
                               tuple(args.token_range))
    if not 0.0 <= args.stream_fraction <= 1.0:
        parser.error("--stream-fraction must be in [0, 1]")
    if args.offline_baseline and (not args.launch or args.dataset):
        parser.error("--offline-baseline needs --launch and the random workload")
    set_stream_fraction(work, args.stream_fraction)
    warm = random_workload(args.warmup, (8, 8), (4, 4), args.seed + 1, tuple(args.token_range))
    if args.warmup_like_workload and not args.dataset:
        warm = random_workload(args.warmup, tuple(args.input_len), (args.warmup_output_len,) * 2, args.seed + 1,
                               tuple(args.token_range))
    elif args.dataset:
        warm = work[: args.warmup]
    offline = None
    if args.offline_baseline:
        offline = run_offline_baseline(server_flags, [(w.payload["prompt"], w.payload["max_tokens"]) for w in warm],
                                       [(w.payload["prompt"], w.payload["max_tokens"]) for w in work])
        print(f"offline baseline: {offline['output_tokens_per_s']:.1f} out tok/s "
              f"({offline['output_tokens']} tokens in {offline['seconds']:.2f} s)", flush=True)
    proc = None
    log_path = os.path.join(tempfile.gettempdir(), f"attnserve-bench-server-{os.getpid()}.log")
    try:
        if args.launch:
            proc, base_url = launch(server_flags, args.api_key, log_path)
            print(f"launched server pid {proc.pid} at {base_url} (log: {log_path})", flush=True)
            wait_healthy(base_url, args.launch_timeout, proc)
        else:
            base_url = args.base_url.rstrip("/")
            wait_healthy(base_url, 30.0)
        model, facts = server_facts(base_url, args.api_key)
        if warm:
            asyncio.run(run_load(base_url, model, args.api_key, warm, float("inf"), None, args.seed, args.timeout))
        runs, raw = [], []
        for conc in args.max_concurrency:
            before = cpu_snapshot(base_url, args.api_key, proc.pid if proc is not None else None)
            results, duration = asyncio.run(run_load(base_url, model, args.api_key, work, args.request_rate, conc,
                                                     args.seed, args.timeout))
            host = cpu_delta(before, cpu_snapshot(base_url, args.api_key, proc.pid if proc is not None else None))
            runs.append({"max_concurrency": conc, "request_rate": args.request_rate,
                         "num_prompts": len(work), "summary": summarize(results, duration), "host": host})
            if offline is not None:
                runs[-1]["ratio_to_offline"] = runs[-1]["summary"]["output_throughput"] / offline["output_tokens_per_s"]
            raw.append(results)
            print(f"done: concurrency {conc}, {runs[-1]['summary']['completed']}/{len(work)} ok "
                  f"in {duration:.1f} s", flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    print(f"\nmodel {model} on {facts.get('device_name', facts.get('device', '?'))} at {base_url}")
    print(format_table(runs))
    for run in runs:
        s = run["summary"]
        print(f"latency (concurrency {run['max_concurrency']}): TTFT over {s['ttft_ms']['requests']} and ITL over "
              f"{s['itl_ms']['requests']} of the {s['completed_streamed']} streamed requests ({s['itl_ms']['gaps']} "
              f"gaps); E2E over all {s['completed']} completed")
    for run in runs:
        h = run["host"]
        if "engine_steps" in h:
            print(f"host (concurrency {run['max_concurrency']}): {h['engine_steps']} engine steps; loop-thread CPU per "
                  f"step {h['step_cpu_ms_per_step']:.3f} ms in the scheduler + {h['serving_cpu_ms_per_step']:.3f} ms "
                  f"serving; server process {h.get('server_process_cpu_s', float('nan')):.2f} s CPU, children "
                  f"{h.get('children_cpu_s', float('nan')):.2f} s")
    if offline is not None:
        print(f"offline {offline['output_tokens_per_s']:.1f} out tok/s; server / offline: "
              + ", ".join(f"{r['ratio_to_offline']:.3f}" for r in runs))
    for run in runs:
        if run["summary"]["errors"]:
            print(f"errors (concurrency {run['max_concurrency']}): {run['summary']['errors']}")
    if not args.no_save:
        import aiohttp

        device = args.device_label or device_slug(facts)
        date = dt.date.today().isoformat()
        path = args.output_file or result_path(args.output_dir, device, date)
        record = {
            "benchmark": "serving",
            "date": dt.datetime.now().isoformat(timespec="seconds"),
            "device": device,
            "device_name": facts.get("device_name"),
            "model": model,
            "server": facts,
            "versions": {"client_python": platform.python_version(), "aiohttp": aiohttp.__version__,
                         "server": facts.get("versions")},
            "args": {**vars(args), "server_flags": server_flags},
            "runs": runs,
            "offline": offline,
        }
        with open(path, "w", encoding="utf-8") as f:
            json.dump(jsonable(record), f, indent=2, default=str, allow_nan=False)
        png = path[: -len(".json")] + ".png"
        plot(runs, raw, png, f"attnserve serving: {model} on {device} ({len(work)} requests)")
        print(f"wrote {path} and {png}")
    return 0 if all(r["summary"]["failed"] == 0 for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
