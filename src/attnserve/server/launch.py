"""Assemble the FastAPI app and run it under uvicorn (``attnserve serve``).

`create_app` wires an `Engine` to the HTTP routes: one `EngineLoop` thread owns the engine,
a `ServerMetrics` with its own Prometheus registry, the OpenAI error handlers, the API-key
middleware and FastAPI's request-body limit (413 above ``max_body_bytes``); `wrap_app` adds
the declared-length body check in front. `launch_server` serves that for the CLI;
`ServerThread` runs the same app in a background thread (tests, notebooks).

Two ways to run the engine (``--engine-process``): in a process of its own
(`attnserve.server.engine_client.start_engine_process`; the default on CUDA), so that HTTP,
tokenization, detokenization and streaming never hold the GIL the scheduler needs, or as a
thread of the HTTP process (`EngineLoop`; the default on CPU, where start-up time matters
more to the tests than the GIL does). The handlers see the same interface either way.
"""

from __future__ import annotations

import logging
import os
import platform
import socket
import threading
import time
from typing import Any, Dict, List, Optional

logger = logging.getLogger(__name__)

#: Largest accepted request body (bytes); bigger bodies get 413.
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


def _cpu_name() -> str:
    """CPU model and core count, e.g. ``"AMD EPYC 9654 (2 cores)"`` (best effort)."""
    name = platform.processor() or platform.machine() or "cpu"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{name} ({os.cpu_count()} cores)"


def describe_engine(engine) -> Dict[str, Any]:
    """Static facts about the engine for ``/debug/state`` and benchmark records."""
    import torch

    import attnserve

    runner = engine.model_runner
    device = str(runner.device)
    device_name = torch.cuda.get_device_name(runner.device) if runner.device.type == "cuda" else _cpu_name()
    choice = getattr(runner, "backend_choice", None)
    return {
        "model": engine.server_args.model,
        "device": device,
        "device_name": device_name,
        "dtype": str(runner.dtype).replace("torch.", ""),
        "context_len": engine.context_len,
        "attention_backend": None if choice is None else {"prefill": choice.prefill, "decode": choice.decode},
        "page_size": runner.page_size,
        "versions": {"attnserve": attnserve.__version__, "torch": torch.__version__,
                     "python": platform.python_version()},
    }


def check_parser_flags(server_args) -> None:
    """``--tool-call-parser`` and ``--reasoning-parser`` name known parsers.

    Raises:
        ValueError: an unknown name (the message lists the valid ones).
    """
    from attnserve.server.parsers import check_reasoning_parser, check_tool_call_parser

    check_tool_call_parser(getattr(server_args, "tool_call_parser", None))
    check_reasoning_parser(getattr(server_args, "reasoning_parser", None))


def create_app(engine, api_key: Optional[str] = None, model_name: Optional[str] = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, loop=None, chat_template: Optional[str] = None,
               allowed_origins: Optional[List[str]] = None):
    """Build the ASGI app serving ``engine``.

    Args:
        engine: an `attnserve.engine.engine.Engine`; from now on only the app's engine loop
            thread touches it. Or a `RemoteEngine` (with ``loop`` its `EngineClient`). Its
            ``server_args`` give ``--tool-call-parser`` and ``--reasoning-parser``.
        api_key: when set, ``/v1/*`` and ``/debug/*`` need ``Authorization: Bearer <key>``
            (None or empty: no key, as SGLang's ``--api-key ''``).
        model_name: id under ``/v1/models`` (default: ``engine.server_args.model``).
        max_body_bytes: request bodies above this many bytes get 413.
        loop: an `EngineLoop` (or `EngineClient`) to use (default: a new `EngineLoop`);
            started with the app's lifespan and stopped at shutdown.
        chat_template: ``--chat-template`` (a Jinja file or the template text; default:
            ``engine.server_args.chat_template``, else the model's own template).
        allowed_origins: CORS origins (default: ``engine.server_args.allowed_origins``);
            None or empty adds no CORS middleware (`wrap_app`).

    Raises:
        ValueError: a chat template that names no readable file or does not compile.

    Returns:
        the FastAPI app; ``app.state.ctx`` is its `ServingContext`.

    Raises:
        ValueError: an unknown ``--tool-call-parser`` / ``--reasoning-parser``.
    """
    from contextlib import asynccontextmanager

    from fastapi import FastAPI

    from attnserve.server.middleware import ApiKeyMiddleware
    from attnserve.server.engine_loop import EngineLoop
    from attnserve.server.errors import install_error_handlers
    from attnserve.server.metrics import ServerMetrics
    from attnserve.model_loader.chat_template import load_chat_template
    from attnserve.server.native_api import build_native_router
    from attnserve.server.openai_api import ServingContext, build_router

    server_args = getattr(engine, "server_args", None)
    check_parser_flags(server_args)
    template = load_chat_template(chat_template or getattr(server_args, "chat_template", None))
    origins = allowed_origins if allowed_origins is not None else getattr(server_args, "allowed_origins", None)
    name = model_name or engine.server_args.model
    # a loop that brings its own metrics (the data-parallel controller's per-replica ones) keeps them
    metrics = getattr(loop, "metrics", None) or ServerMetrics(name)
    if loop is None:
        loop = EngineLoop(engine, metrics)
    elif loop.metrics is None:
        loop.metrics = metrics
    info = getattr(engine, "info", None)  # a `RemoteEngine` brings the engine process's facts
    ctx = ServingContext(loop=loop, engine=engine, model_name=name, metrics=metrics,
                         info=info if isinstance(info, dict) else describe_engine(engine), chat_template=template,
                         tool_call_parser=getattr(server_args, "tool_call_parser", None),
                         reasoning_parser=getattr(server_args, "reasoning_parser", None))

    @asynccontextmanager
    async def lifespan(app):
        if loop.thread_id is None:
            if hasattr(loop, "start_async"):  # an `EngineClient` joins the app's event loop
                await loop.start_async()
            else:
                loop.start()
        try:
            yield
        finally:
            if hasattr(loop, "stop_async"):
                await loop.stop_async()
            else:
                loop.stop()
            logger.warning("attnserve: engine loop stopped")

    app = FastAPI(title="attnserve", version=ctx.info["versions"]["attnserve"], lifespan=lifespan,
                  max_body_size=max_body_bytes, docs_url=None, redoc_url=None, **_lenient_content_type(FastAPI))
    app.state.ctx = ctx
    app.state.max_body_bytes = max_body_bytes
    app.state.allowed_origins = list(origins or [])
    install_error_handlers(app)
    app.include_router(build_router())
    app.include_router(build_native_router())
    app.add_middleware(ApiKeyMiddleware, api_key=api_key or None)
    return app


