"""OpenAI-compatible routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses``
(`attnserve.server.responses_api`), ``/v1/models``,
plus ``/health`` (GET or HEAD: the same status, no body), ``/metrics`` and ``/debug/state``.

A handler validates the request (schema in `attnserve.server.protocol`, then prompt length
and sampling parameters), tokenizes it in a worker thread, submits it to the
`EngineLoop`, waits for the engine to accept it (so a full queue is a 503 before any
byte is streamed), then either streams server-sent events (``data: {...}\\n\\n`` ...
``data: [DONE]\\n\\n``) or collects the whole completion. A client that disconnects, while
streaming or while waiting for a non-streamed answer, aborts its request. The completions
handler (one prompt or a batch) is `attnserve.server.completion_api.create_completion`.

This module imports FastAPI; only `attnserve.server.launch` imports it, lazily, so the
engine works without the server dependencies. Handlers never touch the model, the
scheduler or the KV pools; they read only immutable facts (context length, vocabulary
size, tokenizer) and talk to the engine through the loop's queues.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Dict, List, Optional, Tuple

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from attnserve.server.chat_output import chat_output, finish_reason, harmony_sampling_params
from attnserve.server.choice_extras import ChoiceExtras
from attnserve.server.engine_loop import EngineLoop, RequestStream, StreamEvent, SubmitCommand
from attnserve.server.errors import APIError, error_body
from attnserve.server.grammar_request import has_grammar_fields, request_grammar
from attnserve.server.logprob_format import TokenTexts, chat_logprobs
from attnserve.server.protocol import (
    MAX_STOP_LEN,
    MAX_STOP_SEQUENCES,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    CompletionRequest,
    ModelCard,
    ModelList,
    UsageInfo,
    new_id,
    now_s,
)
from attnserve.server.request_fields import check_unicode
from attnserve.server.responses_protocol import ResponsesRequest
from attnserve.server.tool_request import forced_call_grammar, template_messages, template_tools, tool_request

logger = logging.getLogger(__name__)


@dataclass
class ServingContext:
    """Per-app state (``app.state.ctx``): everything a handler may use.

    Attributes:
        loop: the engine loop (the only path to the engine).
        engine: used only for its immutable parts: ``tokenize`` (tokenizer + vocabulary
            check), ``tokenizer``, ``context_len``, ``max_request_tokens``.
        model_name: id served under ``/v1/models``; requests naming another model get 404.
        metrics: `ServerMetrics` or None.
        info: static facts for ``/debug/state`` (device, versions, backend).
        chat_template: the server's chat template overriding the model's, or None.
        health_generate_timeout_s: how long ``/health_generate`` waits for its token.
    """

    loop: EngineLoop
    engine: Any
    model_name: str
    metrics: Any = None
    info: Optional[Dict[str, Any]] = None
    #: ``--tool-call-parser`` / ``--reasoning-parser`` (`attnserve.server.parsers`), or None.
    tool_call_parser: Optional[str] = None
    reasoning_parser: Optional[str] = None
    #: ``--chat-template`` (Jinja source, `attnserve.model_loader.chat_template.load_chat_template`) or None
    chat_template: Optional[str] = None
    #: ``/health_generate`` waits this long for its one token before answering 503 (seconds)
    health_generate_timeout_s: float = 20.0


# ---- request -> (prompt ids, SamplingParams) ---------------------------------------------------
def _check_model_and_options(ctx: ServingContext, body) -> None:
    """Checks that need no tokenizer: valid Unicode, the model name, refused fields
    (unsupported or unrecognized), stop strings.

    Raises:
        APIError: 400 (``invalid_value`` / ``unsupported_parameter`` /
            ``unrecognized_request_argument``, ``param`` naming the field) or 404 (unknown model).
    """
    check_unicode(body)
    if body.model is not None and body.model != ctx.model_name:
        raise APIError(404, f"the model {body.model!r} does not exist; this server serves {ctx.model_name!r}",
                       "model", "model_not_found")
    refused = body.refusal()  # no field is silently dropped (attnserve.server.request_fields)
    if refused is not None:
        raise APIError(400, refused.message, refused.param, refused.code)
    stops = body.stop_list()
    if len(stops) > MAX_STOP_SEQUENCES or any(len(s) > MAX_STOP_LEN for s in stops):
        raise APIError(400, f"stop takes at most {MAX_STOP_SEQUENCES} strings of at most {MAX_STOP_LEN} characters",
                       "stop", "invalid_value")


def _prompt_ids(ctx: ServingContext, prompt) -> List[int]:
    """Token ids of a completion prompt (runs in a worker thread)."""
    try:
        return ctx.engine.tokenize(prompt)
    except ValueError as e:
        raise APIError(400, str(e), "prompt", "invalid_value") from e


def _chat_ids(ctx: ServingContext, body: ChatCompletionRequest, tool_req=None) -> List[int]:
    """Token ids of a conversation in the server's chat template (``--chat-template``, else
    the tokenizer's) under the request's ``add_generation_prompt`` (default: the assistant
    header is appended), ``continue_final_message`` and ``chat_template_kwargs`` (runs in a
    worker thread; `attnserve.server.chat_template`). A message's ``name`` goes to the
    template with it; tools, tool calls and tool results go through the template's own tool
    support (`attnserve.server.tool_request`)."""
    from attnserve.server.chat_template import request_prompt_ids

    source = ctx.chat_template or getattr(ctx.engine.tokenizer, "chat_template", None)
    messages = template_messages(body, source if isinstance(source, str) else None)
    return request_prompt_ids(ctx, body, messages, tools=template_tools(tool_req))


def _request_limit(ctx: ServingContext) -> int:
    """Most tokens (prompt + output) one request can ever hold: the context length, and the
    KV pool when that is smaller (`Engine.max_request_tokens`, the rule the offline API's
    `Engine.check_prompt` applies too)."""
    limit = getattr(ctx.engine, "max_request_tokens", None)
    if limit is None:  # an engine without a pool size (a test double): the context alone
        limit = ctx.engine.context_len
    return limit


def _max_new_tokens(ctx: ServingContext, prompt_len: int, max_tokens: Optional[int], default: Optional[int],
                    prompt_param: str) -> int:
    """The one length rule: prompt + output must fit what one request can ever hold
    (`_request_limit`); nothing is silently truncated.

    Args:
        max_tokens: the client's explicit limit, or None when it sent none.
        default: the limit used without an explicit one (None: the rest of the context);
            clamped to what fits, so a prompt that fits never fails for want of room.

    Returns:
        ``max_new_tokens`` for the request.

    Raises:
        APIError 400 ``context_length_exceeded``: the prompt alone does not fit (``param``
            is ``prompt_param``), or prompt + explicit ``max_tokens`` does not (``max_tokens``).
    """
    limit = _request_limit(ctx)
    need = prompt_len + (max_tokens or 1)
    if limit < need <= ctx.engine.context_len:  # a larger pool would serve it: advice for the operator's log only
        logger.warning("a request needs %d tokens but the KV pool holds %d; raise --max-total-tokens "
                       "(or --mem-fraction-static) to serve such requests", need, limit)
    if prompt_len >= limit:
        raise APIError(400, f"the prompt has {prompt_len} tokens but this server holds at most {limit} tokens per "
                            f"request (prompt and output); shorten it to at most {limit - 1} tokens", prompt_param,
                       "context_length_exceeded")
    room = limit - prompt_len
    if max_tokens is None:
        return room if default is None else min(default, room)
    if max_tokens > room:
        raise APIError(400, f"the prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) exceeds the "
                            f"{limit} tokens this server holds per request; lower max_tokens to at most {room}",
                       "max_tokens", "context_length_exceeded")
    return max_tokens


def _sampling_params(ctx: ServingContext, body, prompt_len: int, max_tokens: Optional[int], prompt_param: str,
                     default_max_tokens: Optional[int] = None, grammar: Optional[Dict[str, Any]] = None):
    """Build `SamplingParams`, checking the prompt and the output against the context.

    Args:
        max_tokens: the client's explicit output limit, or None (then ``default_max_tokens``,
            clamped to what fits; see `_max_new_tokens`).
        grammar: the request's checked grammar field (`request_grammar`), or None.

    Raises:
        APIError 400: a request that cannot fit (``context_length_exceeded``), or invalid
            sampling values (``param`` names the field).
    """
    from attnserve.engine.penalties import check_logit_bias_vocab
    from attnserve.engine.sampling_params import SamplingParams

    max_tokens = _max_new_tokens(ctx, prompt_len, max_tokens, default_max_tokens, prompt_param)
    try:
        sp = SamplingParams(
            max_new_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=-1 if body.top_k is None else body.top_k,
            min_p=0.0 if body.min_p is None else body.min_p,
            stop=body.stop_list() or None,
            stop_token_ids=body.stop_token_ids,
            ignore_eos=bool(body.ignore_eos),
            seed=body.seed,
            skip_special_tokens=body.skip_special_tokens is not False,
            **(grammar or {}),
            **body.control_params(),
            **body.logprob_params(),
        )
        vocab = getattr(ctx.engine, "vocab_size", None) or getattr(getattr(ctx.engine, "model_config", None),
                                                                   "vocab_size", None)
        if vocab:
            check_logit_bias_vocab(sp, vocab)
        return sp
    except ValueError as e:
        name = str(e).split(" ", 1)[0]
        param = {"max_new_tokens": "max_tokens"}.get(name, name)
        raise APIError(400, str(e), param, "invalid_value") from e


def _raise_engine_error(ev: StreamEvent) -> None:
    """Raise the `APIError` (status, message, code, type) of an event whose ``error`` is set."""
    e = ev.error
    raise APIError(e.status, e.message, None, e.code, e.type)


def choice_ids(rid: str, num_prompts: int, n: int) -> List[str]:
    """Engine request ids of a request's choices, prompt by prompt: ``rid`` for one choice,
    ``rid-{i}`` for the ``n`` choices of one prompt, ``rid-{p}`` / ``rid-{p}-{i}`` in a batch
    of prompts."""
    if num_prompts == 1:
        return [rid] if n == 1 else [f"{rid}-{i}" for i in range(n)]
    return [f"{rid}-{p}" if n == 1 else f"{rid}-{p}-{i}" for p in range(num_prompts) for i in range(n)]


async def _submit_choices(ctx: ServingContext, rid: str, prompts: List[Tuple[List[int], Any]], n: int,
                          arrival: float, stream_tokens: bool = True) -> List[Tuple[str, RequestStream]]:
    """Submit the ``n`` choices of each ``(prompt ids, SamplingParams)`` of one request
    together (ids from `choice_ids`, prompt by prompt; choice i takes `SamplingParams.sample`
    ``(i)``: seed + i when seeded, so the choices differ but the response is reproducible) and
    wait until the engine accepted every one. Submitted in one go, the choices reach the scheduler
    together, so it can compute a shared prompt once and let the others read it from the
    prefix cache. ``stream_tokens`` False: the client waits for the whole answer
    (`SubmitCommand.stream_tokens`).

    Raises:
        APIError: 503 when the waiting queue is full or the server is shutting down, 400
            when the engine refuses a prompt; every choice is aborted first.
    """
    choices: List[Tuple[str, RequestStream]] = []
    crids = iter(choice_ids(rid, len(prompts), n))
    for prompt_ids, sp in prompts:
        for i in range(n):
            crid = next(crids)
            csp = sp.sample(i)
            stream = RequestStream()
            ctx.loop.submit(SubmitCommand(crid, prompt_ids, csp, stream, arrival, stream_tokens=stream_tokens))
            choices.append((crid, stream))
    try:
        firsts = [await stream.get() for _, stream in choices]
    except BaseException:  # cancelled (client gone): abort whatever was accepted
        for crid, _ in choices:
            ctx.loop.abort(crid)
        raise
    refused = [ev for ev in firsts if ev.error is not None]
    if refused:
        for crid, _ in choices:
            ctx.loop.abort(crid)  # unknown (refused) ids are ignored
        _raise_engine_error(refused[0])
    return choices


async def _abort_on_disconnect(request, ctx: ServingContext, rids: List[str]) -> None:
    """Wait for the client to go away, then abort ``rids`` (cancelled when the answer is ready)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            logger.info("client of %s disconnected; aborting", rids[0])
            for rid in rids:
                ctx.loop.abort(rid)
            return


