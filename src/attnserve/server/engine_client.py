"""The HTTP process's side of the multi-process server: `start_engine_process` spawns the
engine process (`attnserve.server.engine_process`), `EngineClient` stands where the
in-process `EngineLoop` stands for the HTTP handlers, and `RemoteEngine` gives them the
engine's immutable facts (tokenizer, context length, limits).

Why a process: with the engine loop as a thread of the HTTP process, HTTP parsing, request
validation, SSE encoding, per-request stream events and metrics hold the GIL the scheduler
needs. Profiled on the 2-core CPU (py-spy ``--gil``, 256 requests at once, qwen3-tiny
shape) the server-side work took 22 % of the GIL samples, more than the scheduler's own
host work (16 %). SGLang runs HTTP + tokenization, the scheduler and the detokenizer in
separate processes; here the HTTP process tokenizes, detokenizes (incrementally:
`IncrementalDetokenizer`) and keeps the metrics, and the engine process only schedules and
sends one message per step. On an H100 (256 mixed requests, half streamed;
``benchmarks/results/h100-serving-vs-offline-2026-11-26.json``) the server went from 0.869
to 0.949 of the offline output tok/s on the Qwen3-0.6B shape and from 0.969 to 0.978 on
Llama-3-8B; the engine loop's own serving work fell from 0.72 to 0.27 ms per step.

Threading contract (HTTP process): `submit`, `abort`, `begin_drain`, `state` and `stop` may
be called from any thread. Once `start_async` ran on the app's event loop, the connection is
an asyncio transport of that loop (`_FrameProtocol`): the engine's messages are read and
dispatched there (no reader thread; events go to each request's `RequestStream` without a
cross-thread hand-off) and commands are written through it, so the HTTP process never
blocks on a full socket (an event loop such as uvloop makes the socket non-blocking; a
plain blocking send from the loop could also deadlock against the engine's own send). The
frames are ``multiprocessing.connection``'s (a 4-byte big-endian length, or -1 and an
8-byte one), which the engine process reads and writes with a plain ``Connection``.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import pickle
import socket
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from attnserve.server.detokenize import IncrementalDetokenizer
from attnserve.server.ipc_frames import FrameProtocol as _FrameProtocol
from attnserve.server.ipc_frames import frame as _frame
from attnserve.server.engine_loop import EngineError, StreamEvent, SubmitCommand, makes_event, wait_for_drain

logger = logging.getLogger(__name__)

_ERRORS = {"ValueError": ValueError, "FileNotFoundError": FileNotFoundError, "OSError": OSError}


def _shutting_down() -> EngineError:
    return EngineError(503, "the server is shutting down", "server_error", "shutting_down")


def _engine_dead() -> EngineError:
    return EngineError(503, "the engine loop is not running", "server_error", "engine_dead")


@dataclass
class _Pending:
    """HTTP-side bookkeeping of one submitted request."""

    cmd: SubmitCommand
    detok: Optional[IncrementalDetokenizer] = None
    accepted: bool = False
    tokens: int = 0
    sent: int = 0  # characters of the detokenized text already pushed
    last_token_at: Optional[float] = None
    logprobs: Optional[list] = None  # output logprob entries not pushed yet
    prompt_logprobs: Optional[list] = None
    cached: int = 0  # the engine's last cached_tokens (short token entries omit it)
    cost: float = 0.0  # the load balancer's estimate (`dp_request_cost.RequestCost`)


class EngineClient:
    """The engine loop as seen from the HTTP process (same methods as `EngineLoop`).

    Args:
        process: the engine process (``multiprocessing.Process``).
        conn: the duplex ``multiprocessing`` connection to it (used as is until
            `start_async` hands its socket to the event loop).
        tokenizer: the engine's tokenizer (None: token-id prompts only; no text).
        state: the engine's first state snapshot.
        metrics: optional `ServerMetrics`, fed here from the engine's events.
        dp_rank: the replica's index under data parallelism (``--dp-size``; None: the only
            engine); the errors and log lines of its death name it.

    ``on_closed``, when set, is called with the `EngineError` once the engine process has
    stopped or died (on the event loop's thread).
    """

    def __init__(self, process, conn, tokenizer=None, state: Optional[Dict[str, Any]] = None, metrics=None,
                 dp_rank: Optional[int] = None):
        self.process = process
        self.dp_rank = dp_rank
        self.on_closed: Optional[Callable[[EngineError], None]] = None
        self.conn = conn
        self.tokenizer = tokenizer
        self.metrics = metrics
        self._state: Dict[str, Any] = dict(state or {})
        self._reqs: Dict[str, _Pending] = {}
        self._work = 0.0  # sum of the open requests' costs (`outstanding_work`)
        self._send_lock = threading.Lock()
        self._outbox: List[tuple] = []  # submits and aborts of this event-loop iteration (`_send`)
        self._outbox_scheduled = False
        self._aloop: Optional[asyncio.AbstractEventLoop] = None
        self._loop_thread: Optional[int] = None
        self._transport: Optional[asyncio.Transport] = None
        self._sock: Optional[socket.socket] = None
        self._stopping = False
        self._draining = threading.Event()
        self._drained = threading.Event()
        self._closed = threading.Event()  # the engine process stopped or died
        self._close_error = _shutting_down()

    # ---- lifecycle -----------------------------------------------------------------------
    async def start_async(self) -> None:
        """Read and write the engine's connection on the running event loop (call it from
        inside that loop; the app's lifespan does)."""
        if self._aloop is not None:
            raise RuntimeError("EngineClient already started")
        loop = asyncio.get_running_loop()
        sock = socket.socket(fileno=os.dup(self.conn.fileno()))
        transport, _ = await loop.create_unix_connection(
            lambda: _FrameProtocol(self._on_message, self._on_lost), sock=sock)
        self.conn.close()  # its socket lives on in the transport
        self._sock, self._transport = sock, transport
        self._aloop, self._loop_thread = loop, threading.get_ident()

    @property
    def thread_id(self) -> Optional[int]:
        """The event loop's thread once started (the thread that reads the engine)."""
        return self._loop_thread

    def is_alive(self) -> bool:
        """True while the engine process runs and no stop was asked."""
        return (self._aloop is not None and not self._stopping and not self._closed.is_set()
                and self.process.is_alive())

    async def stop_async(self, timeout: float = 10.0) -> None:
        """`stop` from the event loop, which keeps delivering the engine's last events
        (its requests end with 503 ``shutting_down``) while it waits."""
        if self._stopping and not self.process.is_alive():
            return
        self._stopping = True
        self._send([("stop",)])
        deadline = time.monotonic() + timeout
        while self.process.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self._finish_stop()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the engine process (its requests end with 503 ``shutting_down``) and wait
        for it; idempotent. From the event loop's own thread use `stop_async`."""
        if self._stopping and not self.process.is_alive():
            return
        self._stopping = True
        if not self._send([("stop",)]):
            self._drop_connection()  # the engine stops on end of file
        self.process.join(timeout)
        self._finish_stop()

    def _finish_stop(self) -> None:
        if self.process.is_alive():
            logger.warning("attnserve: the engine process did not stop in time; terminating it")
            self.process.terminate()
            self.process.join(5.0)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(5.0)
        self._close(_shutting_down())
        self._drop_connection()

    def _drop_connection(self) -> None:
        if self._transport is None:
            self.conn.close()
        elif self._loop_running_here():
            self._transport.close()
        elif self._aloop.is_closed() or not self._aloop.is_running():
            self._sock.close()
        else:
            self._aloop.call_soon_threadsafe(self._transport.close)

    def _loop_running_here(self) -> bool:
        return self._aloop is not None and threading.get_ident() == self._loop_thread and self._aloop.is_running()

    def begin_drain(self, grace_s: float) -> None:
        """Graceful shutdown (`EngineLoop.begin_drain`): new requests get 503 at once,
        running ones get ``grace_s`` seconds in the engine process, then end with 503."""
        self._draining.set()
        self._send([("drain", max(grace_s, 0.0))])
        self._check_drained()

    @property
    def draining(self) -> bool:
        return self._draining.is_set()

    def wait_drained(self, timeout: Optional[float] = None) -> bool:
        """Block until a drain has ended every request or the engine process is gone;
        False if ``timeout`` seconds passed first."""
        return wait_for_drain(self._drained, lambda: self._closed.is_set() or not self.process.is_alive(), timeout)

    # ---- requests ------------------------------------------------------------------------
    def submit(self, cmd: SubmitCommand, cost: float = 0.0) -> None:
        """Send a request to the engine; its first event says whether it was accepted (see
        `EngineLoop.submit`). ``cost``: its estimated work, in `outstanding_work` until it ends."""
        if self._stopping or self._draining.is_set():
            self._push(cmd.stream, StreamEvent(error=_shutting_down()))
            return
        if self._closed.is_set() or not self.process.is_alive():
            self._push(cmd.stream, StreamEvent(error=self._dead_error()))
            return
        detok = None
        if self.tokenizer is not None and cmd.stream_tokens:  # a whole answer is the engine's final text
            sp = cmd.sampling_params
            detok = IncrementalDetokenizer(self.tokenizer, sp.stop_strs, getattr(sp, "skip_special_tokens", True))
        self._reqs[cmd.rid] = _Pending(cmd, detok, cost=cost)
        self._work += cost
        submit = ("submit", cmd.rid, list(cmd.prompt_ids), cmd.sampling_params)
        if not cmd.stream_tokens:
            submit += (False,)
        if not self._send([submit], batch=True):
            self._forget(cmd.rid)
            self._push(cmd.stream, StreamEvent(error=self._dead_error()))

    def abort(self, rid: str) -> None:
        """Abort ``rid`` (unknown or finished ids are ignored)."""
        if rid in self._reqs:
            self._send([("abort", rid)], batch=True)

    def state(self) -> Dict[str, Any]:
        """The engine's last state snapshot (a fresh dict)."""
        return dict(self._state)

    @property
    def num_in_flight(self) -> int:
        """Requests submitted here and not finished yet (the load balancer's queue length)."""
        return len(self._reqs)

    @property
    def outstanding_work(self) -> float:
        """The summed ``cost`` of the requests in flight (the load balancer's work)."""
        return self._work

    def _forget(self, rid: str) -> Optional[_Pending]:
        """Drop ``rid``'s bookkeeping and its work (None if unknown)."""
        p = self._reqs.pop(rid, None)
        if p is not None:
            self._work = self._work - p.cost if self._reqs else 0.0  # no drift once idle
        return p

    def flush_cache(self) -> bool:
        """Ask the engine to drop its prefix cache (`Scheduler.flush_prefix_cache`; a no-op
        while requests run) and reset its scheduler counters; False if it cannot be reached."""
        return self._send([("flush_cache",)])

    def _who(self) -> str:
        return "the engine process" if self.dp_rank is None else f"data-parallel replica {self.dp_rank}"

    def _dead_error(self) -> EngineError:
        if self.dp_rank is None:
            return _engine_dead()
        return EngineError(503, f"data-parallel replica {self.dp_rank} died; its requests were ended",
                           "server_error", "engine_dead")

    # ---- plumbing ------------------------------------------------------------------------
    def _send(self, cmds: List[tuple], batch: bool = False) -> bool:
        """Send ``cmds``; False when the engine process cannot be reached.

        With ``batch`` (submits and aborts) the first commands of an event-loop iteration
        go out at once (an idle engine starts on them) and the later ones of the same
        iteration join an outbox that goes out as one message once the iteration's other
        callbacks have run (`_flush_outbox`): a burst of requests parsed in one iteration
        costs the engine two reads, not one per request. Other commands go out at once,
        after the outbox (commands keep their order)."""
        try:
            if self._transport is None:  # not started: the plain connection
                data = pickle.dumps(cmds, protocol=pickle.HIGHEST_PROTOCOL)
                with self._send_lock:
                    self.conn.send_bytes(data)
                return True
            if self._transport.is_closing():
                return False
            if self._loop_running_here():
                self._to_outbox(cmds, batch)
            elif self._aloop.is_running():
                self._aloop.call_soon_threadsafe(self._to_outbox, cmds, batch)
            else:  # the loop is gone (shutting down): write the socket directly
                cmds, self._outbox = self._outbox + cmds, []
                data = pickle.dumps(cmds, protocol=pickle.HIGHEST_PROTOCOL)
                with self._send_lock:
                    self._sock.setblocking(True)
                    self._sock.sendall(_frame(data))
            return True
        except (OSError, EOFError, ValueError, RuntimeError):  # the engine process (or the loop) is gone
            return False

    def _to_outbox(self, cmds: List[tuple], batch: bool) -> None:
        """On the event loop: send ``cmds`` with the outbox now, or queue them (``batch``,
        once this iteration already sent some)."""
        self._outbox.extend(cmds)
        if batch and self._outbox_scheduled:  # the iteration's message goes out at its end
            return
        self._flush_outbox()
        if batch:
            self._outbox_scheduled = True
            self._aloop.call_soon(self._flush_outbox)

    def _flush_outbox(self) -> None:
        self._outbox_scheduled = False
        if not self._outbox:
            return
        cmds, self._outbox = self._outbox, []
        if self._transport.is_closing():  # the engine is gone: `_on_lost` ends the requests
            return
        try:
            self._transport.write(_frame(pickle.dumps(cmds, protocol=pickle.HIGHEST_PROTOCOL)))
        except (OSError, RuntimeError):
            logger.warning("attnserve: could not send %d command(s) to %s", len(cmds), self._who())

    def _push(self, stream, event: StreamEvent) -> None:
        if threading.get_ident() == self._loop_thread:
            stream.put(event)
        else:
            stream.push(event)

    def _on_message(self, data: bytes) -> None:
        try:
            self._dispatch(pickle.loads(data))
        except Exception:  # a bad message must not stop the reading
            logger.exception("attnserve: could not handle a message from the engine process")
        self._check_drained()

    def _on_lost(self, exc) -> None:
        """End of file from the engine process: it stopped, or it died."""
        if not self._closed.is_set():
            if self._stopping:
                self._close(_shutting_down())
            else:
                self.process.join(0.5)
                logger.critical("attnserve: %s (pid %s) died (exit code %s); failing its %d request(s) with 503",
                                self._who(), self.process.pid, self.process.exitcode, len(self._reqs))
                self._close(self._dead_error())

    def _dispatch(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "out":
            now = time.perf_counter()
            for entry in msg[1]:
                try:
                    if entry[0] == "t":
                        self._on_tokens(now, *entry[1:])
                    else:
                        self._on_event(now, entry[1], entry[2])
                except Exception:  # one request's bookkeeping must not stop the others
                    logger.exception("dispatching an engine event of %s failed", entry[1])
            if msg[2] is not None:
                self._state = msg[2]
                if self.metrics is not None:
                    self.metrics.set_state(msg[2])
        elif kind == "closed":
            err = self._dead_error() if msg[1] == "engine_dead" else _shutting_down()
            if msg[1] == "engine_dead":
                logger.critical("attnserve: the engine loop of %s died; failing its requests with 503", self._who())
            self._close(err)

    def _on_event(self, now: float, rid: str, ev: StreamEvent) -> None:
        p = self._reqs.get(rid)
        if p is None:
            return
        m = self.metrics
        if ev.error is not None:
            if m is not None:
                if p.accepted:
                    m.on_finish("error", now - p.cmd.arrival)
                else:
                    m.on_reject(ev.error.status)
        elif ev.finish_reason is not None:
            if m is not None:
                m.on_finish(ev.finish_reason, now - p.cmd.arrival)
        elif not p.accepted:
            p.accepted = True
            if m is not None:
                m.on_accept(ev.prompt_tokens)
        if ev.final:
            self._forget(rid)
        p.cmd.stream.put(ev)

    def _on_tokens(self, now: float, rid: str, new_ids: List[int], n: int, reason: Optional[str] = None,
                   final_text: Optional[str] = None, cached: Optional[int] = None,
                   logprobs: Optional[tuple] = None, matched: Any = None) -> None:
        p = self._reqs.get(rid)
        if p is None:
            return
        if cached is None:  # a short entry: unchanged
            cached = p.cached
        else:
            p.cached = cached
        if logprobs is not None:  # held until an event goes out (text may be held back)
            if logprobs[0]:
                p.logprobs = (p.logprobs or []) + logprobs[0]
            if logprobs[1] is not None:
                p.prompt_logprobs = logprobs[1]
        m = self.metrics
        k = n - p.tokens
        if k > 0:
            if m is not None:
                if p.last_token_at is None:
                    m.on_first_token(now - p.cmd.arrival)
                else:
                    m.on_inter_token(now - p.last_token_at, k)
                m.on_generated(k)
            p.last_token_at = now
            p.tokens = n
        detok = p.detok
        if reason is not None:
            text = final_text or ""
            sent = detok.text[: p.sent] if detok is not None else ""
            if text.startswith(sent):
                delta = text[len(sent):]
            else:  # the incremental text differs from the engine's final decode; nothing sensible to send
                logger.warning("request %s: decoded text changed after it was streamed", rid)
                delta = ""
        elif detok is not None:
            detok.add(new_ids)
            end = detok.stable_len()
            delta = detok.text[p.sent:end]
            p.sent = max(p.sent, end)
        else:
            delta = ""
        if makes_event(delta, reason, k, self.tokenizer is not None, p.cmd.stream_tokens):
            p.cmd.stream.put(StreamEvent(delta, n, len(p.cmd.prompt_ids), reason, cached_tokens=cached,
                                         logprobs=p.logprobs, prompt_logprobs=p.prompt_logprobs, matched_stop=matched))
            p.logprobs = p.prompt_logprobs = None
        if reason is not None:
            self._forget(rid)
            if m is not None:
                m.on_finish(reason, now - p.cmd.arrival)

    def _close(self, err: EngineError) -> None:
        """The engine process is gone: end every open request with ``err``, stop reading."""
        first = not self._closed.is_set()
        self._closed.set()
        self._close_error = err
        for rid in list(self._reqs):
            p = self._forget(rid)
            if p.accepted and self.metrics is not None:
                self.metrics.on_finish("error", time.perf_counter() - p.cmd.arrival)
            self._push(p.cmd.stream, StreamEvent(completion_tokens=p.tokens, prompt_tokens=len(p.cmd.prompt_ids),
                                                 error=err))
        self._check_drained()
        if first and self.on_closed is not None:
            try:
                self.on_closed(err)
            except Exception:
                logger.exception("attnserve: the on_closed callback of %s failed", self._who())

    def _check_drained(self) -> None:
        if self._draining.is_set() and not self._reqs:
            self._drained.set()


class RemoteEngine:
    """The engine's immutable facts in the HTTP process, where handlers read them
    (``ctx.engine``): ``tokenizer``, ``context_len``, ``max_request_tokens``,
    ``max_total_tokens``, ``server_args``, ``info`` (`describe_engine` of the engine), and
    `tokenize`. `shutdown` stops the engine process."""

    def __init__(self, server_args, facts: Dict[str, Any], client: EngineClient):
        self.server_args = server_args
        self.client = client
        self.tokenizer = client.tokenizer
        self.context_len: int = facts["context_len"]
        self.max_request_tokens: int = facts["max_request_tokens"]
        self.max_total_tokens: int = facts["max_total_tokens"]
        self.vocab_size: int = facts["vocab_size"]
        self.info: Dict[str, Any] = facts["info"]

    def tokenize(self, prompt, chat: bool = False) -> List[int]:
        """Token ids of ``prompt``, checked as `attnserve.engine.engine.Engine.tokenize`
        checks them (both call `attnserve.model_loader.tokenizer.tokenize_prompt`).

        Raises:
            ValueError: an empty prompt, ids that are not ints in the vocabulary, or text
                without a tokenizer.
        """
        from attnserve.model_loader.tokenizer import tokenize_prompt

        return tokenize_prompt(self.tokenizer, self.vocab_size, prompt, chat)

    def shutdown(self) -> None:
        """Stop the engine process (idempotent)."""
        self.client.stop()


def _stop_at_exit(ref) -> None:
    client = ref()
    if client is not None:
        client.stop(timeout=5.0)


def start_engine_process(server_args, log_level: Optional[int] = None, poll_s: float = 0.5
                         ) -> Tuple[RemoteEngine, EngineClient]:
    """Spawn the engine process, wait until its engine is built, and connect to it.

    'spawn' re-imports the caller's main module in the new process: a script that calls
    this needs the ``if __name__ == "__main__":`` guard.

    Args:
        server_args: the engine's `ServerArgs` (the process builds ``Engine(server_args)``).
        log_level: level of the ``attnserve`` loggers in the engine process.
        poll_s: how often the wait checks that the process still lives (seconds).

    Returns:
        ``(engine facts for the handlers, the client to pass as `create_app`'s loop)``.

    Raises:
        ValueError / FileNotFoundError / OSError: the engine refused the flags or the model
            (the engine's own message).
        RuntimeError: the engine process failed otherwise or exited while starting.
    """
    proc, conn = spawn_engine_process(server_args, log_level)
    facts, tokenizer = wait_engine_ready(proc, conn, poll_s)
    client = EngineClient(proc, conn, tokenizer, facts.get("state"))
    atexit.register(_stop_at_exit, weakref.ref(client))
    return RemoteEngine(server_args, facts, client), client


def spawn_engine_process(server_args, log_level: Optional[int] = None, name: str = "attnserve-engine",
                         env: Optional[Dict[str, str]] = None, num_threads: Optional[int] = None,
                         new_process_group: bool = False):
    """Start an engine process (`engine_process_main`) without waiting for it.

    Args:
        server_args / log_level: as `start_engine_process`.
        name: the process's name.
        env: variables set in the process before the engine is built (a data-parallel
            replica's ``CUDA_VISIBLE_DEVICES``).
        num_threads: ``torch.set_num_threads`` of the process (None: PyTorch's default).
        new_process_group: run it in a process group of its own (its tensor-parallel ranks
            join it), so that everything it started can be killed together.

    Returns:
        ``(process, the HTTP side of its connection)``; pass both to `wait_engine_ready`.
    """
    import multiprocessing as mp

    from attnserve.server.engine_process import engine_process_main

    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe(duplex=True)
    # not daemonic: the engine spawns its tensor-parallel ranks itself
    proc = ctx.Process(target=engine_process_main, args=(server_args, theirs, log_level),
                       kwargs=dict(env=env, num_threads=num_threads, new_process_group=new_process_group),
                       name=name)
    saved = {k: os.environ.get(k) for k in (env or {})}
    try:  # the child's environment from its first instruction on (before its imports touch CUDA)
        os.environ.update(env or {})
        proc.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    theirs.close()
    return proc, ours


def wait_engine_ready(proc, conn, poll_s: float = 0.5) -> Tuple[Dict[str, Any], Any]:
    """Wait for the ``ready`` message of an engine process from `spawn_engine_process`.

    Returns:
        ``(facts, tokenizer)``: `engine_process.engine_facts` and the unpickled tokenizer
        (None without one).

    Raises:
        as `start_engine_process`; the process is killed (or has exited) when this raises.
    """
    try:
        while not conn.poll(poll_s):
            if not proc.is_alive():
                raise RuntimeError(f"the engine process exited with code {proc.exitcode} while starting "
                                   "(its log is above)")
        msg = pickle.loads(conn.recv_bytes())
    except BaseException:
        proc.kill()
        proc.join(5.0)
        raise
    if msg[0] == "error":
        proc.join(10.0)
        cls = _ERRORS.get(msg[1])
        if cls is not None:
            raise cls(msg[2])
        raise RuntimeError(f"the engine could not be built: {msg[1]}: {msg[2]}")
    facts = msg[1]
    tokenizer = pickle.loads(facts["tokenizer"]) if facts.get("tokenizer") is not None else None
    return facts, tokenizer
