"""`Engine`: load a model, build the runner and the scheduler, run steps.

Shared by the offline `LLM` API and the HTTP server (which drives `step` from one
background thread).
"""

from __future__ import annotations

import gc
import logging
import weakref
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import torch

from attnserve.engine.model_runner import ModelRunner
from attnserve.engine.request import Req, sglang_finish_reason
from attnserve.engine.sampling_params import SamplingParams
from attnserve.engine.scheduler import Scheduler
from attnserve.engine.tp.launch import TPStepFailed
from attnserve.engine.warmup import warm_up_at_start
from attnserve.env_options import env_flag
from attnserve.server_args import ServerArgs
from attnserve.speculative_config import SpeculativeConfig

logger = logging.getLogger(__name__)

Prompt = Union[str, List[int]]


@dataclass
class GenerateOutput:
    """One finished request: ``text`` (stop strings cut off), generated ``token_ids``
    (EOS/stop token included when it ended the request), ``finish_reason`` ("stop",
    "length" or "abort"), ``cached_tokens`` (prompt tokens served from the prefix cache),
    ``error`` (why an aborted request failed, when it did), ``spec_verify_ct`` (speculative
    verify steps; accept length = ``len(token_ids) / spec_verify_ct``).

    Logprobs (when asked; `attnserve.engine.logprobs`, natural log of the model's own
    distribution): ``output_token_logprobs[i]`` is that of ``token_ids[i]`` and
    ``output_top_logprobs[i]`` the ``top_logprobs`` most likely ``(token id, logprob)`` at
    that position, most likely first; ``prompt_token_logprobs`` / ``prompt_top_logprobs``
    the same for ``prompt_token_ids`` (None at position 0). None when not asked.

    SGLang's offline ``Engine.generate`` answers dicts; ``out["text"]``, ``out["output_ids"]``
    and ``out["meta_info"]`` read this output the same way (`to_sglang_dict`)."""

    rid: str
    text: str
    token_ids: List[int]
    finish_reason: Optional[str]
    prompt_token_ids: List[int]
    matched_stop: object = None
    cached_tokens: int = 0
    error: Optional[str] = None
    spec_verify_ct: int = 0
    output_token_logprobs: Optional[List[float]] = None
    output_top_logprobs: Optional[List[List[Tuple[int, float]]]] = None
    prompt_token_logprobs: Optional[List[Optional[float]]] = None
    prompt_top_logprobs: Optional[List[Optional[List[Tuple[int, float]]]]] = None

    def to_sglang_dict(self) -> dict:
        """This output as SGLang's offline ``Engine.generate`` returns it: ``{"text",
        "output_ids", "meta_info"}`` (`sglang_meta_info`)."""
        return {"text": self.text, "output_ids": list(self.token_ids), "meta_info": self.sglang_meta_info()}

    def sglang_meta_info(self) -> dict:
        """SGLang's ``meta_info``: ``{"id", "finish_reason"`` (`sglang_finish_reason`),
        ``"prompt_tokens", "completion_tokens", "cached_tokens"}``, with ``output_token_logprobs``
        / ``output_top_logprobs`` (and ``input_*`` for the prompt) as ``[logprob, token id,
        None]`` entries when logprobs were asked."""
        finish = sglang_finish_reason(self.finish_reason, self.matched_stop, len(self.token_ids),
                                      self.error or "Aborted")
        meta = {"id": self.rid, "finish_reason": finish, "prompt_tokens": len(self.prompt_token_ids),
                "completion_tokens": len(self.token_ids), "cached_tokens": self.cached_tokens}

        def entries(ids, lps):
            return [[lp, t, None] for t, lp in zip(ids, lps)]

        def tops(rows):
            return [None if row is None else [[lp, t, None] for t, lp in row] for row in rows]

        if self.output_token_logprobs is not None:
            meta["output_token_logprobs"] = entries(self.token_ids, self.output_token_logprobs)
            meta["output_top_logprobs"] = tops(self.output_top_logprobs or [None] * len(self.token_ids))
        if self.prompt_token_logprobs is not None:
            meta["input_token_logprobs"] = entries(self.prompt_token_ids, self.prompt_token_logprobs)
            meta["input_top_logprobs"] = tops(self.prompt_top_logprobs or [None] * len(self.prompt_token_ids))
        return meta

    def __getitem__(self, key: str):
        """SGLang's dict keys (`to_sglang_dict`): ``"text"``, ``"output_ids"``, ``"meta_info"``.

        Raises:
            KeyError: any other key (the dataclass fields are attributes).
        """
        if key == "text":
            return self.text
        if key == "output_ids":
            return list(self.token_ids)
        if key == "meta_info":
            return self.sglang_meta_info()
        raise KeyError(f"{key!r}: a GenerateOutput reads as SGLang's dict through 'text', 'output_ids' and "
                       "'meta_info'; its other fields are attributes (out.finish_reason, out.token_ids, ...)")

    @classmethod
    def from_req(cls, req: Req) -> "GenerateOutput":
        reason = req.finish_reason.value if req.finish_reason is not None else None
        out = cls(req.rid, req.text, list(req.output_ids), reason, list(req.prompt_ids), req.matched_stop,
                  req.cached_tokens, req.error, req.spec_verify_ct)
        rec = req.logprobs
        if rec is not None and rec.output:
            out.output_token_logprobs, out.output_top_logprobs = rec.output_token_logprobs, rec.output_top_logprobs
        if rec is not None and rec.prompt_len:
            out.prompt_token_logprobs, out.prompt_top_logprobs = rec.prompt_token_logprobs, rec.prompt_top_logprobs
        return out


