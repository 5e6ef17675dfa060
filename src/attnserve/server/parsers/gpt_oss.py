"""OpenAI gpt-oss output in the harmony format: ``--reasoning-parser gpt-oss`` and
``--tool-call-parser gpt-oss`` (SGLang's names for these models).

Format facts from OpenAI's "OpenAI Harmony Response Format"
(cookbook.openai.com/articles/openai-harmony) and github.com/openai/harmony. The chat
template's generation prompt ends with ``<|start|>assistant``; the model then writes one or
more messages, each a header, ``<|message|>``, a body and an end marker::

    <|channel|>analysis<|message|>We need ...<|end|><|start|>assistant<|channel|>final<|message|>4.<|return|>
    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"location":"Paris"}<|call|>

A header holds, in any order after the role (only after ``<|start|>``): ``<|channel|>`` and
the channel (``analysis``: chain of thought; ``final``: the answer; ``commentary``: tool
calls and user-visible preambles), a recipient ``to=functions.NAME`` (before or after the
channel), and a content type (``json`` or ``<|constrain|>json``). ``<|end|>`` closes a
message, ``<|return|>`` and ``<|call|>`` close the last one (they end the generation, and
the engine drops the stop token from the text; both are read when present). The markers
are special tokens: they reach the parsers only because the chat route decodes a request
read by a gpt-oss parser with ``skip_special_tokens=False``
(`attnserve.server.chat_output.harmony_sampling_params`).

What goes where:

* a message whose recipient is ``functions.NAME`` is a call of ``NAME`` (whatever its
  channel, normally ``commentary``); its body, a JSON object, is the arguments;
* otherwise ``analysis`` is reasoning, everything else (``final``, ``commentary`` without
  a function recipient, no channel) is content.

Each message's text is taken without whitespace at its start and end; messages of one kind
are joined with ``"\\n"``. The markers never appear in any output.

* ``--reasoning-parser gpt-oss`` (`GptOssReasoningParser`): reasoning -> ``reasoning_content``,
  content -> ``content``. When the gpt-oss tool parser runs after it (the request has
  tools), it hands every non-reasoning message on in harmony form (``<|start|>assistant
  <|channel|>C[ to=R]<|message|>body<|end|>``), so the tool parser sees calls and content in
  order; otherwise a call's body is content.
* ``--tool-call-parser gpt-oss`` (`GptOssMachine`): calls -> ``tool_calls``, content ->
  ``content``; reasoning is dropped (SGLang's gpt-oss tool parser does the same: with no
  reasoning parser the chain of thought has no field to go to). A call is announced (its
  name) at the ``{`` opening its body, its argument text streams as it arrives, and it ends
  with its message; a body that breaks after that (invalid JSON, text after the object,
  cut off) is a broken call (`attnserve.server.parsers.base`: content again in the whole
  text, kept in a stream). A call message whose body does not start with ``{`` is content.

**Malformed input is content.** A header with anything a header cannot hold (a character
other than letters, digits, ``_-.=:/`` and whitespace, more than `MAX_HEADER` characters,
words that are not a role, recipient, channel or content type) turns into the start of a
content message: its text (markers removed) and what follows, so output that is not
harmony at all is content, unchanged. A header cut off or interrupted by another marker
before ``<|message|>`` is dropped when it is well formed, else it is content too. A stray
``<|message|>`` or ``<|constrain|>`` in a body is dropped; ``<|start|>`` or ``<|channel|>``
there ends the message (a missing ``<|end|>``).

Like the other parsers, everything is a state machine fed character by character, so the
whole text and a stream split anywhere give the same result (the one exception: a broken
call, as for every tool-call format).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import List, Optional, Tuple

from attnserve.server.parsers.base import _WS, ToolMachine, WsTrim
from attnserve.server.parsers.reasoning import ReasoningDelta, ReasoningParser

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, RETURN, CALL)
ENDS = (END, RETURN, CALL)
#: the tokens that end an assistant turn (harmony's stop tokens for assistant actions)
STOP_TOKENS = (RETURN, CALL)
FUNCTIONS = "functions."
NAME = "gpt-oss"
#: characters of a header longer than this (markers not counted) make it malformed
MAX_HEADER = 128
_HEADER_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.=:/" + _WS)


@dataclass(frozen=True)
class Header:
    """A message's header: ``channel`` and ``recipient`` (``to=``), None when absent."""

    channel: Optional[str] = None
    recipient: Optional[str] = None

    @property
    def call_name(self) -> Optional[str]:
        """The function a ``to=functions.NAME`` message calls, else None."""
        r = self.recipient
        return r[len(FUNCTIONS):] if r is not None and r.startswith(FUNCTIONS) and len(r) > len(FUNCTIONS) else None

    @property
    def kind(self) -> str:
        """``"call"``, ``"reasoning"`` (the analysis channel) or ``"content"``."""
        if self.call_name is not None:
            return "call"
        return "reasoning" if self.channel == "analysis" else "content"

    def harmony(self) -> str:
        """The header as a new message's harmony text, up to and with ``<|message|>``."""
        to = f" to={self.recipient}" if self.recipient else ""
        return f"{START}assistant{CHANNEL}{self.channel or 'final'}{to}{MESSAGE}"


