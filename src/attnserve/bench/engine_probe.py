"""Record windows of a running engine under ``torch.profiler``, with its loop phases annotated.

`EngineProbe` changes no engine code: it wraps a few methods *of one engine's instances*
(instance attributes shadowing the class's methods) and removes the wrappers in `uninstall`.
While no window records, a wrapper is one attribute test and the original call; while one
records, each phase runs inside a ``torch.profiler.record_function`` range:

==============================  ===========================================================
range                           wrapped call
==============================  ===========================================================
``engine.step#<i>``             ``Scheduler.step`` (``i`` counts steps since `arm`)
``schedule.admit``              ``Scheduler._admit``
``schedule.select``             ``Scheduler._schedule`` (batch choice, retraction)
``radix_cache.make_room``       ``PrefixCacheManager.make_room`` (evictions)
``launch``                      ``Scheduler._launch_forward`` (host layout, KV slots, then below)
``prepare_inputs.h2d``          ``StepInputPacker.pack`` (one packed host-to-device copy)
``prepare_inputs.req_to_token`` ``ReqToTokenPool.write_device``
``forward``                     ``ModelRunner.forward``
``forward.graph_replay``        ``CudaGraphRunner.replay``
``forward.attn_metadata``       ``attn_backend.init_forward_metadata`` (eager forwards)
``sample``                      ``Scheduler._sample_step`` (sampling, D2H copy of the ids)
``radix_cache.insert``          ``PrefixCacheManager.cache_unfinished``
``process_results``             ``Scheduler._process``
``process_results.wait_ids``    ``Scheduler._pending_ids`` (event wait, ``tolist``)
``finish_request``              ``Scheduler._finish`` (radix-cache insert, KV free)
``kv_free``                     ``allocator.free_group_end`` (batched free)
==============================  ===========================================================

A `ProfileWindow` ``(name, start, num_steps)`` records engine steps ``start - lead`` (at
least 0) to ``start + num_steps + tail - 1``: the profiler is started ``lead`` steps early
(its start stalls the host once; the pipeline refills before the window) and stopped
``tail`` steps late, after a device synchronisation (so the window's last kernels are in
the trace). While armed the probe also keeps, for every step, what was launched
(`StepInfo`) and the host time it began (`EngineProbe.step_starts`: unprofiled steps around
a window show how much the profiler itself slows a step). Windows may not overlap.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch

from attnserve.bench.engine_gaps import STEP_PREFIX, StepInfo


@dataclass
class ProfileWindow:
    """Engine steps ``start .. start + num_steps - 1`` (counted from `EngineProbe.arm`)."""

    name: str
    start: int
    num_steps: int
    lead: int = 5
    tail: int = 2
    trace_path: Optional[str] = None  # set once recorded
    recorded: List[int] = field(default_factory=list)  # engine steps inside the trace

    @property
    def first_recorded(self) -> int:
        return max(self.start - self.lead, 0)

    @property
    def last_recorded(self) -> int:
        return self.start + self.num_steps + self.tail - 1


class EngineProbe:
    """Annotate one engine's loop and record `ProfileWindow` s of it (module doc).

    Args:
        engine: an `attnserve.engine.engine.Engine` (``LLM(...).engine``).
        windows: what to record, non-overlapping.
        trace_dir: where the Chrome traces go (``<trace_dir>/<name>.json``).

    Raises:
        ValueError: windows overlap or have ``num_steps < 1``.
    """

    def __init__(self, engine, windows: List[ProfileWindow], trace_dir: str):
        order = sorted(windows, key=lambda w: w.first_recorded)
        for w in order:
            if w.num_steps < 1 or w.start < 0:
                raise ValueError(f"window {w.name!r}: start {w.start} and num_steps {w.num_steps} must be >= 0 / >= 1")
        for a, b in zip(order, order[1:]):
            if b.first_recorded <= a.last_recorded:
                raise ValueError(f"windows {a.name!r} (steps {a.first_recorded}..{a.last_recorded}) and {b.name!r} "
                                 f"(steps {b.first_recorded}..{b.last_recorded}) overlap")
        self.engine = engine
        self.windows = order
        self.trace_dir = trace_dir
        self.step_index = 0
        self.armed = False
        self.recording: Optional[ProfileWindow] = None
        self.infos: Dict[int, StepInfo] = {}
        #: host time (``time.perf_counter``, s) at which each engine step since `arm` began
        self.step_starts: List[float] = []
        self._prof = None
        self._installed: List[tuple] = []

    # ---- wrappers ----------------------------------------------------------------------
    def _wrap(self, obj, attr: str, name: str, before: Optional[Callable] = None) -> None:
        if obj is None or not hasattr(obj, attr):
            return
        own = attr in vars(obj)
        orig = getattr(obj, attr)
        probe = self

        def wrapped(*args, **kwargs):
            if before is not None and probe.armed:
                before(*args, **kwargs)
            if probe.recording is None:
                return orig(*args, **kwargs)
            with torch.profiler.record_function(name):
                return orig(*args, **kwargs)

        setattr(obj, attr, wrapped)
        self._installed.append((obj, attr, own, vars(obj).get(attr) if own else None, orig))

    def install(self) -> "EngineProbe":
        """Wrap the engine's methods (idempotent)."""
        if self._installed:
            return self
        sched = self.engine.scheduler
        runner = sched.runner
        self._wrap(sched, "_admit", "schedule.admit")
        self._wrap(sched, "_schedule", "schedule.select")
        self._wrap(sched.cache, "make_room", "radix_cache.make_room")
        self._wrap(sched, "_launch_forward", "launch", before=self._note_batch)
        self._wrap(sched.packer, "pack", "prepare_inputs.h2d")
        self._wrap(runner.req_to_token_pool, "write_device", "prepare_inputs.req_to_token")
        self._wrap(runner, "forward", "forward")
        self._wrap(runner.cuda_graph_runner, "replay", "forward.graph_replay")
        self._wrap(runner.attn_backend, "init_forward_metadata", "forward.attn_metadata")
        self._wrap(sched, "_sample_step", "sample")
        self._wrap(sched.cache, "cache_unfinished", "radix_cache.insert")
        self._wrap(sched, "_process", "process_results")
        self._wrap(sched, "_pending_ids", "process_results.wait_ids")
        self._wrap(sched, "_finish", "finish_request")
        self._wrap(sched.allocator, "free_group_end", "kv_free")
        orig_step = sched.step
        own = "step" in vars(sched)

        def step(*args, **kwargs):
            if not self.armed:
                return orig_step(*args, **kwargs)
            i = self.step_index
            self.step_starts.append(time.perf_counter())
            self._maybe_start(i)
            try:
                if self.recording is None:
                    return orig_step(*args, **kwargs)
                self.recording.recorded.append(i)
                with torch.profiler.record_function(f"{STEP_PREFIX}{i}"):
                    return orig_step(*args, **kwargs)
            finally:
                self.step_index = i + 1
                self._maybe_stop(i)

        sched.step = step
        self._installed.append((sched, "step", own, vars(sched).get("step") if own else None, orig_step))
        return self

    def uninstall(self) -> None:
        """Stop any recording and restore every wrapped attribute."""
        self.finish()
        for obj, attr, own, value, _orig in reversed(self._installed):
            if own:
                setattr(obj, attr, value)
            else:
                delattr(obj, attr)
        self._installed = []

    def _note_batch(self, batch, *args, **kwargs) -> None:
        self.infos[self.step_index] = StepInfo(
            mode=batch.forward_mode.name.lower(), batch_size=len(batch.reqs),
            context_tokens=sum(batch.prefix_lens) + sum(batch.extend_lens), extend_tokens=sum(batch.extend_lens))

    # ---- windows -----------------------------------------------------------------------
    def arm(self) -> None:
        """Count engine steps from 0 from now on and record the windows as they come."""
        self.step_index = 0
        self.step_starts = []
        self.infos = {}
        self.armed = True

    def _maybe_start(self, i: int) -> None:
        if self.recording is not None:
            return
        for w in self.windows:
            if w.trace_path is None and not w.recorded and w.first_recorded <= i <= w.last_recorded:
                from torch.profiler import ProfilerActivity, profile

                acts = [ProfilerActivity.CPU]
                if torch.cuda.is_available() and torch.device(self.engine.scheduler.device).type == "cuda":
                    acts.append(ProfilerActivity.CUDA)
                self._prof = profile(activities=acts, record_shapes=False, with_stack=False, profile_memory=False)
                self._prof.start()
                self.recording = w
                return

    def _maybe_stop(self, i: int) -> None:
        w = self.recording
        if w is not None and i >= w.last_recorded:
            self._stop()

    def _stop(self) -> None:
        w, prof = self.recording, self._prof
        if self.engine.scheduler.device.type == "cuda":
            torch.cuda.synchronize()
        prof.stop()
        self.recording = self._prof = None
        os.makedirs(self.trace_dir, exist_ok=True)
        path = os.path.join(self.trace_dir, f"{w.name}.json")
        prof.export_chrome_trace(path)
        w.trace_path = path

    def finish(self) -> None:
        """Stop the window being recorded (the run ended inside it) and stop counting."""
        if self.recording is not None:
            self._stop()
        self.armed = False
