"""``POST /v1/responses`` (OpenAI's Responses API): the request schema, its reading into a chat
request, and the response objects (`attnserve.server.responses_api` serves the route).

**Honoured**: ``model``, ``input`` (a string: one user message; or a list of message items
``{"role": "user"|"system"|"developer"|"assistant", "content": str | [parts]}``, with or
without ``"type": "message"`` and the ``id`` / ``status`` of an earlier output; parts are
``input_text`` / ``output_text``), ``instructions`` (a system message placed first, as vLLM
does), ``max_output_tokens``, ``temperature``, ``top_p``, ``stream``, ``text.format``
(``text``, ``json_object``, ``json_schema``: the chat route's ``response_format`` grammars),
and the chat route's SGLang/vLLM sampling extensions (``top_k``, ``min_p``, ``seed``,
``stop``, ``stop_token_ids``, ``ignore_eos``, ``repetition_penalty``, ``presence_penalty``,
``frequency_penalty``, ``min_tokens``, ``logit_bias``).

**Accepted, changing no output**: ``user``, ``safety_identifier``, ``prompt_cache_key``,
``metadata`` (checked as on chat, echoed), ``parallel_tool_calls`` (echoed; no tools are
served), ``tool_choice`` ``"none"`` / ``"auto"`` without tools, ``truncation: "disabled"``,
``stream_options.include_obfuscation: false``, and ``store`` (``true``, ``false`` or absent):
attnserve keeps no state, so, as vLLM does without ``VLLM_ENABLE_RESPONSES_API_STORE``, a
``store: true`` request (OpenAI's default) is served without storing anything and the
response says ``"store": false``.

**Refused** with a 400 naming the field (no silent drops, `attnserve.server.request_fields`):
``previous_response_id`` and ``conversation`` (nothing is stored to continue; send the earlier
turns in ``input``), ``background: true`` (needs a store), ``tools`` / forcing ``tool_choice``
(use ``/v1/chat/completions``), a non-null ``reasoning`` (no reasoning effort can be set; a
server with ``--reasoning-parser`` returns the thinking as a ``reasoning`` output item
anyway), ``truncation: "auto"`` (a prompt that does not fit is a 400, never cut),
``top_logprobs`` > 0 and ``include``, ``text.verbosity``, input items other than messages
(``function_call``, ``reasoning``, ``item_reference`` ...) and image/file/audio parts.

Sources (facts only): the OpenAI API reference (Responses: create, the response object,
streaming events); vLLM ``vllm/entrypoints/openai/serving_responses.py`` and ``protocol.py``
(``ResponsesRequest``, the store fallback, ``instructions`` as the first system message).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, ClassVar, Dict, List, Mapping, Optional, Tuple, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator

from attnserve.server.errors import APIError
from attnserve.server.protocol import (
    MAX_CHAT_TOP_LOGPROBS,
    MAX_STOP_TOKEN_IDS,
    METADATA_MAX_KEY,
    METADATA_MAX_PAIRS,
    METADATA_MAX_VALUE,
    SEED_MAX,
    SEED_MIN,
    TOP_K_MAX,
)
from attnserve.server.request_fields import (
    STREAM_OPTIONS_FIELDS,
    UNRECOGNIZED,
    UNSUPPORTED,
    KnownField,
    Refusal,
    refuse_extras,
    unsupported,
)

_STRICT = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
_MetadataKey = Annotated[StrictStr, Field(max_length=METADATA_MAX_KEY)]
_MetadataValue = Annotated[StrictStr, Field(max_length=METADATA_MAX_VALUE)]
_BiasValue = Annotated[float, Field(ge=-100.0, le=100.0)]


def _known(origin: str, **fields: Tuple[Any, ...]) -> Dict[str, KnownField]:
    return {name: KnownField(neutral, origin) for name, neutral in fields.items()}


#: Fields of the endpoint that attnserve does not implement, accepted at their neutral value.
RESPONSES_FIELDS: Mapping[str, KnownField] = {
    **_known("OpenAI", conversation=(None,), prompt=(None,), max_tool_calls=(None,),
             service_tier=(None, "auto", "default"), prompt_cache_retention=(None,)),
    **_known("SGLang/vLLM", request_id=(None,), priority=(None, 0), cache_salt=(None,), mm_processor_kwargs=(None,),
             enable_response_messages=(None, False), previous_input_messages=(None,)),
}

#: The chat fields a responses request passes on under the same name.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
                   "repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens", "logit_bias", "user")

_ROLES = ("user", "system", "developer", "assistant")
_ITEM_KEYS = ("type", "role", "content", "id", "status")
_PART_KEYS = {"input_text": ("type", "text"), "output_text": ("type", "text", "annotations", "logprobs")}
_OTHER_PARTS = ("input_image", "input_file", "input_audio", "refusal")
_FORMATS = ("text", "json_object", "json_schema")


def _bad(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param, code)


class ResponsesRequest(BaseModel):
    """``POST /v1/responses`` (see the module doc for what is honoured and what is refused)."""

    model_config = _STRICT
    known_extras: ClassVar[Mapping[str, KnownField]] = RESPONSES_FIELDS

    model: Optional[StrictStr] = None
    input: Union[StrictStr, List[Any]]
    instructions: Optional[StrictStr] = None
    max_output_tokens: Optional[StrictInt] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    stream: Optional[StrictBool] = False
    stream_options: Optional[Dict[StrictStr, Any]] = None
    text: Optional[Dict[StrictStr, Any]] = None
    user: Optional[StrictStr] = None
    safety_identifier: Optional[StrictStr] = None
    prompt_cache_key: Optional[StrictStr] = None
    metadata: Optional[Dict[_MetadataKey, _MetadataValue]] = Field(default=None, max_length=METADATA_MAX_PAIRS)
    store: Optional[StrictBool] = None
    background: Optional[StrictBool] = None
    previous_response_id: Optional[StrictStr] = None
    tools: Optional[List[Any]] = None
    tool_choice: Optional[Any] = None
    parallel_tool_calls: Optional[StrictBool] = None
    reasoning: Optional[Dict[StrictStr, Any]] = None
    truncation: Optional[StrictStr] = None
    top_logprobs: Optional[StrictInt] = Field(default=None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)
    include: Optional[List[StrictStr]] = None
    # the chat route's SGLang/vLLM sampling extensions (attnserve.server.protocol._SamplingFields)
    top_k: Optional[StrictInt] = Field(default=None, le=TOP_K_MAX)
    min_p: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    seed: Optional[StrictInt] = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: Optional[Union[StrictStr, List[StrictStr]]] = None
    stop_token_ids: Optional[List[StrictInt]] = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: Optional[StrictBool] = None
    repetition_penalty: Optional[float] = Field(default=None, gt=0.0)
    presence_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    min_tokens: Optional[StrictInt] = Field(default=None, ge=0)
    logit_bias: Optional[Dict[StrictStr, _BiasValue]] = None

    @field_validator("truncation")
    @classmethod
    def _truncation_value(cls, v):
        if v is not None and v not in ("auto", "disabled"):
            raise ValueError(f"must be 'auto' or 'disabled', got {v!r:.40}")
        return v

    def stop_list(self) -> List[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def refusal(self) -> Optional[Refusal]:
        """The first field attnserve cannot honour (unknown, or known and not neutral), else None."""
        refused = refuse_extras(self.model_extra, self.known_extras) or self._declared_refusal()
        if refused is None and self.stream_options is not None:
            refused = refuse_extras(self.stream_options, STREAM_OPTIONS_FIELDS, "stream_options.")
        return refused

    def _declared_refusal(self) -> Optional[Refusal]:
        if self.previous_response_id is not None:
            return Refusal("previous_response_id", UNSUPPORTED,
                           f"previous_response_id={self.previous_response_id!r:.70} cannot be served: attnserve stores "
                           "no responses (every response has store false), so there is no earlier response to "
                           "continue; send the earlier turns as messages in input instead")
        if self.background:
            return unsupported("background", True, hint="background responses need a response store, which "
                                                        "attnserve does not keep; leave it out or send false")
        if self.tools:
            return unsupported("tools", self.tools, hint="/v1/responses serves text generation only; for tool "
                                                         "calling use /v1/chat/completions with tools")
        if self.tool_choice not in (None, "none", "auto"):
            return unsupported("tool_choice", self.tool_choice, hint="without tools only 'none' or 'auto' apply; "
                                                                     "leave it out")
        if self.reasoning is not None and any(v is not None for v in self.reasoning.values()):
            return unsupported("reasoning", self.reasoning,
                               hint="attnserve cannot set a reasoning effort or summaries; leave it out (a server "
                                    "started with --reasoning-parser returns the model's thinking as a reasoning "
                                    "output item)")
        if self.truncation == "auto":
            return unsupported("truncation", "auto", hint="attnserve never truncates the input (a prompt that "
                                                          "does not fit is a 400); leave it out or send 'disabled'")
        if self.top_logprobs:
            return unsupported("top_logprobs", self.top_logprobs, hint="leave it out or send 0")
        if self.include:
            return unsupported("include", self.include, hint="leave it out or send []")
        return self._text_refusal()

    def _text_refusal(self) -> Optional[Refusal]:
        for key, value in (self.text or {}).items():
            if key == "verbosity" and value is not None:
                return unsupported("text.verbosity", value, hint="leave it out or send null")
            if key not in ("format", "verbosity"):
                return Refusal(f"text.{key}", UNRECOGNIZED, f"Unrecognized request argument supplied: text.{key}")
        return None

    def text_format(self) -> Dict[str, Any]:
        """``text.format`` as sent (checked), ``{"type": "text"}`` without one.

        Raises:
            APIError 400 naming ``text.format`` (or the offending key of it).
        """
        fmt = (self.text or {}).get("format")
        if fmt is None:
            return {"type": "text"}
        if not isinstance(fmt, dict):
            raise _bad("text.format", "text.format must be an object such as {\"type\": \"json_object\"}")
        kind = fmt.get("type")
        if kind not in _FORMATS:
            raise _bad("text.format.type", f"text.format.type must be 'text', 'json_object' or 'json_schema', "
                                           f"got {kind!r:.40}")
        allowed = ("type", "name", "schema", "description", "strict") if kind == "json_schema" else ("type",)
        for key in fmt:
            if key not in allowed:
                raise _bad(f"text.format.{key}", f"Unrecognized request argument supplied: text.format.{key}",
                           UNRECOGNIZED)
        return fmt

    def response_format(self) -> Optional[Dict[str, Any]]:
        """The chat route's ``response_format`` of ``text.format`` (None for plain text)."""
        fmt = self.text_format()
        if fmt["type"] == "text":
            return None
        if fmt["type"] == "json_object":
            return {"type": "json_object"}
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}

    def chat_fields(self) -> Dict[str, Any]:
        """The body of the equivalent ``/v1/chat/completions`` request (see `input_messages`)."""
        chat: Dict[str, Any] = {"messages": input_messages(self), "stream": bool(self.stream)}
        if self.model is not None:
            chat["model"] = self.model
        for name in SAMPLING_FIELDS:
            value = getattr(self, name)
            if value is not None:
                chat[name] = value
        if self.max_output_tokens is not None:
            chat["max_completion_tokens"] = self.max_output_tokens
        rf = self.response_format()
        if rf is not None:
            chat["response_format"] = rf
        return chat


