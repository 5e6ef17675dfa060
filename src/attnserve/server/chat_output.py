"""A chat choice's output read back into OpenAI's message fields: ``reasoning_content``
(``--reasoning-parser``), ``content`` and ``tool_calls`` (``--tool-call-parser``, or the
forced-call array), whole (`ChatOutput.message`) or streamed (`ChoiceStream`).

Which readers apply (`chat_output`): a forced call (`attnserve.server.tool_request`) is read
with the bare-array parser and no reasoning parser (its grammar allows nothing else);
otherwise the reasoning parser, when the server has one, splits off the thinking, and the
tool-call parser, when the server has one and the request has tools with ``tool_choice``
``"auto"``, reads calls out of the rest. Without either the text is passed on untouched.
A choice with calls that stopped naturally finishes with ``tool_calls``.

gpt-oss (`attnserve.server.parsers.gpt_oss`): its harmony markers (``<|channel|>``,
``<|message|>`` ...) are special tokens, which the engine leaves out of the text by default,
and the parsers need them. A request read by a gpt-oss parser (`ChatOutput.keeps_markers`)
is therefore decoded with ``skip_special_tokens=False`` and stops at ``<|return|>`` and
``<|call|>`` (`harmony_sampling_params`); the parsers consume every marker, so the client
still receives none (SGLang also decodes gpt-oss output with special tokens kept). The
request's own ``skip_special_tokens`` (SGLang's and vLLM's field, default true) is about the
text the client gets, and the markers are structure the parsers remove whatever it says:
false (special tokens kept) changes nothing else for harmony. One limit: the decode keeps
all special tokens or none, so a special token that is not a harmony marker (gpt-oss's
reserved tokens, ``<|endoftext|>``; the model does not write them inside a turn) would reach
the content even with true. When the server's ``--tool-call-parser`` is gpt-oss but the
request takes no calls, the output is still read as harmony (`HARMONY_TEXT`: calls are
content, reasoning dropped, as with the tool parser) unless the gpt-oss reasoning parser
reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from attnserve.server.parsers import HARMONY, HARMONY_TEXT, parse_tool_calls, reasoning_parser, stream_tool_calls
from attnserve.server.parsers.base import new_call_id
from attnserve.server.parsers.gpt_oss import STOP_TOKENS as HARMONY_STOP_TOKENS


@dataclass(frozen=True)
class ChatOutput:
    """Readers of a request's choices.

    Attributes:
        tool_format: a tool-call parser name (``"json_array"`` for forced calls), or None.
        reasoning: a reasoning parser name, or None.
    """

    tool_format: Optional[str] = None
    reasoning: Optional[str] = None

    @property
    def active(self) -> bool:
        return self.tool_format is not None or self.reasoning is not None

    @property
    def keeps_markers(self) -> bool:
        """A gpt-oss parser reads the output: decode it with the harmony markers kept."""
        return HARMONY in (self.reasoning, self.tool_format) or self.tool_format == HARMONY_TEXT

    def message(self, text: str) -> Tuple[Dict[str, Any], bool]:
        """``(ChatResponseMessage fields, whether it has calls)`` of a whole output.
        ``content`` is None when the choice has calls and no other text."""
        fields: Dict[str, Any] = {}
        if self.reasoning is not None:
            reasoning, text = reasoning_parser(self.reasoning, self.tool_format).parse(text)
            fields["reasoning_content"] = reasoning or None
        calls: List[Dict[str, Any]] = []
        if self.tool_format is not None:
            parsed = parse_tool_calls(self.tool_format, text)
            text = parsed.content
            calls = [{"id": new_call_id(), "type": "function",
                      "function": {"name": c.name, "arguments": c.arguments}} for c in parsed.calls]
        if calls:
            fields["tool_calls"] = calls
        fields["content"] = text if (text or not calls) else None
        return fields, bool(calls)

    def stream(self) -> "ChoiceStream":
        return ChoiceStream(self)


class ChoiceStream:
    """One streamed choice: `delta` turns each new piece of text into the keys of an
    OpenAI ``delta`` (``reasoning_content``, ``content``, ``tool_calls``; only those with
    something to say)."""

    def __init__(self, out: ChatOutput) -> None:
        self.reasoning = (reasoning_parser(out.reasoning, out.tool_format).stream()
                          if out.reasoning is not None else None)
        self.tools = stream_tool_calls(out.tool_format) if out.tool_format is not None else None

    @property
    def has_calls(self) -> bool:
        return self.tools is not None and self.tools.has_calls

    def delta(self, text: str, final: bool = False) -> Dict[str, Any]:
        """The delta keys of ``text``; with ``final``, everything held back is flushed too."""
        reasoning, content = "", text
        if self.reasoning is not None:
            a = self.reasoning.feed(text)
            reasoning, content = a.reasoning, a.content
            if final:
                b = self.reasoning.finish()
                reasoning, content = reasoning + b.reasoning, content + b.content
        out: Dict[str, Any] = {}
        if reasoning:
            out["reasoning_content"] = reasoning
        if self.tools is None:
            if content:
                out["content"] = content
            return out
        deltas = [self.tools.feed(content)] + ([self.tools.finish()] if final else [])
        content = "".join(d.content for d in deltas)
        if content:
            out["content"] = content
        merged: Dict[int, Any] = {}
        for d in deltas:
            for c in d.calls:
                if c.index in merged:
                    merged[c.index].arguments += c.arguments
                else:
                    merged[c.index] = c
        if merged:
            out["tool_calls"] = [merged[i].to_openai() for i in sorted(merged)]
        return out


def chat_output(tool_req, tool_call_parser: Optional[str], reasoning: Optional[str]) -> ChatOutput:
    """The readers of a request (see the module doc).

    Args:
        tool_req: the request's `ToolRequest`, or None.
        tool_call_parser / reasoning: the server's ``--tool-call-parser`` /
            ``--reasoning-parser`` (None when not set).
    """
    if tool_req is not None and tool_req.forced:
        return ChatOutput("json_array", None)
    auto = tool_req is not None and tool_req.choice == "auto" and tool_call_parser is not None
    if not auto and tool_call_parser == HARMONY and reasoning != HARMONY:
        return ChatOutput(HARMONY_TEXT, reasoning)
    return ChatOutput(tool_call_parser if auto else None, reasoning)


def harmony_sampling_params(sp, tokenizer):
    """``sp`` for a request a gpt-oss parser reads (`ChatOutput.keeps_markers`): decoded with
    ``skip_special_tokens=False`` and, unless it ignores EOS, stopped by ``<|return|>`` and
    ``<|call|>`` (the end of an assistant turn in harmony; they join ``stop_token_ids``, which
    take the stop token out of the text as EOS does, and ``stop_reason`` still reports only
    the client's own ids). Tokens the tokenizer does not have are skipped."""
    import dataclasses

    stops = list(sp.stop_token_ids or ())
    if not sp.ignore_eos and tokenizer is not None:
        unk = getattr(tokenizer, "unk_token_id", None)
        for token in HARMONY_STOP_TOKENS:
            tid = tokenizer.convert_tokens_to_ids(token)
            if isinstance(tid, int) and tid != unk and tid not in stops:
                stops.append(tid)
    return dataclasses.replace(sp, skip_special_tokens=False, stop_token_ids=stops or None)


def finish_reason(reason: Optional[str], has_calls: bool) -> Optional[str]:
    """``tool_calls`` for a choice with calls that stopped by itself, else ``reason``."""
    return "tool_calls" if has_calls and reason == "stop" else reason