def parse_header(pieces: List[Tuple[bool, str]], role: bool) -> Optional[Header]:
    """The `Header` of a header's pieces (``(is_marker, text)``), or None when it holds
    anything else than an optional role (when ``role``: it followed ``<|start|>``), one
    recipient, one channel and one content type."""
    tokens: List[str] = []
    for is_marker, s in pieces:
        if is_marker:
            tokens.append(s)
        else:
            tokens.extend(s.split())
    i = 1 if role and tokens and tokens[0] not in MARKERS and not tokens[0].startswith("to=") else 0
    channel = recipient = ctype = None
    while i < len(tokens):
        t = tokens[i]
        nxt = tokens[i + 1] if i + 1 < len(tokens) else None
        if t.startswith("to=") and len(t) > 3 and recipient is None:
            recipient = t[3:]
        elif t in (CHANNEL, CONSTRAIN) and nxt is not None and nxt not in MARKERS and not nxt.startswith("to="):
            if t == CHANNEL:
                if channel is not None:
                    return None
                channel = nxt
            elif ctype is not None:
                return None
            else:
                ctype = nxt
            i += 1
        elif t not in MARKERS and channel is not None and ctype is None:
            ctype = t  # "commentary json"
        else:
            return None
        i += 1
    return Header(channel, recipient)


class MarkerSplitter:
    """Splits text fed one character at a time into text and markers, holding back a tail
    that may still become a marker."""

    def __init__(self) -> None:
        self.held = ""

    def push(self, c: str) -> List[Tuple[bool, str]]:
        """``(is_marker, text)`` pieces that are certain now."""
        if not self.held and c != "<":
            return [(False, c)]
        self.held += c
        out: List[Tuple[bool, str]] = []
        while self.held:
            if any(m.startswith(self.held) for m in MARKERS):
                if self.held in MARKERS:
                    out.append((True, self.held))
                    self.held = ""
                break
            cut = self.held.find("<", 1)
            if cut < 0:
                out.append((False, self.held))
                self.held = ""
            else:
                out.append((False, self.held[:cut]))
                self.held = self.held[cut:]
        return out

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