def input_messages(body: ResponsesRequest) -> List[Dict[str, str]]:
    """The conversation of ``instructions`` + ``input`` as chat messages (``{"role", "content"}``).

    Raises:
        APIError 400 naming the item or part (``input.2.content.0.type`` ...): empty input,
            items that are not messages, unknown roles, parts that are not text, unknown keys.
    """
    messages = [] if body.instructions is None else [{"role": "system", "content": body.instructions}]
    if isinstance(body.input, str):
        if not body.input:
            raise _bad("input", "input must not be empty: send a string or a list of messages")
        return messages + [{"role": "user", "content": body.input}]
    if not body.input:
        raise _bad("input", "input must not be empty: send a string or a list of messages")
    for i, item in enumerate(body.input):
        messages.append({"role": _item_role(f"input.{i}", item), "content": _item_text(f"input.{i}", item)})
    return messages


def _item_role(p: str, item: Any) -> str:
    if not isinstance(item, dict):
        raise _bad(p, f"{p} must be a message object {{\"role\": ..., \"content\": ...}}, got {type(item).__name__}")
    kind = item.get("type", "message")
    if kind != "message":
        if isinstance(kind, str):
            raise _bad(f"{p}.type", f"{p}.type={kind!r:.40} is not supported by attnserve: input takes message "
                                    f"items only (role and content; no tool calls, reasoning or item references)",
                       UNSUPPORTED)
        raise _bad(f"{p}.type", f"{p}.type must be 'message'")
    for key in item:
        if key not in _ITEM_KEYS:
            raise _bad(f"{p}.{key}", f"Unrecognized request argument supplied: {p}.{key}", UNRECOGNIZED)
    role = item.get("role")
    if role not in _ROLES:
        raise _bad(f"{p}.role", f"{p}.role must be one of {', '.join(repr(r) for r in _ROLES)}, got {role!r:.40}")
    return role


