"""OpenAI's logprob shapes from the engine's logprob entries (HTTP process).

The engine sends, per output token, ``(token id, logprob, [(id, logprob), ...])`` and,
under ``echo``, per prompt token ``(token id, logprob or None, alternatives or None)``
(`attnserve.engine.logprobs.StreamCursor`). This module turns them into:

* chat: ``choices[].logprobs.content[]`` = ``{token, logprob, bytes, top_logprobs:
  [{token, logprob, bytes}]}`` (`chat_logprobs`);
* completions: ``choices[].logprobs`` = ``{tokens, token_logprobs, top_logprobs:
  [{text: logprob}], text_offset}`` (`CompletionLogprobsBuilder`); as OpenAI documents,
  each ``top_logprobs`` dict holds the chosen token too, so it may have ``logprobs + 1``
  entries (fewer when alternatives decode to the same text).

A token's text is ``tokenizer.decode([id])`` (special tokens kept). Its ``bytes`` are its
exact UTF-8 bytes: the text's encoding when it decodes to whole characters; for a token
that is only part of a character, the bytes behind a byte-level BPE symbol (the GPT-2
byte-to-unicode table, Radford et al. 2019) or a SentencePiece ``<0xNN>`` byte token.
Logprobs below `LOGPROB_FLOOR` (never for finite logits) are reported as the floor, as JSON
has no ``-inf``.
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional, Sequence, Tuple

from attnserve.server.protocol import ChatChoiceLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob

#: the lowest logprob reported (vLLM's stand-in for -inf as well)
LOGPROB_FLOOR = -9999.0
_SP_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _byte_level_table() -> Dict[str, int]:
    """GPT-2's byte-level BPE alphabet, symbol -> byte: printable Latin-1 bytes stand for
    themselves, the other bytes for code points from 256 up, in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) \
        + list(range(ord("\xae"), ord("\xff") + 1))
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


class TokenTexts:
    """Text and bytes of token ids, cached (one instance per response).

    Args:
        tokenizer: an HF tokenizer, or None (then a token's text is ``"token_id:<id>"``).
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: Dict[int, Tuple[str, List[int]]] = {}
        self._table: Optional[Dict[str, int]] = None

    def _raw_bytes(self, tid: int, text: str) -> List[int]:
        if "\ufffd" not in text:
            return list(text.encode("utf-8"))
        piece = self.tokenizer.convert_ids_to_tokens(tid)
        if isinstance(piece, str):
            m = _SP_BYTE.match(piece)
            if m:
                return [int(m.group(1), 16)]
            if self._table is None:
                self._table = _byte_level_table()
            if piece and all(c in self._table for c in piece):
                return [self._table[c] for c in piece]
        return list(text.encode("utf-8"))

    def get(self, tid: int) -> Tuple[str, List[int]]:
        """``(text, UTF-8 bytes)`` of token ``tid``."""
        hit = self._cache.get(tid)
        if hit is None:
            if self.tokenizer is None:
                text = f"token_id:{tid}"
                hit = (text, list(text.encode("utf-8")))
            else:
                text = self.tokenizer.decode([tid], skip_special_tokens=False)
                hit = (text, self._raw_bytes(tid, text))
            self._cache[tid] = hit
        return hit


def _lp(x: float) -> float:
    return x if x >= LOGPROB_FLOOR else LOGPROB_FLOOR


def chat_logprobs(entries: Sequence[tuple], texts: TokenTexts) -> ChatChoiceLogprobs:
    """``choices[].logprobs`` of a chat response or chunk from output entries."""
    content = []
    for tid, lp, top in entries:
        text, raw = texts.get(tid)
        alts = []
        for aid, alp in top:
            atext, araw = texts.get(aid)
            alts.append(TopLogprob(token=atext, logprob=_lp(alp), bytes=araw))
        content.append(ChatTokenLogprob(token=text, logprob=_lp(lp), bytes=raw, top_logprobs=alts))
    return ChatChoiceLogprobs(content=content)


class CompletionLogprobsBuilder:
    """``choices[].logprobs`` of a completion, chunk by chunk (``text_offset`` continues
    across the chunks of a stream).

    Args:
        texts: the response's `TokenTexts`.
        offset: character offset of the first token (0: the choice's text starts with it).
    """

    def __init__(self, texts: TokenTexts, offset: int = 0):
        self.texts = texts
        self.offset = offset

    def build(self, entries: Sequence[tuple]) -> CompletionLogprobs:
        """From prompt and/or output entries ``(token id, logprob or None, alternatives or
        None)``, in text order."""
        tokens: List[str] = []
        token_lps: List[Optional[float]] = []
        tops: List[Optional[Dict[str, float]]] = []
        offsets: List[int] = []
        for tid, lp, top in entries:
            text = self.texts.get(tid)[0]
            tokens.append(text)
            offsets.append(self.offset)
            self.offset += len(text)
            if lp is None:  # the first prompt token: no context, no distribution
                token_lps.append(None)
                tops.append(None)
                continue
            token_lps.append(_lp(lp))
            alts: Dict[str, float] = {}
            for aid, alp in top or ():
                alts.setdefault(self.texts.get(aid)[0], _lp(alp))
            alts.setdefault(text, _lp(lp))
            tops.append(alts)
        return CompletionLogprobs(tokens=tokens, token_logprobs=token_lps, top_logprobs=tops, text_offset=offsets)
