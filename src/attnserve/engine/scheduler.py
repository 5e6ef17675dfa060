"""Continuous-batching scheduler with overlap scheduling and retraction.

Each `step`:

1. **Admit** waiting requests in arrival order while a `ReqToTokenPool` row is free and
   the KV pool covers their prompt plus an *estimate* of their future output
   (``new_token_ratio * remaining max_new_tokens``, SGLang's admission rule) on top of the
   running requests' own estimates. The ratio starts at `AdmissionPolicy.init_ratio`,
   decays by ``decay`` a decode step down to ``min_ratio``, and is raised after a
   retraction.
2. **Pick a batch** on the host: EXTEND chunks for requests still prefilling (at most
   ``chunked_prefill_size`` tokens; with ``enable_mixed_chunk`` decode requests ride
   along in a MIXED batch), else a DECODE batch of every running request that may still
   produce a token. When the pool lacks pages for the batch, the running requests with
   the fewest generated tokens are **retracted**: their KV is freed, their output kept, and
   they go back to the front of the waiting queue to prefill prompt + output later
   (SGLang ``retract_decode``). A request that fits the pool alone is never refused.
3. **Launch** it: slots from the tensor allocator, every integer input in one packed
   host->device copy (`StepInputPacker`), one batched ``req_to_token`` write, the forward
   (a CUDA-graph replay for decode), batched sampling (`StepSampling`). Decode inputs are
   read on the device from the future-token map ``token_map[req_pool_idx]`` that each
   sampling step scatters its ids into, so a step never needs the previous one's ids on
   the host. The sampled ids go to the host through a non-blocking copy and an event.
4. **Process** a launched step's results: append tokens, check stop conditions, free the
   KV of finished requests in one batched free.

Without overlap (the CPU default, ``--disable-overlap-schedule``) a step processes its own
results (3 then 4). With overlap (the CUDA default) step N+1 is launched *before* step N's
results are processed, so the host builds the next batch and post-processes the previous
one while the GPU computes (SGLang's overlap scheduler; a batch with grammar masks samples
at the next launch: `StepSampling`). A request that finished at step N may then get one
more token computed at N+1; it is discarded, never emitted, and its KV is freed with the
rest. Length limits are known on the host, so no request gets a step past ``max_new_tokens``.

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

from attnserve.engine.constrained.scheduler_hooks import ConstrainedScheduling
from attnserve.engine.detokenizer import check_stop, may_stop, stop_ids_of
from attnserve.engine.prefix_cache import PrefixCacheManager
from attnserve.engine.request import FinishReason, Req
from attnserve.engine.sampling_params import SamplingParams
from attnserve.engine.schedule_batch import LaunchedStep, ScheduleBatch, SchedulerStats  # noqa: F401 (re-export)
from attnserve.speculative_config import SpeculativeConfig
from attnserve.engine.schedule_policy import (  # noqa: F401 (AdmissionPolicy re-exported)
    LPM_MAX_QUEUE,
    AdmissionPolicy,
    InBatchPrefixCheck,
    order_waiting,
    reserved_tokens,
)
from attnserve.engine.step_inputs import StepInputPacker, host_step_layout
from attnserve.engine.step_sampling import StepSampling
from attnserve.engine.tp.step_sync import StepMessage, StepSender, execute_step
from attnserve.forward_batch import ForwardMode

logger = logging.getLogger(__name__)


class Scheduler(StepSampling, ConstrainedScheduling):
    """Owns the waiting queue and the running batch of one engine.

    Args:
        model_runner: a `ModelRunner` (pools, backend, model).
        server_args: the engine's `ServerArgs`.
        tokenizer: HF tokenizer (for stop strings and text), or None.
        eos_token_ids: ids that end a request unless ``ignore_eos``.
        policy: the admission estimate (`AdmissionPolicy`).
        draft_runner: the draft model's `ModelRunner` (STANDALONE speculative decoding).
    """

    def __init__(self, model_runner, server_args, tokenizer=None, eos_token_ids: Sequence[int] = (),
                 policy: Optional[AdmissionPolicy] = None, draft_runner=None):
        self.runner = model_runner
        self.args = server_args
        self.tokenizer = tokenizer
        self.eos_token_ids = list(eos_token_ids)
        self.context_len = model_runner.context_len
        self.device = torch.device(model_runner.device)
        self.overlap = server_args.overlap_schedule_enabled(self.device.type)
        self.policy = policy or AdmissionPolicy.for_conservativeness(server_args.schedule_conservativeness)
        self.new_token_ratio = self.policy.init_ratio
        self.waiting: Deque[Req] = deque()
        self.running: List[Req] = []
        self.requests: Dict[str, Req] = {}
        self._rid_counter = itertools.count()
        self.seed_generator = torch.Generator().manual_seed(server_args.random_seed)
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.allocator = model_runner.token_to_kv_pool_allocator
        self._use_prefix_cache(not server_args.disable_radix_cache)
        # future-token map: the last sampled id of the request in each req_to_token row
        self.token_map = torch.zeros(self.req_to_token_pool.size, dtype=torch.int64, device=self.device)
        self.packer = StepInputPacker(self.device)
        self.spec = None  # speculative decoding (attnserve.engine.speculative), overlap off
        spec_config = SpeculativeConfig.from_server_args(server_args)
        if spec_config is not None:
            from attnserve.engine.speculative.verify import SpecDecoder

            self.spec = SpecDecoder(spec_config, model_runner, self.token_map, self.packer, draft_runner)
        self._init_sampling(model_runner)  # grammars, logit controls, logprobs (engine/step_sampling)
        #: tensor parallelism: rank 0 broadcasts each step to the other ranks
        self.tp_sender = None
        if model_runner.tp.size > 1:
            self.tp_sender = StepSender(model_runner.tp, self.req_to_token_pool)
        self._pending: Optional[LaunchedStep] = None
        self._current: List[Req] = []  # requests of the step being launched or processed
        #: after `step` raised: the requests of the step it was working on (the caller
        #: fails these alone; everything else stays consistent and keeps running), and the
        #: requests it had already updated (the caller still reports their progress)
        self.failed_reqs: List[Req] = []
        self.touched_before_failure: List[Req] = []
        self.stats = SchedulerStats()

    @property
    def num_steps(self) -> int:
        return self.stats.num_steps

    # ---- prefix cache ------------------------------------------------------------------
    def _use_prefix_cache(self, enabled: bool) -> None:
        from attnserve.mem_cache.radix_cache import ChunkCache, RadixCache

        cls = RadixCache if enabled else ChunkCache
        self.radix_enabled = enabled
        self.tree_cache = cls(self.allocator, self.allocator.page_size)
        self.cache = PrefixCacheManager(self.tree_cache, self.allocator, self.req_to_token_pool)

    def flush_prefix_cache(self) -> bool:
        """Drop every cached prefix (slots back to the allocator), as SGLang's
        ``/flush_cache``. Only while no request runs or waits; returns whether it did."""
        self.flush()
        if self.running or self.waiting:
            return False
        self.tree_cache.evict(self.tree_cache.evictable_size())
        self.tree_cache.reset()
        return True

    def set_prefix_cache(self, enabled: bool) -> None:
        """Switch the radix cache on or off (benchmarks compare both in one engine).

        Raises:
            RuntimeError: requests are running or waiting.
        """
        if not self.flush_prefix_cache():
            raise RuntimeError("the prefix cache can only be switched while the engine is idle")
        self._use_prefix_cache(enabled)

    # ---- requests ----------------------------------------------------------------------
    def add_request(self, prompt_ids: List[int], sampling_params: SamplingParams, rid: Optional[str] = None) -> Req:
        """Validate and enqueue a request.

        Raises:
            ValueError: empty prompt, prompt too long for the context or the KV pool, a
                duplicate rid, or a full waiting queue (message says which).
        """
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        self.grammar.check(sampling_params)
        n = len(prompt_ids)
        if n >= self.context_len:
            raise ValueError(
                f"the prompt has {n} tokens but the context length is {self.context_len}; "
                f"shorten it to at most {self.context_len - 1} tokens"
            )
        capacity = self.allocator.size
        if n + 1 > capacity:
            raise ValueError(f"the prompt has {n} tokens but the KV pool holds {capacity}")
        if self.args.max_queued_requests is not None and len(self.waiting) >= self.args.max_queued_requests:
            raise QueueFullError(f"the waiting queue is full ({self.args.max_queued_requests} requests)")
        rid = rid if rid is not None else f"req-{next(self._rid_counter)}"
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        max_total = min(n + sampling_params.max_new_tokens, self.context_len, capacity)
        req = Req(rid=rid, prompt_ids=list(prompt_ids), sampling_params=sampling_params, max_total_len=max_total)
        req.stop_ids = stop_ids_of(req, self.eos_token_ids)
        if sampling_params.seed is not None:
            req.seed = int(sampling_params.seed)
        else:
            req.seed = int(torch.randint(0, 2**31 - 1, (1,), generator=self.seed_generator))
        self.extras.register(req)
        self.requests[rid] = req
        self.grammar.enqueue(req, self.waiting)  # held back while its grammar compiles
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
        self._forget_state(req)
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._pending is not None or self.grammar.compiling)

    def forget(self, rid: str) -> None:
        """Drop a finished request's record (the caller has consumed its output)."""
        req = self.requests.get(rid)
        if req is not None and req.finished:
            del self.requests[rid]

    def release(self) -> None:
        """Drop everything the scheduler holds on the device or in pinned host memory, and
        its references to the runner and its pools; the scheduler cannot step afterwards.

        Requests still waiting or running end with ``abort`` (``error`` says why); the
        launched step whose results were pending is dropped. Released: the future-token map
        (int64 per ``req_to_token`` row), the pinned rings of `StepInputPacker` and of the
        sampled ids, the pending step's device ids and event, the speculative decoder
        (`SpecDecoder.release`: verify/draft graphs and their buffers), the prefix cache, the
        tensor-parallel step sender. Idempotent. Call it once the device has finished the
        launched work (`ModelRunner.release` waits for it)."""
        for req in [*self.waiting, *self.running]:
            if not req.finished:
                req.finish_reason = FinishReason.ABORT
                req.error = "the engine was shut down"
        self.waiting.clear()
        self.running.clear()
        self.requests.clear()
        self._pending = None
        self._current, self.failed_reqs, self.touched_before_failure = [], [], []
        if self.spec is not None:
            self.spec.release()
        self.spec = None
        self._release_sampling()
        self.token_map = self.packer = None
        self.tree_cache = self.cache = None
        self.allocator = self.req_to_token_pool = None
        self.tp_sender = None
        self.runner = None

    # ---- KV accounting -----------------------------------------------------------------
    def _future_tokens(self, req: Req, cached: int = 0) -> float:
        """Tokens ``req`` is expected to still add to the cache (prefill exactly, decode by
        the estimate ratio), plus a partly filled page; ``cached``: tokens a waiting
        request would take from the prefix cache."""
        if req.req_pool_idx is not None:
            prefill = max(req.prefill_target - req.kv_len, 0)
        else:
            prefill = len(req.prompt_ids) + len(req.output_ids) - cached
        decode = req.sampling_params.max_new_tokens - req.num_launched_outputs
        return prefill + self.new_token_ratio * max(decode, 0) + (self.allocator.page_size - 1)

    def _admit(self) -> None:
        if not self.waiting or len(self.running) >= self.runner.serving_limits.max_running_requests:
            return
        policy = self.args.schedule_policy
        matches = {}
        if self.radix_enabled and policy == "lpm" and len(self.waiting) <= LPM_MAX_QUEUE:
            matches = {id(r): self.cache.match(r) for r in self.waiting}
        order = order_waiting(self.waiting, {k: int(m.slots.numel()) for k, m in matches.items()}, policy)
        reserved = reserved_tokens(self.running, self.new_token_ratio, self.allocator.page_size)  # Σ _future_tokens
        check = InBatchPrefixCheck(self.allocator.page_size) if self.radix_enabled else None
        admitted = set()
        for req in order:
            if len(self.running) >= self.runner.serving_limits.max_running_requests:
                break
            match = matches.get(id(req)) or self.cache.match(req)
            match = self.extras.prefix_match(req, match, self.tree_cache)  # none for prompt logprobs
            cached = int(match.slots.numel())
            key = req.fill_ids
            if check is not None and check.holds_back(key, cached):
                continue  # shares an uncached prefix with a request admitted now: next step
            need = self._future_tokens(req, cached)
            if self.running and self.cache.available_tokens_after_attach(match) - reserved < need:
                break
            rows = self.req_to_token_pool.alloc(1)
            if rows is None:
                break
            req.req_pool_idx = rows[0]
            self.cache.attach(req, match)
            req.prefill_target = len(req.prompt_ids) + len(req.output_ids)
            if req.num_retractions == 0:
                self.stats.admitted_prompt_tokens += len(req.prompt_ids)
                self.stats.cached_prompt_tokens += req.cached_tokens
            reserved += need
            self.running.append(req)
            admitted.add(id(req))
            if check is not None:
                check.add(key)
        if admitted:
            self.waiting = deque(r for r in self.waiting if id(r) not in admitted)

    def _release(self, req: Req, cache: bool = True) -> None:
        """Give ``req``'s KV to the prefix cache (or back to the allocator) and its row back."""
        self.cache.release(req, cache=cache)

    def _retract(self, victims: List[Req]) -> None:
        """Send ``victims`` (no token in flight) back to the front of the waiting queue."""
        for req in victims:
            self.running.remove(req)
            self._release(req)  # cached: a re-admission may find its own prefix still there
            req.prefill_target = 0
            req.num_retractions += 1
            if self.spec is not None:
                self.spec.forget(req)
            self.waiting.appendleft(req)
        self.stats.num_retractions += 1
        self.stats.num_retracted_requests += len(victims)
        decoded = sum(len(r.output_ids) for r in self.running)
        total = sum(r.sampling_params.max_new_tokens for r in self.running) or 1
        self.new_token_ratio = min(1.0, (decoded + self.policy.retract_decode_steps * len(self.running)) / total)
        logger.warning(
            "KV pool exhausted: retracted %d request(s) (%s); %d running, new_token_ratio %.3f",
            len(victims), ", ".join(r.rid for r in victims), len(self.running), self.new_token_ratio,
        )

    def _pages_for(self, reqs: List[Req], extend_lens: List[int]) -> int:
        if self.allocator.page_size == 1:  # a page per token
            return sum(extend_lens)
        return sum(self.allocator.pages_needed(r.kv_len, r.kv_len + e) for r, e in zip(reqs, extend_lens))

    # ---- choosing a step ---------------------------------------------------------------
    def _select(self) -> Optional[ScheduleBatch]:
        prefilling: List[Req] = []
        decoding: List[Req] = []
        for r in self.running:  # one pass (runs every step over every running request)
            if r.kv_len < r.prefill_target:  # Req.is_prefilling
                prefilling.append(r)
            elif r.can_decode_more():
                decoding.append(r)
        if not prefilling:
            if not decoding:
                return None
            if self.spec is not None:
                plan = self.spec.plan(decoding)
                return ScheduleBatch(ForwardMode.TARGET_VERIFY, decoding, [r.kv_len for r in decoding],
                                     list(plan.extents), spec=plan)
            return ScheduleBatch(ForwardMode.DECODE, decoding, [r.kv_len for r in decoding], [1] * len(decoding))
        limits = self.runner.serving_limits
        budget = limits.chunked_prefill_size
        reqs, lens = [], []
        for r in prefilling:
            if budget <= 0:
                break
            n = min(r.prefill_target - r.kv_len, budget)
            if not limits.chunk_prompts and reqs and n < r.prefill_target - r.kv_len:
                break  # --chunked-prefill-size -1: the next step takes this prompt whole
            reqs.append(r)
            lens.append(n)
            budget -= n
        if self.args.enable_mixed_chunk and decoding:
            return ScheduleBatch(ForwardMode.MIXED, reqs + decoding, [r.kv_len for r in reqs + decoding],
                                 lens + [1] * len(decoding))
        return ScheduleBatch(ForwardMode.EXTEND, reqs, [r.kv_len for r in reqs], lens)

    def _schedule(self, touched: List[Req]) -> Optional[ScheduleBatch]:
        """The next batch, with enough free pages for it (retracting when needed)."""
        while True:
            batch = self._select()
            if batch is None:
                return None
            need = self._pages_for(batch.reqs, batch.extend_lens)
            if self.cache.make_room(need):  # evicts cached prefixes (LRU) when short
                return batch
            if self._pending is not None:  # finished requests of the pending step may free enough
                touched.extend(self._process(self._take_pending()))
                continue
            in_batch = set(map(id, batch.reqs))
            victims = [r for r in self.running if id(r) not in in_batch]
            if not victims:
                victims = batch.reqs[1:] if len(batch.reqs) > 1 else []
            if not victims:
                raise RuntimeError(
                    f"request {batch.reqs[0].rid} needs {need} KV pages but the pool has "
                    f"{self.allocator.num_free_pages()} free of {self.allocator.num_pages} (scheduler bug)"
                )
            # fewest generated tokens first, then the longest prompt (SGLang retract_decode)
            victims.sort(key=lambda r: (len(r.output_ids), -len(r.prompt_ids)))
            freed, chosen = 0, []
            short = need - self.allocator.num_free_pages()
            for r in victims:
                chosen.append(r)
                freed += -(-r.kv_len // self.allocator.page_size)
                if freed >= short:
                    break
            self._retract(chosen)

    # ---- one step ----------------------------------------------------------------------
    def step(self) -> List[Req]:
        """Run one engine step; return the requests that got a token or finished."""
        t0 = time.perf_counter()
        wait0 = self.stats.wait_seconds
        touched: List[Req] = []
        launched = batch = None
        self.failed_reqs = []
        self.touched_before_failure = []
        try:
            self._poll_grammars(touched)
            self._admit()
            batch = self._schedule(touched)
            if batch is None or batch.spec is not None:  # else `_launch_host`, after the host layout
                self._finish_deferred()  # a step whose grammar masks were being filled samples now
            if batch is not None and batch.spec is not None:  # speculative: verify, then accept at once
                self._current = batch.reqs
                touched.extend(self._verify(batch))
            elif batch is not None:
                self._current = batch.reqs
                launched = self._launch(batch)
            if self.overlap:
                pending, self._pending = self._pending, launched
                if pending is not None:
                    touched.extend(self._process(pending))
            elif launched is not None:
                touched.extend(self._process(launched))
            self._wait_for_grammars(batch)
        except BaseException:
            # Only the step that raised is lost: a launch that failed leaves the pending
            # step pending; a pending step whose results could not be read is dropped while
            # the step launched after it stays pending.
            self.failed_reqs = [r for r in self._current if not r.finished]
            for r in self.failed_reqs:
                r.kv_committed = False  # never cache K/V this step may not have written
            self.touched_before_failure = touched
            raise
        finally:
            self._current = []
        host = time.perf_counter() - t0 - (self.stats.wait_seconds - wait0)
        if batch is not None:
            self.stats.num_steps += 1
            if batch.forward_mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):
                self.stats.num_decode_steps += 1
                self.stats.decode_host_seconds += host
                self.new_token_ratio = max(self.policy.min_ratio, self.new_token_ratio - self.policy.decay)
            else:
                self.stats.num_extend_steps += 1
                self.stats.extend_host_seconds += host
        return touched

    def flush(self) -> List[Req]:
        """Process the launched step whose results are still pending (overlap); returns
        the requests it touched."""
        pending = self._take_pending()
        return self._process(pending) if pending is not None else []

    def _launch(self, batch: ScheduleBatch) -> LaunchedStep:
        """Enqueue ``batch``'s GPU work; then put its prefill chunks in the prefix cache
        (once the forward that writes their K/V is enqueued)."""
        launched = self._launch_forward(batch)
        if self.radix_enabled:
            for r, p in zip(batch.reqs, batch.prefix_lens):
                if p < r.prefill_target:
                    self.cache.cache_unfinished(r)
        return launched

    def _launch_forward(self, batch: ScheduleBatch) -> LaunchedStep:
        reqs, prefix_lens, extend_lens = batch.reqs, batch.prefix_lens, batch.extend_lens
        rows = [r.req_pool_idx for r in reqs]
        host = host_step_layout(rows, prefix_lens, extend_lens)
        r2t = self.req_to_token_pool
        last_loc = r2t.req_to_token_host[host["req_pool_indices"], (host["extend_prefix_lens"].long() - 1).clamp_min(0)]
        loc = self.allocator.alloc_extend(host["extend_prefix_lens"], host["seq_lens"], last_loc)
        if loc is None:  # _schedule checked the pages
            raise RuntimeError("KV pool exhausted after the schedule reserved pages (scheduler bug)")
        # Record the slots at once (host mirror + kv_len), so that whatever fails later in
        # this step, freeing these requests returns exactly the slots they hold.
        loc_i32 = loc.to(torch.int32)
        r2t.write_host(host["token_rows"], host["positions"], loc_i32)
        if batch.forward_mode == ForwardMode.DECODE:  # every row decodes: what the loop below gives, batched
            for r, p in zip(reqs, prefix_lens):
                r.kv_len = p + 1
            n = len(reqs)
            batch.emit = [True] * n
            host.update(input_ids=torch.full((n,), -1, dtype=torch.int64), out_cache_loc=loc,
                        out_cache_loc_i32=loc_i32, emit_index=torch.arange(n, dtype=torch.int64))
            return self._launch_host(batch, list(reqs), host, True)
        input_ids: List[int] = []
        emit: List[bool] = []
        has_future = False
        for r, p, e in zip(reqs, prefix_lens, extend_lens):
            if p < r.prefill_target:  # prefill chunk: ids known on the host
                input_ids.extend(r.fill_ids[p: p + e])
                r.kv_len = p + e
                emit.append(r.kv_len == r.prefill_target)
            else:  # decode: the input is the request's last sampled token, read on the device
                input_ids.append(-1)
                has_future = True
                r.kv_len = p + 1
                emit.append(True)
        batch.emit = emit
        emit_reqs = [r for r, e in zip(reqs, emit) if e]
        emit_index = [i for i, e in enumerate(emit) if e]
        host.update(
            input_ids=torch.tensor(input_ids, dtype=torch.int64), out_cache_loc=loc,
            out_cache_loc_i32=loc_i32, emit_index=torch.tensor(emit_index, dtype=torch.int64),
        )
        return self._launch_host(batch, emit_reqs, host, has_future)

    def _launch_host(self, batch: ScheduleBatch, emit_reqs: List[Req], host: dict, has_future: bool) -> LaunchedStep:
        """`_launch_forward`'s second half: the step's host tensors are built; broadcast it
        (tensor parallel), run the forward and enqueue the sampling."""
        reqs, prefix_lens, extend_lens = batch.reqs, batch.prefix_lens, batch.extend_lens
        # the pending step's deferred sampling (grammar masks), enqueued before this forward: its
        # host layout above was built while the masks were filled (engine/step_sampling)
        self._finish_deferred()
        plan, plan_owners = self.extras.plan_prompt(batch.forward_mode, reqs, prefix_lens, extend_lens)
        local = self._tp_local_sampling(emit_reqs)  # every rank samples itself, or None (engine/step_sampling)
        msg = StepMessage(batch.forward_mode, host, list(prefix_lens), list(extend_lens), has_future,
                          len(emit_reqs), prompt_plan=plan, local_sampling=local)
        if self.tp_sender is not None:
            t_send = time.perf_counter()
            self.tp_sender.send_step(msg)
            self.stats.tp_send_seconds += time.perf_counter() - t_send
        logits, dev = execute_step(self.runner, self.packer, self.token_map, msg)
        return self._sample_step(batch, emit_reqs, logits, dev, plan, plan_owners, local)

    def _process(self, launched: LaunchedStep) -> List[Req]:
        """Apply a launched step's sampled ids: append, check stops, free finished KV."""
        self._current = launched.batch.reqs
        self.stats.wait_seconds += self.extras.deliver(launched.extras, launched.emit_reqs)  # logprobs first
        if not launched.emit_reqs:
            return []
        ids = self._pending_ids(launched)
        touched: List[Req] = []
        now = time.perf_counter()
        ctx = self.context_len
        self.allocator.free_group_begin()
        try:
            for r, tok in zip(launched.emit_reqs, ids):
                r.num_inflight -= 1
                if r.finish_reason is not None:  # finished or aborted while this step ran: the token is dropped
                    self.stats.discarded_tokens += 1
                    continue
                if may_stop(r, tok, ctx):
                    self._append(r, [tok], now)
                else:  # what _append does for a token that cannot end r (no grammar, no stop string)
                    r.output_ids.append(tok)
                    if r.first_token_at is None:
                        r.first_token_at = now
                touched.append(r)
        finally:
            self.allocator.free_group_end()
        return touched

    def _append(self, r: Req, tokens: List[int], now: float) -> int:
        """Append ``tokens`` to ``r`` one at a time, checking stop conditions after each
        (tokens after a stop are dropped); finish it when it stops. Returns how many were
        kept. A failure here fails ``r`` alone."""
        kept = 0
        try:
            for tok in tokens:
                r.output_ids.append(tok)
                kept += 1
                if r.first_token_at is None:
                    r.first_token_at = now
                self.grammar.accept(r, tok)  # a terminated grammar finishes r with stop
                check_stop(r, self.tokenizer, self.eos_token_ids, self.context_len)
                if r.finished:
                    break
        except Exception as e:  # this request alone fails; the batch goes on
            logger.exception("post-processing request %s failed", r.rid)
            r.finish_reason = FinishReason.ABORT
            r.error = f"{type(e).__name__}: {e}"
        if r.finished:
            self._finish(r)
        return kept

    def _verify(self, batch: ScheduleBatch) -> List[Req]:
        """A speculative step (`SpecDecoder.verify`) and its results, at once (no overlap)."""
        result = self.spec.verify(batch.reqs, batch.spec)
        now = time.perf_counter()
        self.allocator.free_group_begin()
        try:
            for r, tokens in zip(batch.reqs, result.tokens):
                r.spec_verify_ct += 1
                self.spec.stats.num_emitted += self._append(r, tokens, now)
        finally:
            self.allocator.free_group_end()
        return list(batch.reqs)

    def _finish(self, req: Req) -> None:
        req.finished_at = time.perf_counter()
        self._forget_state(req)
        if req in self.running:
            self.running.remove(req)
        self._release(req)


class QueueFullError(ValueError):
    """The waiting queue is at ``--max-queued-requests`` (HTTP 503)."""
