"""Qwen 2.5 / Hermes tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
blocks, any number, with text around them (`attnserve.server.parsers.base` for the rules).

Format facts from Qwen2.5's chat template (``tokenizer_config.json``: the assistant writes
each call as ``<tool_call>\\n{json}\\n</tool_call>``) and NousResearch's Hermes-2-Pro
function-calling format. A block whose end tag never comes is still a call when its JSON
object is complete.
"""

from __future__ import annotations

from attnserve.server.parsers.base import _WS, CallScanner, TagMatcher, ToolMachine

START, END = "<tool_call>", "</tool_call>"


class HermesMachine(ToolMachine):
    """State machine of the Hermes format: text -> ``<tool_call>`` -> one call object ->
    optional ``</tool_call>`` -> text."""

    def __init__(self) -> None:
        super().__init__()
        self.mode = "text"
        self.start = TagMatcher(START)
        self.end = TagMatcher(END)
        self.scanner = None
        self.n = 0
        self.after_held = ""

    def push(self, c: str) -> None:
        if self.mode == "text":
            out, hit = self.start.push(c)
            self.events.text(out)
            if hit:
                self.mode, self.scanner = "call", CallScanner(self.n, self.events)
        elif self.mode == "call":
            sc = self.scanner
            sc.push(c)
            if sc.status == "bad":
                self.mode = "text"
                self.events.text(START + sc.text())
            elif sc.status != "open":
                if sc.status == "broken":
                    self.raws[sc.index] = START + sc.text()
                self.n += 1
                self.mode, self.after_held = "after", ""
        else:  # after a call: whitespace and the end tag are dropped
            if not self.end.held and c in _WS:
                self.after_held += c
                return
            out, hit = self.end.push(c)
            if hit:
                self.mode = "text"
            elif out:  # not the end tag: back to text
                self.mode = "text"
                rest = self.end.flush()
                self.events.text(self.after_held)
                for ch in out + rest:
                    self.push(ch)

    def finish(self) -> None:
        if self.mode == "text":
            self.events.text(self.start.flush())
        elif self.mode == "call":
            sc = self.scanner
            sc.finish()
            if sc.status == "bad":
                self.events.text(START + sc.text())
            else:
                self.raws[sc.index] = START + sc.text()
        else:
            self.events.text(self.end.flush())
