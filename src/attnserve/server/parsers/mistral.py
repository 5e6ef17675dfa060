"""Mistral tool calls: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``, and the
bare JSON array of call objects (`JsonArrayMachine`), which is also the output format of
attnserve's forced calls (`attnserve.server.tool_request`); the rules are in
`attnserve.server.parsers.base`.

Format facts from Mistral's chat templates (v3 tokenizer: the assistant writes
``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}``). ``[TOOL_CALLS]`` is a
control token, which detokenization drops, so an array at the very start of the output is
read as calls too; an array anywhere else is text.
"""

from __future__ import annotations

from typing import Optional

from attnserve.server.parsers.base import _WS, CallScanner, TagMatcher, ToolMachine

TOOL_CALLS = "[TOOL_CALLS]"


class JsonArrayMachine(ToolMachine):
    """text (``[`` at the start, or after ``tag``, opens the array) -> call objects
    separated by ``,`` -> ``]`` -> text.

    Args:
        tag: the marker before the array (``[TOOL_CALLS]``), or None for a bare array only.
    """

    def __init__(self, tag: Optional[str] = TOOL_CALLS) -> None:
        super().__init__()
        self.mode = "text"
        self.tag = TagMatcher(tag) if tag else None
        self.tag_text = tag or ""
        self.at_start = True
        self.scanner = None
        self.n = 0
        self.prefix = ""  # the array's text before its first call (returned when that call fails)
        self.in_array = 0  # calls in the current array

    def push(self, c: str) -> None:
        mode = self.mode
        if mode == "text":
            held = self.tag is not None and self.tag.held
            if self.at_start and not held and c in _WS:
                self.events.text(c)
                return
            if self.tag is None:
                out, hit = c, False
            else:
                out, hit = self.tag.push(c)
            if out and self.at_start and out[0] == "[":  # a bare array opens the output
                self.at_start = False
                rest = out[1:] + (self.tag.flush() if self.tag is not None else "")
                self.mode, self.prefix, self.in_array = "item", "[", 0
                for ch in rest:
                    self.push(ch)
                return
            if out:
                self.at_start = False
            self.events.text(out)
            if hit:
                self.at_start = False
                self.mode, self.prefix = "open", self.tag_text
        elif mode == "open":
            self.prefix += c
            if c == "[":
                self.mode, self.in_array = "item", 0
            elif c not in _WS:
                self.mode = "text"
                self.events.text(self.prefix)
        elif mode == "item":
            if c in _WS:
                self.prefix += c
            elif c == "{":
                self.mode, self.scanner = "call", CallScanner(self.n, self.events)
                self.scanner.push(c)
            else:
                self._leave(c)
        elif mode == "call":
            sc = self.scanner
            sc.push(c)
            if sc.status == "bad":
                self.mode = "text"
                self.events.text((self.prefix if self.in_array == 0 else "") + sc.text())
            elif sc.status != "open":
                if sc.status == "broken":
                    self.raws[sc.index] = (self.prefix if self.in_array == 0 else "") + sc.text()
                self.n += 1
                self.in_array += 1
                self.mode = "sep"
        else:  # "sep": between calls
            if c == ",":
                self.mode, self.prefix = "item", ""
            elif c == "]":
                self.mode = "text"
            elif c not in _WS:
                self.mode = "text"
                self.push(c)

    def _leave(self, c: str) -> None:
        """A character that cannot continue the array where a call should start."""
        self.mode = "text"
        if self.in_array == 0:
            self.events.text(self.prefix)
        self.push(c)

    def finish(self) -> None:
        if self.mode == "text":
            if self.tag is not None:
                self.events.text(self.tag.flush())
        elif self.mode in ("open", "item"):
            if self.in_array == 0:
                self.events.text(self.prefix)
        elif self.mode == "call":
            sc = self.scanner
            sc.finish()
            if sc.status == "bad":
                self.events.text((self.prefix if self.in_array == 0 else "") + sc.text())
            else:
                self.raws[sc.index] = (self.prefix if self.in_array == 0 else "") + sc.text()


class MistralMachine(JsonArrayMachine):
    """``[TOOL_CALLS] [...]`` (or a bare leading array)."""

    def __init__(self) -> None:
        super().__init__(TOOL_CALLS)
