"""Command line: ``attnserve generate ...`` and ``attnserve serve ...``.

Errors in the user's input (bad flags, missing model, over-long prompt) print one line
``attnserve: error: ...`` and exit with code 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import List, Optional

from attnserve.server_args import ServerArgs
from attnserve.sglang_flags import add_sglang_flags


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate completions for prompts (offline)")
    p.add_argument("prompts", nargs="*", help="prompt texts")
    p.add_argument("--prompts-file", help="file with one prompt per line")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="apply the model's chat template (default: on)")
    ServerArgs.add_cli_args(p)
    add_sglang_flags(p)


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="start the OpenAI-compatible HTTP server")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer <key>'")
    p.add_argument("--served-model-name", default=None,
                   help="the model id under /v1/models, in responses and in metric labels; requests naming "
                        "another model get 404 (default: --model)")
    p.add_argument("--enable-metrics", action="store_true",
                   help="taken for SGLang's launch commands: /metrics (Prometheus) is always served")
    p.add_argument("--log-level-http", default=None, type=str.lower,
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="the HTTP server's (uvicorn's) log level, e.g. info for one line a request (default: "
                        "--log-level where uvicorn has it, else warning)")
    ServerArgs.add_cli_args(p)
    add_sglang_flags(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnserve", description="attnserve LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_serve(sub)
    return parser


def _read_prompts(args) -> List[str]:
    prompts = list(args.prompts)
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            prompts.extend(line.rstrip("\n") for line in f if line.strip())
    if not prompts:
        raise ValueError("no prompts given; pass prompt texts or --prompts-file")
    return prompts


def run_generate(args) -> int:
    from attnserve.engine.llm import LLM
    from attnserve.engine.sampling_params import SamplingParams

    prompts = _read_prompts(args)
    sp = SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, seed=args.seed, ignore_eos=args.ignore_eos,
    )
    sa = ServerArgs.from_cli_args(args)
    if sa.dp_size > 1:
        raise ValueError("--dp-size > 1 is for 'attnserve serve' (and bench.offline); generate runs one engine")
    with LLM(**vars(sa)) as llm:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, chat=args.chat)
        dt = time.perf_counter() - t0
        runner = llm.engine.model_runner
        where = f"backend={runner.backend_choice.decode} device={runner.device}"  # read before the shutdown
    for prompt, out in zip(prompts, outs):
        print(f"### {prompt}\n{out.text.strip()}\n[finish_reason={out.finish_reason}, tokens={len(out.token_ids)}]\n")
    n_prompt = sum(len(o.prompt_token_ids) for o in outs)
    n_gen = sum(len(o.token_ids) for o in outs)
    print(
        f"requests={len(outs)} prompt_tokens={n_prompt} generated_tokens={n_gen} "
        f"seconds={dt:.2f} tokens/s={n_gen / max(dt, 1e-9):.1f} {where}"
    )
    return 0


def run_serve(args) -> int:
    from attnserve.server.launch import launch_server

    return launch_server(args)


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # Our own logger at --log-level (default info: start-up says which backend serves which
    # phase and why); third-party libraries stay at warning.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("attnserve").setLevel(getattr(logging, str(args.log_level).upper(), logging.INFO))
    try:
        if getattr(args, "node_rank", 0) > 0:  # a worker node of a multi-node tensor-parallel engine
            from attnserve.engine.tp.launch import run_worker_node

            steps = run_worker_node(ServerArgs.from_cli_args(args))
            print(f"node {args.node_rank}: rank 0 shut the engine down after {steps} steps")
            return 0
        if args.command == "generate":
            return run_generate(args)
        return run_serve(args)
    except (ValueError, FileNotFoundError, OSError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"attnserve: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