#: ``=1``: a ``--context-length`` longer than the model's is a warning, not an error (SGLang's
#: ``SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN``; benchmarks that time one token past the model's length)
ALLOW_LONGER_CONTEXT_ENV = "ATTNSERVE_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"


def check_context_length(server_args: ServerArgs) -> None:
    """Refuse a ``--context-length`` longer than the model's own (``max_position_embeddings``):
    its RoPE tables end there, so longer sequences would fail mid-request (SGLang refuses
    the same by default; `ALLOW_LONGER_CONTEXT_ENV` makes it a warning).

    Raises:
        ValueError: naming both lengths and what to pass instead.
    """
    from attnserve.model_loader.loader import load_model_config

    model_ctx = load_model_config(server_args.model, server_args.load_format).context_len
    if server_args.context_length <= model_ctx:
        return
    if not env_flag(ALLOW_LONGER_CONTEXT_ENV, default=False):
        raise ValueError(f"--context-length {server_args.context_length} is longer than the context of "
                         f"{server_args.model!r} ({model_ctx} tokens, its max_position_embeddings); pass at most {model_ctx}, "
                         "or leave it out to use the model's")
    logger.warning("--context-length %d is longer than the %d positions of %r (%s=1): positions past them "
                   "read beyond its RoPE tables, and outputs there are not the model's", server_args.context_length,
                   model_ctx, server_args.model, ALLOW_LONGER_CONTEXT_ENV)


