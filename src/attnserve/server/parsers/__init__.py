"""Tool-call and reasoning parsers of chat outputs (``--tool-call-parser``,
``--reasoning-parser``; SGLang's flag and parser names).

Tool-call formats, one module each: `hermes` (``qwen25``, ``hermes``: ``<tool_call>``
blocks), `llama3` (``llama3``: JSON calls), `mistral` (``mistral``: ``[TOOL_CALLS]`` and a
JSON array); `base` holds the shared call scanner and the whole-text / streamed readers.
Reasoning formats: `reasoning` (``deepseek-r1``, ``qwen3``). Every parser is a state
machine fed character by character, so a streamed output, however split, reassembles to
the whole-text result (see `base` for the one exception, a call that breaks after it was
announced).
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

from attnserve.server.parsers.base import ParseResult, StreamDelta, ToolCall, ToolCallDelta, ToolCallStream, ToolMachine, parse_text
from attnserve.server.parsers.hermes import HermesMachine
from attnserve.server.parsers.llama3 import Llama3Machine
from attnserve.server.parsers.mistral import JsonArrayMachine, MistralMachine
from attnserve.server.parsers.reasoning import REASONING_PARSERS, ReasoningParser, ReasoningStream

#: ``--tool-call-parser`` name -> factory of a fresh state machine.
TOOL_CALL_PARSERS: Dict[str, Callable[[], ToolMachine]] = {
    "llama3": Llama3Machine,
    "qwen25": HermesMachine,
    "hermes": HermesMachine,
    "mistral": MistralMachine,
}


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
    array of forced calls)."""
    if name == "json_array":
        return JsonArrayMachine(None)
    check_tool_call_parser(name)
    return TOOL_CALL_PARSERS[name]()


def parse_tool_calls(name: str, text: str) -> ParseResult:
    """Split a whole output into content and calls with the format ``name``."""
    return parse_text(tool_machine(name), text)


def stream_tool_calls(name: str) -> ToolCallStream:
    """A streamed parser of the format ``name``."""
    return ToolCallStream(tool_machine(name))


def reasoning_parser(name: str) -> ReasoningParser:
    check_reasoning_parser(name)
    return REASONING_PARSERS[name]()


__all__ = [
    "REASONING_PARSERS", "TOOL_CALL_PARSERS", "ParseResult", "ReasoningStream", "StreamDelta", "ToolCall",
    "ToolCallDelta", "ToolCallStream", "check_reasoning_parser", "check_tool_call_parser", "parse_tool_calls",
    "reasoning_parser", "stream_tool_calls", "tool_machine",
]