async def _merged(choices: List[Tuple[str, RequestStream]]) -> AsyncIterator[Tuple[int, StreamEvent]]:
    """``(choice index, event)`` of every choice's stream in arrival order, until each
    choice's final event."""
    if len(choices) == 1:
        while True:
            ev = await choices[0][1].get()
            yield 0, ev
            if ev.final:
                return
    queue: "asyncio.Queue[Tuple[int, StreamEvent]]" = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        while True:
            ev = await stream.get()
            await queue.put((i, ev))
            if ev.final:
                return

    tasks = [asyncio.ensure_future(pump(i, st)) for i, (_, st) in enumerate(choices)]
    try:
        remaining = len(choices)
        while remaining:
            i, ev = await queue.get()
            remaining -= ev.final
            yield i, ev
    finally:
        for t in tasks:
            t.cancel()


async def _collect(request, ctx: ServingContext, choices: List[Tuple[str, RequestStream]]) -> List[StreamEvent]:
    """Wait for every choice; returns each one's final event with ``text`` = all its text.

    Raises:
        APIError 500 (or the engine's status) when a choice failed (the others are aborted).
    """
    rids = [rid for rid, _ in choices]
    watcher = asyncio.ensure_future(_abort_on_disconnect(request, ctx, rids))
    parts: List[List[str]] = [[] for _ in choices]
    lps: List[list] = [[] for _ in choices]  # logprob entries (requests that asked)
    prompt_lps: List[Optional[list]] = [None] * len(choices)
    finals: List[Optional[StreamEvent]] = [None] * len(choices)
    try:
        async for i, ev in _merged(choices):
            if ev.error is not None:
                _raise_engine_error(ev)
            parts[i].append(ev.text)
            lps[i].extend(ev.logprobs or ())
            prompt_lps[i] = ev.prompt_logprobs if ev.prompt_logprobs is not None else prompt_lps[i]
            if ev.final:
                finals[i] = StreamEvent("".join(parts[i]), ev.completion_tokens, ev.prompt_tokens,
                                        ev.finish_reason, cached_tokens=ev.cached_tokens, logprobs=lps[i],
                                        prompt_logprobs=prompt_lps[i], matched_stop=ev.matched_stop)
        return finals
    finally:
        watcher.cancel()
        for rid, f in zip(rids, finals):
            if f is None:
                ctx.loop.abort(rid)


