"""`EngineLoop`: the one thread that drives an `Engine`, and the bridge to asyncio.

Threading contract:

* Only the loop thread calls the engine (tokenizer decoding inside `Scheduler.step`,
  `Scheduler.add_request`, `abort_request`, `step`, the pools). HTTP handlers only call
  `EngineLoop.submit` / `EngineLoop.abort`, which put commands on a thread-safe
  ``queue.Queue``.
* Results go back through a `RequestStream` per request: the loop thread calls
  `RequestStream.push`, which hands the event to the handler's asyncio loop with
  ``loop.call_soon_threadsafe``; the handler awaits `RequestStream.get`.
* Commands are drained before every step, so an abort frees the request's KV slots before
  the next forward pass ("within one engine step").

Failure isolation: an exception raised while admitting, stepping or emitting one request
fails the requests it concerns (they get an `EngineError` event, status 500) and the loop
keeps serving. When `Scheduler.step` itself raises, the requests of the step that raised
(`Scheduler.failed_reqs`) are failed and aborted (their KV freed) and the others keep
running; if slots are still held once nothing runs (a step died half-way), both pools are
reset so no capacity leaks.

End of the loop: `stop` (the app's shutdown) and a loop thread that dies (an exception
the per-iteration guard cannot catch) both end every admitted and every queued request
with a 503 event (``shutting_down`` / ``engine_dead``), so no handler waits forever; a
request submitted after that is answered 503 at once (`submit`). A graceful drain
(`begin_drain`) refuses new requests, lets running ones finish until its deadline, then
ends the rest the same way; `wait_drained` tells the HTTP server when it may exit.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

logger = logging.getLogger(__name__)


def wait_for_drain(drained: threading.Event, ended: Callable[[], bool], timeout: Optional[float]) -> bool:
    """Block until ``drained`` is set or ``ended()`` (the engine is gone) is true, polling
    every 0.1 s; False if ``timeout`` seconds passed first (None: no limit)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not drained.is_set():
        if ended():
            return True
        left = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
        if left <= 0:
            return False
        drained.wait(left)
    return True


@dataclass
class EngineError:
    """Why a request failed: HTTP ``status``, ``message``, OpenAI error ``type`` and ``code``."""

    status: int
    message: str
    type: str = "server_error"
    code: Optional[str] = None


def request_error(req) -> EngineError:
    """The error event of a request that failed alone (``req.error`` set): 400 when the
    request was at fault (``req.error_status``, e.g. a grammar that did not compile), else
    500."""
    if getattr(req, "error_status", 500) == 400:
        return EngineError(400, req.error, "invalid_request_error", "invalid_value")
    return EngineError(500, f"internal error while finishing the request: {req.error}")


@dataclass
class StreamEvent:
    """One update of a request, in order.

    Attributes:
        text: new text since the previous event (may be empty; already safe to show, i.e.
            no half UTF-8 character and no possible start of a stop string).
        completion_tokens: generated tokens so far (EOS/stop token included).
        prompt_tokens: prompt length in tokens.
        finish_reason: ``"stop"``, ``"length"``, ``"abort"`` on the last event, else None.
        error: set (and final) when the request failed.
        cached_tokens: prompt tokens served from the prefix cache (known once admitted).
        logprobs: output tokens' logprob entries not sent before (requests that asked;
            `attnserve.engine.logprobs.StreamCursor`), else None.
        prompt_logprobs: the prompt's entries, once, with the first tokens (``echo``).
        matched_stop: on a final ``"stop"`` event, what ended the request (`Req.matched_stop`):
            the token id (int: EOS, a stop token, a grammar's end) or the stop string (str).
    """

    text: str = ""
    completion_tokens: int = 0
    prompt_tokens: int = 0
    finish_reason: Optional[str] = None
    error: Optional[EngineError] = None
    cached_tokens: int = 0
    logprobs: Optional[list] = None
    prompt_logprobs: Optional[list] = None
    matched_stop: Any = None

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class RequestStream:
    """Events of one request, produced on the loop thread and consumed on an asyncio loop.

    Must be created on the consuming event loop (it captures the running loop).
    """

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: "asyncio.Queue[StreamEvent]" = asyncio.Queue()

    def push(self, event: StreamEvent) -> None:
        """Thread-safe; a no-op once the consuming loop is closed (server shutting down)."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:
            pass

    def put(self, event: StreamEvent) -> None:
        """`push` from the consuming loop's own thread (no cross-thread wake-up)."""
        self._queue.put_nowait(event)

    async def get(self) -> StreamEvent:
        return await self._queue.get()