def _item_text(p: str, item: Dict[str, Any]) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{p}.content", f"{p}.content must be a string or a list of input_text / output_text parts")
    texts = []
    for j, part in enumerate(content):
        q = f"{p}.content.{j}"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _PART_KEYS:
            if kind in _OTHER_PARTS:
                raise _bad(f"{q}.type", f"{q}.type={kind!r} is not supported by attnserve (text models only); "
                                        f"send input_text parts", UNSUPPORTED)
            raise _bad(f"{q}.type" if isinstance(part, dict) else q,
                       f"{q} must be a part {{\"type\": \"input_text\" or \"output_text\", \"text\": ...}}")
        for key in part:
            if key not in _PART_KEYS[kind]:
                raise _bad(f"{q}.{key}", f"Unrecognized request argument supplied: {q}.{key}", UNRECOGNIZED)
        if not isinstance(part.get("text"), str):
            raise _bad(f"{q}.text", f"{q}.text must be a string")
        texts.append(part["text"])
    return "".join(texts)


# ---- response objects ------------------------------------------------------------------------
def new_item_id(prefix: str) -> str:
    """OpenAI-style ids: ``resp_<hex>``, ``msg_<hex>``, ``rs_<hex>``."""
    return f"{prefix}_{uuid.uuid4().hex}"


