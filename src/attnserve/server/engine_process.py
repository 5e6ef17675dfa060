"""The engine process of the multi-process server (``--engine-process on``; the default on
CUDA): the `Engine` (scheduler, model, KV pools, tensor-parallel ranks) and its loop, with
no HTTP, no tokenization and no streaming detokenization in the process.

`engine_process_main` is the process's entry point (``multiprocessing`` 'spawn'); it talks to
the HTTP process (`attnserve.server.engine_client.EngineClient`) over one duplex
``multiprocessing`` connection (a Unix socket pair) carrying pickled messages:

HTTP -> engine, each a list of commands:
    ``("submit", rid, prompt_ids, sampling_params[, stream_tokens])`` (``stream_tokens``
    False: `SubmitCommand.stream_tokens`; absent: True), ``("abort", rid)``,
    ``("drain", grace_s)``, ``("stop",)``, ``("flush_cache",)`` (drop the prefix cache when
    idle and reset the scheduler's counters; benchmarks between timed passes).
engine -> HTTP:
    ``("ready", facts)`` once the engine is built (facts: `describe_engine`, the context
    length, the per-request token limit, the vocabulary size, the pickled tokenizer, the
    first state snapshot), or ``("error", exception class name, message)`` if it could not
    be built; then one ``("out", entries, state)`` per loop iteration that has something to
    say (``state``: the `EngineLoop.state` snapshot, None when unchanged), and finally
    ``("closed", code)`` (``shutting_down`` or ``engine_dead``) before the process exits.

An iteration's ``entries`` are in the order they happened (so a request's acceptance
precedes its tokens):

* ``("e", rid, StreamEvent)``: acceptance (empty event), refusal, abort or failure, exactly
  the events the in-process `EngineLoop` sends;
* ``("t", rid, new_token_ids, completion_tokens, finish_reason, final_text,
  cached_tokens, logprobs, matched_stop)``: one per request that got tokens this step (one
  message per step for the whole batch, not one per request); ``finish_reason`` and
  ``final_text`` (the engine's `finalize_text`) are None until the request finishes,
  ``matched_stop`` (`StreamEvent.matched_stop`) None unless it is ``"stop"``; ``logprobs`` is None, or
  ``(new output entries, prompt entries)`` for a request that asked
  (`attnserve.engine.logprobs.StreamCursor`). A running request without logprobs whose
  ``cached_tokens`` did not change since its last entry gets the short form ``("t", rid,
  new_token_ids, completion_tokens)`` (the HTTP process keeps the last ``cached_tokens``):
  a decode step of 256 requests then pickles half the fields. A request that is not
  streamed gets entries only on its first token, every `QUIET_INTERVAL` tokens and at its
  end (its final entry's text is the whole answer).

The acceptance events of the commands read before a step go out at once, before the step
(the HTTP handlers wait for them), and the step's own entries after it.

The loop is `EngineLoop`'s own (same admission, abort-before-step, failure isolation, drain
deadline, state snapshot), run in a thread of the engine process (`ProcessEngineLoop.serve`
says why); only where commands come from and where events go differ. The process ignores
SIGINT and SIGTERM: the HTTP process owns the graceful drain and stops the engine process;
if the HTTP process disappears (end of file on the connection) the loop stops as on
``("stop",)``.
"""

from __future__ import annotations

import logging
import os
import pickle
import select
import signal
import time
from typing import Any, Dict, List, Optional

from attnserve.server.engine_loop import EngineError, EngineLoop, SubmitCommand, request_error, take_logprobs

logger = logging.getLogger(__name__)


class _Outbox:
    """The `RequestStream` stand-in of one request in the engine process: events go to
    the iteration's outgoing batch."""

    __slots__ = ("rid", "loop")

    def __init__(self, rid: str, loop: "ProcessEngineLoop"):
        self.rid = rid
        self.loop = loop

    def push(self, event) -> None:
        self.loop._entries.append(("e", self.rid, event))


