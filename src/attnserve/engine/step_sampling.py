"""`StepSampling`: the sampling half of a launched step, kept out of
`attnserve.engine.scheduler` (a mixin of `Scheduler`, whose state it uses: ``extras``,
``grammar``, ``token_map``, ``tp_sender``, ``device``).

`Scheduler._launch_forward` enqueues a step's forward and calls `_sample_step` once, with
the logits of every row. Per step, on the device and in stream order:

1. the rows that sample (``emit_index``) are taken from the logits;
2. logit controls (`SamplingExtras.before_sampling`: penalties, ``logit_bias``,
   ``min_tokens``); when some row also wants logprobs, which are of the unprocessed
   logits, the controls work out of place;
3. grammar masks of the constrained rows (`ConstrainedScheduling._mask_grammar`), on a
   copy of the logits when the logprobs still need the unmasked ones;
4. greedy argmax or `sampler.sample`; the ids are scattered into the future-token map
   (the next decode step reads its inputs there, on the device);
5. `SamplingExtras.after_sampling` (penalty counts, logprob copies), the tensor-parallel
   broadcast of the ids, and one non-blocking copy of the ids to pinned host memory with
   an event (`LaunchedStep`).

Batches without controls, logprobs or grammars pay one truthiness test per hook.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from attnserve.engine.request import Req
from attnserve.engine.sampler import SamplingBatchInfo, argmax_last, sample
from attnserve.engine.schedule_batch import LaunchedStep, ScheduleBatch
from attnserve.engine.tp.step_sync import emit_rows


class StepSampling:
    """Mixin of `Scheduler`: sample a step whose forward is enqueued."""

    def _sample_step(self, batch: ScheduleBatch, emit_reqs: List[Req], logits: torch.Tensor, dev,
                     plan, plan_owners) -> LaunchedStep:
        """Enqueue the sampling of ``batch`` (steps 1-5 of the module doc).

        Args:
            batch: the step; ``emit_reqs``: its rows that sample, in order.
            logits: float32 ``[len(batch.reqs), V]`` of the forward.
            dev: the step's device tensors (`StepTensors`).
            plan / plan_owners: its prompt-logprob rows (`SamplingExtras.plan_prompt`).
        """
        if not emit_reqs:
            return LaunchedStep(batch, [], None, extras=self.extras.after_sampling(None, None, plan, plan_owners))
        if len(emit_reqs) != len(batch.reqs):
            logits = logits[dev.emit_index]
        logits, pending_extras = self.extras.before_sampling(emit_reqs, logits)
        if (pending_extras is not None and logits is pending_extras.raw_logits
                and self.grammar.any_constrained(emit_reqs)):
            logits = logits.clone()  # the logprobs are of the unmasked logits (after_sampling)
        self._mask_grammar(logits, emit_reqs)  # constrained rows only (engine/constrained)
        params = [r.sampling_params for r in emit_reqs]
        if all(p.is_greedy for p in params):
            next_ids = argmax_last(logits)
        else:
            info = SamplingBatchInfo.from_params(params, [r.seed for r in emit_reqs],
                                                 [r.num_launched_outputs for r in emit_reqs], self.device)
            next_ids = sample(logits, info)
        self.token_map[emit_rows(dev, len(emit_reqs))] = next_ids
        extras = self.extras.after_sampling(pending_extras, next_ids, plan, plan_owners, emit_reqs)
        if self.tp_sender is not None:
            self.tp_sender.send_ids(next_ids)
        for r in emit_reqs:
            r.num_inflight += 1
        host_ids = self._ids_buffer(len(emit_reqs))
        if host_ids is None:
            return LaunchedStep(batch, emit_reqs, next_ids, extras=extras)
        host_ids.copy_(next_ids, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        return LaunchedStep(batch, emit_reqs, host_ids, ev, extras=extras)

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