def _usage(prompt_lens: List[int], finals: List[StreamEvent]) -> UsageInfo:
    """One usage for all choices: each prompt counted once, every choice's tokens, and the
    prompt tokens each prompt found cached as a whole (its first choice computed the rest)."""
    n = len(finals) // len(prompt_lens)
    cached = sum(min(f.cached_tokens for f in finals[p * n:(p + 1) * n]) for p in range(len(prompt_lens)))
    return UsageInfo.of(sum(prompt_lens), sum(f.completion_tokens for f in finals), cached)


def _sse(obj) -> str:
    data = obj.model_dump_json(exclude_unset=False) if hasattr(obj, "model_dump_json") else json.dumps(obj)
    return f"data: {data}\n\n"


async def _stream_events(ctx: ServingContext, choices, make_chunk, make_usage, first_chunks=(),
                         extras=None) -> AsyncIterator[str]:
    """SSE body: one chunk per event of any choice with something to say (``make_chunk(index,
    text, None, event)``, None when it has nothing: no text, no logprobs), a chunk with each
    choice's ``finish_reason`` (``make_chunk(index, None, reason)``), the usage chunk when
    asked (``make_usage(final events)``), then ``data: [DONE]``. ``extras`` (a
    `ChoiceExtras`, optional) adds ``stop_reason`` to each finish chunk and, when asked, a
    per-choice ``usage`` to every chunk (``first_chunks`` count 0 tokens). An error after the
    stream started becomes a ``data: {"error": ...}`` event (the other choices are aborted).
    (Aborting on early exit is `_SSEResponse`'s job.)"""
    for c in first_chunks:
        yield _sse(extras.decorate(c, c.choices[0].index, 0) if extras is not None else c)
    finals: List[Optional[StreamEvent]] = [None] * len(choices)
    async for i, ev in _merged(choices):
        if ev.error is not None:
            for rid, _ in choices:
                ctx.loop.abort(rid)
            yield _sse(error_body(ev.error.status, ev.error.message, None, ev.error.code, ev.error.type))
            break
        chunk = make_chunk(i, ev.text, None, ev)
        if chunk is not None:
            yield _sse(extras.decorate(chunk, i, ev.completion_tokens) if extras is not None else chunk)
        if ev.final:
            finals[i] = ev
            end = make_chunk(i, None, ev.finish_reason)
            yield _sse(extras.decorate(end, i, ev.completion_tokens, ev) if extras is not None else end)
    else:
        usage = make_usage(finals)
        if usage is not None:
            yield _sse(usage)
    yield "data: [DONE]\n\n"


