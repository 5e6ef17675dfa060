"""Reasoning parsers (``--reasoning-parser``): the model's thinking, written between
``<think>`` and ``</think>``, goes to ``reasoning_content``; the rest is ``content``.

* ``deepseek-r1``: the opening ``<think>`` may already be in the prompt (DeepSeek-R1's
  template ends the generation prompt with it), so everything before ``</think>`` is
  reasoning; a ``<think>`` at the very start of the output is dropped. Without
  ``</think>`` the whole output is reasoning (the thinking was cut off).
* ``qwen3``: reasoning only when the output starts with ``<think>`` (Qwen3's template
  writes an empty ``<think></think>`` into the prompt when ``enable_thinking`` is false,
  and the output then has none); up to ``</think>``, or the end.

Whitespace at the start and end of the reasoning and at the start of the content after
``</think>`` is dropped. One state machine, fed character by character, serves both the
whole text (`ReasoningParser.parse`) and the stream (`ReasoningStream`), so a stream split
anywhere reassembles to the whole-text result. Tags from the DeepSeek-R1 and Qwen3 model
cards and chat templates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Dict, Optional, Tuple, Type

from attnserve.server.parsers.base import _WS, TagMatcher, WsTrim

THINK_START, THINK_END = "<think>", "</think>"


@dataclass
class ReasoningDelta:
    """What a piece of text adds: ``reasoning`` text and ``content`` text."""

    reasoning: str = ""
    content: str = ""


class ReasoningStream:
    """Feed pieces of the output, then `finish`; each call returns a `ReasoningDelta`.

    Args:
        force: everything before ``</think>`` is reasoning (deepseek-r1); else only a
            leading ``<think>`` opens it (qwen3).
    """

    def __init__(self, force: bool) -> None:
        self.force = force
        self.mode = "start"
        self.start = TagMatcher(THINK_START)
        self.end = TagMatcher(THINK_END)
        self.r_trim = WsTrim()
        self.c_trim = WsTrim()
        self.c_trim.lead = False  # content is left as it is unless a </think> came before it
        self.out = ReasoningDelta()

    def feed(self, text: str) -> ReasoningDelta:
        for c in text:
            self._push(c)
        return self._take()

    def finish(self) -> ReasoningDelta:
        if self.mode == "start":
            held = self.start.flush()
            self.mode = "reasoning" if self.force else "content"
            for c in held:
                self._push(c)
        if self.mode == "reasoning":
            self.out.reasoning += self.r_trim.push(self.end.flush())
        return self._take()

    def _take(self) -> ReasoningDelta:
        out, self.out = self.out, ReasoningDelta()
        return out

    def _push(self, c: str) -> None:
        if self.mode == "start":
            if not self.start.held and c in _WS:
                if self.force:
                    return  # leading whitespace of the reasoning
                self.out.content += c
                return
            out, hit = self.start.push(c)
            if hit:
                self.mode = "reasoning"
            elif out:  # the output does not open with <think>
                held = self.start.flush()
                self.mode = "reasoning" if self.force else "content"
                for ch in out + held:
                    self._push(ch)
        elif self.mode == "reasoning":
            out, hit = self.end.push(c)
            self.out.reasoning += self.r_trim.push(out)
            if hit:
                self.mode = "content"
                self.c_trim.lead = True
        else:
            self.out.content += self.c_trim.push(c) if self.c_trim.lead else c


class ReasoningParser:
    """One reasoning format; `stream` makes a per-output state machine.

    Args:
        tool_format: the tool-call parser that reads the content next, or None (only
            gpt-oss's parser depends on it: `attnserve.server.parsers.gpt_oss`).
    """

    name: ClassVar[str] = ""
    force: ClassVar[bool] = False

    def __init__(self, tool_format: Optional[str] = None) -> None:
        self.tool_format = tool_format

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.force)

    def parse(self, text: str) -> Tuple[str, str]:
        """``(reasoning, content)`` of a whole output."""
        st = self.stream()
        a, b = st.feed(text), st.finish()
        return a.reasoning + b.reasoning, a.content + b.content


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek-r1"
    force = True


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    force = False


REASONING_PARSERS: Dict[str, Type[ReasoningParser]] = {
    cls.name: cls for cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}
