"""Incremental detokenization of one streamed request (HTTP process of the
multi-process server).

The engine process sends each step's new token ids; `IncrementalDetokenizer` turns them into
text a few tokens at a time instead of decoding the whole output every step (which costs
O(output length) per step: 228 us for 300 SmolLM2 tokens on this project's 2-core CPU, so
O(n^2) per request). It keeps two offsets into the ids, as SGLang's detokenizer manager and
vLLM's ``detokenize_incrementally`` do: the window ``ids[prefix_offset:read_offset]`` was
decoded already and serves as left context (SentencePiece's leading-space rule and
multi-token characters depend on it), and each round decodes ``ids[prefix_offset:]`` and
appends what follows the window's own text. A decode that ends in U+FFFD (an incomplete
UTF-8 sequence) is held back until the next token completes it.

`stable_text` is what may be streamed: the decoded text minus any tail that could still be
the start of a stop string (the rule of `attnserve.engine.detokenizer.stable_text`). The
final text always comes from the engine (`attnserve.engine.detokenizer.finalize_text`:
stop strings cut, the stop token dropped); the stream's last delta is that text minus what
was sent.
"""

from __future__ import annotations

from typing import List, Sequence


class IncrementalDetokenizer:
    """Decoded text of one request's output so far.

    Args:
        tokenizer: an HF tokenizer (``decode(ids, skip_special_tokens=...)``).
        stop_strs: the request's stop strings (text that could start one is held back).
        skip_special_tokens: leave special tokens out of the text (the request's
            `SamplingParams` field, as the engine's final text does).
    """

    def __init__(self, tokenizer, stop_strs: Sequence[str] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stop_strs = tuple(s for s in stop_strs if s)
        self.skip_special_tokens = skip_special_tokens
        self.ids: List[int] = []
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: Sequence[int]) -> None:
        """Append generated token ids and extend `text` with what they decode to (nothing
        yet when they end inside a multi-byte character)."""
        if not new_ids:
            return
        self.ids.extend(new_ids)
        window = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if full.endswith("\ufffd"):
            return
        if full.startswith(window):
            self.text += full[len(window):]
        else:  # the window decodes differently once followed by more tokens: decode all once
            whole = self._decode(self.ids)
            if whole.startswith(self.text):
                self.text = whole
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)

    def stable_len(self) -> int:
        """Length of the streamable part of `text`: all of it but a tail that is a proper
        prefix of a stop string. It never decreases as tokens are added (a longer held tail
        would have been held before)."""
        text = self.text
        hold = 0
        for s in self.stop_strs:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        return len(text) - hold

    def stable_text(self) -> str:
        """``text[:stable_len()]``."""
        return self.text[: self.stable_len()]
