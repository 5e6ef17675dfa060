"""OpenAI-compatible request and response schemas (pydantic v2).

Requests are validated strictly: a JSON string where a number is expected, a number
where a boolean is expected, ``NaN``/``Infinity`` and values out of range are errors
(HTTP 400 with an OpenAI-style error body, see `attnserve.server.errors`).

No field is silently dropped (`attnserve.server.request_fields`): every field is honoured
or refused with a 400 naming it (``param``). OpenAI fields that attnserve does not
implement (``suffix``, ``reasoning_effort`` ...) and the SGLang/vLLM extensions
it does not implement (``guided_json``, ``structural_tag``, ``lora_path``,
``documents`` ...) are accepted only at their neutral value, else code
``unsupported_parameter``; a field that none of these APIs defines gets
``unrecognized_request_argument``. The request models keep undeclared fields aside
(``extra="allow"``) and `CompletionRequest.refusal` /
`ChatCompletionRequest.refusal` sort them in one pass after validation.

Logprobs and logit controls (`attnserve.engine.logprobs`, `attnserve.engine.penalties`):
chat ``logprobs`` + ``top_logprobs`` (<= 20), completions ``logprobs`` (<= 5) and ``echo``
(with ``logprobs``: the prompt's logprobs too); ``presence_penalty``,
``frequency_penalty`` ([-2, 2]) and ``logit_bias`` (token id -> [-100, 100]) on both.

Extensions beyond OpenAI that attnserve honours (SGLang/vLLM names): ``top_k``, ``min_p``,
``ignore_eos``, ``stop_token_ids``, ``repetition_penalty`` (> 0), ``min_tokens``; constrained
decoding: ``response_format`` (also on completions), ``json_schema``, ``regex``, ``ebnf``
(`attnserve.server.grammar_request`); chat-template control: ``add_generation_prompt``,
``continue_final_message``, ``chat_template_kwargs`` (`attnserve.server.chat_template`).
vLLM's ``stop_reason`` is on every choice (`StopReason`) and ``stream_options`` takes vLLM's
``continuous_usage_stats`` (`StreamOptions`). Accepted as OpenAI accepts them and changing no output:
``user`` (both endpoints); ``store``, ``metadata``, ``safety_identifier`` and
``prompt_cache_key`` (chat; see `ChatCompletionRequest`).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, ClassVar, Dict, List, Literal, Mapping, Optional, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    field_validator,
    model_serializer,
    model_validator,
)

from attnserve.server.request_fields import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    MESSAGE_FIELDS,
    NO_FIELDS,
    STREAM_OPTIONS_FIELDS,
    KnownField,
    Refusal,
    refuse_extras,
    unsupported,
)

#: OpenAI allows 4 stop sequences; attnserve allows this many (each is checked per token).
MAX_STOP_SEQUENCES = 16
#: Longest accepted stop string, in characters.
MAX_STOP_LEN = 256
#: ``max_tokens`` of a completion that sets none (OpenAI's default), clamped to what fits.
DEFAULT_COMPLETION_MAX_TOKENS = 16
#: Most parallel samples (``n``) of one request.
MAX_N = 16
#: most prompts in one ``/v1/completions`` batch (OpenAI's limit for a prompt array)
MAX_COMPLETION_PROMPTS = 2048
#: Most accepted ``stop_token_ids``.
MAX_STOP_TOKEN_IDS = 64
#: Seeds must fit a signed 64-bit integer, as `SamplingParams` requires (the sampler's int64 seeds).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
#: Largest ``top_k``: the sampler holds it in an int64 (a larger one failed the engine step,
#: a 500 for every request of the batch); any ``top_k`` >= the vocabulary keeps every token.
TOP_K_MAX = 2**63 - 1
#: OpenAI's ``metadata`` limits: pairs, key and value length in characters.
METADATA_MAX_PAIRS, METADATA_MAX_KEY, METADATA_MAX_VALUE = 16, 64, 512

#: Undeclared fields are kept (``model_extra``) for `refuse_extras`, never dropped.
_STRICT = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
#: OpenAI's limits: ``top_logprobs`` of chat, ``logprobs`` of completions.
MAX_CHAT_TOP_LOGPROBS, MAX_COMPLETION_LOGPROBS = 20, 5
_BiasValue = Annotated[float, Field(ge=-100.0, le=100.0)]


class StreamOptions(BaseModel):
    """``stream_options`` of a streamed request. ``include_usage``: a last chunk (``choices``
    empty) with the request's usage. ``continuous_usage_stats`` (vLLM's extension; honoured,
    as in vLLM, only together with ``include_usage``): every chunk that has choices also
    carries ``usage`` for the one choice it holds: ``prompt_tokens`` of that choice's prompt,
    ``completion_tokens`` that choice generated so far (0 on chat's first ``role`` chunk and
    under ``echo`` with ``max_tokens: 0``), ``total_tokens`` their sum
    (`attnserve.server.choice_extras`). With ``n`` > 1 or a batch of prompts each chunk counts
    its own choice only, as vLLM does; the last usage chunk still sums all choices."""

    model_config = _STRICT
    known_extras: ClassVar[Mapping[str, KnownField]] = STREAM_OPTIONS_FIELDS
    include_usage: Optional[StrictBool] = False
    continuous_usage_stats: Optional[StrictBool] = False


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = _STRICT

    model: Optional[StrictStr] = None
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)  # OpenAI's range
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    top_k: Optional[StrictInt] = Field(default=None, le=TOP_K_MAX)
    min_p: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    stop: Optional[Union[StrictStr, List[StrictStr]]] = None
    stop_token_ids: Optional[List[StrictInt]] = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    n: Optional[StrictInt] = Field(default=1, ge=1, le=MAX_N)
    seed: Optional[StrictInt] = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stream: Optional[StrictBool] = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: Optional[StrictBool] = False
    #: An end-user id (OpenAI's abuse-monitoring tag); accepted, changes no output.
    user: Optional[StrictStr] = None
    # constrained decoding, at most one of them (attnserve.server.grammar_request)
    response_format: Optional[Dict[str, Any]] = None
    json_schema: Optional[Union[StrictStr, Dict[str, Any]]] = None
    regex: Optional[StrictStr] = None
    ebnf: Optional[StrictStr] = None
    # logit controls (attnserve.engine.penalties); the last two are SGLang/vLLM extensions
    presence_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: Optional[Dict[StrictStr, _BiasValue]] = None
    repetition_penalty: Optional[float] = Field(default=None, gt=0.0)
    min_tokens: Optional[StrictInt] = Field(default=None, ge=0)
    #: SGLang/vLLM: false keeps special tokens in the text the client gets (default true);
    #: gpt-oss's harmony markers are read and removed by its parsers either way
    #: (`attnserve.server.chat_output`)
    skip_special_tokens: Optional[StrictBool] = None

    #: Undeclared fields this endpoint knows (`attnserve.server.request_fields`).
    known_extras: ClassVar[Mapping[str, KnownField]] = {}

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys_are_ids(cls, v):
        for key in v or {}:
            if not key.isdigit():
                raise ValueError(f"keys must be token ids (decimal integers), got {key!r}")
        return v

    def declared_refusal(self) -> Optional[Refusal]:
        """The first declared field set to a value attnserve cannot honour, else None."""
        return None

    def control_params(self) -> Dict[str, Any]:
        """The logit-control fields of `SamplingParams`."""
        return dict(
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            min_tokens=self.min_tokens or 0,
        )

    def refusal(self) -> Optional[Refusal]:
        """Why this request cannot be served as asked (the first offending field): an
        undeclared field that is unknown or not neutral, a declared one that attnserve
        cannot honour, or a refused field of a nested object; None when every field is
        honoured. (The no-silent-drop rule; see `attnserve.server.request_fields`.)"""
        refused = refuse_extras(self.model_extra, self.known_extras) or self.declared_refusal()
        if refused is None and self.stream_options is not None:
            refused = refuse_extras(self.stream_options.model_extra, StreamOptions.known_extras, "stream_options.")
        return refused

    def stop_list(self) -> List[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage on every streamed chunk (`StreamOptions`): ``include_usage`` and
        ``continuous_usage_stats`` both set."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: ``prompt`` is one string, one list of token ids, or a batch
    of either (a list of strings or a list of token-id lists, at most
    `MAX_COMPLETION_PROMPTS`), as OpenAI's API takes it; a batch of ``P`` prompts answers
    ``P * n`` choices, prompt ``p``'s ``n`` choices at indices ``p * n .. p * n + n - 1``.
    Without ``max_tokens`` a completion stops after `DEFAULT_COMPLETION_MAX_TOKENS` tokens, or
    earlier where the context or the KV pool ends. ``max_tokens: 0`` is accepted only with
    ``echo`` (OpenAI's and vLLM's way to score a prompt): each choice is the prompt alone
    (with ``logprobs``, the prompt's logprobs), ``finish_reason`` ``length`` and 0
    completion tokens (`attnserve.server.completion_api`); without ``echo`` it is a 400."""

    prompt: Union[StrictStr, List[StrictInt], List[StrictStr], List[List[StrictInt]]]
    max_tokens: Optional[StrictInt] = Field(default=DEFAULT_COMPLETION_MAX_TOKENS, ge=0)
    #: the prompt's text first in the choice's text (and its logprobs, with ``logprobs``)
    echo: Optional[StrictBool] = False
    #: logprobs of the chosen tokens and of the ``logprobs`` most likely alternatives
    logprobs: Optional[StrictInt] = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    best_of: Optional[StrictInt] = None
    suffix: Optional[StrictStr] = None

    known_extras: ClassVar[Mapping[str, KnownField]] = COMPLETION_FIELDS

    @field_validator("prompt")
    @classmethod
    def _prompt_batch_size(cls, v):
        if isinstance(v, list) and v and not isinstance(v[0], int) and len(v) > MAX_COMPLETION_PROMPTS:
            raise ValueError(f"a batch holds at most {MAX_COMPLETION_PROMPTS} prompts, got {len(v)}")
        return v

    def prompts(self) -> List[Union[str, List[int]]]:
        """The request's prompts: ``[prompt]`` for one string or one token-id list (an empty
        list included, which the tokenizer check refuses), else the batch itself."""
        p = self.prompt
        if isinstance(p, str) or not p or isinstance(p[0], int):
            return [p]
        return list(p)

    def logprob_params(self) -> Dict[str, Any]:
        """The logprob fields of `SamplingParams`."""
        on = self.logprobs is not None
        return dict(logprobs=on, top_logprobs=self.logprobs or 0, prompt_logprobs=on and bool(self.echo))

    def declared_refusal(self) -> Optional[Refusal]:
        if self.best_of is not None and self.best_of != (self.n or 1):
            return unsupported("best_of", self.best_of, hint="attnserve returns n independent samples and does not "
                                                              "rank them; leave best_of out or set it equal to n")
        if self.suffix:
            return unsupported("suffix", self.suffix)
        return super().declared_refusal()

    def requested_max_tokens(self) -> Optional[int]:
        """The client's explicit ``max_tokens``; None when it sent none (or null)."""
        return self.max_tokens if "max_tokens" in self.model_fields_set else None

    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens: 0``: the prompt (and its logprobs) without a completion."""
        return bool(self.echo) and self.requested_max_tokens() == 0


class TextContentPart(BaseModel):
    model_config = _STRICT
    known_extras: ClassVar[Mapping[str, KnownField]] = NO_FIELDS
    type: Literal["text"]
    text: StrictStr


class ToolCallFunction(BaseModel):
    """``function`` of an assistant message's tool call: its name and JSON ``arguments`` text."""

    model_config = _STRICT
    known_extras: ClassVar[Mapping[str, KnownField]] = NO_FIELDS
    name: StrictStr
    arguments: StrictStr


