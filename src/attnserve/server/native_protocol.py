"""Request bodies of the native routes (`attnserve.server.native_api`): ``/tokenize`` and
``/detokenize`` (the OpenAI-compatible servers' shapes) and SGLang's ``/generate``, plus the
mapping of SGLang's ``sampling_params`` names onto `SamplingParams`.

As on the OpenAI routes no field is silently dropped (`attnserve.server.request_fields`):
a field that SGLang defines but attnserve does not implement is accepted only at its
neutral value (else 400 ``unsupported_parameter``), any other field is 400
``unrecognized_request_argument``; both name the field in ``param``.

Sources (facts only): SGLang's ``io_struct.py::GenerateReqInput`` and
``sampling_params.py::SamplingParams`` and its "Sampling Parameters" and "Native APIs"
documentation; vLLM's ``TokenizeCompletionRequest`` / ``TokenizeChatRequest`` /
``DetokenizeRequest``.
"""

from __future__ import annotations

from typing import Any, ClassVar, Dict, List, Mapping, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from attnserve.server.errors import APIError
from attnserve.server.protocol import MAX_N, TOP_K_MAX, ChatMessage
from attnserve.server.request_fields import KnownField, Refusal, _table, refuse_extras

_STRICT = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
_NONE = (None,)
_FALSE = (None, False)

#: SGLang's ``sampling_params`` default ``max_new_tokens`` (clamped to what fits).
DEFAULT_MAX_NEW_TOKENS = 128
#: Most prompts in one ``/generate`` batch.
MAX_BATCH = 64

#: ``GenerateReqInput`` fields attnserve does not implement (neutral values accepted).
GENERATE_FIELDS: Mapping[str, KnownField] = _table(
    "SGLang",
    image_data=_NONE, audio_data=_NONE, video_data=_NONE, input_embeds=_NONE, modalities=_NONE,
    lora_path=_NONE, lora_id=_NONE, custom_logit_processor=_NONE, return_hidden_states=_FALSE,
    token_ids_logprob=_NONE, session_params=_NONE, bootstrap_host=_NONE, bootstrap_port=_NONE,
    bootstrap_room=_NONE, data_parallel_rank=_NONE, routed_dp_rank=_NONE, priority=(None, 0),
    log_metrics=(None, True, False), return_routed_experts=_FALSE, extra_key=_NONE, no_logs=(None, True, False),
)


class _Body(BaseModel):
    model_config = _STRICT
    known_extras: ClassVar[Mapping[str, KnownField]] = {}

    def refusal(self) -> Optional[Refusal]:
        return refuse_extras(self.model_extra, self.known_extras)