@dataclass
class SubmitCommand:
    """Enqueue ``prompt_ids`` with ``sampling_params`` under id ``rid``.

    ``arrival`` is the ``time.perf_counter()`` at which the HTTP request arrived (TTFT and
    end-to-end latency are measured from it). ``stream_tokens`` False (a client that waits
    for the whole answer): the request's tokens are reported on its first token, then only
    every `QUIET_INTERVAL` tokens and at its end, not every step (the final event carries
    the whole text); SGLang's scheduler sends a non-streamed request's output every 50
    tokens (``DEFAULT_FORCE_STREAM_INTERVAL``) for the same reason."""

    rid: str
    prompt_ids: List[int]
    sampling_params: Any
    stream: RequestStream
    arrival: float = field(default_factory=time.perf_counter)
    stream_tokens: bool = True


#: tokens between two reports of a request that is not streamed (`SubmitCommand.stream_tokens`)
QUIET_INTERVAL = 50


def makes_event(delta: str, reason: Optional[str], new_tokens: int, has_tokenizer: bool, streamed: bool) -> bool:
    """Whether a report of a request's output becomes a `StreamEvent`: new text, its end, or,
    for a model without a tokenizer (no text at all), new tokens of a streamed request (so
    its client sees every token arrive). Both serving paths (`EngineLoop._emit`, the engine
    process's `EngineClient`) use this rule."""
    return bool(delta) or reason is not None or (new_tokens > 0 and not has_tokenizer and streamed)


@dataclass
class _AbortCommand:
    rid: str


class _FlushCacheCommand:
    """Drop the prefix cache once the commands before it are handled (`EngineLoop.flush_cache`)."""


@dataclass
class _Live:
    """Loop-thread bookkeeping of one admitted request."""

    cmd: SubmitCommand
    sent: str = ""  # text already pushed
    last_token_at: Optional[float] = None
    tokens: int = 0
    logprobs: Any = None  # a StreamCursor once the request's logprobs are streamed
    cached_sent: int = -1  # cached_tokens last sent to the HTTP process (engine process only)
    quiet: bool = False  # not streamed: tokens reported every QUIET_INTERVAL (SubmitCommand.stream_tokens)

    def holds_back(self, n: int) -> bool:
        """A running request that is not streamed, with ``n`` output tokens: whether they wait
        (reported already, and fewer than `QUIET_INTERVAL` new since). Callers ask only while
        the request runs (its end is always reported)."""
        return self.quiet and self.tokens > 0 and n - self.tokens < QUIET_INTERVAL


_STOP = object()
_WAKE = object()  # nudges an idle loop thread (a drain began)


def take_logprobs(live, req) -> tuple:
    """``(output entries, prompt entries)`` of ``req`` not yet sent to ``live``'s client
    (`attnserve.engine.logprobs.StreamCursor.take`); ``(None, None)`` without logprobs."""
    if getattr(req, "logprobs", None) is None:
        return None, None
    if live.logprobs is None:
        from attnserve.engine.logprobs import StreamCursor

        live.logprobs = StreamCursor()
    return live.logprobs.take(req)


def _shutting_down(detail: str = "") -> EngineError:
    return EngineError(503, "the server is shutting down" + detail, "server_error", "shutting_down")


