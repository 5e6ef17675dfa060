"""`StepSampling`: the sampling half of a launched step, kept out of
`attnserve.engine.scheduler` (a mixin of `Scheduler`, whose state it uses: ``extras``,
``grammar``, ``token_map``, ``tp_sender``, ``device``, ``overlap``, ``_pending``).

`Scheduler._launch_forward` enqueues a step's forward and calls `_sample_step` once, with
the logits of every row. On the device and in stream order, `_enqueue_sampling` then does:

1. logit controls (`SamplingExtras.before_sampling`: penalties, ``logit_bias``,
   ``min_tokens``) on the rows that sample; when some row also wants logprobs, which are
   of the unprocessed logits, the controls work out of place;
2. grammar masks of the constrained rows (`GrammarManager.apply_masks`), on a copy of the
   logits when the logprobs still need the unmasked ones;
3. greedy argmax or `sampler.sample`; the ids are scattered into the future-token map
   (the next decode step reads its inputs there, on the device);
4. `SamplingExtras.after_sampling` (penalty counts, logprob copies), the tensor-parallel
   broadcast of the ids, and one non-blocking copy of the ids to pinned host memory with
   an event (`LaunchedStep`).

Batches without controls, logprobs or grammars pay one truthiness test per hook.

**Grammar masks and overlap scheduling.** A constrained row's mask for step N+1 depends on
its token of step N, which under overlap scheduling reaches the host only after step N+1
is launched. With the host fill of 64 masks taking longer than a small model's forward,
any order that keeps fill, processing and scheduling one after the other on the host
leaves the GPU idle. So a batch with constrained rows is launched in two halves:

* **step N+1, forward half** (`_sample_step`): the forward of N+1 is enqueued; the host
  waits for step N's ids (the GPU has finished sampling N, and runs forward N+1 behind
  it) and hands a `MaskJob` to the mask worker thread (`GrammarManager.start_masks`,
  `attnserve.engine.constrained.mask_job`): accept N's tokens into the constrained rows'
  matchers (one ``batch_accept_string`` of the tokens' bytes, ~1-5 us a row: the module
  doc of `mask_job` says why not ``accept_token``), then fill N+1's masks (xgrammar's
  batch fill, its own C++ threads); xgrammar releases the GIL for both. The step's
  sampling is *deferred* (`LaunchedStep.deferred`), and the scheduler thread goes on at
  once: it processes step N (tokens, stop checks, detokenization; a constrained row's
  accept outcome comes from the job, waited for if not ready yet), returns, admits and
  schedules step N+2 and builds its host inputs (layout, KV slots), all while the GPU runs
  forward N+1 and the worker accepts and fills. This ids read is the ``early_syncs``
  counter: one per constrained step, by design (the masks need the tokens), and it does
  not idle the GPU, which has forward N+1 queued behind the ids.
* **step N+1, sampling half** (`_finish_deferred`, called by `Scheduler._launch_host` once
  step N+2's host inputs are built, right before its forward is enqueued, or whenever the
  scheduler needs step N+1's results): wait for the fill (normally done), then enqueue the
  mask upload, the masking kernel and the sampling of N+1 (1-4 above), then at once the
  forward of N+2.

So the GPU runs forward N+1 while the host does everything else of the step; the GPU idles
only where the ids' round trip plus the job's accept and fill, or the scheduler thread's
own work, outlasts forward N+1. The forward of N+2 reads its input ids from the
future-token map written by N+1's sampling, so it is enqueued after it (one stream); the
static logits of a CUDA graph are read by the sampling of N+1 before the graph is
replayed for N+2, in stream order. Without overlap scheduling the masks are filled on
the scheduler thread right after the forward is enqueued (the fill overlaps the forward)
and the step samples at once. Batches without constrained rows never defer.

Requests in a deferred step count the token as launched (``num_inflight``) from the
forward half on, so the scheduler never schedules past ``max_new_tokens``; the sampling
half uses the output positions recorded at the forward half (sampling seeds,
``min_tokens``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import List, Optional

import torch

from attnserve.engine.request import Req
from attnserve.engine.sampler import SamplingBatchInfo, argmax_last, sample
from attnserve.engine.sampling_extras import SamplingExtras
from attnserve.engine.schedule_batch import LaunchedStep, ScheduleBatch
from attnserve.engine.tp.step_sync import LocalSampling, emit_rows


@dataclass
class DeferredSampling:
    """What the sampling half of a deferred step needs (`StepSampling._sample_step`).

    Attributes:
        logits: float32 ``[len(emit_reqs), V]`` of the sampling rows.
        dev: the step's device tensors (`StepTensors`).
        plan / plan_owners: its prompt-logprob rows.
        masks: the `MaskJob` being filled.
        positions: each sampling row's output tokens before this step.
    """

    logits: torch.Tensor
    dev: object
    plan: object
    plan_owners: list
    masks: object
    positions: List[int]


class StepSampling:
    """Mixin of `Scheduler`: sample a step whose forward is enqueued."""

    def _init_sampling(self, model_runner) -> None:
        """Constructor part: the `GrammarManager`, the `SamplingExtras` (both free for
        requests that use neither) and the ring of pinned id buffers."""
        self._init_grammar(model_runner)  # constrained decoding (engine/constrained)
        self.extras = SamplingExtras.of(self)
        self._ids_ring: List[Optional[torch.Tensor]] = [None] * 4
        self._ids_next = 0

    def _release_sampling(self) -> None:
        """`Scheduler.release` part: stop the grammar workers, drop the pinned buffers."""
        self.grammar.shutdown()
        self.extras = None
        self._ids_ring = [None] * len(self._ids_ring)

    def _tp_local_sampling(self, emit_reqs: List[Req]) -> Optional[LocalSampling]:
        """Tensor parallelism: the `LocalSampling` with which every rank samples a step whose
        sampling rows are ``emit_reqs``, or None (one GPU, or rank 0 broadcasts the ids:
        `StepSender.local_sampling`)."""
        if self.tp_sender is None:
            return None
        return self.tp_sender.local_sampling(emit_reqs, [r.num_launched_outputs for r in emit_reqs])

    def _sample_step(self, batch: ScheduleBatch, emit_reqs: List[Req], logits: torch.Tensor, dev,
                     plan, plan_owners, local: Optional[LocalSampling] = None) -> LaunchedStep:
        """Enqueue the sampling of ``batch``, or defer it while its grammar masks are filled
        (see the module doc).

        Args:
            batch: the step; ``emit_reqs``: its rows that sample, in order.
            logits: float32 ``[len(batch.reqs), V]`` of the forward.
            dev: the step's device tensors (`StepTensors`).
            plan / plan_owners: its prompt-logprob rows (`SamplingExtras.plan_prompt`).
            local: every tensor-parallel rank samples the step this way (no grammar rows,
                so never deferred), or None.
        """
        if not emit_reqs:
            return LaunchedStep(batch, [], None, extras=self.extras.after_sampling(None, None, plan, plan_owners))
        if len(emit_reqs) != len(batch.reqs):
            logits = logits[dev.emit_index]
        masks = None
        if self.grammar.any_constrained(emit_reqs):
            ahead_reqs, ahead_tokens = self._pending_grammar_tokens(emit_reqs)
            masks = self.grammar.start_masks(emit_reqs, self.overlap, ahead_reqs, ahead_tokens)
            if masks is not None and masks.future is not None:
                positions = [r.num_launched_outputs for r in emit_reqs]
                for r in emit_reqs:
                    r.num_inflight += 1
                deferred = DeferredSampling(logits, dev, plan, plan_owners, masks, positions)
                return LaunchedStep(batch, emit_reqs, None, deferred=deferred)
        launched = self._enqueue_sampling(batch, emit_reqs, logits, dev, plan, plan_owners, masks, local=local)
        for r in emit_reqs:
            r.num_inflight += 1
        return launched

    def _enqueue_sampling(self, batch: ScheduleBatch, emit_reqs: List[Req], logits: torch.Tensor, dev, plan,
                          plan_owners, masks, positions: Optional[List[int]] = None,
                          local: Optional[LocalSampling] = None) -> LaunchedStep:
        """Steps 1-4 of the module doc; ``masks``: the batch's `MaskJob` or None;
        ``positions``: the rows' output tokens before this step (default: counted now,
        before this step's tokens are counted as launched); ``local``: the step's
        `LocalSampling`, which rank 0 samples with exactly as the other ranks do (and then
        broadcasts nothing), or None."""
        if masks is not None:
            if positions is None:
                positions = [r.num_launched_outputs for r in emit_reqs]
            self.grammar.finish_masks(masks, positions)
        logits, pending_extras = self.extras.before_sampling(emit_reqs, logits, positions)
        if pending_extras is not None and logits is pending_extras.raw_logits and masks is not None:
            logits = logits.clone()  # the logprobs are of the unmasked logits (after_sampling)
        self.grammar.apply_masks(logits, masks)  # constrained rows only (engine/constrained)
        params = [r.sampling_params for r in emit_reqs]
        if local is not None:
            next_ids = local.sample(logits)
        elif all(p.is_greedy for p in params):
            next_ids = argmax_last(logits)
        else:
            if positions is None:
                positions = [r.num_launched_outputs for r in emit_reqs]
            info = SamplingBatchInfo.from_params(params, [r.seed for r in emit_reqs], positions, self.device)
            next_ids = sample(logits, info)
        self.token_map[emit_rows(dev, len(emit_reqs))] = next_ids
        extras = self.extras.after_sampling(pending_extras, next_ids, plan, plan_owners, emit_reqs)
        if self.tp_sender is not None and local is None:
            self.tp_sender.send_ids(next_ids)
        host_ids = self._ids_buffer(len(emit_reqs))
        if host_ids is None:
            return LaunchedStep(batch, emit_reqs, next_ids, extras=extras)
        host_ids.copy_(next_ids, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        return LaunchedStep(batch, emit_reqs, host_ids, ev, extras=extras)

    def _finish_deferred(self) -> None:
        """Enqueue the sampling half of the pending step if it was deferred (before any
        forward is enqueued, and before its results are read). A failure fails that step's
        requests (``_current``) and drops the step; called from `Scheduler._launch_host` it
        also fails the requests of the step being launched, whose host layout holds KV slots
        already (freeing a failed request returns them)."""
        pending = self._pending
        if pending is None or pending.deferred is None:
            return
        d, self._pending = pending.deferred, None
        current = self._current
        mine = {id(r) for r in pending.batch.reqs}
        self._current = pending.batch.reqs + [r for r in current if id(r) not in mine]
        launched = self._enqueue_sampling(pending.batch, pending.emit_reqs, d.logits, d.dev, d.plan,
                                          d.plan_owners, d.masks, d.positions)
        self._current = current
        self._pending = launched

    def _take_pending(self) -> Optional[LaunchedStep]:
        """The pending step, sampled (`_finish_deferred`), no longer pending; or None."""
        self._finish_deferred()
        pending, self._pending = self._pending, None
        return pending

    def _pending_ids(self, launched: LaunchedStep) -> List[int]:
        """``launched``'s sampled ids on the host (waits for its event once)."""
        if launched.ids is None:
            if launched.event is not None:
                t = time.perf_counter()
                launched.event.synchronize()
                self.stats.wait_seconds += time.perf_counter() - t
            launched.ids = launched.next_ids_host.tolist()
        return launched.ids

    def _pending_grammar_tokens(self, emit_reqs: List[Req]):
        """Overlap: when some constrained row of ``emit_reqs`` has its previous token in the
        pending step, that step's constrained rows and their ids (read on the host now), for
        the mask job to accept first; else two empty lists. The step is processed later as
        usual."""
        pending = self._pending
        if pending is None or pending.accepted_ahead or not self.grammar.needs_tokens_first(emit_reqs):
            return [], []
        pending.accepted_ahead = True
        pairs = [(r, tok) for r, tok in zip(pending.emit_reqs, self._pending_ids(pending))
                 if r.grammar is not None and not r.finished]
        self.grammar.stats.early_syncs += 1
        return [r for r, _ in pairs], [t for _, t in pairs]

    def _forget_state(self, req: Req) -> None:
        """``req`` finished or was aborted: drop its logit-control slot and speculative state."""
        self.extras.forget(req)
        if self.spec is not None:
            self.spec.forget(req)

    def _ids_buffer(self, n: int) -> Optional[torch.Tensor]:
        """A pinned int64 host buffer of ``n`` ids from a ring of four (None on the CPU)."""
        if self.device.type != "cuda":
            return None
        i = self._ids_next
        self._ids_next = (i + 1) % len(self._ids_ring)
        buf = self._ids_ring[i]
        if buf is None or buf.numel() < n:
            buf = torch.empty(max(n, 256), dtype=torch.int64, pin_memory=True)
            self._ids_ring[i] = buf
        return buf[:n]
