"""Which request fields attnserve refuses, and how: the "no silent drops" rule.

Every field of a ``/v1/completions`` or ``/v1/chat/completions`` body is either honoured or
refused with HTTP 400 naming it (``param``); nothing is accepted and then ignored. The
request models (`attnserve.server.protocol`) declare the fields attnserve honours, plus a
few OpenAI fields it accepts only at their neutral value; they keep any other field aside
(pydantic ``extra="allow"``), and `refuse_extras` sorts those with the tables below:

* a field that OpenAI, SGLang or vLLM defines for this endpoint but attnserve does not
  implement: accepted at a neutral value (one that asks for the default behaviour, e.g.
  ``length_penalty: 1.0``, ``prompt_logprobs: null``, ``guided_regex: null``), else 400 with code
  ``unsupported_parameter``;
* any other field: 400 with OpenAI's code ``unrecognized_request_argument`` and message
  "Unrecognized request argument supplied: <name>".

Sources (facts only): the OpenAI API reference for chat completions and completions;
SGLang ``python/sglang/srt/entrypoints/openai/protocol.py`` (``CompletionRequest``,
``ChatCompletionRequest``, ``StreamOptions``, chat message params); vLLM
``vllm/entrypoints/openai/protocol.py`` (the ``*-sampling-params`` and ``*-extra-params``
blocks of the same requests). Fields that attnserve honours (``top_k``, ``min_p``,
``stop_token_ids``, ``ignore_eos``, ``repetition_penalty``, ``min_tokens``, chat's
``top_logprobs``, the grammars ``response_format``, ``json_schema``, ``regex``, ``ebnf``
...) are declared on the models, not listed here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Tuple

UNSUPPORTED = "unsupported_parameter"
UNRECOGNIZED = "unrecognized_request_argument"

#: Neutral values: None (the field absent) and nothing else.
_NONE: Tuple[Any, ...] = (None,)
_FALSE: Tuple[Any, ...] = (None, False)
_TRUE: Tuple[Any, ...] = (None, True)


@dataclass(frozen=True)
class KnownField:
    """A field some API defines that attnserve does not implement.

    Attributes:
        neutral: values that ask for what attnserve does anyway (accepted).
        origin: ``"OpenAI"`` or ``"SGLang/vLLM"`` (named in the error message).
    """

    neutral: Tuple[Any, ...]
    origin: str


def _table(origin: str, **fields: Tuple[Any, ...]) -> Mapping[str, KnownField]:
    return {name: KnownField(neutral, origin) for name, neutral in fields.items()}


# ---- SGLang / vLLM extensions of both endpoints -----------------------------------------
_EXT_COMMON = _table(
    "SGLang/vLLM",
    # sampling and stopping
    length_penalty=(None, 1.0), use_beam_search=_FALSE,
    no_stop_trim=_FALSE, include_stop_str_in_output=_FALSE, stop_regex=_NONE, bad_words=(None, []),
    allowed_token_ids=_NONE, truncate_prompt_tokens=_NONE, prompt_logprobs=_NONE,
    logits_processors=_NONE, custom_logit_processor=_NONE, custom_params=_NONE, vllm_xargs=_NONE,
    # detokenisation (skip_special_tokens is a declared field: server/protocol.py)
    spaces_between_special_tokens=_TRUE,
    # constrained decoding
    structural_tag=_NONE, structured_outputs=_NONE,
    guided_json=_NONE, guided_regex=_NONE, guided_choice=_NONE, guided_grammar=_NONE,
    guided_decoding_backend=_NONE, guided_whitespace_pattern=_NONE,
    # extra outputs
    return_hidden_states=_FALSE, return_routed_experts=_FALSE, routed_experts_start_len=(None, 0),
    return_cached_tokens_details=_FALSE, return_token_ids=_FALSE, return_tokens_as_token_ids=_FALSE,
    # adapters, sessions, scheduling, routing, disaggregation
    lora_path=_NONE, session_id=_NONE, session_params=_NONE, rid=_NONE, request_id=_NONE, priority=(None, 0),
    extra_key=_NONE, cache_salt=_NONE, ngram_corpus_id=_NONE, custom_labels=_NONE, images_config=_NONE,
    bootstrap_host=_NONE, bootstrap_port=_NONE, bootstrap_room=_NONE, routed_dp_rank=_NONE,
    data_parallel_rank=_NONE, disagg_prefill_dp_rank=_NONE, kv_transfer_params=_NONE,
)

#: Extensions of ``/v1/completions`` only. ``tokenizer.encode`` adds the tokenizer's special
#: tokens (BOS), so ``add_special_tokens: true`` is what attnserve does.
_EXT_COMPLETION = _table(
    "SGLang/vLLM",
    add_special_tokens=_TRUE, prompt_embeds=_NONE,
)

#: Extensions of ``/v1/chat/completions`` only. The chat template is applied without extra
#: special tokens; ``add_generation_prompt``, ``continue_final_message`` and
#: ``chat_template_kwargs`` are declared fields (`attnserve.server.chat_template`).
_EXT_CHAT = _table(
    "SGLang/vLLM",
    add_special_tokens=_FALSE,
    chat_template=_NONE, documents=_NONE, mm_processor_kwargs=_NONE,
    media_io_kwargs=_NONE, max_dynamic_patch=_NONE, min_dynamic_patch=_NONE, use_audio_in_video=_FALSE,
    input_ids=_NONE, task=_NONE, reasoning=_NONE, separate_reasoning=_FALSE, stream_reasoning=_TRUE,
    include_reasoning=_TRUE, return_prompt_token_ids=_FALSE, return_meta_info=_FALSE, echo=_FALSE,
    best_of=(None, 1),
)

#: OpenAI chat fields attnserve does not implement and the models do not declare.
#: ``parallel_tool_calls`` is honoured by forced calls (`attnserve.server.tool_request`);
#: ``service_tier`` "auto"/"default" asks for ordinary processing.
_OPENAI_CHAT = _table(
    "OpenAI",
    reasoning_effort=_NONE, audio=_NONE, modalities=(None, ["text"]), prediction=_NONE,
    service_tier=(None, "auto", "default"), functions=(None, []), function_call=(None, "none", "auto"),
    web_search_options=_NONE, verbosity=_NONE, parallel_tool_calls=(None, True, False),
)

COMPLETION_FIELDS: Mapping[str, KnownField] = {**_EXT_COMMON, **_EXT_COMPLETION}
CHAT_FIELDS: Mapping[str, KnownField] = {**_EXT_COMMON, **_EXT_CHAT, **_OPENAI_CHAT}

#: Fields of one chat message (OpenAI's assistant message fields; SGLang's
#: ``reasoning_content`` and message-level ``tools``). ``tool_calls`` and ``tool_call_id``
#: are declared on `ChatMessage`.
MESSAGE_FIELDS: Mapping[str, KnownField] = {
    **_table("OpenAI", function_call=_NONE, refusal=_NONE, audio=_NONE),
    **_table("SGLang/vLLM", reasoning_content=_NONE, tools=_NONE),
}

#: ``stream_options`` beside ``include_usage`` and vLLM's ``continuous_usage_stats`` (both
#: declared on `attnserve.server.protocol.StreamOptions`). attnserve adds no obfuscation padding.
STREAM_OPTIONS_FIELDS: Mapping[str, KnownField] = _table("OpenAI", include_obfuscation=_FALSE)

#: Nothing beside ``type`` and ``text`` in a text content part.
NO_FIELDS: Mapping[str, KnownField] = {}


@dataclass(frozen=True)
class Refusal:
    """Why a request is refused (answered as HTTP 400 ``invalid_request_error``).

    Attributes:
        param: the offending field, dotted for nested ones (``"messages.0.tool_calls"``).
        code: `UNSUPPORTED` or `UNRECOGNIZED`.
        message: one sentence for the client.
    """

    param: str
    code: str
    message: str


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_neutral(value: Any, neutral: Tuple[Any, ...]) -> bool:
    """True when ``value`` equals one of ``neutral`` with a matching JSON type: booleans
    match only booleans (``true`` is not ``1``), numbers match numbers (``1`` is ``1.0``)."""
    for n in neutral:
        if n is None or value is None:
            if n is value:
                return True
            continue
        if isinstance(value, bool) or isinstance(n, bool):
            if value is n:
                return True
            continue
        numbers = isinstance(value, (int, float)) and isinstance(n, (int, float))
        if (numbers or type(value) is type(n)) and value == n:
            return True
    return False


def unsupported(param: str, value: Any, origin: str = "OpenAI", hint: str = "") -> Refusal:
    """The refusal of a known field set to a value attnserve cannot honour."""
    what = f"{param}={_short(value)}"
    if origin != "OpenAI":
        what += f" (an {origin} extension)"
    return Refusal(param, UNSUPPORTED, f"{what} is not supported by attnserve; {hint or 'leave it out'}")


def refuse_extras(extras: Optional[Mapping[str, Any]], known: Mapping[str, KnownField],
                  prefix: str = "") -> Optional[Refusal]:
    """The first refused field among ``extras`` (the fields a model did not declare), in
    request order; None when every one is known and neutral.

    Args:
        extras: ``model.model_extra`` (name -> raw JSON value), or None.
        known: the table of the endpoint or nested object (`CHAT_FIELDS` ...).
        prefix: dotted path of the object (``"messages.0."``), prepended to ``param``.
    """
    for name, value in (extras or {}).items():
        param = prefix + name
        field = known.get(name)
        if field is None:
            return Refusal(param, UNRECOGNIZED, f"Unrecognized request argument supplied: {param}")
        if not is_neutral(value, field.neutral):
            neutral = " or ".join("null" if n is None else _short(n) for n in field.neutral)
            return unsupported(param, value, field.origin, f"leave it out or send {neutral}")
    return None


def check_unicode(body) -> None:
    """400 ``invalid_value`` naming the field when any text of the request (prompt,
    messages, stop strings, model, user ...) is not valid Unicode: a lone UTF-16 surrogate,
    which JSON's ``\\uD800`` escapes can carry but UTF-8 cannot encode, so it could reach
    neither the tokenizer nor a response."""
    from attnserve.server.errors import APIError

    for name, value in body:
        where = lone_surrogate(value)
        if where is not None:
            raise APIError(400, f"{name} is not valid Unicode: a lone surrogate at character {where} of a string",
                           name, "invalid_value")


def lone_surrogate(value) -> Optional[int]:
    """Index of the first lone surrogate in the first string inside ``value`` (strings,
    lists, dicts, pydantic models, nested) that has one; None when all text is valid."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return e.start
        return None
    if isinstance(value, dict):
        items = [x for kv in value.items() for x in kv]
    elif isinstance(value, (list, tuple)):
        if _no_text(value):  # token ids: nothing to check (a 1,000-id prompt in ~5 us, not ~0.5 ms)
            return None
        items = value
    elif hasattr(value, "model_fields_set"):  # a nested pydantic model (a chat message, a content part)
        items = [v for _, v in value]
    else:
        return None
    for item in items:
        where = lone_surrogate(item)
        if where is not None:
            return where
    return None


_PLAIN = frozenset((int, float, bool, type(None)))


def _no_text(values) -> bool:
    """True when ``values`` holds only numbers, booleans and nulls (a token-id prompt), so
    it can hold no string; one pass over the element types at C speed."""
    return set(map(type, values)) <= _PLAIN