class GenerateRequest(_Body):
    """``POST /generate`` (SGLang's ``GenerateReqInput``). One of ``text`` (a string or a
    batch of strings) and ``input_ids`` (ids or a batch of id lists). The per-request
    fields (``sampling_params``, ``return_logprob``, ``top_logprobs_num``,
    ``logprob_start_len``, ``rid``) take one value for every prompt or a list of one per
    prompt."""

    text: Optional[Union[StrictStr, List[StrictStr]]] = None
    input_ids: Optional[Union[List[StrictInt], List[List[StrictInt]]]] = None
    sampling_params: Optional[Union[Dict[StrictStr, Any], List[Dict[StrictStr, Any]]]] = None
    stream: Optional[StrictBool] = False
    return_logprob: Optional[Union[StrictBool, List[StrictBool]]] = False
    top_logprobs_num: Optional[Union[StrictInt, List[StrictInt]]] = 0
    #: -1: logprobs of the output only; 0: of the whole prompt too (other starts are refused)
    logprob_start_len: Optional[Union[StrictInt, List[StrictInt]]] = -1
    return_text_in_logprobs: Optional[StrictBool] = False
    rid: Optional[Union[StrictStr, List[StrictStr]]] = None

    known_extras: ClassVar[Mapping[str, KnownField]] = GENERATE_FIELDS

    def prompts(self) -> List[Union[str, List[int]]]:
        """The prompts, a batch or one.

        Raises:
            APIError 400: neither or both of ``text`` / ``input_ids``, an empty batch, an
                empty prompt, or more than `MAX_BATCH` prompts."""
        if (self.text is None) == (self.input_ids is None):
            param = "text" if self.text is not None else "input_ids"
            raise APIError(400, "send exactly one of text and input_ids", param, "invalid_value")
        if self.text is not None:
            param, items = "text", ([self.text] if isinstance(self.text, str) else list(self.text))
        else:
            ids = self.input_ids
            param, items = "input_ids", (ids if ids and isinstance(ids[0], list) else [ids])
        if not items:
            raise APIError(400, f"{param} is an empty batch", param, "invalid_value")
        if len(items) > MAX_BATCH:
            raise APIError(400, f"{param} holds {len(items)} prompts; at most {MAX_BATCH} per request", param,
                           "invalid_value")
        for i, item in enumerate(items):
            if len(item) == 0:
                where = param if not self.is_batch() else f"{param}.{i}"
                raise APIError(400, f"{where} is empty; send at least one character or token", where, "invalid_value")
        return items

    def is_batch(self) -> bool:
        if self.text is not None:
            return not isinstance(self.text, str)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)

    def per_prompt(self, name: str, n: int) -> List[Any]:
        """Field ``name`` spread over ``n`` prompts (one value for all, or a list of ``n``).

        Raises:
            APIError 400: a list whose length is not ``n``."""
        value = getattr(self, name)
        if isinstance(value, list):
            if len(value) != n:
                raise APIError(400, f"{name} holds {len(value)} values for {n} prompts", name, "invalid_value")
            return list(value)
        return [value] * n


class TokenizeRequest(_Body):
    """``POST /tokenize``: ``prompt`` (text, tokenized with the tokenizer's special tokens
    unless ``add_special_tokens`` is false) or ``messages`` (rendered by the chat
    template with the chat-completions options, without extra special tokens unless
    ``add_special_tokens`` is true)."""

    model: Optional[StrictStr] = None
    prompt: Optional[StrictStr] = None
    messages: Optional[List[ChatMessage]] = Field(default=None, min_length=1)
    add_special_tokens: Optional[StrictBool] = None
    add_generation_prompt: Optional[StrictBool] = True
    continue_final_message: Optional[StrictBool] = False
    chat_template_kwargs: Optional[Dict[StrictStr, Any]] = None
    return_token_strs: Optional[StrictBool] = False

    known_extras: ClassVar[Mapping[str, KnownField]] = _table("vLLM", tools=(None, []), chat_template=_NONE,
                                                             mm_processor_kwargs=_NONE)

    def refusal(self) -> Optional[Refusal]:
        refused = super().refusal()
        for i, message in enumerate(self.messages or ()):
            if refused is not None:
                break
            refused = message.refusal(f"messages.{i}.")
        return refused


class DetokenizeRequest(_Body):
    """``POST /detokenize``: ``tokens`` (ids) back to text."""

    model: Optional[StrictStr] = None
    tokens: List[StrictInt]


# ---- SGLang sampling_params -> SamplingParams ---------------------------------------------------
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_str_or_strs(v) -> bool:
    return isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v))