class HarmonyReader:
    """Harmony text fed in pieces -> message events: ``("open", Header)``, ``("text", s)``
    (body text; consecutive pieces merged), ``("close",)`` (see the module doc)."""

    def __init__(self) -> None:
        self.split = MarkerSplitter()
        self.mode = "header"
        self.pieces: List[Tuple[bool, str]] = []
        self.role = False  # the header followed <|start|>
        self.header_len = 0
        self.out: List[tuple] = []
        self.buf: List[str] = []  # body text not yet in `out` (one event per run of text)

    def feed(self, text: str) -> List[tuple]:
        for c in text:
            for is_marker, s in self.split.push(c):
                self._piece(is_marker, s)
        return self._take()

    def finish(self) -> List[tuple]:
        rest = self.split.flush()
        if rest:
            self._piece(False, rest)
        if self.mode == "body":
            self._event(("close",))
        else:
            self._interrupted()
        self.mode = "done"
        return self._take()

    def _take(self) -> List[tuple]:
        self._event(None)
        out, self.out = self.out, []
        return out

    def _text(self, s: str) -> None:
        if s:
            self.buf.append(s)

    def _event(self, ev: Optional[tuple]) -> None:
        """Append ``ev`` (None: nothing) after the text before it."""
        if self.buf:
            self.out.append(("text", "".join(self.buf)))
            self.buf = []
        if ev is not None:
            self.out.append(ev)

    def _new_header(self, role: bool) -> None:
        self.mode, self.pieces, self.role, self.header_len = "header", [], role, 0

    def _header_text(self) -> str:
        return "".join(s for is_marker, s in self.pieces if not is_marker)

    def _as_content(self, rest: str) -> None:
        """The header so far is malformed: it starts a content message."""
        self._event(("open", Header()))
        self.mode = "body"
        self._text(self._header_text() + rest)

    def _interrupted(self) -> None:
        """A header ended without ``<|message|>``: dropped when well formed, else content."""
        text = self._header_text()
        if text.strip(_WS) and parse_header(self.pieces, self.role) is None:
            self._as_content("")
            self._event(("close",))

    def _piece(self, is_marker: bool, s: str) -> None:
        if self.mode == "body":
            if not is_marker:
                self._text(s)
            elif s in ENDS or s in (START, CHANNEL):
                self._event(("close",))
                self._new_header(s == START)
                if s == CHANNEL:
                    self.pieces.append((True, s))
            return  # a stray <|message|> / <|constrain|> is dropped
        if is_marker:
            if s == MESSAGE:
                header = parse_header(self.pieces, self.role)
                if header is None:
                    self._as_content("")
                else:
                    self._event(("open", header))
                    self.mode = "body"
            elif s in (CHANNEL, CONSTRAIN):
                self.pieces.append((True, s))
            else:  # <|start|> or an end marker before <|message|>
                self._interrupted()
                self._new_header(s == START)
            return
        for i, c in enumerate(s):
            self.header_len += 1
            if c not in _HEADER_CHARS or self.header_len > MAX_HEADER:
                self._header_piece(s[:i])
                self._as_content(s[i:])
                return
        self._header_piece(s)

    def _header_piece(self, s: str) -> None:
        """Append header text (merged with the text piece before it: a word is one piece)."""
        if self.pieces and not self.pieces[-1][0]:
            self.pieces[-1] = (False, self.pieces[-1][1] + s)
        elif s:
            self.pieces.append((False, s))


class _Joined:
    """One output field built from messages: each message's text without whitespace at its
    start and end, messages joined by ``"\\n"`` (held until more text follows)."""

    def __init__(self) -> None:
        self.all = WsTrim()
        self.msg = WsTrim()

    def open(self) -> None:
        self.msg = WsTrim()

    def push(self, s: str) -> str:
        return self.all.push(self.msg.push(s))

    def close(self) -> None:
        if not self.msg.lead:  # the message had text
            self.all.push("\n")


class GptOssReasoningStream:
    """The reasoning side of harmony (`ReasoningStream`'s interface: `feed`, `finish`).

    Args:
        keep_calls: the gpt-oss tool parser reads the content next: every non-reasoning
            message is handed on as harmony text.
    """

    def __init__(self, keep_calls: bool) -> None:
        self.reader = HarmonyReader()
        self.keep = keep_calls
        self.reasoning, self.content = _Joined(), _Joined()
        self.route: Optional[_Joined] = None  # None: handed on as harmony text

    def feed(self, text: str) -> ReasoningDelta:
        return self._apply(self.reader.feed(text))

    def finish(self) -> ReasoningDelta:
        return self._apply(self.reader.finish())

    def _apply(self, events: List[tuple]) -> ReasoningDelta:
        out = ReasoningDelta()
        for ev in events:
            if ev[0] == "open":
                header: Header = ev[1]
                if header.kind == "reasoning":
                    self.route = self.reasoning
                elif self.keep:
                    self.route = None
                    out.content += header.harmony()
                else:
                    self.route = self.content
                if self.route is not None:
                    self.route.open()
            elif ev[0] == "text":
                if self.route is None:
                    out.content += ev[1]
                elif self.route is self.reasoning:
                    out.reasoning += self.reasoning.push(ev[1])
                else:
                    out.content += self.content.push(ev[1])
            elif self.route is None:
                out.content += END
            else:
                self.route.close()
        return out


