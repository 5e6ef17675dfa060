"""Llama 3.1 / 3.2 / 3.3 JSON tool calls: ``{"name": ..., "parameters": {...}}`` at the
start of the output or after ``<|python_tag|>``, several separated by ``;`` or whitespace
(`attnserve.server.parsers.base` for the rules).

Format facts from Meta's Llama 3.1 model card ("JSON based tool calling": the model
answers ``{"name": function name, "parameters": dictionary of argument name and its
value}``) and its chat template (``<|python_tag|>`` opens a call). ``<|python_tag|>`` is a
special token, which detokenization drops, so a call usually arrives as bare JSON at the
start of the output; a ``{`` anywhere else is text.
"""

from __future__ import annotations

from attnserve.server.parsers.base import _WS, CallScanner, TagMatcher, ToolMachine

PYTHON_TAG = "<|python_tag|>"


class Llama3Machine(ToolMachine):
    """text (a leading ``{`` or ``<|python_tag|>`` opens the call region) -> call objects
    separated by ``;`` / whitespace -> text."""

    def __init__(self) -> None:
        super().__init__()
        self.mode = "text"
        self.tag = TagMatcher(PYTHON_TAG)
        self.at_start = True
        self.scanner = None
        self.n = 0
        self.prefix = ""  # text of the region before the current object (a failed first object returns it)

    def push(self, c: str) -> None:
        if self.mode == "text":
            if self.at_start and not self.tag.held and c in _WS:
                self.events.text(c)
                return
            if self.at_start and not self.tag.held and c == "{":
                self.at_start = False
                self.prefix = ""
                return self._open(c)
            out, hit = self.tag.push(c)
            if out:
                self.at_start = False
            self.events.text(out)
            if hit:
                self.at_start = False
                self.mode, self.prefix = "region", PYTHON_TAG
        elif self.mode == "region":
            if c in _WS or c == ";":
                self.prefix += c
            elif c == "{":
                self._open(c)
            else:
                self.mode = "text"
                if self.prefix == PYTHON_TAG:
                    self.events.text(self.prefix)
                self.push(c)
        else:
            sc = self.scanner
            sc.push(c)
            if sc.status == "bad":
                self.mode = "text"
                self.events.text(self.prefix + sc.text())
            elif sc.status != "open":
                if sc.status == "broken":
                    self.raws[sc.index] = sc.text()
                self.n += 1
                self.mode, self.prefix = "region", ""

    def _open(self, c: str) -> None:
        self.mode, self.scanner = "call", CallScanner(self.n, self.events)
        self.scanner.push(c)

    def finish(self) -> None:
        if self.mode == "text":
            self.events.text(self.tag.flush())
        elif self.mode == "region":
            if self.prefix == PYTHON_TAG:
                self.events.text(self.prefix)
        else:
            sc = self.scanner
            sc.finish()
            if sc.status == "bad":
                self.events.text(self.prefix + sc.text())
            else:
                self.raws[sc.index] = sc.text()
