"""OpenAI-compatible request and response schemas (pydantic v2).

Requests are validated strictly: a JSON string where a number is expected, a number
where a boolean is expected, ``NaN``/``Infinity`` and values out of range are errors
(HTTP 400 with an OpenAI-style error body, see `attnserve.server.errors`). Fields that
OpenAI defines but attnserve does not implement (``logprobs``, ``echo``, penalties,
``tools`` ...) are accepted only at their neutral value; anything else is a 400 naming the
field. Fields that OpenAI does not define are **ignored** (``extra="ignore"``), as the
OpenAI API itself does, so clients that send vendor extensions keep working.

Extensions beyond OpenAI (SGLang/vLLM names): ``top_k``, ``min_p``, ``ignore_eos``,
``stop_token_ids``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

#: OpenAI allows 4 stop sequences; attnserve allows this many (each is checked per token).
MAX_STOP_SEQUENCES = 16
#: Longest accepted stop string, in characters.
MAX_STOP_LEN = 256
#: ``max_tokens`` of a completion that sets none (OpenAI's default), clamped to what fits.
DEFAULT_COMPLETION_MAX_TOKENS = 16
#: Most parallel samples (``n``) of one request.
MAX_N = 16
#: Most accepted ``stop_token_ids``.
MAX_STOP_TOKEN_IDS = 64
#: Seeds must fit a 64-bit generator state (``torch.Generator.manual_seed``).
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1

_STRICT = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: Optional[StrictBool] = False


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = _STRICT

    model: Optional[StrictStr] = None
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)  # OpenAI's range
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    top_k: Optional[StrictInt] = None
    min_p: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    stop: Optional[Union[StrictStr, List[StrictStr]]] = None
    stop_token_ids: Optional[List[StrictInt]] = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    n: Optional[StrictInt] = Field(default=1, ge=1, le=MAX_N)
    seed: Optional[StrictInt] = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stream: Optional[StrictBool] = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: Optional[StrictBool] = False
    user: Optional[StrictStr] = None
    # OpenAI fields that attnserve does not implement: only their neutral value is accepted.
    logprobs: Optional[Any] = None
    top_logprobs: Optional[Any] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[Dict[str, Any]] = None

    def unsupported(self) -> Optional[str]:
        """Name of the first field set to a value attnserve cannot honour, else None."""
        if self.logprobs not in (None, False, 0):
            return "logprobs"
        if self.top_logprobs not in (None, 0):
            return "top_logprobs"
        if self.presence_penalty not in (None, 0.0):
            return "presence_penalty"
        if self.frequency_penalty not in (None, 0.0):
            return "frequency_penalty"
        if self.logit_bias:
            return "logit_bias"
        return None

    def stop_list(self) -> List[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: ``prompt`` is one string or one list of token ids. Without
    ``max_tokens`` a completion stops after `DEFAULT_COMPLETION_MAX_TOKENS` tokens, or
    earlier where the context or the KV pool ends."""

    prompt: Union[StrictStr, List[StrictInt]]
    max_tokens: Optional[StrictInt] = Field(default=DEFAULT_COMPLETION_MAX_TOKENS, ge=1)
    echo: Optional[StrictBool] = False
    best_of: Optional[StrictInt] = None
    suffix: Optional[StrictStr] = None

    def unsupported(self) -> Optional[str]:
        if self.echo:
            return "echo"
        if self.best_of is not None and self.best_of != (self.n or 1):
            return "best_of"
        if self.suffix:
            return "suffix"
        return super().unsupported()

    def requested_max_tokens(self) -> Optional[int]:
        """The client's explicit ``max_tokens``; None when it sent none (or null)."""
        return self.max_tokens if "max_tokens" in self.model_fields_set else None


class TextContentPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    """One message; ``content`` is a string or a list of ``{"type": "text", "text": ...}``
    parts (image/audio parts are rejected)."""

    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[StrictStr, List[TextContentPart]]
    name: Optional[StrictStr] = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` wins over the older
    ``max_tokens``; without either the request may use the rest of the context."""

    messages: List[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[StrictInt] = Field(default=None, ge=1)
    max_completion_tokens: Optional[StrictInt] = Field(default=None, ge=1)
    tools: Optional[List[Any]] = None
    tool_choice: Optional[Any] = None
    response_format: Optional[Dict[str, Any]] = None

    def unsupported(self) -> Optional[str]:
        if self.tools:
            return "tools"
        if self.tool_choice not in (None, "none", "auto"):
            return "tool_choice"
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            return "response_format"
        return super().unsupported()

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


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: Optional[str] = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: List[CompletionChoice]
    usage: Optional[UsageInfo] = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: None = None
    finish_reason: Optional[str] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: List[ChatChoice]
    usage: Optional[UsageInfo] = None


class ChatChunkChoice(BaseModel):
    """``delta`` holds only the keys that are present: ``{"role": "assistant", "content": ""}``
    first, then ``{"content": "..."}``, then ``{}`` beside the ``finish_reason``."""

    index: int = 0
    delta: Dict[str, str]
    logprobs: None = None
    finish_reason: Optional[str] = None


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