def _lenient_content_type(fastapi_cls) -> Dict[str, Any]:
    """``{"strict_content_type": False}`` where FastAPI has that flag (newer releases default
    it to True and then hand a body without ``Content-Type`` to the handler as raw bytes, which
    answered a valid JSON body with a misleading 400 "must be a JSON object"), else ``{}``.
    A body without the header is read as JSON, as `JsonContentTypeMiddleware` documents
    (``requests.post(url, data=json.dumps(body))`` sends none); a non-JSON ``Content-Type``
    is still a 415."""
    import inspect

    params = inspect.signature(fastapi_cls.__init__).parameters
    return {"strict_content_type": False} if "strict_content_type" in params else {}


def wrap_app(app):
    """The ASGI callable to serve: ``app`` (from `create_app`) behind
    `DeclaredBodyLimitMiddleware`, which must sit outside FastAPI's own limiter (whose
    plain-text 413 would replace the OpenAI error body), `JsonContentTypeMiddleware` (415),
    `CloseOnServerErrorMiddleware` (``Connection: close`` on any 5xx) and, outermost when
    ``--allowed-origins`` is set, Starlette's ``CORSMiddleware`` (preflights answered before
    the API key is asked; every answer, errors included, carries the CORS headers)."""
    from attnserve.server.middleware import (
        CloseOnServerErrorMiddleware,
        DeclaredBodyLimitMiddleware,
        JsonContentTypeMiddleware,
    )

    inner = JsonContentTypeMiddleware(DeclaredBodyLimitMiddleware(app, app.state.max_body_bytes))
    outer = CloseOnServerErrorMiddleware(inner)
    origins = getattr(app.state, "allowed_origins", None)
    if origins:
        from starlette.middleware.cors import CORSMiddleware

        outer = CORSMiddleware(outer, allow_origins=origins, allow_methods=["*"], allow_headers=["*"])
    return outer


def launch_server(args) -> int:
    """Load the model from the parsed ``attnserve serve`` arguments and serve until stopped.

    Args:
        args: argparse namespace with ``host``, ``port``, ``api_key`` and every `ServerArgs`
            flag (``served_model_name`` and ``max_body_bytes`` optional).

    Returns:
        0 when uvicorn returns. On Ctrl-C / SIGTERM the server drains (`draining_server`:
        new requests get 503 ``shutting_down``, running ones get
        ``--graceful-shutdown-timeout`` seconds, then end with an error), uvicorn shuts
        down, the engine loop stops, and the signal is re-raised, so the process ends with
        that signal's status, as an unhandled one would.

    Raises:
        ValueError / FileNotFoundError: bad flags or model, an empty ``--served-model-name``,
            a host or port that cannot be bound (the CLI prints them in one line).
    """
    from attnserve.server_args import ServerArgs

    server_args = ServerArgs.from_cli_args(args)
    check_parser_flags(server_args)  # before the model loads
    if not 0 <= int(args.port) <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    from attnserve.model_loader.chat_template import load_chat_template

    load_chat_template(server_args.chat_template)  # a bad --chat-template fails before the model loads
    served = getattr(args, "served_model_name", None)
    if served is not None and not served.strip():
        raise ValueError("--served-model-name must not be empty; leave it out to serve under --model's name")
    sock = bind_socket(args.host, int(args.port))  # a port in use fails now, not after the model loads
    try:
        _serve_on(sock, args, server_args, served)
    finally:
        sock.close()
    return 0