#: SGLang name -> (SamplingParams field, type check, what the type is)
_SAMPLING_MAP = {
    "max_new_tokens": ("max_new_tokens", _is_int, "an integer"),
    "min_new_tokens": ("min_tokens", _is_int, "an integer"),
    "temperature": ("temperature", _is_num, "a number"),
    "top_p": ("top_p", _is_num, "a number"),
    "top_k": ("top_k", lambda v: _is_int(v) and v <= TOP_K_MAX, f"an integer of at most {TOP_K_MAX}"),
    "min_p": ("min_p", _is_num, "a number"),
    "frequency_penalty": ("frequency_penalty", _is_num, "a number"),
    "presence_penalty": ("presence_penalty", _is_num, "a number"),
    "repetition_penalty": ("repetition_penalty", _is_num, "a number"),
    "stop": ("stop", _is_str_or_strs, "a string or a list of strings"),
    "stop_token_ids": ("stop_token_ids", lambda v: isinstance(v, list) and all(_is_int(t) for t in v),
                       "a list of token ids"),
    "ignore_eos": ("ignore_eos", lambda v: isinstance(v, bool), "true or false"),
    "skip_special_tokens": ("skip_special_tokens", lambda v: isinstance(v, bool), "true or false"),
    "sampling_seed": ("seed", _is_int, "an integer"),
    "n": ("n", lambda v: _is_int(v) and 1 <= v <= MAX_N, f"an integer in [1, {MAX_N}]"),
    "logit_bias": ("logit_bias", lambda v: isinstance(v, dict) and all(
        isinstance(k, str) and k.lstrip("-").isdigit() and _is_num(x) for k, x in v.items()),
        "an object of token id -> number"),
    "json_schema": ("json_schema", lambda v: isinstance(v, (str, dict)), "a string or an object"),
    "regex": ("regex", lambda v: isinstance(v, str), "a string"),
    "ebnf": ("ebnf", lambda v: isinstance(v, str), "a string"),
}
#: SGLang sampling params attnserve does not implement: their neutral values.
_SAMPLING_NEUTRAL = {
    "spaces_between_special_tokens": (None, True),
    "no_stop_trim": _FALSE, "structural_tag": _NONE, "custom_params": _NONE, "stream_interval": _NONE,
}
_GRAMMARS = ("json_schema", "regex", "ebnf")


def sampling_kwargs(params: Optional[Dict[str, Any]], param: str = "sampling_params") -> Dict[str, Any]:
    """`SamplingParams` keyword arguments from SGLang's ``sampling_params`` dict (the
    grammar fields are returned as given; `attnserve.server.native_api` parses them).

    Args:
        params: the dict (None: all defaults).
        param: its dotted name in the request (``"sampling_params"`` or
            ``"sampling_params.1"`` in a batch), for the error's ``param``.

    Raises:
        APIError 400: an unknown name (``unrecognized_request_argument``), a known one at a
            value attnserve cannot honour (``unsupported_parameter``), a value of the wrong
            JSON type (``invalid_value``); ``param`` is ``<param>.<name>``.
    """
    from attnserve.server.request_fields import is_neutral, unsupported

    out: Dict[str, Any] = {}
    for name, value in (params or {}).items():
        where = f"{param}.{name}"
        if name in _SAMPLING_NEUTRAL:
            if not is_neutral(value, _SAMPLING_NEUTRAL[name]):
                r = unsupported(where, value, "SGLang", "leave it out")
                raise APIError(400, r.message, r.param, r.code)
            continue
        spec = _SAMPLING_MAP.get(name)
        if spec is None:
            raise APIError(400, f"unknown sampling parameter {where}; attnserve takes "
                                f"{', '.join(sorted(_SAMPLING_MAP))}", where, "unrecognized_request_argument")
        field, ok, kind = spec
        if value is None:
            continue
        if not ok(value):
            raise APIError(400, f"{where} must be {kind}, got {value!r:.60}", where, "invalid_value")
        if field == "logit_bias":
            value = {int(k): float(x) for k, x in value.items()}
        out[field] = value
    return out


def grammar_view(kwargs: Dict[str, Any]):
    """An object with the grammar attributes `attnserve.server.grammar_request.request_grammar`
    reads (``response_format`` None, ``json_schema``, ``regex``, ``ebnf``)."""
    from types import SimpleNamespace

    return SimpleNamespace(response_format=None, **{g: kwargs.get(g) for g in _GRAMMARS})