def usage_object(input_tokens: int, output_tokens: int, cached_tokens: int) -> Dict[str, Any]:
    """``usage`` of a response. ``reasoning_tokens`` is 0: the engine does not count the
    thinking's tokens apart (a ``--reasoning-parser`` splits text, not tokens)."""
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


def message_item(item_id: str, text: str, status: str) -> Dict[str, Any]:
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def reasoning_item(item_id: str, text: str, status: str) -> Dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def status_of(finish_reason: Optional[str]) -> Tuple[str, Optional[Dict[str, Any]]]:
    """``(status, incomplete_details)`` of a response whose generation ended so: ``length``
    is ``incomplete`` with reason ``max_output_tokens`` (the request's limit, or the rest of
    the context), an abort ``incomplete`` without a reason, else ``completed``."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "abort":
        return "incomplete", None
    return "completed", None


def response_object(body: ResponsesRequest, rid: str, created_at: int, model: str, status: str,
                    output: List[Dict[str, Any]], usage: Optional[Dict[str, Any]] = None,
                    incomplete_details: Optional[Dict[str, Any]] = None,
                    error: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """OpenAI's response object, echoing the request's settings (defaults where it sent none)."""
    return {
        "id": rid, "object": "response", "created_at": created_at, "status": status, "background": False,
        "completed_at": int(time.time()) if status == "completed" else None,
        "error": error, "incomplete_details": incomplete_details, "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens, "max_tool_calls": None, "metadata": body.metadata or {},
        "model": model, "output": output, "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": None, "reasoning": {"effort": None, "summary": None}, "service_tier": "default",
        "store": False, "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": {"format": body.text_format(), "verbosity": None},
        "tool_choice": body.tool_choice if body.tool_choice is not None else "auto", "tools": [],
        "top_logprobs": 0, "top_p": 1.0 if body.top_p is None else body.top_p, "truncation": "disabled",
        "usage": usage, "user": body.user, "safety_identifier": body.safety_identifier,
        "prompt_cache_key": body.prompt_cache_key,
    }