class _SSEResponse(StreamingResponse):
    """`StreamingResponse` that aborts its request unless the whole stream was sent: the
    client left mid-stream (Starlette cancels the body iterator), left before the first
    byte (the iterator never started), or sending failed. Aborting a request that has
    finished in the meantime is a no-op."""

    def __init__(self, gen, on_exit):
        super().__init__(gen, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_exit = on_exit

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_exit()


def _sse_response(ctx: ServingContext, rids: List[str], gen):
    state = {"finished": False}

    async def tracked():
        async for item in gen:
            yield item
        state["finished"] = True

    def on_exit():
        if not state["finished"]:
            for rid in rids:
                ctx.loop.abort(rid)

    return _SSEResponse(tracked(), on_exit)


# ---- routes --------------------------------------------------------------------------------
def build_router():
    """The API routes; they read ``request.app.state.ctx`` (a `ServingContext`)."""
    from attnserve.server.completion_api import create_completion  # it imports this module's helpers
    from attnserve.server.responses_api import create_response  # likewise

    router = APIRouter()

    @router.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers' and k8s probes (no body)
    async def health(request: Request):
        ctx: ServingContext = request.app.state.ctx
        if ctx.loop.draining:
            return JSONResponse(error_body(503, "the server is shutting down", code="shutting_down"), 503)
        if not ctx.loop.is_alive():
            return JSONResponse(error_body(503, "the engine loop is not running", code="engine_dead"), 503)
        dead = ctx.loop.dead_replicas() if hasattr(ctx.loop, "dead_replicas") else []
        if dead:  # --dp-size: the live replicas still serve
            return {"status": "degraded", "dead_replicas": dead}
        return {"status": "ok"}

    @router.get("/metrics")
    async def metrics(request: Request):
        ctx: ServingContext = request.app.state.ctx
        if ctx.metrics is None:
            raise APIError(404, "metrics are disabled", None, "not_found")
        return Response(ctx.metrics.render(), media_type=ctx.metrics.content_type())

    @router.get("/debug/state")
    async def debug_state(request: Request):
        """Engine snapshot (running/waiting requests, KV slots used/free/total ...) taken
        by the loop thread after its last step, plus static facts about the server, and
        ``event_loop``: the HTTP process's asyncio loop (``uvloop`` or ``asyncio``; uvicorn
        takes uvloop when it is installed, which the ``server`` extra does)."""
        ctx: ServingContext = request.app.state.ctx
        event_loop = type(asyncio.get_running_loop()).__module__.split(".")[0]
        return {**(ctx.info or {}), **ctx.loop.state(), "engine_alive": ctx.loop.is_alive(), "event_loop": event_loop}

    @router.get("/v1/models")
    async def list_models(request: Request):
        ctx: ServingContext = request.app.state.ctx
        return ModelList(data=[ModelCard(id=ctx.model_name, max_model_len=ctx.engine.context_len)])

    @router.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request):
        ctx: ServingContext = request.app.state.ctx
        if model_id != ctx.model_name:
            raise APIError(404, f"the model {model_id!r} does not exist", "model", "model_not_found")
        return ModelCard(id=ctx.model_name, max_model_len=ctx.engine.context_len)

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await create_completion(body, request)

    @router.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        return await create_response(body, request)

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        ctx: ServingContext = request.app.state.ctx
        arrival = time.perf_counter()
        _check_model_and_options(ctx, body)
        tool_req = tool_request(body)
        out = chat_output(tool_req, ctx.tool_call_parser, ctx.reasoning_parser)
        prompt_ids = await run_in_threadpool(_chat_ids, ctx, body, tool_req)
        if tool_req is not None and tool_req.forced:
            grammar = await run_in_threadpool(forced_call_grammar, body, tool_req)
        else:
            grammar = await run_in_threadpool(request_grammar, body) if has_grammar_fields(body) else None
        sp = _sampling_params(ctx, body, len(prompt_ids), body.requested_max_tokens(), "messages", None, grammar)
        if out.keeps_markers:  # a gpt-oss parser reads the harmony markers (attnserve.server.chat_output)
            sp = harmony_sampling_params(sp, ctx.engine.tokenizer)
        rid = new_id("chatcmpl")
        choices = await _submit_choices(ctx, rid, [(prompt_ids, sp)], body.n or 1, arrival, bool(body.stream))
        model, created = ctx.model_name, now_s()  # one `created` for every chunk of the response
        texts = TokenTexts(ctx.engine.tokenizer) if body.logprobs else None
        extras = ChoiceExtras([len(prompt_ids)], len(choices), body.stop_token_ids, body.continuous_usage)
        if body.stream:
            readers = [out.stream() for _ in choices] if out.active else None

            def chunk(i, text, reason, ev=None):
                entries = (ev and ev.logprobs) or None
                if reason is not None:
                    delta = {}
                    reason = finish_reason(reason, readers is not None and readers[i].has_calls)
                elif readers is not None:
                    delta = readers[i].delta(text or "", final=bool(ev is not None and ev.final))
                    if not delta and not entries:
                        return None
                else:
                    if not text and not entries:
                        return None
                    delta = {"content": text or ""}
                lp = chat_logprobs(entries, texts) if texts and entries else None
                return ChatCompletionChunk(id=rid, model=model, created=created, choices=[
                    ChatChunkChoice(index=i, delta=delta, logprobs=lp, finish_reason=reason)])

            def usage(finals):
                if not body.include_usage:
                    return None
                return ChatCompletionChunk(id=rid, model=model, created=created, choices=[],
                                           usage=_usage([len(prompt_ids)], finals))

            first = [ChatCompletionChunk(id=rid, model=model, created=created,
                                         choices=[ChatChunkChoice(index=i, delta={"role": "assistant", "content": ""})])
                     for i in range(len(choices))]
            return _sse_response(ctx, [r for r, _ in choices],
                                 _stream_events(ctx, choices, chunk, usage, first_chunks=first, extras=extras))
        finals = await _collect(request, ctx, choices)
        messages = [out.message(f.text) if out.active else ({"content": f.text}, False) for f in finals]
        return ChatCompletionResponse(
            id=rid, model=model, created=created,
            choices=[ChatChoice(index=i, message=ChatResponseMessage(**messages[i][0]),
                                finish_reason=finish_reason(f.finish_reason, messages[i][1]),
                                stop_reason=extras.stop_reason(f),
                                logprobs=chat_logprobs(f.logprobs, texts) if texts else None)
                     for i, f in enumerate(finals)],
            usage=_usage([len(prompt_ids)], finals),
        )

    return router