class GptOssReasoningParser(ReasoningParser):
    """``--reasoning-parser gpt-oss`` (see the module doc)."""

    name = NAME

    def stream(self) -> GptOssReasoningStream:  # type: ignore[override]
        return GptOssReasoningStream(keep_calls=self.tool_format == NAME)


class _Call:
    """The body of one call message."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.raw: List[str] = []
        self.args: List[str] = []
        self.state = "wait"  # -> "args" at "{" -> "done" when the object closes; "junk": text after it
        self.index = -1
        self.depth, self.in_str, self.esc = 0, False, False

    def scan(self, c: str) -> None:
        """One character of the JSON text (state "args")."""
        self.args.append(c)
        if self.esc:
            self.esc = False
        elif self.in_str:
            if c == "\\":
                self.esc = True
            elif c == '"':
                self.in_str = False
        elif c == '"':
            self.in_str = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            if self.depth == 0:
                self.state = "done"

    def valid(self) -> bool:
        if self.state != "done":
            return False
        try:
            return isinstance(json.loads("".join(self.args)), dict)
        except ValueError:
            return False


class GptOssMachine(ToolMachine):
    """``--tool-call-parser gpt-oss`` (see the module doc).

    Args:
        calls: False: call messages are content (the request takes no calls, but the
            harmony markers must still be read).
    """

    def __init__(self, calls: bool = True) -> None:
        super().__init__()
        self.reader = HarmonyReader()
        self.calls = calls
        self.mode: Optional[str] = None  # "skip" | "text" | "call"
        self.msg = WsTrim()
        self.call: Optional[_Call] = None
        self.n = 0

    def feed(self, text: str) -> None:
        self._apply(self.reader.feed(text))

    def push(self, c: str) -> None:
        self.feed(c)

    def finish(self) -> None:
        self._apply(self.reader.finish())

    def _apply(self, events: List[tuple]) -> None:
        for ev in events:
            if ev[0] == "open":
                header: Header = ev[1]
                if header.kind == "reasoning":
                    self.mode = "skip"
                elif header.kind == "call" and self.calls:
                    self.mode, self.call = "call", _Call(header.call_name)
                else:
                    self.mode, self.msg = "text", WsTrim()
            elif ev[0] == "text":
                if self.mode == "text":
                    self.events.text(self.msg.push(ev[1]))
                elif self.mode == "call":
                    self._call_text(ev[1])
            else:
                if self.mode == "text" and not self.msg.lead:
                    self.events.text("\n")  # between messages; dropped unless more text follows
                elif self.mode == "call":
                    self._end_call()
                self.mode = None

    def _call_text(self, s: str) -> None:
        call = self.call
        start = len(call.args)
        for k, c in enumerate(s):
            call.raw.append(c)
            if call.state == "wait":
                if c in _WS:
                    continue
                if c != "{":  # not a JSON object: the message is content
                    self.mode, self.msg = "text", WsTrim()
                    self.events.text(self.msg.push("".join(call.raw) + s[k + 1:]))
                    return
                call.state, call.index = "args", self.n
                self.n += 1
                self.events.items.append(("start", call.index, call.name))
            if call.state == "args":
                call.scan(c)
            elif call.state == "done" and c not in _WS:
                call.state = "junk"
        if call.index >= 0:
            self.events.args(call.index, "".join(call.args[start:]))

    def _end_call(self) -> None:
        call = self.call
        if call.state == "wait":  # an empty body: nothing to say
            return
        if call.valid():
            self.events.items.append(("end", call.index))
        else:
            self.raws[call.index] = "".join(call.raw)
            self.events.items.append(("broken", call.index, None))
