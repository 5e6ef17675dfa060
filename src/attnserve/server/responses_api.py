"""``POST /v1/responses``: OpenAI's Responses API for text generation, served through the chat
route's machinery (request schema and what is refused: `attnserve.server.responses_protocol`).

A request is read into the equivalent chat request (``instructions`` + ``input`` as messages,
``max_output_tokens`` as ``max_completion_tokens``, ``text.format`` as ``response_format``) and
then goes the chat route's way (`attnserve.server.openai_api`): the server's chat template,
the same `SamplingParams` and context check, the same submission (a full queue is a 503
before any byte is sent), abort when the client disconnects, the same error bodies and
metrics. The answer is one ``message`` output item holding one ``output_text`` part; with
``--reasoning-parser`` the thinking comes first as a ``reasoning`` item. A generation cut by
``max_output_tokens`` (or the end of the context) is ``status: "incomplete"`` with
``incomplete_details.reason`` ``max_output_tokens``.

Streamed (``stream: true``), the body is OpenAI's typed server-sent events (``event: <type>``
and ``data: {...}``, each with its ``sequence_number`` from 0, no ``[DONE]``), in order:
``response.created``, ``response.in_progress``, then per output item
``response.output_item.added``, ``response.content_part.added``, the deltas
(``response.output_text.delta``, or ``response.reasoning_text.delta`` for a reasoning item),
``response.output_text.done`` / ``response.reasoning_text.done``,
``response.content_part.done``, ``response.output_item.done``, and last
``response.completed`` (or ``response.incomplete``, as OpenAI ends an incomplete response)
carrying the whole response with its ``usage``. An engine error after the stream started is
an ``error`` event followed by ``response.failed``.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable, Dict, List, Optional

from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from attnserve.server.chat_output import ChatOutput, chat_output, harmony_sampling_params
from attnserve.server.errors import APIError, _loc_to_param
from attnserve.server.grammar_request import has_grammar_fields, request_grammar
from attnserve.server.openai_api import (
    ServingContext,
    _chat_ids,
    _check_model_and_options,
    _collect,
    _merged,
    _sampling_params,
    _sse_response,
    _submit_choices,
)
from attnserve.server.protocol import ChatCompletionRequest, now_s
from attnserve.server.responses_protocol import (
    ResponsesRequest,
    message_item,
    new_item_id,
    reasoning_item,
    response_object,
    status_of,
    usage_object,
)

__all__ = ["ResponsesRequest", "ResponseEvents", "create_response"]

#: chat names in errors -> the responses names the client sent
_PARAMS = (("response_format.json_schema", "text.format"), ("response_format", "text.format"),
           ("max_tokens", "max_output_tokens"), ("messages", "input"))


def _renamed(e: APIError) -> APIError:
    """``e`` (raised for the equivalent chat request) naming the responses fields instead."""
    param, message = e.param, e.message
    for old, new in _PARAMS:
        if param is not None and (param == old or param.startswith(old + ".")):
            param = new + param[len(old):]
        if old != "messages":
            message = message.replace(old, new)
    return APIError(e.status, message, param, e.code, e.type)


def _chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate(body.chat_fields())
    except ValidationError as e:  # a value only the chat schema checks (logit_bias keys ...)
        first = e.errors()[0]
        raise _renamed(APIError(400, f"{first.get('msg')}", _loc_to_param(first.get("loc", ())),
                                "invalid_value")) from None


class ResponseEvents:
    """The typed events of one streamed response, as SSE text, numbered in order.

    Args:
        snapshot: ``snapshot(status, output, usage, incomplete_details, error)`` -> the
            response object (`responses_protocol.response_object` bound to the request).
    """

    _PARTS = {"text": ("message", "output_text"), "reasoning": ("reasoning", "reasoning_text")}

    def __init__(self, snapshot: Callable[..., Dict[str, Any]]):
        self.snapshot = snapshot
        self.seq = 0
        self.done: List[Dict[str, Any]] = []  # finished output items
        self.kind: Optional[str] = None  # the open item's kind ("text" / "reasoning"), None when none is open
        self.item_id = ""
        self.parts: List[str] = []

    def _event(self, type_: str, **fields: Any) -> str:
        data = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {type_}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def _item(self, status: str) -> Dict[str, Any]:
        text = "".join(self.parts)
        if self.kind == "reasoning":
            return reasoning_item(self.item_id, text, status)
        return message_item(self.item_id, text, status)

    def _part(self, text: str) -> Dict[str, Any]:
        if self.kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _where(self) -> Dict[str, Any]:
        return {"item_id": self.item_id, "output_index": len(self.done), "content_index": 0}

    def start(self) -> List[str]:
        """``response.created`` and ``response.in_progress``."""
        first = self.snapshot("in_progress", [])
        return [self._event("response.created", response=first), self._event("response.in_progress", response=first)]

    def _open(self, kind: str) -> List[str]:
        self.kind, self.item_id, self.parts = kind, new_item_id("msg" if kind == "text" else "rs"), []
        item = self._item("in_progress")
        item["content"] = []
        return [self._event("response.output_item.added", output_index=len(self.done), item=item),
                self._event("response.content_part.added", part=self._part(""), **self._where())]

    def _close(self, status: str) -> List[str]:
        text, where = "".join(self.parts), self._where()
        done = "response.output_text.done" if self.kind == "text" else "response.reasoning_text.done"
        extra = {"logprobs": []} if self.kind == "text" else {}
        item = self._item(status)
        out = [self._event(done, text=text, **extra, **where),
               self._event("response.content_part.done", part=self._part(text), **where),
               self._event("response.output_item.done", output_index=where["output_index"], item=item)]
        self.done.append(item)
        self.kind = None
        return out

    def delta(self, kind: str, text: str) -> List[str]:
        """Events for ``text`` of ``kind`` (``"text"`` or ``"reasoning"``): the open item's
        delta, after closing an item of the other kind and opening one of this kind."""
        if not text:
            return []
        out: List[str] = []
        if self.kind != kind:
            if self.kind is not None:
                out += self._close("completed")
            out += self._open(kind)
        self.parts.append(text)
        name = "response.output_text.delta" if kind == "text" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "text" else {}
        return out + [self._event(name, delta=text, **extra, **self._where())]

    def finish(self, finish_reason: Optional[str], usage: Dict[str, Any]) -> List[str]:
        """Close the open item (a message always ends the output, empty if need be) and end
        with ``response.completed`` / ``response.incomplete``."""
        status, details = status_of(finish_reason)
        out: List[str] = []
        if self.kind == "reasoning":
            out += self._close("completed")
        if self.kind is None:
            out += self._open("text")
        out += self._close(status)
        final = self.snapshot(status, self.done, usage, details)
        return out + [self._event("response.completed" if status == "completed" else "response.incomplete",
                                  response=final)]

    def fail(self, code: Optional[str], message: str) -> List[str]:
        """An ``error`` event and ``response.failed`` (what is finished so far in its output)."""
        failed = self.snapshot("failed", self.done, None, None, {"code": code or "server_error", "message": message})
        return [self._event("error", code=code, message=message, param=None),
                self._event("response.failed", response=failed)]


def _reader(ctx: ServingContext) -> ChatOutput:
    """The readers of a response's text: the chat route's for a request without tools (the
    ``--reasoning-parser``; gpt-oss's harmony markers are read whenever a gpt-oss parser is
    set, `attnserve.server.chat_output`)."""
    return chat_output(None, ctx.tool_call_parser, ctx.reasoning_parser)


def _output_items(ctx: ServingContext, text: str, status: str) -> List[Dict[str, Any]]:
    """The output of a whole answer: a reasoning item when ``--reasoning-parser`` finds
    thinking, then the message."""
    items = []
    out = _reader(ctx)
    if out.active:
        fields, _ = out.message(text)
        text = fields.get("content") or ""
        if fields.get("reasoning_content"):
            items.append(reasoning_item(new_item_id("rs"), fields["reasoning_content"], "completed"))
    return items + [message_item(new_item_id("msg"), text, status)]


async def create_response(body: ResponsesRequest, request) -> Any:
    """The ``/v1/responses`` handler (see the module doc).

    Raises:
        APIError: 400 for a request that cannot be served (``param`` names the responses
            field), 404 for another model, 503 when the engine's queue is full.
    """
    ctx: ServingContext = request.app.state.ctx
    arrival = time.perf_counter()
    _check_model_and_options(ctx, body)
    chat = _chat_request(body)
    try:
        prompt_ids = await run_in_threadpool(_chat_ids, ctx, chat, None)
        grammar = await run_in_threadpool(request_grammar, chat) if has_grammar_fields(chat) else None
        sp = _sampling_params(ctx, chat, len(prompt_ids), chat.requested_max_tokens(), "input", None, grammar)
        if _reader(ctx).keeps_markers:
            sp = harmony_sampling_params(sp, ctx.engine.tokenizer)
    except APIError as e:
        raise _renamed(e) from None
    rid = new_item_id("resp")
    choices = await _submit_choices(ctx, rid, [(prompt_ids, sp)], 1, arrival, bool(body.stream))
    model, created = ctx.model_name, now_s()

    def snapshot(status, output, usage=None, details=None, error=None):
        return response_object(body, rid, created, model, status, output, usage, details, error)

    def usage_of(final) -> Dict[str, Any]:
        return usage_object(len(prompt_ids), final.completion_tokens, final.cached_tokens)

    if not body.stream:
        final = (await _collect(request, ctx, choices))[0]
        status, details = status_of(final.finish_reason)
        return snapshot(status, _output_items(ctx, final.text, status), usage_of(final), details)

    async def events():
        ev = ResponseEvents(snapshot)
        for s in ev.start():
            yield s
        out = _reader(ctx)
        reader = out.stream() if out.active else None
        async for _, e in _merged(choices):
            if e.error is not None:
                ctx.loop.abort(rid)
                for s in ev.fail(e.error.code, e.error.message):
                    yield s
                return
            if reader is None:
                pieces = [("text", e.text)]
            else:
                d = reader.delta(e.text or "", final=e.final)
                pieces = [("reasoning", d.get("reasoning_content")), ("text", d.get("content"))]
            for kind, text in pieces:
                for s in ev.delta(kind, text or ""):
                    yield s
            if e.final:
                for s in ev.finish(e.finish_reason, usage_of(e)):
                    yield s
                return

    return _sse_response(ctx, [rid], events())
