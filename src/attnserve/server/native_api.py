"""Routes beside the OpenAI ones: ``/tokenize``, ``/detokenize`` (the OpenAI-compatible
servers' shapes), SGLang's native ``/generate``, ``/health_generate`` and
``/get_model_info``.

* ``POST /tokenize``: ``{"prompt": text}`` or ``{"messages": [...]}`` (rendered by the
  server's chat template with ``add_generation_prompt`` / ``continue_final_message`` /
  ``chat_template_kwargs``) -> ``{"tokens", "count", "max_model_len"}`` (and
  ``"token_strs"`` with ``return_token_strs``).
* ``POST /detokenize``: ``{"tokens": [ids]}`` -> ``{"prompt": text}`` (special tokens
  kept, so tokenize -> detokenize gives the text back).
* ``POST /generate``: ``text`` or ``input_ids``, one prompt or a batch, SGLang's
  ``sampling_params`` names (`attnserve.server.native_protocol.sampling_kwargs`);
  answers ``{"text", "meta_info": {"id", "finish_reason", "prompt_tokens",
  "completion_tokens", "cached_tokens", "e2e_latency"}}`` (a list for a batch);
  ``finish_reason`` is SGLang's (`finish_reason_json`): ``{"type": "stop", "matched": token id
  or stop string}``, ``{"type": "length", "length": n}`` or ``{"type": "abort", "message", ...}``,
  None while streaming. ``sampling_params.max_new_tokens: 0`` scores the prompt as SGLang
  does: ``text`` "", ``completion_tokens`` 0, ``finish_reason`` ``{"type": "length",
  "length": 0}``, with ``return_logprob`` and ``logprob_start_len: 0`` the prompt's
  ``input_token_logprobs`` (and ``output_ids`` / ``output_token_logprobs`` empty). With
  ``return_logprob``: ``meta_info.output_token_logprobs`` ``[[logprob, id, text], ...]``
  (text None unless ``return_text_in_logprobs``), ``output_top_logprobs`` (per position
  the ``top_logprobs_num`` most likely ``[logprob, id, text]``), ``output_ids``, and with
  ``logprob_start_len: 0`` the prompt's ``input_token_logprobs`` / ``input_top_logprobs``
  (None at position 0). ``stream``: server-sent ``data: {...}`` events, each holding the
  text so far (SGLang's cumulative chunks; ``index`` in a batch), then ``data: [DONE]``.
  ``sampling_params.n`` (SGLang's parallel sampling; the same for every prompt): prompt
  ``i``'s samples are answers ``i*n .. i*n+n-1`` of a list (also for one prompt), each with
  its ``index``; sample ``j`` is seeded ``sampling_seed + j`` when seeded, and a given
  ``rid`` becomes ``rid-j``.
* ``GET /health_generate`` (or ``HEAD``: the same status without a body, for probes): one
  token through the engine; 200 when it comes back, 503 when the engine loop is dead,
  draining, failed the request, or took longer than ``ServingContext.health_generate_timeout_s``.
* ``GET /get_model_info``: ``model_path``, ``tokenizer_path``, ``is_generation`` ...
* ``GET /server_info`` (and SGLang's older ``/get_server_info``): the resolved flags,
  ``version``, the limits and the engine's state snapshots (`server_info`); ``GET /version``:
  ``{"version"}`` (vLLM's route).
* ``GET`` / ``POST /flush_cache``: drop the prefix (radix) cache of the engine, or of every
  data-parallel replica, as SGLang's route does (benchmarks call it between runs): 200 when
  no request runs or waits, else 400 and the cache is kept (the check reads the last
  published state; a request that arrives in between also keeps the cache, and the engine
  logs it).

Sources (facts only): SGLang's "Native APIs" and "Sampling Parameters" documentation and
``GenerateReqInput``; vLLM's ``/tokenize`` and ``/detokenize``.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Dict, List, Optional, Tuple

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from attnserve.server.engine_loop import RequestStream, StreamEvent, SubmitCommand
from attnserve.server.errors import APIError, error_body
from attnserve.server.logprob_format import LOGPROB_FLOOR, TokenTexts
from attnserve.server.native_protocol import (
    DEFAULT_MAX_NEW_TOKENS,
    DetokenizeRequest,
    GenerateRequest,
    TokenizeRequest,
    grammar_view,
    sampling_kwargs,
)
from attnserve.server.protocol import new_id

#: most samples (prompts x ``n``) one ``/generate`` request may start
MAX_GENERATE_SAMPLES = 256
#: SamplingParams field -> SGLang's name (for the ``param`` of a 400).
_SGLANG_NAME = {"min_tokens": "min_new_tokens", "seed": "sampling_seed"}


def _check_body(ctx, body) -> None:
    from attnserve.server.request_fields import check_unicode

    check_unicode(body)
    refused = body.refusal()
    if refused is not None:
        raise APIError(400, refused.message, refused.param, refused.code)
    model = getattr(body, "model", None)
    if model is not None and model != ctx.model_name:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {ctx.model_name!r}", "model",
                       "model_not_found")


def _vocab_size(ctx) -> Optional[int]:
    return getattr(ctx.engine, "vocab_size", None) or getattr(getattr(ctx.engine, "model_config", None),
                                                              "vocab_size", None)


# ---- /tokenize, /detokenize ------------------------------------------------------------------
def tokenize_body(ctx, body: TokenizeRequest) -> Dict[str, Any]:
    """The ``/tokenize`` answer (runs in a worker thread).

    Raises:
        APIError 400: neither or both of ``prompt`` / ``messages``, chat options with a
            ``prompt``, no tokenizer, or a chat-template error (`attnserve.server.chat_template`).
    """
    from attnserve.server.chat_template import render_request
    from attnserve.server.tool_request import template_messages

    tok = ctx.engine.tokenizer
    if tok is None:
        raise APIError(400, "this model has no tokenizer", None, "invalid_value")
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "send exactly one of prompt and messages", "prompt", "invalid_value")
    if body.prompt is not None:
        for name in ("add_generation_prompt", "continue_final_message", "chat_template_kwargs"):
            if name in body.model_fields_set:
                raise APIError(400, f"{name} applies to messages, not to a prompt", name, "invalid_value")
        ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
    else:
        source = getattr(ctx, "chat_template", None) or getattr(tok, "chat_template", None)
        rendered = render_request(ctx, body, template_messages(body, source if isinstance(source, str) else None))
        ids = rendered.token_ids
        if body.add_special_tokens:
            ids = tok.encode(rendered.text, add_special_tokens=True)
    out: Dict[str, Any] = {"count": len(ids), "max_model_len": ctx.engine.context_len, "tokens": [int(t) for t in ids]}
    if body.return_token_strs:
        out["token_strs"] = tok.convert_ids_to_tokens(out["tokens"])
    return out


def detokenize_body(ctx, body: DetokenizeRequest) -> Dict[str, Any]:
    """The ``/detokenize`` answer, ``{"prompt": text}`` (runs in a worker thread).

    Raises:
        APIError 400: no tokenizer, or an id outside the vocabulary (``param`` ``tokens``)."""
    tok = ctx.engine.tokenizer
    if tok is None:
        raise APIError(400, "this model has no tokenizer", None, "invalid_value")
    vocab = _vocab_size(ctx) or len(tok)
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"tokens must be ids in [0, {vocab}), got {bad}", "tokens", "invalid_value")
    return {"prompt": tok.decode(body.tokens, skip_special_tokens=False)}


# ---- /generate ---------------------------------------------------------------------------------
def _prompt_ids(ctx, prompt, param: str) -> List[int]:
    try:
        return ctx.engine.tokenize(prompt)
    except ValueError as e:
        raise APIError(400, str(e), param, "invalid_value") from e


async def _build_item(ctx, body: GenerateRequest, i: int, prompt, batch: bool, per: Dict[str, list]):
    """``(prompt ids, SamplingParams, prompt_only)`` of prompt ``i``, checked. ``prompt_only``:
    ``max_new_tokens`` 0 (the engine computes one token, for the prompt's logprobs, and
    `_Result` drops it).

    Raises:
        APIError 400 naming the field (``sampling_params.<name>``, ``text`` ...)."""
    from attnserve.engine.penalties import check_logit_bias_vocab
    from attnserve.engine.sampling_params import SamplingParams
    from attnserve.server.grammar_request import has_grammar_fields, request_grammar
    from attnserve.server.openai_api import _max_new_tokens

    sfx = f".{i}" if batch else ""
    prompt_param = ("text" if isinstance(prompt, str) else "input_ids") + sfx
    sp_param = "sampling_params" + (f".{i}" if isinstance(body.sampling_params, list) else "")
    if isinstance(prompt, str):  # tokenizing may take a while: off the event loop
        ids = await run_in_threadpool(_prompt_ids, ctx, prompt, prompt_param)
    else:  # token ids are only checked (tens of us)
        ids = _prompt_ids(ctx, prompt, prompt_param)
    kwargs = sampling_kwargs(per["sampling_params"][i], sp_param)
    view = grammar_view(kwargs)
    if has_grammar_fields(view):
        try:
            grammar = await run_in_threadpool(request_grammar, view)
        except APIError as e:
            e.param = f"{sp_param}.{e.param}"
            raise
        for g in ("json_schema", "regex", "ebnf"):
            kwargs.pop(g, None)
        kwargs.update(grammar)
    want_lp = bool(per["return_logprob"][i])
    start = per["logprob_start_len"][i]
    if start not in (None, -1, 0):
        raise APIError(400, f"logprob_start_len={start} is not supported by attnserve; use -1 (output only) or 0 "
                            "(the whole prompt too)", "logprob_start_len", "unsupported_parameter")
    top = per["top_logprobs_num"][i] or 0
    requested = kwargs.pop("max_new_tokens", None)
    prompt_only = requested == 0
    try:
        max_new = _max_new_tokens(ctx, len(ids), 1 if prompt_only else requested, DEFAULT_MAX_NEW_TOKENS,
                                  prompt_param)
    except APIError as e:
        if e.param == "max_tokens":  # the OpenAI routes' name for it
            e.param, e.message = f"{sp_param}.max_new_tokens", e.message.replace("max_tokens", "max_new_tokens")
            e.args = (e.message,)
        raise
    try:
        sp = SamplingParams(max_new_tokens=max_new, **kwargs, logprobs=want_lp, top_logprobs=top if want_lp else 0,
                            prompt_logprobs=want_lp and start == 0)
        vocab = _vocab_size(ctx)
        if vocab:
            check_logit_bias_vocab(sp, vocab)
    except ValueError as e:
        name = str(e).split(" ", 1)[0]
        if name == "top_logprobs":
            param = "top_logprobs_num"
        else:
            param = f"{sp_param}.{_SGLANG_NAME.get(name, name)}"
        raise APIError(400, str(e), param, "invalid_value") from e
    return ids, sp, prompt_only


async def _submit_all(ctx, items: List[Tuple[List[int], Any]], arrival: float,
                      stream_tokens: bool = True) -> List[Tuple[str, RequestStream]]:
    """Submit every prompt of the request together; wait until each one is accepted.
    ``stream_tokens`` False: the client waits for the whole answer (`SubmitCommand.stream_tokens`).

    Raises:
        APIError: the first refusal (503 full queue / shutting down, 400 from the engine);
            every prompt is aborted first."""
    from attnserve.server.openai_api import _raise_engine_error

    choices: List[Tuple[str, RequestStream]] = []
    for ids, sp in items:
        rid, stream = new_id("generate"), RequestStream()
        ctx.loop.submit(SubmitCommand(rid, ids, sp, stream, arrival, stream_tokens=stream_tokens))
        choices.append((rid, stream))
    try:
        firsts = [await stream.get() for _, stream in choices]
    except BaseException:
        for rid, _ in choices:
            ctx.loop.abort(rid)
        raise
    refused = [ev for ev in firsts if ev.error is not None]
    if refused:
        for rid, _ in choices:
            ctx.loop.abort(rid)
        _raise_engine_error(refused[0])
    return choices


def _lp(x: Optional[float]) -> Optional[float]:
    return None if x is None else max(x, LOGPROB_FLOOR)


def finish_reason_json(ev: StreamEvent, prompt_only: bool = False) -> Optional[Dict[str, Any]]:
    """SGLang's ``meta_info.finish_reason`` of a request whose last event is ``ev`` (None while
    it runs): ``{"type": "stop", "matched": token id (int) or stop string (str)}`` when EOS, a
    stop token, a stop string or a grammar's end ended it; ``{"type": "length", "length":
    tokens generated}`` (0 for ``prompt_only``); ``{"type": "abort", "message", "status_code",
    "err_type"}`` for an aborted one (SGLang's ``FINISH_*.to_json``)."""
    from attnserve.engine.request import sglang_finish_reason  # lazily, as the other engine imports here

    if prompt_only and ev.finish_reason is not None:
        return sglang_finish_reason("length", None, 0)
    return sglang_finish_reason(ev.finish_reason, ev.matched_stop, ev.completion_tokens)


class _Result:
    """One prompt's answer, built up from its events (SGLang's ``{text, meta_info}``).
    ``prompt_only`` (``max_new_tokens`` 0): the generated token is dropped, only the prompt's
    logprobs are kept."""

    def __init__(self, rid: str, sp, texts: Optional[TokenTexts], arrival: float, prompt_only: bool = False):
        self.rid, self.sp, self.texts, self.arrival = rid, sp, texts, arrival
        self.prompt_only = prompt_only
        self.text = ""
        self.out: List[tuple] = []
        self.prompt: Optional[list] = None
        self.last: StreamEvent = StreamEvent()

    def add(self, ev: StreamEvent) -> None:
        if not self.prompt_only:
            self.text += ev.text
            self.out.extend(ev.logprobs or ())
        if ev.prompt_logprobs is not None:
            self.prompt = list(ev.prompt_logprobs)
        self.last = ev

    def _entry(self, tid: int, lp: Optional[float]) -> list:
        return [_lp(lp), tid, self.texts.get(tid)[0] if self.texts is not None else None]

    def _top(self, top) -> Optional[list]:
        return None if top is None else [self._entry(aid, alp) for aid, alp in top]

    def body(self, index: Optional[int] = None) -> Dict[str, Any]:
        ev = self.last
        meta: Dict[str, Any] = {"id": self.rid, "finish_reason": finish_reason_json(ev, self.prompt_only),
                                "prompt_tokens": ev.prompt_tokens,
                                "completion_tokens": 0 if self.prompt_only else ev.completion_tokens,
                                "cached_tokens": ev.cached_tokens, "e2e_latency": time.perf_counter() - self.arrival}
        out: Dict[str, Any] = {"text": self.text}
        if self.sp.logprobs:
            meta["output_token_logprobs"] = [self._entry(t, lp) for t, lp, _ in self.out]
            meta["output_top_logprobs"] = [self._top(top) for _, _, top in self.out]
            out["output_ids"] = [t for t, _, _ in self.out]
            if self.sp.prompt_logprobs:
                meta["input_token_logprobs"] = [self._entry(t, lp) for t, lp, _ in self.prompt or ()]
                meta["input_top_logprobs"] = [self._top(top) for _, _, top in self.prompt or ()]
        out["meta_info"] = meta
        if index is not None:
            out["index"] = index
        return out


def _samples_per_prompt(body: GenerateRequest, items) -> int:
    """``sampling_params.n``: the samples of every prompt (SGLang's parallel sampling); one
    value for the whole request, as SGLang requires.

    Raises:
        APIError 400: prompts of one batch asking for different ``n``, or more than
            `MAX_GENERATE_SAMPLES` samples in all."""
    counts = [sp.n for _, sp, _ in items]
    if len(set(counts)) > 1:
        k = next(i for i, c in enumerate(counts) if c != counts[0])
        raise APIError(400, f"sampling_params.{k}.n is {counts[k]} but sampling_params.0.n is {counts[0]}; every "
                            "prompt of a batch takes the same n", f"sampling_params.{k}.n", "invalid_value")
    if counts[0] * len(items) > MAX_GENERATE_SAMPLES:
        raise APIError(400, f"{len(items)} prompts x n {counts[0]} is {counts[0] * len(items)} samples; at most "
                            f"{MAX_GENERATE_SAMPLES} per request", "sampling_params.n", "invalid_value")
    return counts[0]


async def generate(ctx, body: GenerateRequest, request) -> Any:
    """``POST /generate`` (see the module docstring)."""
    from attnserve.server.openai_api import _collect, _merged, _sse_response

    arrival = time.perf_counter()
    _check_body(ctx, body)
    prompts = body.prompts()
    batch, n = body.is_batch(), len(prompts)
    per = {name: body.per_prompt(name, n)
           for name in ("sampling_params", "return_logprob", "top_logprobs_num", "logprob_start_len", "rid")}
    items = [await _build_item(ctx, body, i, p, batch, per) for i, p in enumerate(prompts)]
    samples = _samples_per_prompt(body, items)
    listed = batch or samples > 1  # SGLang answers a list (and streams ``index``) for either
    expanded = [(ids, sp.sample(j)) for ids, sp, _ in items for j in range(samples)]  # prompt i's at i*n .. i*n+n-1
    choices = await _submit_all(ctx, expanded, arrival, bool(body.stream))
    texts = TokenTexts(ctx.engine.tokenizer) if body.return_text_in_logprobs else None

    def result_id(k: int, rid: str) -> str:
        given = per["rid"][k // samples]
        return rid if not given else given if samples == 1 else f"{given}-{k % samples}"

    results = [_Result(result_id(k, rid), sp, texts, arrival, items[k // samples][2]) for k, ((rid, _), (_, sp))
               in enumerate(zip(choices, expanded))]
    if not body.stream:
        finals = await _collect(request, ctx, choices)
        for res, f in zip(results, finals):
            res.add(f)
        bodies = [r.body(k if samples > 1 else None) for k, r in enumerate(results)]
        return bodies if listed else bodies[0]

    async def events():
        async for i, ev in _merged(choices):
            if ev.error is not None:
                for rid, _ in choices:
                    ctx.loop.abort(rid)
                e = ev.error
                yield f"data: {json.dumps(error_body(e.status, e.message, None, e.code, e.type))}\n\n"
                break
            if not ev.final and not ev.prompt_logprobs and (results[i].prompt_only or not (ev.text or ev.logprobs)):
                continue
            results[i].add(ev)
            yield f"data: {json.dumps(results[i].body(i if listed else None))}\n\n"
        yield "data: [DONE]\n\n"

    return _sse_response(ctx, [rid for rid, _ in choices], events())


# ---- /health_generate, /get_model_info ----------------------------------------------------------
async def health_generate(ctx) -> JSONResponse:
    """Run one greedy token (prompt: token id 0) through the engine; 200 when it comes
    back within ``ctx.health_generate_timeout_s``, else 503."""
    from attnserve.engine.sampling_params import SamplingParams

    if ctx.loop.draining:
        return JSONResponse(error_body(503, "the server is shutting down", code="shutting_down"), 503)
    if not ctx.loop.is_alive():
        return JSONResponse(error_body(503, "the engine loop is not running", code="engine_dead"), 503)
    rid, stream = new_id("health"), RequestStream()
    ctx.loop.submit(SubmitCommand(rid, [0], SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True),
                                  stream))

    async def until_final() -> StreamEvent:
        while True:
            ev = await stream.get()
            if ev.final:
                return ev

    try:
        ev = await asyncio.wait_for(until_final(), ctx.health_generate_timeout_s)
    except asyncio.TimeoutError:
        ctx.loop.abort(rid)
        return JSONResponse(error_body(503, f"the engine did not generate a token within "
                                            f"{ctx.health_generate_timeout_s:g} s", code="engine_unresponsive"), 503)
    except BaseException:
        ctx.loop.abort(rid)
        raise
    if ev.error is not None:
        return JSONResponse(error_body(503, f"the engine failed a one-token request: {ev.error.message}",
                                       code=ev.error.code or "engine_error"), 503)
    return JSONResponse({"status": "ok", "completion_tokens": ev.completion_tokens})


def model_info(ctx) -> Dict[str, Any]:
    """SGLang's ``/get_model_info`` fields that apply to attnserve."""
    args = getattr(ctx.engine, "server_args", None)
    mc = getattr(ctx.engine, "model_config", None)
    hf = getattr(mc, "hf_config", None)
    tok = ctx.engine.tokenizer
    return {
        "model_path": getattr(args, "model", ctx.model_name),
        "tokenizer_path": getattr(tok, "name_or_path", None),
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": getattr(hf, "model_type", None),
        "architectures": [mc.architecture] if getattr(mc, "architecture", None) else None,
        "served_model_name": ctx.model_name,
        "max_model_len": ctx.engine.context_len,
    }


def build_native_router():
    """The native routes; they read ``request.app.state.ctx`` (a `ServingContext`)."""
    router = APIRouter()

    @router.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest, request: Request):
        ctx = request.app.state.ctx
        _check_body(ctx, body)
        return await run_in_threadpool(tokenize_body, ctx, body)

    @router.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest, request: Request):
        ctx = request.app.state.ctx
        _check_body(ctx, body)
        return await run_in_threadpool(detokenize_body, ctx, body)

    @router.post("/generate")
    async def generate_route(body: GenerateRequest, request: Request):
        return await generate(request.app.state.ctx, body, request)

    @router.api_route("/health_generate", methods=["GET", "HEAD"])
    async def health_generate_route(request: Request):
        return await health_generate(request.app.state.ctx)

    @router.get("/get_model_info")
    async def get_model_info_route(request: Request):
        return model_info(request.app.state.ctx)

    @router.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache_route(request: Request):
        return flush_cache(request.app.state.ctx)

    @router.get("/server_info")
    @router.get("/get_server_info")  # SGLang's older name, still what its tools call
    async def server_info_route(request: Request):
        return server_info(request.app.state.ctx)

    @router.get("/version")
    async def version_route():
        import attnserve

        return {"version": attnserve.__version__}

    return router


def server_info(ctx) -> Dict[str, Any]:
    """SGLang's ``/server_info``: the engine's resolved flags (`ServerArgs` fields, through
    FastAPI's ``jsonable_encoder``), ``version``, the serving limits the memory rules chose, and
    ``internal_states``: the engine's state snapshot, one per data-parallel replica."""
    import dataclasses

    from fastapi.encoders import jsonable_encoder

    import attnserve

    args = getattr(ctx.engine, "server_args", None)
    out: Dict[str, Any] = jsonable_encoder(args) if dataclasses.is_dataclass(args) else {}
    state = ctx.loop.state()
    out.update({"version": attnserve.__version__, "served_model_name": ctx.model_name,
                "context_length": ctx.engine.context_len, "max_total_num_tokens": ctx.engine.max_total_tokens,
                "internal_states": state.get("replicas") or [state]})
    return out


def flush_cache(ctx):
    """``/flush_cache`` (see the module docstring).

    Raises:
        APIError 400 ``requests_in_flight``: requests run or wait; 503: the engine cannot be
            reached.
    """
    state = ctx.loop.state()
    busy = int(state.get("running", 0)) + int(state.get("waiting", 0))
    if busy:
        raise APIError(400, f"the prefix cache was not flushed: {busy} requests are running or waiting; "
                            "call /flush_cache when the server is idle", None, "requests_in_flight")
    if ctx.loop.flush_cache() is False:
        raise APIError(503, "the engine cannot be reached", None, "engine_dead")
    return JSONResponse({"message": "Cache flushed."})