def _engine_dead() -> EngineError:
    return EngineError(503, "the engine loop is not running", "server_error", "engine_dead")


class EngineLoop:
    """Runs ``engine`` (an `attnserve.engine.engine.Engine` or anything with ``scheduler``,
    ``model_runner``, ``step``, ``has_work``, ``add_request``, ``abort_request``) in one
    daemon thread.

    Args:
        engine: the engine; after `start` only the loop thread touches it.
        metrics: optional `attnserve.server.metrics.ServerMetrics` fed from the loop thread.
        idle_poll_s: how long the idle thread blocks on the command queue (seconds) before
            refreshing its state snapshot.
    """

    def __init__(self, engine, metrics=None, idle_poll_s: float = 0.5):
        self.engine = engine
        self.metrics = metrics
        self.idle_poll_s = idle_poll_s
        self._commands: "queue.Queue[Any]" = queue.Queue()
        self._live: Dict[str, _Live] = {}
        self._thread: Optional[threading.Thread] = None
        self._stopping = threading.Event()
        self._draining = threading.Event()
        self._drained = threading.Event()  # draining, and nothing admitted or queued is left
        self._closed = threading.Event()  # the thread left its loop (stopped or died)
        self._close_error = _shutting_down()
        self._drain_deadline = float("inf")
        self._state: Dict[str, Any] = {}
        self.step_errors = 0
        # CPU seconds of the loop thread: every iteration, and inside `Engine.step` alone;
        # the difference is what serving adds to the scheduler's own host work
        self.loop_cpu_s = 0.0
        self.step_cpu_s = 0.0
        self._iter_t0: Optional[float] = None  # thread_time() at the start of the running iteration

    # ---- called from any thread ----------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("EngineLoop already started")
        self._publish_state()
        self._thread = threading.Thread(target=self._run, name="attnserve-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the thread to finish (pending requests fail with 503) and join it."""
        self._stopping.set()
        self._commands.put(_STOP)
        if self._thread is not None:
            self._thread.join(timeout)

    def begin_drain(self, grace_s: float) -> None:
        """Graceful shutdown: refuse new requests (503 ``shutting_down``) from now on, let
        running ones finish for ``grace_s`` seconds, then end the rest with a 503 error
        event (their streams then close with the error and ``[DONE]``). Calling it again
        can only bring the deadline forward (a second Ctrl-C: ``grace_s=0``)."""
        self._drain_deadline = min(self._drain_deadline, time.monotonic() + max(grace_s, 0.0))
        self._draining.set()
        self._commands.put(_WAKE)

    @property
    def draining(self) -> bool:
        return self._draining.is_set()

    def wait_drained(self, timeout: Optional[float] = None) -> bool:
        """Block until a drain has ended every request (finished, or failed at the
        deadline) or the loop thread has ended; False if ``timeout`` seconds passed first."""
        return wait_for_drain(self._drained, lambda: self._closed.is_set() or (
            self._thread is not None and not self._thread.is_alive()), timeout)

    @property
    def thread_id(self) -> Optional[int]:
        return None if self._thread is None else self._thread.ident

    def is_alive(self) -> bool:
        """True while the loop thread runs and has not been asked to stop."""
        return (self._thread is not None and self._thread.is_alive() and not self._stopping.is_set()
                and not self._closed.is_set())

    def submit(self, cmd: SubmitCommand) -> None:
        """Queue a request; its first event says whether it was accepted (an empty event)
        or rejected (``error`` set: 503 ``shutting_down`` while draining or stopped, 503
        ``engine_dead`` when the loop thread died, 503 ``queue_full`` when the waiting queue
        is full, 400 when the engine refuses the prompt)."""
        if self._stopping.is_set() or self._draining.is_set():
            cmd.stream.push(StreamEvent(error=_shutting_down()))
            return
        if self._closed.is_set() or (self._thread is not None and not self._thread.is_alive()):
            cmd.stream.push(StreamEvent(error=_engine_dead()))
            return
        self._commands.put(cmd)
        if self._closed.is_set():  # the loop ended while we queued: it may never read the command
            self._flush_commands(self._close_error)

    def abort(self, rid: str) -> None:
        """Abort ``rid`` (unknown or finished ids are ignored)."""
        self._commands.put(_AbortCommand(rid))

    def flush_cache(self) -> bool:
        """Ask the loop thread to drop the prefix cache (`Scheduler.flush_prefix_cache`: a no-op,
        logged, while requests run or wait); True: the command was queued."""
        self._commands.put(_FlushCacheCommand())
        return True

    def state(self) -> Dict[str, Any]:
        """Snapshot taken by the loop thread after its last step (a fresh dict)."""
        return dict(self._state)

    def _flush_commands(self, err: EngineError) -> None:
        """Answer every queued submit with ``err`` (thread-safe: it touches only the queue
        and the requests' streams, never the engine)."""
        while True:
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, SubmitCommand):
                item.stream.push(StreamEvent(error=err))

    # ---- loop thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                try:
                    self._iterate()
                except Exception:  # the loop must survive anything; log and go on
                    logger.exception("engine loop iteration failed")
                    time.sleep(0.01)
        except BaseException:  # the thread is ending: its requests must not hang
            logger.critical("the engine loop died; failing every request with 503", exc_info=True)
            self._close_error = _engine_dead()
        finally:
            self._closed.set()
            self._shutdown(self._close_error)
            self._drained.set()

    def _iterate(self) -> None:
        """One round: drain commands, end requests past a drain's deadline, step, publish."""
        self._iter_t0 = time.thread_time()
        try:
            self._iterate_once()
        finally:
            self.loop_cpu_s += time.thread_time() - self._iter_t0
            self._iter_t0 = None

    def _iterate_once(self) -> None:
        self._drain(block=not self.engine.has_work())
        if self._stopping.is_set():
            return
        if self._draining.is_set() and self._live and time.monotonic() >= self._drain_deadline:
            err = _shutting_down("; the request did not finish within the graceful-shutdown timeout")
            for rid in list(self._live):
                self._fail(rid, err)
        if self.engine.has_work():
            self._step()
        self._publish_state()
        if self._draining.is_set() and not self._live and self._commands.empty():
            self._drained.set()

    def _drain(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=self.idle_poll_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if item is _STOP:
                return
            if item is _WAKE:
                pass
            elif isinstance(item, _AbortCommand):
                self._abort(item.rid)
            elif isinstance(item, _FlushCacheCommand):
                self._flush_cache()
            else:
                self._add(item)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _flush_cache(self) -> None:
        """Drop the prefix cache (loop thread); kept, with a warning, while requests run or wait."""
        if not self.engine.scheduler.flush_prefix_cache():
            logger.warning("flush_cache while requests run or wait; the prefix cache is kept")

    def _add(self, cmd: SubmitCommand) -> None:
        from attnserve.engine.scheduler import QueueFullError

        try:
            self.engine.add_request(cmd.prompt_ids, cmd.sampling_params, rid=cmd.rid)
        except QueueFullError as e:
            self._reject(cmd, EngineError(503, str(e), "server_overloaded", "queue_full"))
            return
        except ValueError as e:
            self._reject(cmd, EngineError(400, str(e), "invalid_request_error", "invalid_value"))
            return
        except Exception as e:
            logger.exception("add_request failed for %s", cmd.rid)
            self._reject(cmd, EngineError(500, f"internal error while queueing the request: {e}"))
            return
        self._live[cmd.rid] = _Live(cmd, quiet=not cmd.stream_tokens)
        if self.metrics is not None:
            self.metrics.on_accept(len(cmd.prompt_ids))
        cmd.stream.push(StreamEvent(prompt_tokens=len(cmd.prompt_ids)))

    def _reject(self, cmd: SubmitCommand, err: EngineError) -> None:
        if self.metrics is not None:
            self.metrics.on_reject(err.status)
        cmd.stream.push(StreamEvent(prompt_tokens=len(cmd.prompt_ids), error=err))

    def _abort(self, rid: str) -> None:
        live = self._live.pop(rid, None)
        try:
            self.engine.abort_request(rid)
            self.engine.scheduler.forget(rid)
        except Exception:
            logger.exception("aborting %s failed", rid)
        if live is not None:
            if self.metrics is not None:
                self.metrics.on_finish("abort", time.perf_counter() - live.cmd.arrival)
            live.cmd.stream.push(StreamEvent(completion_tokens=live.tokens, prompt_tokens=len(live.cmd.prompt_ids),
                                             finish_reason="abort"))

    def _fail(self, rid: str, err: EngineError) -> None:
        """Abort ``rid`` in the scheduler (freeing its KV) and send ``err`` to its client."""
        live = self._live.pop(rid, None)
        try:
            self.engine.abort_request(rid)
            self.engine.scheduler.forget(rid)
        except Exception:
            logger.exception("could not abort failed request %s", rid)
        if live is not None:
            if self.metrics is not None:
                self.metrics.on_finish("error", time.perf_counter() - live.cmd.arrival)
            live.cmd.stream.push(StreamEvent(completion_tokens=live.tokens, prompt_tokens=len(live.cmd.prompt_ids),
                                             error=err))

    def _step(self) -> None:
        try:
            t0 = time.thread_time()
            try:
                touched = self.engine.step()
            finally:
                self.step_cpu_s += time.thread_time() - t0
        except Exception as e:
            self.step_errors += 1
            logger.exception("engine step failed; failing the running batch")
            self._recover(EngineError(500, f"internal error while generating: {type(e).__name__}: {e}"))
            touched = list(getattr(self.engine.scheduler, "touched_before_failure", None) or [])
        self._emit_all(touched)

    def _emit_all(self, touched) -> None:
        """`_emit` each request the step touched; one that raises fails alone (500)."""
        for req in touched:
            try:
                self._emit(req)
            except Exception as e:
                self._emit_failed(req, e)

    def _emit_failed(self, req, e: Exception) -> None:
        logger.exception("emitting output of %s failed", req.rid)
        self._fail(req.rid, EngineError(500, f"internal error while streaming: {type(e).__name__}: {e}"))

    def _recover(self, err: EngineError) -> None:
        """Fail the requests of the step that raised (`Scheduler.failed_reqs`; all running
        requests when the failure was outside a step's batch) and keep serving the rest."""
        sched = self.engine.scheduler
        failed = list(getattr(sched, "failed_reqs", None) or sched.running)
        for req in failed:
            self._fail(req.rid, err)
        if not sched.running:
            runner = self.engine.model_runner
            alloc, rows = runner.token_to_kv_pool_allocator, runner.req_to_token_pool
            tree = getattr(sched, "tree_cache", None)
            cached = tree.evictable_size() if tree is not None else 0
            if alloc.available_size() + cached != alloc.size or rows.available_size() != rows.size:
                logger.warning("KV slots leaked by the failed step; resetting the pools and the prefix cache")
                alloc.clear()
                rows.clear()
                if tree is not None:
                    tree.reset()

    def _emit(self, req) -> None:
        from attnserve.engine.detokenizer import stable_text

        live = self._live.get(req.rid)
        if live is None:  # not ours (or already failed): nothing to report
            return
        if req.finished and getattr(req, "error", None):  # failed alone (a bad grammar: 400)
            self._fail(req.rid, request_error(req))
            return
        new_tokens = len(req.output_ids) - live.tokens
        if req.finish_reason is None and live.holds_back(len(req.output_ids)):
            return  # the client reads the whole answer at the end
        now = time.perf_counter()
        if self.metrics is not None and new_tokens > 0:
            if live.last_token_at is None:
                self.metrics.on_first_token(now - live.cmd.arrival)
            else:
                self.metrics.on_inter_token(now - live.last_token_at, new_tokens)
            self.metrics.on_generated(new_tokens)
        if new_tokens > 0:
            live.last_token_at = now
            live.tokens = len(req.output_ids)
        tokenizer = getattr(self.engine, "tokenizer", None)
        text = stable_text(req, tokenizer)
        delta = ""
        if text.startswith(live.sent):
            delta = text[len(live.sent):]
            live.sent = text
        else:  # the detokenizer rewrote text already streamed; nothing sensible to send
            logger.warning("request %s: decoded text changed after it was streamed", req.rid)
        reason = req.finish_reason.value if req.finish_reason is not None else None
        if not makes_event(delta, reason, new_tokens, tokenizer is not None, live.cmd.stream_tokens):
            return
        lp = take_logprobs(live, req)
        matched = getattr(req, "matched_stop", None) if reason == "stop" else None
        live.cmd.stream.push(StreamEvent(delta, live.tokens, len(req.prompt_ids), reason,
                                         cached_tokens=getattr(req, "cached_tokens", 0), logprobs=lp[0],
                                         prompt_logprobs=lp[1], matched_stop=matched))
        if reason is not None:
            del self._live[req.rid]
            self.engine.scheduler.forget(req.rid)
            if self.metrics is not None:
                self.metrics.on_finish(reason, now - live.cmd.arrival)

    def _publish_state(self) -> None:
        sched = self.engine.scheduler
        runner = self.engine.model_runner
        alloc, rows = runner.token_to_kv_pool_allocator, runner.req_to_token_pool
        tree = getattr(sched, "tree_cache", None)
        cached = tree.evictable_size() if tree is not None else 0
        protected = tree.protected_size() if tree is not None else 0
        state = {
            "running": len(sched.running),
            "waiting": len(sched.waiting),
            "kv_slots_total": alloc.size,
            # free = handed out on demand: unused, or a cached prefix no request holds
            "kv_slots_free": alloc.available_size() + cached,
            "kv_slots_used": alloc.size - alloc.available_size() - cached,
            "kv_slots_cached": cached,
            "kv_slots_protected": protected,
            "kv_cache_bytes": runner.token_to_kv_pool.mem_bytes(),
            "kv_cache_dtype": str(runner.token_to_kv_pool.dtype).replace("torch.", ""),
            "req_rows_total": rows.size,
            "req_rows_free": rows.available_size(),
            "tracked_requests": len(sched.requests),
            "live_requests": len(self._live),
            "pending_commands": self._commands.qsize(),
            "num_steps": getattr(sched, "num_steps", 0),
            "step_errors": self.step_errors,
            "loop_cpu_seconds": self.loop_cpu_s + (0.0 if self._iter_t0 is None
                                                   else time.thread_time() - self._iter_t0),
            "step_cpu_seconds": self.step_cpu_s,
        }
        stats = getattr(sched, "stats", None)
        if stats is not None:
            state.update(retractions=stats.num_retractions, retracted_requests=stats.num_retracted_requests,
                         new_token_ratio=sched.new_token_ratio, cached_prompt_tokens=stats.cached_prompt_tokens,
                         admitted_prompt_tokens=stats.admitted_prompt_tokens)
        spec = getattr(sched, "spec", None)
        if spec is not None:
            state.update(spec_verify=spec.stats.num_verify, spec_accept_length=spec.stats.mean_accept_length)
        self._state = state
        if self.metrics is not None:
            self.metrics.set_state(state)

    def _shutdown(self, err: EngineError) -> None:
        """End every admitted request (KV freed where the engine still can) and every
        queued submit with ``err``."""
        for rid in list(self._live):
            self._fail(rid, err)
        self._flush_commands(err)