class ProcessEngineLoop(EngineLoop):
    """`EngineLoop` driven from a connection instead of a thread-safe queue.

    Args:
        engine: the `Engine` (built in this process).
        conn: the duplex ``multiprocessing`` connection to the HTTP process.
        idle_poll_s: how long an idle loop waits for a command (seconds).
        state_interval_s: least time between two state snapshots while the engine has
            work (seconds).
    """

    def __init__(self, engine, conn, idle_poll_s: float = 0.5, state_interval_s: float = 0.05):
        super().__init__(engine, metrics=None, idle_poll_s=idle_poll_s)
        self.conn = conn
        self.state_interval_s = state_interval_s
        self._entries: List[Any] = []
        self._sent_state: Optional[Dict[str, Any]] = None
        self._state_at = float("-inf")
        # `Connection.poll` builds a selector per call (~20 us); the loop polls once a step
        self._poller = select.poll()
        self._poller.register(conn.fileno(), select.POLLIN)

    # ---- commands ------------------------------------------------------------------------
    def _readable(self, timeout_s: float) -> bool:
        """True when a message (or end of file) waits on the connection."""
        return bool(self._poller.poll(int(timeout_s * 1000)))

    def _drain(self, block: bool) -> None:
        try:
            if not self._readable(self.idle_poll_s if block else 0.0):
                return
            while True:
                for cmd in pickle.loads(self.conn.recv_bytes()):
                    self._command(cmd)
                if self._stopping.is_set() or not self._readable(0.0):
                    break
        except (EOFError, OSError):  # the HTTP process is gone: stop as on ("stop",)
            logger.warning("attnserve engine process: the HTTP process went away; stopping")
            self._stopping.set()
            return
        if self._entries:  # acceptances (or refusals) now, not after the step
            self._flush()

    def _command(self, cmd) -> None:
        kind = cmd[0]
        if kind == "submit":
            _, rid, prompt_ids, sampling_params, *rest = cmd
            stream_tokens = bool(rest[0]) if rest else True
            if self._draining.is_set():  # sent before the HTTP process saw the drain
                self._reject(SubmitCommand(rid, prompt_ids, sampling_params, _Outbox(rid, self)),
                             EngineError(503, "the server is shutting down", "server_error", "shutting_down"))
                return
            self._add(SubmitCommand(rid, prompt_ids, sampling_params, _Outbox(rid, self), 0.0, stream_tokens))
        elif kind == "abort":
            self._abort(cmd[1])
        elif kind == "drain":
            grace_s = max(float(cmd[1]), 0.0)
            self._drain_deadline = min(self._drain_deadline, time.monotonic() + grace_s)
            self._draining.set()
        elif kind == "stop":
            self._stopping.set()
        elif kind == "flush_cache":
            from attnserve.engine.schedule_batch import SchedulerStats

            self._flush_cache()
            self.engine.scheduler.stats = SchedulerStats()
        else:
            logger.error("attnserve engine process: unknown command %r", kind)

    # ---- events --------------------------------------------------------------------------
    def _emit_all(self, touched) -> None:
        """`_emit` of every touched request, with the common case of a decode step inlined
        (one running request without logprobs, whose ``cached_tokens`` was sent: a short
        entry, or nothing for a request that is not streamed between its reports): at 256
        running requests this loop is most of the serving work of a step."""
        live_of = self._live.get
        entries = self._entries
        for req in touched:
            live = live_of(req.rid)
            if live is None:
                continue
            out = req.output_ids
            n = len(out)
            k = live.tokens
            if req.finish_reason is None and n > k and req.logprobs is None and req.cached_tokens == live.cached_sent:
                if live.quiet and live.holds_back(n):
                    continue
                live.tokens = n
                entries.append(("t", req.rid, out[k:], n))
                continue
            try:
                self._emit(req)
            except Exception as e:
                self._emit_failed(req, e)

    def _emit(self, req) -> None:
        """One ``("t", ...)`` entry with the request's new token ids (detokenization is the
        HTTP process's job); a finished request's entry carries its final text. A request
        that is not streamed (`SubmitCommand.stream_tokens` False) gets an entry on its
        first token, then every `QUIET_INTERVAL` tokens and at its end.

        `_emit_all` sends the common case of a decode step (a running request without
        logprobs whose ``cached_tokens`` was sent) itself; the rest comes here."""
        live = self._live.get(req.rid)
        if live is None:
            return
        out = req.output_ids
        n = len(out)
        k = live.tokens
        if req.finish_reason is None:
            if n <= k or live.holds_back(n):
                return
        elif req.error:  # failed alone (a bad grammar: 400)
            self._fail(req.rid, request_error(req))
            return
        new = out[k:n] if n > k else []
        live.tokens = n
        reason = req.finish_reason.value if req.finish_reason is not None else None
        lp = take_logprobs(live, req) if req.logprobs is not None else None
        cached = req.cached_tokens
        if reason is None and lp is None and cached == live.cached_sent:
            self._entries.append(("t", req.rid, new, n))
            return
        live.cached_sent = cached
        matched = req.matched_stop if reason == "stop" else None
        self._entries.append(("t", req.rid, new, n, reason, req.text if reason is not None else None, cached, lp,
                              matched))
        if reason is not None:
            del self._live[req.rid]
            self.engine.scheduler.forget(req.rid)

    def _publish_state(self) -> None:
        """Refresh the snapshot at most every ``state_interval_s`` while the engine has
        work (it costs a dict of ~25 entries and its pickling every step otherwise), and
        at once when it has none, so an idle engine is seen idle."""
        now = time.monotonic()
        if self._state and now - self._state_at < self.state_interval_s and self.engine.has_work():
            return
        self._state_at = now
        super()._publish_state()

    def _iterate_once(self) -> None:
        super()._iterate_once()
        self._flush()

    def _flush(self) -> None:
        """Send this iteration's entries and the state snapshot if either is new."""
        state = self._state
        changed = state != self._sent_state
        if not self._entries and not changed:
            return
        msg = ("out", self._entries, state if changed else None)
        self._entries = []
        self._sent_state = state
        try:
            self.conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
        except (OSError, EOFError):  # the HTTP process is gone: nobody to serve
            logger.warning("attnserve engine process: the HTTP process went away; stopping")
            self._stopping.set()

    def serve(self) -> str:
        """Run the loop until stopped or dead; returns the closing code (``shutting_down``
        or ``engine_dead``) after sending the last events.

        The loop runs in a thread of its own, as `EngineLoop` does in the HTTP process, not
        in the main thread that built the engine: on CPU, PyTorch's OpenMP ops called from
        the main thread ran the same steps 5x slower on this project's loaded 2-core
        machine (64 requests of qwen3-tiny: 32.2 s vs 6.6 s wall, 12.9 s vs 2.6 s CPU; with
        OMP_NUM_THREADS=1 both took 4.7 s), and CUDA graphs are already replayed from the
        loop thread in the in-process server."""
        self.start()
        while self._thread.is_alive():
            self._thread.join(0.5)
        code = self._close_error.code or "shutting_down"
        try:
            self._publish_state()
        except Exception:  # a dead engine may not answer; the last snapshot stands
            pass
        try:
            self._flush()
            self.conn.send_bytes(pickle.dumps(("closed", code)))
        except (OSError, EOFError):
            pass
        return code