class MessageToolCall(BaseModel):
    """One ``tool_calls`` entry of an assistant message in the history."""

    model_config = _STRICT
    known_extras: ClassVar[Mapping[str, KnownField]] = NO_FIELDS
    id: StrictStr
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    """One message; ``content`` is a string or a list of ``{"type": "text", "text": ...}``
    parts (image/audio parts are rejected). ``name`` is passed to the chat template.
    An assistant message may carry ``tool_calls`` (then ``content`` may be null or absent);
    a ``tool`` message answers one call and needs its ``tool_call_id``
    (`attnserve.server.tool_request`)."""

    model_config = _STRICT
    known_extras: ClassVar[Mapping[str, KnownField]] = MESSAGE_FIELDS
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[StrictStr, List[TextContentPart]]] = None
    name: Optional[StrictStr] = None
    tool_calls: Optional[List[MessageToolCall]] = None
    tool_call_id: Optional[StrictStr] = None

    @model_validator(mode="after")
    def _check_tool_fields(self):
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs tool_call_id (the id of the call it answers)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (only an assistant message with tool_calls may omit it)")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def refusal(self, prefix: str) -> Optional[Refusal]:
        """The first refused field of this message or of its content parts (``param``
        starts with ``prefix``, e.g. ``"messages.0."``)."""
        refused = refuse_extras(self.model_extra, self.known_extras, prefix)
        for j, call in enumerate(self.tool_calls or ()):
            if refused is None:
                refused = (refuse_extras(call.model_extra, call.known_extras, f"{prefix}tool_calls.{j}.")
                           or refuse_extras(call.function.model_extra, NO_FIELDS, f"{prefix}tool_calls.{j}.function."))
        if refused is None and isinstance(self.content, list):
            for j, part in enumerate(self.content):
                refused = refuse_extras(part.model_extra, part.known_extras, f"{prefix}content.{j}.")
                if refused is not None:
                    break
        return refused


