"""``POST /v1/completions``: one prompt or a batch of prompts (OpenAI's ``prompt`` as a string,
a token-id list, a list of strings or a list of token-id lists).

A batch of ``P`` prompts with ``n`` choices each is submitted as ``P * n`` engine requests
at once (`openai_api._submit_choices`; a shared prefix is computed once and read from the
prefix cache by the rest) and answered as one response whose choice ``p * n + i`` is prompt
``p``'s choice ``i``, as OpenAI and vLLM order them; streamed chunks carry that index.
``usage`` counts each prompt once and every choice's tokens. A prompt that cannot be served
(too long, not tokenizable) refuses the whole request with a 400 naming it (``prompt[p]``)
before anything is submitted.

``echo`` with ``max_tokens: 0`` scores the prompt (`CompletionRequest.echo_only`): the engine
computes one token to produce the prompt's logprobs, and that token is dropped, so each choice
holds the prompt alone, ``finish_reason`` ``length``, and ``usage.completion_tokens`` is 0.
"""

from __future__ import annotations

import dataclasses
import time
from typing import List, Optional

from starlette.concurrency import run_in_threadpool

from attnserve.server.choice_extras import ChoiceExtras
from attnserve.server.errors import APIError
from attnserve.server.grammar_request import has_grammar_fields, request_grammar
from attnserve.server.logprob_format import CompletionLogprobsBuilder, TokenTexts
from attnserve.server.openai_api import (
    ServingContext,
    _check_model_and_options,
    _collect,
    _prompt_ids,
    _sampling_params,
    _sse_response,
    _stream_events,
    _submit_choices,
    _usage,
)
from attnserve.server.protocol import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    new_id,
    now_s,
)


def echo_text(ctx: ServingContext, echo: bool, prompt, prompt_ids: List[int]) -> Optional[str]:
    """The prompt as a completion's ``echo`` repeats it (a token-id prompt decoded), or None
    without ``echo``."""
    if not echo:
        return None
    if isinstance(prompt, str):
        return prompt
    tok = ctx.engine.tokenizer
    return tok.decode(prompt_ids, skip_special_tokens=False) if tok is not None else ""


def _batch_error(e: APIError, p: int, batch: bool) -> APIError:
    """``e`` about prompt ``p`` of a batch: its message and ``param`` name the prompt."""
    if not batch or e.param != "prompt":
        return e
    return APIError(e.status, f"prompt[{p}]: {e.message}", f"prompt[{p}]", e.code)


async def create_completion(body: CompletionRequest, request):
    """The ``/v1/completions`` handler (see the module docstring).

    Raises:
        APIError: 400 for a request or prompt that cannot be served (``max_tokens: 0``
            without ``echo`` included), 404 for another model, 503 when the engine's queue
            is full (`openai_api._submit_choices`).
    """
    ctx: ServingContext = request.app.state.ctx
    arrival = time.perf_counter()
    _check_model_and_options(ctx, body)
    echo_only = body.echo_only()
    if body.requested_max_tokens() == 0 and not echo_only:
        raise APIError(400, "max_tokens must be at least 1; 0 is accepted only with echo (the prompt, and with "
                            "logprobs its logprobs, without a completion)", "max_tokens", "invalid_value")
    max_tokens = 1 if echo_only else body.requested_max_tokens()  # echo_only: that token is dropped
    prompts = body.prompts()
    batch = len(prompts) > 1

    def ids_of(p: int, prompt) -> List[int]:
        try:
            return _prompt_ids(ctx, prompt)
        except APIError as e:
            raise _batch_error(e, p, batch) from e

    if any(isinstance(p, str) for p in prompts):  # the tokenizer may take a while: off the event loop
        prompt_ids = await run_in_threadpool(lambda: [ids_of(p, x) for p, x in enumerate(prompts)])
    else:  # token ids: only checked (tens of us); a worker-thread hop would queue the burst behind it
        prompt_ids = [ids_of(p, x) for p, x in enumerate(prompts)]
    grammar = await run_in_threadpool(request_grammar, body) if has_grammar_fields(body) else None
    params = []
    for p, ids in enumerate(prompt_ids):
        try:
            params.append(_sampling_params(ctx, body, len(ids), max_tokens, "prompt",
                                           DEFAULT_COMPLETION_MAX_TOKENS, grammar))
        except APIError as e:
            raise _batch_error(e, p, batch) from e
    n = body.n or 1
    rid = new_id("cmpl")
    choices = await _submit_choices(ctx, rid, list(zip(prompt_ids, params)), n, arrival, bool(body.stream))
    model, created = ctx.model_name, now_s()  # one `created` for every chunk of the response
    prompt_echoes = [echo_text(ctx, bool(body.echo), p, ids) for p, ids in zip(prompts, prompt_ids)]
    echoes = [prompt_echoes[i // n] for i in range(len(choices))]  # decoded once per prompt, not per choice
    texts = TokenTexts(ctx.engine.tokenizer) if body.logprobs is not None else None
    prompt_lens = [len(ids) for ids in prompt_ids]
    extras = ChoiceExtras(prompt_lens, n, body.stop_token_ids, body.continuous_usage, scoring=echo_only)

    def usage_of(finals):
        if echo_only:
            finals = [dataclasses.replace(f, completion_tokens=0) for f in finals]
        return _usage(prompt_lens, finals)

    if body.stream:
        builders = [CompletionLogprobsBuilder(texts) if texts else None for _ in choices]
        echoed = [e is None for e in echoes]
        # a model without a tokenizer makes no text: an empty chunk marks each report of new tokens
        tokenless, reported = ctx.engine.tokenizer is None, [0] * len(choices)

        def chunk(i, text, reason, ev=None):
            entries, lp = list((ev and ev.logprobs) or ()), None
            if echo_only:  # the token generated for the prompt's logprobs is not shown
                text, entries, reason = None, [], reason and "length"
            if reason is None and not echoed[i]:  # the prompt (and its logprobs) first
                echoed[i] = True
                text, entries = echoes[i] + (text or ""), list(ev.prompt_logprobs or ()) + entries
            new_tokens = ev is not None and ev.completion_tokens > reported[i] and not echo_only
            if new_tokens:
                reported[i] = ev.completion_tokens
            if reason is None and not text and not entries and not (tokenless and new_tokens):
                return None
            if builders[i] is not None and (entries or reason is None):
                lp = builders[i].build(entries)
            return CompletionResponse(id=rid, model=model, created=created, choices=[
                CompletionChoice(index=i, text=text or "", logprobs=lp, finish_reason=reason)])

        def usage(finals):
            if not body.include_usage:
                return None
            return CompletionResponse(id=rid, model=model, created=created, choices=[], usage=usage_of(finals))

        return _sse_response(ctx, [r for r, _ in choices], _stream_events(ctx, choices, chunk, usage, extras=extras))
    finals = await _collect(request, ctx, choices)
    if echo_only:
        finals = [dataclasses.replace(f, text="", logprobs=[], finish_reason="length") for f in finals]
    return CompletionResponse(
        id=rid, model=model, created=created,
        choices=[CompletionChoice(index=i, text=(echoes[i] or "") + f.text, finish_reason=f.finish_reason,
                                  stop_reason=extras.stop_reason(f),
                                  logprobs=CompletionLogprobsBuilder(texts).build(
                                      list(f.prompt_logprobs or ()) + f.logprobs) if texts else None)
                 for i, f in enumerate(finals)],
        usage=usage_of(finals),
    )