class Engine:
    """A model with its KV cache, attention backend and scheduler.

    `shutdown` gives its memory back; every other method raises RuntimeError afterwards.

    Args:
        server_args: engine options (validated with `ServerArgs.check`).

    Raises:
        ValueError / FileNotFoundError: invalid options or model path (message says what to do).
    """

    def __init__(self, server_args: ServerArgs):
        self._shut_down = False
        server_args.check()
        self.server_args = server_args
        self.tp_runtime = None
        self._tp_finalizer = None
        self._tp_step_failure: Optional[str] = None
        if server_args.context_length is not None:
            check_context_length(server_args)
        tp = None
        if server_args.tp_size > 1:
            tp = self._start_tensor_parallel(server_args)
        try:
            self._build(server_args, tp)
        except BaseException:
            self.shutdown()
            raise
        if self.tp_runtime is not None:
            self._tp_finalizer = weakref.finalize(self, _stop_ranks, self.scheduler.tp_sender, self.tp_runtime,
                                                  self.model_runner)

    def _start_tensor_parallel(self, server_args: ServerArgs):
        """Check the heads against ``--tp-size``, spawn the other ranks, join them."""
        from attnserve.engine.tp.launch import TPRuntime
        from attnserve.distributed.partition import check_tp_size
        from attnserve.model_loader.loader import load_model_config

        if server_args.node_rank != 0:
            raise ValueError(f"--node-rank {server_args.node_rank}: only node 0 runs the engine; start the other "
                             "nodes with the attnserve CLI (generate/serve with the same flags), which follows it")
        mc = load_model_config(server_args.model, server_args.load_format)
        check_tp_size(mc.num_attention_heads, 0 if mc.is_mla else mc.num_key_value_heads, server_args.tp_size)
        self.tp_runtime = TPRuntime(server_args)
        return self.tp_runtime.start()

    def _build(self, server_args: ServerArgs, tp) -> None:
        from attnserve.model_loader.loader import load_model

        loaded = load_model(
            server_args.model,
            load_format=server_args.load_format,
            dtype=server_args.resolved_dtype(),
            device=server_args.resolved_device(),
            tp=tp,
            quantization=server_args.quantization,
            tokenizer_path=server_args.tokenizer_path,
            trust_remote_code=server_args.trust_remote_code,
            fp8_lm_head=server_args.enable_fp8_lm_head,
        )
        self.tokenizer = loaded.tokenizer
        self.model_config = loaded.model_config
        spec = SpeculativeConfig.from_server_args(server_args)
        draft_runner = None
        if spec is not None and spec.algorithm == "STANDALONE":
            from attnserve.engine.speculative.draft_model import load_draft_model

            draft = load_draft_model(spec, server_args, loaded)
            extra = draft.model_config.kv_cache_bytes_per_token(server_args.resolved_dtype())
            self.model_runner = ModelRunner(server_args, loaded, extra_kv_bytes_per_token=extra)
            draft_runner = ModelRunner(server_args, draft, draft_of=self.model_runner)
        else:
            self.model_runner = ModelRunner(server_args, loaded, tp=tp)
        self.draft_runner = draft_runner
        eos = list(getattr(self.model_config, "eos_token_ids", None) or [])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.append(self.tokenizer.eos_token_id)
        self.scheduler = Scheduler(self.model_runner, server_args, self.tokenizer, sorted(set(eos)),
                                   draft_runner=draft_runner)
        self.warmup_report = warm_up_at_start(self)  # compile what serving launches (engine/warmup.py)
        from attnserve.engine.step_trace import attach_step_trace

        attach_step_trace(self)  # only with $ATTNSERVE_STEP_TRACE (a debug trace; off: nothing)

    @property
    def is_shut_down(self) -> bool:
        return self._shut_down

    def check_running(self) -> None:
        """Raise RuntimeError once `shutdown` has run."""
        if self._shut_down:
            raise RuntimeError("this engine was shut down and its memory released; build a new one")

    @property
    def context_len(self) -> int:
        self.check_running()
        return self.model_runner.context_len

    @property
    def max_total_tokens(self) -> int:
        """KV-pool size in tokens: no request can hold more (prompt + output)."""
        self.check_running()
        return self.model_runner.token_to_kv_pool_allocator.size

    def tokenize(self, prompt: Prompt, chat: bool = False) -> List[int]:
        """Token ids of ``prompt`` (a string, or already ids); ``chat`` applies the model's
        chat template as one user message.

        Raises:
            ValueError: an empty prompt, ids that are not ints in the vocabulary, or text
                without a tokenizer.
            RuntimeError: the engine was shut down.
        """
        self.check_running()
        from attnserve.model_loader.tokenizer import tokenize_prompt

        return tokenize_prompt(self.tokenizer, self.model_config.vocab_size, prompt, chat)

    @property
    def max_request_tokens(self) -> int:
        """Most tokens (prompt + output) one request can ever hold: the context length, or
        the KV pool when that is smaller."""
        return min(self.context_len, self.max_total_tokens)

    def check_prompt(self, prompt_ids: Sequence[int], sampling_params: SamplingParams) -> None:
        """Raise ValueError if the request could not be served as asked (checked before
        enqueueing, so nothing is silently truncated): an empty prompt, invalid sampling
        parameters (a grammar must parse and suit the engine: `attnserve.engine.constrained`),
        or prompt + ``max_new_tokens`` beyond what one request can ever hold
        (`max_request_tokens`: the context length and the KV pool), ``n`` above 1, stop strings
        on a model without a tokenizer. RuntimeError after `shutdown`."""
        self.check_running()
        n = len(prompt_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        sampling_params.verify()
        if sampling_params.stop_strs and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer and this model has none, so they could never match; "
                             "use stop_token_ids")
        if sampling_params.n != 1:
            raise ValueError(f"n={sampling_params.n}: the engine takes one sample per request; LLM.generate "
                             "expands n, or submit n requests")
        self.scheduler.grammar.check(sampling_params, parse=True)  # a grammar this engine can serve
        self.scheduler.extras.check(sampling_params)  # logit_bias ids in the vocabulary; none under speculation
        ctx, pool = self.context_len, self.max_total_tokens
        if n >= ctx:
            raise ValueError(
                f"the prompt has {n} tokens but the context length is {ctx}; shorten it to at most {ctx - 1} tokens"
            )
        if n >= pool:
            raise ValueError(f"the prompt has {n} tokens but the KV pool holds {pool}; shorten it to at most "
                             f"{pool - 1} tokens or give the engine a larger pool (max_total_tokens)")
        want = n + sampling_params.max_new_tokens
        if want > ctx:
            raise ValueError(f"the prompt ({n} tokens) plus max_new_tokens ({sampling_params.max_new_tokens}) "
                             f"exceeds the context length {ctx}; lower max_new_tokens to at most {ctx - n}")
        if want > pool:
            raise ValueError(f"the prompt ({n} tokens) plus max_new_tokens ({sampling_params.max_new_tokens}) "
                             f"exceeds the KV pool of {pool} tokens; lower max_new_tokens to at most {pool - n} "
                             f"or give the engine a larger pool (max_total_tokens)")

    def add_request(self, prompt_ids: List[int], sampling_params: SamplingParams, rid: Optional[str] = None) -> Req:
        self.check_running()
        return self.scheduler.add_request(prompt_ids, sampling_params, rid)

    def abort_request(self, rid: str) -> bool:
        self.check_running()
        return self.scheduler.abort_request(rid)

    def step(self) -> List[Req]:
        """One scheduler step.

        Raises:
            attnserve.engine.tp.launch.RankDied: a tensor-parallel rank has died (naming it).
            attnserve.engine.tp.launch.TPStepFailed: a step raised on rank 0 under tensor
                parallelism. The other ranks may then be inside that step's collectives and
                cannot be brought back in step, so they are stopped at once (no hang); the
                engine stays stopped and every later call raises the same error.
            RuntimeError: the engine was shut down.
        """
        self.check_running()
        if self.tp_runtime is None:
            return self.scheduler.step()
        if self._tp_step_failure is not None:
            raise TPStepFailed(self._tp_step_failure)
        self.tp_runtime.check()
        try:
            return self.scheduler.step()
        except Exception as e:
            self.tp_runtime.check(wait_s=2.0)  # a collective failed because a rank died?
            self._tp_step_failure = (f"a tensor-parallel step failed on rank 0 ({type(e).__name__}: {e}); the "
                                     "other ranks were stopped, as they cannot be resynchronised: start a new engine")
            logger.error("%s", self._tp_step_failure)
            self.tp_runtime.abort(self._tp_step_failure)
            raise TPStepFailed(self._tp_step_failure) from e

    def shutdown(self) -> None:
        """Stop the engine and give back its memory; idempotent.

        1. Tensor parallelism: stop the other ranks first, as before (`_stop_ranks`: rank
           0's CUDA graphs are released while the ranks still serve collectives, then
           SHUTDOWN, then the process groups).
        2. `ModelRunner.release` of the target: wait for the device to finish the queued
           work, destroy the decode graphs and their memory pool, drop the attention
           backend's buffers, the KV pool, ``req_to_token`` and the weights.
        3. `Scheduler.release`: the future-token map, pinned host rings, the pending step,
           the speculative decoder (verify and draft graphs); then the draft runner's
           `ModelRunner.release`. The engine drops its runners and scheduler.
        4. ``gc.collect()``, then ``torch.cuda.empty_cache()``: the caching allocator hands
           the freed blocks back to the driver, so `torch.cuda.mem_get_info`, which sizes
           the next engine's KV pool, sees them as free; the unused pinned host blocks go
           back too (``torch._C._host_emptyCache``, where torch has it).

        What stays allocated is torch's, for the process: cuBLAS's workspace of each stream
        that ran a matmul (32 MiB each on an H100: the current stream and the one capture
        stream, `cuda_graph_runner.capture_stream`). Five Llama-3-8B-shape engines in turn
        on an H100 each left 64.0 MiB above the level before the first
        (tests/gpu/test_engine_release_gpu.py).

        Kept (device state untouched, logged): the engine of a failed tensor-parallel
        group (its device may still sit in a collective that will never complete), and an
        engine whose device did not finish its queued work within 10 s. Afterwards every
        method but this one raises RuntimeError. Tokenizer and model config stay readable.
        """
        if self._shut_down:
            return
        self._shut_down = True
        if self._tp_finalizer is not None:
            self._tp_finalizer()
        elif self.tp_runtime is not None:
            self.tp_runtime.stop(timeout=0.0)
        if self.tp_runtime is not None and self.tp_runtime.failure is not None:
            logger.warning("engine shut down after a tensor-parallel failure: its device memory is not released")
            return
        runner = getattr(self, "model_runner", None)
        if runner is not None and not runner.release():
            return  # the device is busy: freeing would block on it (logged by release_cuda_graphs)
        scheduler = getattr(self, "scheduler", None)
        if scheduler is not None:
            scheduler.release()
        draft = getattr(self, "draft_runner", None)
        if draft is not None:
            draft.release()
        self.model_runner = self.draft_runner = self.scheduler = None
        gc.collect()
        torch.cuda.empty_cache()  # a no-op unless CUDA was initialised
        empty_pinned = getattr(torch._C, "_host_emptyCache", None)  # pinned host blocks (CUDA builds)
        if empty_pinned is not None and torch.cuda.is_initialized():
            empty_pinned()

    def has_work(self) -> bool:
        self.check_running()
        return self.scheduler.has_work()


def _stop_ranks(sender, runtime, model_runner) -> None:
    """On a healthy engine: release rank 0's CUDA graphs while the other ranks still serve
    their collectives (a graph that captured one keeps NCCL's teardown waiting:
    `ModelRunner.release_cuda_graphs`), then tell the ranks to stop. Then reap them (a
    failed engine's ranks are killed there)."""
    if runtime.failure is None:
        try:
            model_runner.release_cuda_graphs()
        except Exception:  # e.g. a device fault: still stop the ranks
            logger.exception("releasing the CUDA graphs before the tensor-parallel teardown failed")
        try:
            if sender is not None:
                sender.shutdown()
        except Exception:  # a broken group: the ranks are killed below
            pass
    runtime.stop()