_MetadataKey = Annotated[StrictStr, Field(max_length=METADATA_MAX_KEY)]
_MetadataValue = Annotated[StrictStr, Field(max_length=METADATA_MAX_VALUE)]


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` wins over the older
    ``max_tokens``; without either the request may use the rest of the context.

    Accepted as OpenAI accepts them, changing no output:

    * ``store`` (``true``/``false``/``null``): attnserve never stores a completion, whatever
      the value; OpenAI keeps ``store: true`` completions for its dashboard and its
      stored-completions routes, which attnserve does not serve (they are 404).
    * ``metadata``: at most 16 string pairs (keys at most 64 characters, values at most
      512), checked as OpenAI checks them (else 400 ``invalid_value``) and then discarded,
      like ``store``, since nothing is stored to tag.
    * ``safety_identifier`` (OpenAI's successor of ``user``): a string.
    * ``prompt_cache_key``: a string. OpenAI routes requests by it to raise cache hits;
      attnserve's prefix cache matches every request's tokens already, so it needs none.
    """

    messages: List[ChatMessage] = Field(min_length=1)
    logprobs: Optional[StrictBool] = False
    top_logprobs: Optional[StrictInt] = Field(default=None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)
    max_tokens: Optional[StrictInt] = Field(default=None, ge=1)
    max_completion_tokens: Optional[StrictInt] = Field(default=None, ge=1)
    tools: Optional[List[Any]] = None  # checked by attnserve.server.tool_request
    tool_choice: Optional[Any] = None
    store: Optional[StrictBool] = None
    metadata: Optional[Dict[_MetadataKey, _MetadataValue]] = Field(default=None, max_length=METADATA_MAX_PAIRS)
    safety_identifier: Optional[StrictStr] = None
    prompt_cache_key: Optional[StrictStr] = None
    # chat-template control (attnserve.server.chat_template): the assistant header (default
    # true), an open last message to continue (exclusive with the header), template variables
    add_generation_prompt: Optional[StrictBool] = True
    continue_final_message: Optional[StrictBool] = False
    chat_template_kwargs: Optional[Dict[StrictStr, Any]] = None

    known_extras: ClassVar[Mapping[str, KnownField]] = CHAT_FIELDS

    def logprob_params(self) -> Dict[str, Any]:
        """The logprob fields of `SamplingParams` (``top_logprobs`` without ``logprobs``
        is refused there, naming ``top_logprobs``)."""
        return dict(logprobs=bool(self.logprobs), top_logprobs=self.top_logprobs or 0)

    def refusal(self) -> Optional[Refusal]:
        refused = super().refusal()
        for i, message in enumerate(self.messages):
            if refused is not None:
                break
            refused = message.refusal(f"messages.{i}.")
        return refused

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---- responses ---------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    """OpenAI ``usage.prompt_tokens_details``: ``cached_tokens`` prompt tokens were served
    from the prefix cache instead of being computed."""

    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: Optional[PromptTokensDetails] = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> "UsageInfo":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions ``logprobs``: per token its text, logprob (None for the
    first prompt token under ``echo``), the most likely alternatives as ``{text: logprob}``
    (the chosen token always among them) and its character offset in the choice's text."""

    tokens: List[str]
    token_logprobs: List[Optional[float]]
    top_logprobs: List[Optional[Dict[str, float]]]
    text_offset: List[int]


class TopLogprob(BaseModel):
    """One alternative of a chat token: text, logprob, UTF-8 bytes."""

    token: str
    logprob: float
    bytes: Optional[List[int]] = None


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[List[int]] = None
    top_logprobs: List[TopLogprob]


class ChatChoiceLogprobs(BaseModel):
    """``choices[].logprobs`` of chat: one entry per output token."""

    content: Optional[List[ChatTokenLogprob]] = None
    refusal: Optional[List[ChatTokenLogprob]] = None


#: vLLM's ``stop_reason`` of a choice: the stop string that ended it, or the token id of
#: the request's ``stop_token_ids`` that did; None otherwise (EOS, length, abort)
StopReason = Optional[Union[int, str]]


class CompletionChoice(BaseModel):
    """A completion choice (also a streamed chunk's); ``stop_reason`` is `StopReason`, set
    on the choice (chunk) that carries the ``finish_reason``."""

    index: int = 0
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: StopReason = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: List[CompletionChoice]
    usage: Optional[UsageInfo] = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    """A call in a response message: ``id`` (``call_...``), ``type`` and ``function``."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    """``content`` is null when the message holds only tool calls; ``reasoning_content``
    (``--reasoning-parser``) and ``tool_calls`` appear only when set."""

    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[List[ToolCall]] = None

    @model_serializer(mode="wrap")
    def _drop_unset_extras(self, handler):
        data = handler(self)
        for key in ("reasoning_content", "tool_calls"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


class ChatChoice(BaseModel):
    """A chat choice; ``stop_reason``: `StopReason`."""

    index: int = 0
    message: ChatResponseMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: StopReason = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: List[ChatChoice]
    usage: Optional[UsageInfo] = None


class ChatChunkChoice(BaseModel):
    """``delta`` holds only the keys that are present: ``{"role": "assistant", "content": ""}``
    first, then ``{"content": "..."}`` (and ``reasoning_content``, ``tool_calls`` deltas
    with the parsers of `attnserve.server.chat_output`), then ``{}`` beside the
    ``finish_reason`` (with its `StopReason`)."""

    index: int = 0
    delta: Dict[str, Any]
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: StopReason = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now_s)
    model: str
    choices: List[ChatChunkChoice]
    usage: Optional[UsageInfo] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now_s)
    owned_by: str = "attnserve"
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: List[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    """OpenAI error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorDetail
