"""The scheduler's per-step records: what a step runs (`ScheduleBatch`), what a launched
step will deliver (`LaunchedStep`), and the scheduler's counters (`SchedulerStats`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import torch

from attnserve.engine.request import Req
from attnserve.forward_batch import ForwardMode


@dataclass
class SchedulerStats:
    """Counters of one scheduler (read by benchmarks and ``/metrics``).

    ``decode_host_seconds`` / ``extend_host_seconds``: time spent inside `Scheduler.step`
    minus the time blocked waiting for the GPU's results (``wait_seconds``), by the kind of
    step launched. ``discarded_tokens``: tokens computed for requests that had already
    finished (overlap). ``cached_prompt_tokens`` of ``admitted_prompt_tokens`` came from the
    prefix cache. ``tp_send_seconds`` (tensor parallel, rank 0): time spent broadcasting
    step messages, part of the host time; a gloo broadcast returns only once every rank has
    reached it, so this includes waiting for the other ranks' previous step (and, through
    them, for their GPUs).
    """

    num_steps: int = 0
    num_decode_steps: int = 0
    num_extend_steps: int = 0
    decode_host_seconds: float = 0.0
    extend_host_seconds: float = 0.0
    wait_seconds: float = 0.0
    num_retractions: int = 0
    num_retracted_requests: int = 0
    discarded_tokens: int = 0
    admitted_prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    tp_send_seconds: float = 0.0

    @property
    def host_ms_per_decode_step(self) -> float:
        return 1e3 * self.decode_host_seconds / max(self.num_decode_steps, 1)

    @property
    def tp_send_ms_per_step(self) -> float:
        return 1e3 * self.tp_send_seconds / max(self.num_steps, 1)


@dataclass
class ScheduleBatch:
    """A step chosen on the host: ``reqs`` with ``prefix_lens[i]`` cached tokens and
    ``extend_lens[i]`` computed now; ``emit[i]``: row i samples an output token;
    ``spec``: the `SpecPlan` of a speculative verify step (TARGET_VERIFY), else None."""

    forward_mode: ForwardMode
    reqs: List[Req]
    prefix_lens: List[int]
    extend_lens: List[int]
    emit: List[bool] = field(default_factory=list)
    spec: Optional[object] = None


@dataclass
class LaunchedStep:
    """A step whose GPU work is enqueued: ``emit_reqs`` get ``next_ids_host`` (valid once
    ``event`` has completed; None on the CPU, where it is valid at once); ``extras``: its
    logprob results (`attnserve.engine.sampling_extras.LaunchedLogprobs`), or None.
    ``deferred``: its forward is enqueued but its sampling waits for grammar masks being
    filled (`attnserve.engine.step_sampling.DeferredSampling`; ``next_ids_host`` is None
    until `StepSampling._finish_deferred`). ``ids``: the ids as a list once read on the
    host; ``accepted_ahead``: its constrained rows' matchers have accepted them."""

    batch: ScheduleBatch
    emit_reqs: List[Req]
    next_ids_host: Optional[torch.Tensor]
    event: Optional["torch.cuda.Event"] = None
    extras: Optional[object] = None
    deferred: Optional[object] = None
    ids: Optional[List[int]] = None
    accepted_ahead: bool = False
