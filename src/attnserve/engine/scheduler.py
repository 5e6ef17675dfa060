"""Continuous-batching scheduler.

Each `step`:

1. **Admit** waiting requests in arrival order while a `ReqToTokenPool` row is free and
   the KV pool can hold the request's whole future (prompt + ``max_new_tokens``, in
   pages) on top of what running requests have reserved. Reserving the worst case means
   a running request never runs out of KV, so nothing is ever preempted.
2. **Pick a batch**: if some admitted request still has prompt tokens without K/V, an
   EXTEND batch of prompt chunks (at most ``chunked_prefill_size`` tokens in all; with
   ``enable_mixed_chunk`` the decoding requests ride along in a MIXED batch); otherwise a
   DECODE batch of every running request.
3. **Run** it (slots from `TokenToKVPoolAllocator.alloc_extend`, written into
   ``req_to_token``, then `ModelRunner.forward`), sample, check stop conditions, and free a
   finished request's KV slots and row at once.

Requests that are still decoding keep their place in the running batch while new ones are
prefilled (continuous batching, Yu et al., "Orca", OSDI 2022).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from typing import Deque, Dict, List, Optional, Sequence

import torch

from attnserve.engine.detokenizer import update_text_and_check_stop
from attnserve.engine.request import FinishReason, Req
from attnserve.engine.sampler import sample
from attnserve.engine.sampling_params import SamplingParams
from attnserve.forward_batch import ForwardMode

logger = logging.getLogger(__name__)


class Scheduler:
    """Owns the waiting queue and the running batch of one engine.

    Args:
        model_runner: a `ModelRunner` (pools, backend, model).
        server_args: the engine's `ServerArgs`.
        tokenizer: HF tokenizer (for stop strings and text), or None.
        eos_token_ids: ids that end a request unless ``ignore_eos``.
    """

    def __init__(self, model_runner, server_args, tokenizer=None, eos_token_ids: Sequence[int] = ()):
        self.runner = model_runner
        self.args = server_args
        self.tokenizer = tokenizer
        self.eos_token_ids = list(eos_token_ids)
        self.context_len = model_runner.context_len
        self.waiting: Deque[Req] = deque()
        self.running: List[Req] = []
        self.requests: Dict[str, Req] = {}
        self._rid_counter = itertools.count()
        self.default_generator = torch.Generator(device=model_runner.device).manual_seed(server_args.random_seed)
        self.num_steps = 0

    # ---- requests ----------------------------------------------------------------------
    def add_request(self, prompt_ids: List[int], sampling_params: SamplingParams, rid: Optional[str] = None) -> Req:
        """Validate and enqueue a request.

        Raises:
            ValueError: empty prompt, prompt too long for the context or the KV pool, a
                duplicate rid, or a full waiting queue (message says which).
        """
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        n = len(prompt_ids)
        if n >= self.context_len:
            raise ValueError(
                f"the prompt has {n} tokens but the context length is {self.context_len}; "
                f"shorten it to at most {self.context_len - 1} tokens"
            )
        capacity = self.runner.token_to_kv_pool_allocator.size
        if n + 1 > capacity:
            raise ValueError(f"the prompt has {n} tokens but the KV pool holds {capacity}; raise --max-total-tokens")
        if self.args.max_queued_requests is not None and len(self.waiting) >= self.args.max_queued_requests:
            raise QueueFullError(f"the waiting queue is full ({self.args.max_queued_requests} requests)")
        rid = rid if rid is not None else f"req-{next(self._rid_counter)}"
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        max_total = min(n + sampling_params.max_new_tokens, self.context_len, capacity)
        req = Req(rid=rid, prompt_ids=list(prompt_ids), sampling_params=sampling_params, max_total_len=max_total)
        if sampling_params.seed is not None:
            req.generator = torch.Generator(device=self.runner.device).manual_seed(sampling_params.seed)
        self.requests[rid] = req
        self.waiting.append(req)
        return req

    def abort_request(self, rid: str) -> bool:
        """Finish ``rid`` with reason ``abort`` and free its KV now. False if unknown/finished."""
        req = self.requests.get(rid)
        if req is None or req.finished:
            return False
        req.finish_reason = FinishReason.ABORT
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        self._release(req)
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- KV accounting -----------------------------------------------------------------
    def _pages_to_finish(self, req: Req) -> int:
        return self.runner.token_to_kv_pool_allocator.pages_needed(req.kv_len, req.max_total_len)

    def _admit(self) -> None:
        alloc = self.runner.token_to_kv_pool_allocator
        reserved = sum(self._pages_to_finish(r) for r in self.running)
        while self.waiting and len(self.running) < self.args.max_running_requests:
            req = self.waiting[0]
            need = self._pages_to_finish(req)
            if alloc.num_free_pages() - reserved < need:
                break
            rows = self.runner.req_to_token_pool.alloc(1)
            if rows is None:
                break
            self.waiting.popleft()
            req.req_pool_idx = rows[0]
            reserved += need
            self.running.append(req)

    def _release(self, req: Req) -> None:
        if req.req_pool_idx is None:
            return
        if req.kv_len:
            slots = self.runner.req_to_token_pool.req_to_token[req.req_pool_idx, : req.kv_len]
            self.runner.token_to_kv_pool_allocator.free(slots.to("cpu", torch.int64))
        self.runner.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.kv_len = 0

    # ---- one step ----------------------------------------------------------------------
    def _select(self):
        """Return (mode, reqs, extend_lens) for this step, or None when idle."""
        prefilling = [r for r in self.running if r.is_prefilling]
        decoding = [r for r in self.running if not r.is_prefilling]
        if not prefilling:
            if not decoding:
                return None
            return ForwardMode.DECODE, decoding, [1] * len(decoding)
        budget = self.args.chunked_prefill_size
        reqs, lens = [], []
        for r in prefilling:
            if budget <= 0:
                break
            n = min(len(r.prompt_ids) - r.kv_len, budget)
            reqs.append(r)
            lens.append(n)
            budget -= n
        if self.args.enable_mixed_chunk and decoding:
            return ForwardMode.MIXED, reqs + decoding, lens + [1] * len(decoding)
        return ForwardMode.EXTEND, reqs, lens

    def step(self) -> List[Req]:
        """Run one engine step; return the requests that got a token or finished."""
        self._admit()
        sel = self._select()
        if sel is None:
            return []
        mode, reqs, extend_lens = sel
        prefix_lens = [r.kv_len for r in reqs]
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        out_cache_loc = self.runner.token_to_kv_pool_allocator.alloc_extend(
            prefix_lens, seq_lens, [r.last_loc for r in reqs]
        )
        if out_cache_loc is None:  # cannot happen: admission reserved the pages
            raise RuntimeError("KV pool exhausted despite admission reservation (scheduler bug)")
        input_ids: List[int] = []
        offset = 0
        for r, p, e in zip(reqs, prefix_lens, extend_lens):
            input_ids.extend(r.fill_ids[p : p + e])
            self.runner.req_to_token_pool.write(r.req_pool_idx, p, out_cache_loc[offset : offset + e])
            r.kv_len = p + e
            r.last_loc = int(out_cache_loc[offset + e - 1])
            offset += e
        logits = self.runner.forward_step(
            mode, input_ids, [r.req_pool_idx for r in reqs], prefix_lens, extend_lens, out_cache_loc
        )
        # Requests whose prompt is now complete (or that are decoding) get a token.
        emit = [i for i, r in enumerate(reqs) if not r.is_prefilling]
        touched: List[Req] = []
        if emit:
            next_ids = sample(
                logits[emit],
                [reqs[i].sampling_params for i in emit],
                [reqs[i].generator for i in emit],
                self.default_generator,
            )
            for i, tok in zip(emit, next_ids):
                r = reqs[i]
                r.output_ids.append(int(tok))
                if r.first_token_at is None:
                    r.first_token_at = time.perf_counter()
                update_text_and_check_stop(r, self.tokenizer, self.eos_token_ids, self.context_len)
                touched.append(r)
                if r.finished:
                    self._finish(r)
        self.num_steps += 1
        return touched

    def _finish(self, req: Req) -> None:
        req.finished_at = time.perf_counter()
        self.running.remove(req)
        self._release(req)

    def forget(self, rid: str) -> None:
        """Drop a finished request's record (the caller has consumed its output)."""
        req = self.requests.get(rid)
        if req is not None and req.finished:
            del self.requests[rid]


class QueueFullError(ValueError):
    """The waiting queue is at ``--max-queued-requests`` (HTTP 503)."""