def engine_facts(engine, loop: EngineLoop) -> Dict[str, Any]:
    """What the HTTP process needs of the engine: static facts, limits, the tokenizer."""
    from attnserve.server.launch import describe_engine

    tok = engine.tokenizer
    try:
        tok_bytes = pickle.dumps(tok) if tok is not None else None
    except Exception as e:  # the HTTP process then serves token-id prompts only
        logger.warning("attnserve engine process: the tokenizer cannot be pickled (%s); text prompts will be "
                       "refused", e)
        tok_bytes = None
    info = describe_engine(engine)
    try:  # what a benchmark's floor needs (replicas of bench.offline --dp-size)
        from attnserve.engine.model_facts import roofline_facts

        info["roofline_model"] = roofline_facts(engine.model_runner)
    except Exception as e:  # a model the floor does not describe: no floor, the engine serves
        logger.info("attnserve engine process: no roofline model (%s: %s)", type(e).__name__, e)
    return {
        "info": info,
        "context_len": engine.context_len,
        "max_request_tokens": engine.max_request_tokens,
        "max_total_tokens": engine.max_total_tokens,
        "vocab_size": engine.model_config.vocab_size,
        "tokenizer": tok_bytes,
        "state": loop.state(),
    }


def engine_process_main(server_args, conn, log_level: Optional[int] = None, env: Optional[Dict[str, str]] = None,
                        num_threads: Optional[int] = None, new_process_group: bool = False) -> None:
    """Entry point of the engine process: build the engine, say ``ready`` (or ``error``),
    serve until stopped, shut the engine down (its tensor-parallel ranks).

    ``env``, ``num_threads`` and ``new_process_group``: see
    `attnserve.server.engine_client.spawn_engine_process` (data-parallel replicas)."""
    if new_process_group:
        os.setpgid(0, 0)
    if env:
        os.environ.update(env)  # before anything initializes CUDA in this process
    if num_threads is not None:
        import torch

        torch.set_num_threads(max(1, int(num_threads)))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the HTTP process drains
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if log_level is not None:
        logging.getLogger("attnserve").setLevel(log_level)
    from attnserve.engine.engine import Engine

    t0 = time.perf_counter()
    try:
        engine = Engine(server_args)
    except BaseException as e:
        conn.send_bytes(pickle.dumps(("error", type(e).__name__, str(e))))
        conn.close()
        raise SystemExit(1)
    code = "engine_dead"
    try:
        loop = ProcessEngineLoop(engine, conn)
        loop._publish_state()  # the first snapshot, for the ready message
        conn.send_bytes(pickle.dumps(("ready", engine_facts(engine, loop))))
        logger.info("attnserve engine process ready in %.1f s", time.perf_counter() - t0)
        code = loop.serve()
    finally:
        engine.shutdown()
        conn.close()
    raise SystemExit(0 if code == "shutting_down" else 1)
