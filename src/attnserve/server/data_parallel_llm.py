"""Offline generation over data-parallel replicas: ``DataParallelLLM(model, dp_size=N)``.

The offline counterpart of ``attnserve serve --dp-size N``: the same replicas (engine
processes on disjoint GPUs, `attnserve.server.data_parallel.start_data_parallel`) and the
same `DataParallelController` and load balancer, driven from a private asyncio loop in a
thread of this process instead of an HTTP server. `generate` blocks until every prompt is
done and returns the outputs in prompt order. ``bench.offline --dataset random --dp-size``
measures it (`attnserve.bench.offline_dp`).

Example::

    with DataParallelLLM("llama-3-8b", load_format="dummy", dp_size=2) as llm:
        outs = llm.generate([[1, 2, 3]] * 8, SamplingParams(max_new_tokens=16, ignore_eos=True))
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from dataclasses import dataclass
from typing import List, Optional, Sequence, Union

from attnserve.server_args import DEFAULT_MODEL, ServerArgs


@dataclass
class DPGenerateOutput:
    """One prompt's result.

    Attributes:
        text: the generated text ("" without a tokenizer).
        completion_tokens: generated tokens.
        prompt_tokens: prompt length in tokens.
        finish_reason: ``stop`` / ``length`` / ``abort``.
        cached_tokens: prompt tokens served from the replica's prefix cache.
        dp_rank: the replica that served it.
        finished_at: ``time.perf_counter()`` when its last event arrived here.
    """

    text: str
    completion_tokens: int
    prompt_tokens: int
    finish_reason: Optional[str]
    cached_tokens: int
    dp_rank: int
    finished_at: float = 0.0


class DPRequestFailed(RuntimeError):
    """A request ended with an error (a dead replica, a refused prompt)."""


class DataParallelLLM:
    """``dp_size`` engine replicas behind one offline ``generate``.

    Args:
        model: as `attnserve.engine.llm.LLM`.
        **kwargs: any `ServerArgs` field; ``dp_size`` (>= 1) is the number of replicas.

    Raises:
        ValueError / FileNotFoundError / RuntimeError: as `start_data_parallel`.
    """

    def __init__(self, model: str = DEFAULT_MODEL, **kwargs):
        from attnserve.server.data_parallel import start_data_parallel

        self.server_args = ServerArgs(model=model, **kwargs)
        self.server_args.check()
        self._aloop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._aloop.run_forever, name="attnserve-dp-llm", daemon=True)
        self._thread.start()
        self._closed = False
        try:
            self.engine, self.controller = start_data_parallel(self.server_args, with_metrics=False)
            self._call(self.controller.start_async())
        except BaseException:
            self._stop_loop()
            raise

    @property
    def dp_size(self) -> int:
        return len(self.controller.clients)

    def _call(self, coro, timeout: Optional[float] = None):
        return asyncio.run_coroutine_threadsafe(coro, self._aloop).result(timeout)

    def generate(self, prompts: Sequence[Union[str, List[int]]], sampling_params, chat: bool = False
                 ) -> List[DPGenerateOutput]:
        """Run every prompt to completion on the replicas the balancer picks (the whole
        batch at once, costliest first: `DataParallelController.submit_many`; not streamed, so
        the text comes whole with each request's last event).

        Args:
            prompts: texts or token-id lists.
            sampling_params: one `SamplingParams` (or dict of its fields) for all or one per
                prompt, as `attnserve.engine.llm.LLM.generate` takes them (``n`` > 1: that many
                outputs for the prompt, in a row).
            chat: wrap text prompts in the chat template.

        Raises:
            ValueError: a bad prompt (before anything is sent) or a prompt/params count mismatch.
            DPRequestFailed: a request ended with an error (e.g. its replica died).
            RuntimeError: after `shutdown`.
        """
        if self._closed:
            raise RuntimeError("the DataParallelLLM was shut down")
        from attnserve.engine.llm import expand_samples, per_prompt_params

        params = per_prompt_params(sampling_params, len(prompts), "prompts")
        ids, params = expand_samples([self.engine.tokenize(p, chat=chat) for p in prompts], params)
        return self._call(self._generate(ids, params))

    async def _generate(self, ids: List[List[int]], params) -> List[DPGenerateOutput]:
        from attnserve.server.engine_loop import RequestStream, SubmitCommand

        streams = [RequestStream() for _ in ids]
        # not streamed: the replicas report a request every QUIET_INTERVAL tokens, not every step
        ranks = self.controller.submit_many([SubmitCommand(uuid.uuid4().hex, prompt, sp, stream, stream_tokens=False)
                                             for prompt, sp, stream in zip(ids, params, streams)])

        async def collect(i: int) -> DPGenerateOutput:
            text = ""
            while True:
                ev = await streams[i].get()
                if ev.error is not None:
                    raise DPRequestFailed(f"request {i} failed ({ev.error.status} {ev.error.code}): {ev.error.message}")
                text += ev.text
                if ev.final:
                    return DPGenerateOutput(text, ev.completion_tokens, ev.prompt_tokens, ev.finish_reason,
                                            ev.cached_tokens, ranks[i] if ranks[i] is not None else -1,
                                            time.perf_counter())

        return list(await asyncio.gather(*(collect(i) for i in range(len(ids)))))

    def flush_cache(self) -> None:
        """Drop every replica's prefix cache and reset its scheduler counters (between timed
        passes; takes effect before any later request)."""

        async def flush():
            self.controller.flush_cache()

        self._call(flush())

    def shutdown(self) -> None:
        """Stop every replica (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._call(self.controller.stop_async(), timeout=60.0)
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._aloop.call_soon_threadsafe(self._aloop.stop)
        self._thread.join(10.0)

    def __enter__(self) -> "DataParallelLLM":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.shutdown()
        return False