def bind_socket(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound (uvicorn listens on it): bound before the model
    loads, so a port in use or an unknown host is a one-line error at once, and ``--port 0``'s
    port is known for the start-up line. ``SO_REUSEADDR`` as uvicorn sets it.

    Raises:
        ValueError: ``host`` does not resolve, or ``host:port`` cannot be bound (in use,
            not an address of this machine, a privileged port).
    """
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r} does not resolve: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}; pick another --port or --host") from None
    return sock


def _serve_on(sock: socket.socket, args, server_args, served: Optional[str]) -> None:
    """`launch_server` once the socket is bound: build the engine, serve until stopped."""
    import uvicorn

    from attnserve.engine.engine import Engine

    loop = None
    if server_args.dp_size > 1:  # replicas in engine processes of their own (server/data_parallel.py)
        from attnserve.server.data_parallel import start_data_parallel

        server_args.check()
        engine, loop = start_data_parallel(server_args, logging.getLogger("attnserve").level or None,
                                           model_name=served)
    elif use_engine_process(server_args):
        from attnserve.server.engine_client import start_engine_process

        server_args.check()  # flag errors in this process, before a process is spawned
        engine, loop = start_engine_process(server_args, logging.getLogger("attnserve").level or None)
    else:
        engine = Engine(server_args)
    app = create_app(engine, api_key=args.api_key, loop=loop, model_name=served,
                     max_body_bytes=getattr(args, "max_body_bytes", None) or DEFAULT_MAX_BODY_BYTES)
    log_level = getattr(args, "log_level_http", None) or str(server_args.log_level).lower()
    port = sock.getsockname()[1]
    logger.warning("attnserve serving %s%s on http://%s:%s", server_args.model,
                   f" as {served!r}" if served else "", args.host, port)
    config = uvicorn.Config(wrap_app(app), host=args.host, port=port, log_level=log_level if log_level in (
        "critical", "error", "warning", "info", "debug", "trace") else "warning",
        timeout_graceful_shutdown=server_args.graceful_shutdown_timeout + 5)
    try:
        draining_server(config, app.state.ctx.loop, server_args.graceful_shutdown_timeout).run(sockets=[sock])
    finally:
        engine.shutdown()  # the engine process, or the other tensor-parallel ranks


def use_engine_process(server_args) -> bool:
    """``--engine-process``: ``on``, ``off``, or ``auto`` (on when the engine runs on CUDA).

    Raises:
        ValueError: any other value."""
    mode = getattr(server_args, "engine_process", "auto")
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"--engine-process must be auto, on or off, got {mode!r}")
    if mode == "auto":
        return server_args.resolved_device() == "cuda"
    return mode == "on"


def draining_server(config, loop, grace_s: float):
    """A uvicorn ``Server`` that drains ``loop`` before it exits.

    The first SIGTERM / Ctrl-C starts `EngineLoop.begin_drain`: the socket stays open and
    every new request (and ``/health``) gets 503 ``shutting_down``, running requests get
    ``grace_s`` seconds to finish, then the rest end with an error (a 503 body, or an error
    event and ``[DONE]`` on a stream). Once nothing runs, uvicorn's own shutdown starts; it
    waits for those last answers to be written (``config.timeout_graceful_shutdown`` should
    exceed ``grace_s``). A second signal ends the remaining requests at once and exits."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if loop.draining or self.should_exit:
                loop.begin_drain(0.0)
                super().handle_exit(sig, frame)
                return
            logger.warning("attnserve: shutting down; running requests get %.1f s to finish", grace_s)
            if isinstance(getattr(self, "_captured_signals", None), list):
                self._captured_signals.append(sig)  # uvicorn re-raises it once served (exit status)
            loop.begin_drain(grace_s)
            threading.Thread(target=self._exit_when_drained, name="attnserve-drain", daemon=True).start()

        def _exit_when_drained(self) -> None:
            if not loop.wait_drained(grace_s + 10.0):
                logger.warning("attnserve: requests still open after the graceful-shutdown timeout; exiting")
            self.should_exit = True

    return DrainingServer(config)


class ServerThread:
    """Serve ``app`` with uvicorn in a background thread (tests, notebooks).

    Args:
        app: from `create_app`.
        host: bind address.
        port: TCP port; 0 picks a free one (see `port` after `start`).
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        config = uvicorn.Config(wrap_app(app), host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.host = host
        self._thread = threading.Thread(target=self.server.run, name="attnserve-uvicorn", daemon=True)

    def start(self, timeout: float = 60.0) -> "ServerThread":
        """Start and wait until the socket listens.

        Raises:
            RuntimeError: uvicorn did not start within ``timeout`` seconds.
        """
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 15.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
