"""Shared pieces of the tool-call parsers: the parse results, the event stream every
format's state machine writes, an incremental scanner of one JSON call object, a tag
matcher that holds back partial tags, and the two ways to read a machine's events (whole
text, or streamed deltas).

Every format (`attnserve.server.parsers.hermes`, ``llama3``, ``mistral``) is one state
machine fed the model's text character by character, so its decisions depend only on the
text seen so far, never on how the text was split into chunks. The same machine serves
the non-streamed response (`parse_text`) and the streamed one (`ToolCallStream`).

**Calls.** A call is a JSON object ``{"name": "<function>", "arguments": {...}}`` (Llama
writes ``"parameters"``; both are read, the first one present wins; other keys are
ignored). ``arguments`` must be a JSON object or a string holding one; the response's
``arguments`` is the object's JSON text exactly as the model wrote it (a string value:
its decoded text), ``"{}"`` when absent. A call is announced (``start`` event: its name)
once its name is complete; argument text follows as it arrives.

**Malformed calls stay content.** A call whose JSON breaks before its name is complete
(not an object, bad syntax, a non-string name, arguments that are neither object nor
string) is given back as plain text. One that breaks after its name was announced (e.g.
``{"a": 1,}`` arguments, or the output ends mid-call) is ``broken``: the non-streamed
parse turns its text back into content; a stream cannot take back what it sent, so there
the call keeps the name and argument text already sent (as vLLM and SGLang do). This is
the only case where the streamed and non-streamed results differ.

**Content** is the text outside the calls, without whitespace at its start and end; the
whitespace around a call collapses to the whitespace before it (``"a\n<call>\nb"`` ->
``"a\nb"``), so the newlines a template puts around ``<tool_call>`` blocks vanish.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

_WS = " \t\r\n"
#: keys whose value is a call's arguments (Hermes/Mistral/OpenAI, Llama 3.x)
ARGUMENT_KEYS = ("arguments", "parameters")


def new_call_id() -> str:
    """An OpenAI-style tool-call id: ``call_`` and 24 hex digits."""
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolCall:
    """One parsed call. ``arguments`` is JSON text (an object)."""

    name: str
    arguments: str


@dataclass
class ParseResult:
    """A whole output split into ``content`` (text outside the calls) and ``calls``."""

    content: str
    calls: List[ToolCall] = field(default_factory=list)


@dataclass
class ToolCallDelta:
    """One streamed piece of call ``index``: the first carries ``id`` and ``name``, the
    rest argument text (OpenAI's ``delta.tool_calls[]`` entries)."""

    index: int
    arguments: str = ""
    id: Optional[str] = None
    name: Optional[str] = None

    def to_openai(self) -> Dict[str, Any]:
        """The OpenAI chunk form: ``{"index", "id", "type", "function": {"name", "arguments"}}``
        (``id``, ``type`` and ``name`` only in a call's first delta)."""
        out: Dict[str, Any] = {"index": self.index}
        fn: Dict[str, Any] = {}
        if self.name is not None:
            out["id"], out["type"] = self.id, "function"
            fn["name"] = self.name
        fn["arguments"] = self.arguments
        out["function"] = fn
        return out


@dataclass
class StreamDelta:
    """What one piece of streamed text adds: content text and call deltas (one per call
    index at most, in index order)."""

    content: str = ""
    calls: List[ToolCallDelta] = field(default_factory=list)


class Events:
    """The event list a machine writes: ``("text", s)``, ``("start", i, name)``,
    ``("args", i, s)``, ``("end", i)``, ``("broken", i, raw_text)``; consecutive text or
    argument pieces are merged."""

    def __init__(self) -> None:
        self.items: List[tuple] = []

    def text(self, s: str) -> None:
        if not s:
            return
        if self.items and self.items[-1][0] == "text":
            self.items[-1] = ("text", self.items[-1][1] + s)
        else:
            self.items.append(("text", s))

    def args(self, i: int, s: str) -> None:
        if not s:
            return
        last = self.items[-1] if self.items else None
        if last is not None and last[0] == "args" and last[1] == i:
            self.items[-1] = ("args", i, last[2] + s)
        else:
            self.items.append(("args", i, s))

    def take(self) -> List[tuple]:
        out, self.items = self.items, []
        return out


class TagMatcher:
    """Finds ``tag`` in text fed one character at a time, holding back a suffix that may
    still become the tag."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.held = ""

    def push(self, c: str):
        """Returns ``(text that is certainly not part of the tag, whether the tag just ended)``."""
        self.held += c
        if self.tag.startswith(self.held):
            if self.held == self.tag:
                self.held = ""
                return "", True
            return "", False
        out = ""
        while self.held and not self.tag.startswith(self.held):
            out, self.held = out + self.held[0], self.held[1:]
        return out, False

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


class CallScanner:
    """Scans one JSON call object fed character by character (see the module doc).

    ``status`` is ``"open"``, ``"done"`` (a valid call, ``end`` written), ``"bad"`` (broke
    before its name was announced: the caller gives ``raw`` back as text) or ``"broken"``
    (broke after; ``broken`` written). Events go to ``events`` with call index ``index``.
    """

    def __init__(self, index: int, events: Events) -> None:
        self.index, self.ev = index, events
        self.raw: List[str] = []
        self.status = "open"
        self.state = "start"
        self.key: Optional[str] = None
        self.key_chars: List[str] = []
        self.val: List[str] = []
        self.kind = ""  # "str" | "container" | "scalar"
        self.depth, self.in_str, self.esc = 0, False, False
        self.is_args = False
        self.args_key: Optional[str] = None
        self.name: Optional[str] = None
        self.pending_args: List[str] = []  # argument text before the name is known

    @property
    def started(self) -> bool:
        return self.name is not None

    def text(self) -> str:
        return "".join(self.raw)

    def push(self, c: str) -> None:
        self.raw.append(c)
        self._step(c)

    def finish(self) -> None:
        """The text ended inside the object."""
        if self.status == "open":
            self._fail()

    # ---- the state machine ----
    def _step(self, c: str) -> None:
        st = self.state
        if st == "value":
            self._value_char(c)
        elif st == "in_key":
            if self.esc:
                self.esc = False
            elif c == "\\":
                self.esc = True
            elif c == '"':
                try:
                    self.key = json.loads('"' + "".join(self.key_chars) + '"')
                except ValueError:
                    return self._fail()
                self.state = "colon"
                return None
            self.key_chars.append(c)
        elif c in _WS:
            return None
        elif st == "start":
            if c != "{":
                return self._fail()
            self.state = "key"
        elif st == "key":
            if c == '"':
                self.state, self.key_chars = "in_key", []
            elif c == "}":
                self._close()
            else:
                self._fail()
        elif st == "colon":
            if c != ":":
                return self._fail()
            self.state = "value_start"
        elif st == "value_start":
            self._value_start(c)
        elif st == "after":
            if c == ",":
                self.state = "key"
            elif c == "}":
                self._close()
            else:
                self._fail()
        return None

    def _value_start(self, c: str) -> None:
        self.val = [c]
        self.is_args = self.key in ARGUMENT_KEYS and self.args_key is None
        if c == '"':
            self.kind, self.in_str, self.esc = "str", True, False
        elif c in "{[":
            self.kind, self.depth, self.in_str, self.esc = "container", 1, False, False
        else:
            self.kind = "scalar"
        if self.is_args:
            self.args_key = self.key
            if c != "{" and c != '"':
                return self._fail()  # arguments must be an object or a string holding one
            if c == "{":
                self._args_text(c)
        self.state = "value"

    def _value_char(self, c: str) -> None:
        if self.kind == "scalar":
            if c in _WS or c in ",}":
                self.state = "after"
                self._end_value()
                if self.status == "open" and c not in _WS:
                    self._step(c)
                return
            self.val.append(c)
            return
        self.val.append(c)
        if self.is_args and self.kind == "container":
            self._args_text(c)
        if self.esc:
            self.esc = False
        elif self.in_str:
            if c == "\\":
                self.esc = True
            elif c == '"':
                self.in_str = False
                if self.kind == "str":
                    self.state = "after"
                    self._end_value()
        elif c == '"':
            self.in_str = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            if self.depth == 0:
                self.state = "after"
                self._end_value()

    def _args_text(self, s: str) -> None:
        if self.started:
            self.ev.args(self.index, s)
        else:
            self.pending_args.append(s)

    def _end_value(self) -> None:
        raw = "".join(self.val)
        if self.key == "name" and self.name is None:
            try:
                name = json.loads(raw)
            except ValueError:
                return self._fail()
            if not isinstance(name, str) or not name:
                return self._fail()
            self.name = name
            self.ev.items.append(("start", self.index, name))
            self.ev.args(self.index, "".join(self.pending_args))
            self.pending_args = []
        elif self.is_args and self.kind == "str":
            try:
                text = json.loads(raw)
            except ValueError:
                return self._fail()
            self._args_text(text)
        return None

    def _close(self) -> None:
        try:
            obj = json.loads(self.text())
        except ValueError:
            return self._fail()
        if not isinstance(obj, dict) or not self.started:
            return self._fail()
        if self.args_key is None:
            self.ev.args(self.index, "{}")
        self.status = "done"
        self.ev.items.append(("end", self.index))
        return None

    def _fail(self) -> None:
        if self.started:
            self.status = "broken"
            self.ev.items.append(("broken", self.index, None))
        else:
            self.status = "bad"


class WsTrim:
    """Drops whitespace at the start and end of a streamed text channel and around cuts
    (call boundaries), whatever the chunking: trailing whitespace is held until more text
    follows."""

    def __init__(self) -> None:
        self.lead, self.pending = True, ""

    def push(self, s: str) -> str:
        if self.lead:
            s = s.lstrip(_WS)
            if not s:
                return ""
            self.lead = False
        s = self.pending + s
        body = s.rstrip(_WS)
        self.pending = s[len(body):]
        return body

    def cut(self) -> None:
        """A call boundary: whitespace after it is dropped; the whitespace held from before
        it is written only if more text follows (so ``"a <call> b"`` reads ``"a b"``)."""
        self.lead = True


class ToolMachine:
    """Interface of a format's state machine: ``feed(text)`` and ``finish()`` write
    `Events` (``self.events``); ``raw_of(i)`` is the text of call ``i`` (for a broken call)."""

    def __init__(self) -> None:
        self.events = Events()
        self.raws: Dict[int, str] = {}

    def feed(self, text: str) -> None:
        for c in text:
            self.push(c)

    def push(self, c: str) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def finish(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError


def parse_text(machine: ToolMachine, text: str) -> ParseResult:
    """Run ``machine`` over the whole ``text``: broken calls become content again."""
    machine.feed(text)
    machine.finish()
    trim = WsTrim()
    parts: List[str] = []
    calls: Dict[int, ToolCall] = {}
    for ev in machine.events.take():
        kind = ev[0]
        if kind == "text":
            parts.append(trim.push(ev[1]))
        elif kind == "start":
            trim.cut()
            calls[ev[1]] = ToolCall(ev[2], "")
        elif kind == "args":
            calls[ev[1]].arguments += ev[2]
        elif kind == "end":
            trim.cut()
        elif kind == "broken":
            calls.pop(ev[1], None)
            parts.append(trim.push(machine.raws.get(ev[1], "")))
            trim.cut()
    return ParseResult("".join(parts), [calls[i] for i in sorted(calls)])


class ToolCallStream:
    """The streamed side of a machine: `feed` each new piece of text, then `finish`; each
    returns a `StreamDelta`. Call ids are made here (``call_...``)."""

    def __init__(self, machine: ToolMachine) -> None:
        self.machine = machine
        self.trim = WsTrim()
        self.ids: Dict[int, str] = {}

    @property
    def has_calls(self) -> bool:
        return bool(self.ids)

    def feed(self, text: str) -> StreamDelta:
        self.machine.feed(text)
        return self._drain()

    def finish(self) -> StreamDelta:
        self.machine.finish()
        return self._drain()

    def _drain(self) -> StreamDelta:
        out = StreamDelta()
        by_index: Dict[int, ToolCallDelta] = {}
        for ev in self.machine.events.take():
            kind = ev[0]
            if kind == "text":
                out.content += self.trim.push(ev[1])
            elif kind == "start":
                self.trim.cut()
                self.ids[ev[1]] = new_call_id()
                by_index[ev[1]] = ToolCallDelta(ev[1], "", self.ids[ev[1]], ev[2])
            elif kind == "args":
                by_index.setdefault(ev[1], ToolCallDelta(ev[1])).arguments += ev[2]
            elif kind in ("end", "broken"):
                self.trim.cut()
        out.calls = [by_index[i] for i in sorted(by_index)]
        return out
