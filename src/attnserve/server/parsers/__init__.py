"""Tool-call and reasoning parsers of chat outputs (``--tool-call-parser``,
``--reasoning-parser``; SGLang's flag and parser names).

Tool-call formats, one module each: `hermes` (``qwen25``, ``hermes``: ``<tool_call>``
blocks), `llama3` (``llama3``: JSON calls), `mistral` (``mistral``: ``[TOOL_CALLS]`` and a
JSON array); `base` holds the shared call scanner and the whole-text / streamed readers.
Reasoning formats: `reasoning` (``deepseek-r1``, ``qwen3``). gpt-oss's harmony format
(`gpt_oss`) has both: ``gpt-oss`` names its reasoning parser and its tool-call parser, and
a request read by either is decoded with the harmony markers kept
(`attnserve.server.chat_output`). Every parser is a state machine fed character by
character, so a streamed output, however split, reassembles to the whole-text result (see
`base` for the one exception, a call that breaks after it was announced).
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Type

from attnserve.server.parsers.base import ParseResult, StreamDelta, ToolCall, ToolCallDelta, ToolCallStream, ToolMachine, parse_text
from attnserve.server.parsers.gpt_oss import GptOssMachine, GptOssReasoningParser
from attnserve.server.parsers.hermes import HermesMachine
from attnserve.server.parsers.llama3 import Llama3Machine
from attnserve.server.parsers.mistral import JsonArrayMachine, MistralMachine
from attnserve.server.parsers.reasoning import REASONING_PARSERS as _THINK_PARSERS
from attnserve.server.parsers.reasoning import ReasoningParser, ReasoningStream

#: ``--tool-call-parser`` name -> factory of a fresh state machine.
TOOL_CALL_PARSERS: Dict[str, Callable[[], ToolMachine]] = {
    "llama3": Llama3Machine,
    "qwen25": HermesMachine,
    "hermes": HermesMachine,
    "mistral": MistralMachine,
    "gpt-oss": GptOssMachine,
}

#: ``--reasoning-parser`` name -> parser class.
REASONING_PARSERS: Dict[str, Type[ReasoningParser]] = {**_THINK_PARSERS, "gpt-oss": GptOssReasoningParser}

#: the parser name of gpt-oss's harmony format (both registries)
HARMONY = "gpt-oss"
#: internal tool format: harmony output of a request that takes no calls (the server's
#: ``--tool-call-parser`` is gpt-oss): call messages are content, reasoning is dropped
HARMONY_TEXT = "gpt-oss-text"


def check_tool_call_parser(name: Optional[str]) -> None:
    """Raises ValueError (listing the valid names) for an unknown ``--tool-call-parser``."""
    if name is not None and name not in TOOL_CALL_PARSERS:
        raise ValueError(f"--tool-call-parser {name!r} is unknown; choose one of {', '.join(TOOL_CALL_PARSERS)}")


def check_reasoning_parser(name: Optional[str]) -> None:
    """Raises ValueError (listing the valid names) for an unknown ``--reasoning-parser``."""
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser {name!r} is unknown; choose one of {', '.join(REASONING_PARSERS)}")


def tool_machine(name: str) -> ToolMachine:
    """A fresh state machine of the tool-call format ``name`` (``"json_array"``: the bare
    array of forced calls; `HARMONY_TEXT`: harmony without calls)."""
    if name == "json_array":
        return JsonArrayMachine(None)
    if name == HARMONY_TEXT:
        return GptOssMachine(calls=False)
    check_tool_call_parser(name)
    return TOOL_CALL_PARSERS[name]()


def parse_tool_calls(name: str, text: str) -> ParseResult:
    """Split a whole output into content and calls with the format ``name``."""
    return parse_text(tool_machine(name), text)


def stream_tool_calls(name: str) -> ToolCallStream:
    """A streamed parser of the format ``name``."""
    return ToolCallStream(tool_machine(name))


def reasoning_parser(name: str, tool_format: Optional[str] = None) -> ReasoningParser:
    """The reasoning parser ``name``; ``tool_format``: the tool-call format that reads its
    content next, if any (`ReasoningParser`)."""
    check_reasoning_parser(name)
    return REASONING_PARSERS[name](tool_format)


__all__ = [
    "HARMONY", "HARMONY_TEXT", "REASONING_PARSERS", "TOOL_CALL_PARSERS", "ParseResult", "ReasoningStream",
    "StreamDelta", "ToolCall", "ToolCallDelta", "ToolCallStream", "check_reasoning_parser", "check_tool_call_parser",
    "parse_tool_calls", "reasoning_parser", "stream_tool_calls", "tool_machine",
]
