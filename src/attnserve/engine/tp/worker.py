"""A non-zero tensor-parallel rank: load this rank's slice of the model, build its pools and
backend (`ModelRunner`), then run every step rank 0 broadcasts (`step_sync.follow_steps`)."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

logger = logging.getLogger(__name__)


def build_rank(server_args, tp):
    """This rank's `ModelRunner` (weights sliced by ``tp``; no tokenizer, no progress bars)."""
    from attnserve.engine.model_runner import ModelRunner
    from attnserve.model_loader.loader import load_model

    loaded = load_model(server_args.model, load_format=server_args.load_format, dtype=server_args.resolved_dtype(),
                        device=tp_device(server_args, tp), load_tokenizer=False, progress=False,
                        seed=server_args.random_seed, tp=tp, quantization=server_args.quantization,
                        fp8_lm_head=server_args.enable_fp8_lm_head)
    return ModelRunner(server_args, loaded, tp=tp)


def tp_device(server_args, tp) -> str:
    """``cuda:<local rank>`` on CUDA, else ``cpu``."""
    if server_args.resolved_device() != "cuda":
        return "cpu"
    import torch

    return f"cuda:{torch.cuda.current_device()}"


def follow(runner, tp) -> int:
    from attnserve.engine.tp.step_sync import follow_steps

    return follow_steps(runner, tp)


def _exit_with_parent(parent_pid: int) -> None:
    """End this process when the process that spawned it is gone (e.g. SIGKILL)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(3)


def worker_main(server_args, cfg, parent_pid: int) -> None:
    """Entry point of a spawned rank (see `launch.TPRuntime`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 handles Ctrl-C and stops us
    logging.basicConfig(level=getattr(logging, str(server_args.log_level).upper(), logging.INFO),
                        format=f"[tp{cfg.rank}] %(levelname)s %(name)s: %(message)s")
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    if os.environ.get("ATTNSERVE_DEBUG_STACKS"):  # every N s, all threads' stacks to stderr (hangs)
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["ATTNSERVE_DEBUG_STACKS"]), repeat=True)
    from attnserve.engine.tp.launch import init_rank, set_cpu_threads

    try:
        set_cpu_threads(server_args)
        tp = init_rank(cfg)
        runner = build_rank(server_args, tp)
        follow(runner, tp)
    except BaseException:
        logger.exception("tensor-parallel rank %d failed", cfg.rank)
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)  # skip interpreter teardown of the process group and CUDA state
