"""Detokenisation and stop conditions of one request.

The text leaves special tokens out unless the request's ``skip_special_tokens`` is False
(`SamplingParams`); stop strings are looked for in that same text.

The scheduler calls `check_stop` once per new token. Token-level conditions (EOS, stop
token ids, length) cost no decoding; stop strings are looked for in the decoded tail of
the output only (a stop string newly completed by the last token lies within it), so the
per-token cost does not grow with the output. The full text is decoded once, when the
request finishes (`finalize_text`), or on demand for streaming (`stable_text`).
"""

from __future__ import annotations

from typing import Iterable, Set

from attnserve.engine.request import FinishReason, Req

#: tokens decoded per character of the longest stop string when looking for it in the tail
#: (a character can take several byte-level tokens, e.g. 3-4 for CJK or emoji)
_TAIL_TOKENS_PER_CHAR = 4


def decode_text(tokenizer, token_ids, skip_special_tokens: bool = True) -> str:
    """The text of ``token_ids`` ("" without a tokenizer); special tokens are left out
    unless ``skip_special_tokens`` is False (a request's `SamplingParams` field)."""
    if tokenizer is None:
        return ""
    return tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


def stop_ids_of(req: Req, eos_token_ids: Iterable[int]) -> frozenset:
    """The token ids that end ``req``: its ``stop_token_ids``, plus ``eos_token_ids`` unless
    ``ignore_eos`` (`Req.stop_ids` keeps them for the request's lifetime)."""
    p = req.sampling_params
    ids: Set[int] = set(p.stop_token_ids or ())
    if not p.ignore_eos:
        ids |= set(eos_token_ids)
    return frozenset(ids)


def may_stop(req: Req, token: int, context_len: int) -> bool:
    """Whether appending ``token`` to ``req`` could end it: False only when `check_stop`
    would certainly leave it running (a request without grammar or stop strings whose
    ``stop_ids`` are known, ``token`` not among them, below every length limit). The
    scheduler's per-token fast path: such a token is appended without `check_stop`."""
    if req.grammar is not None or req.stop_ids is None or req.sampling_params.stop_strs or token in req.stop_ids:
        return True
    n = len(req.output_ids) + 1
    total = len(req.prompt_ids) + n
    return n >= req.sampling_params.max_new_tokens or total >= req.max_total_len or total >= context_len


def finalize_text(req: Req, tokenizer) -> None:
    """Set ``req.text`` to the whole output: a stop token is not part of it, and the text
    is cut before the earliest stop string (``req.matched_stop`` names it)."""
    ids = req.output_ids
    if req.finish_reason == FinishReason.STOP and not isinstance(req.matched_stop, str) and ids:
        ids = ids[:-1]  # EOS / stop token
    text = decode_text(tokenizer, ids, req.sampling_params.skip_special_tokens)
    cut = -1
    for s in req.sampling_params.stop_strs:
        pos = text.find(s)
        if pos >= 0 and (cut < 0 or pos < cut):
            cut = pos
            if req.finish_reason == FinishReason.STOP and isinstance(req.matched_stop, str):
                req.matched_stop = s
    req.text = text[:cut] if cut >= 0 else text


def check_stop(req: Req, tokenizer, eos_token_ids: Iterable[int], context_len: int) -> None:
    """After a token was appended to ``req.output_ids``: set ``req.finish_reason`` when a
    stop condition holds, and then the final ``req.text``.

    Order of checks: stop token ids and EOS (unless ``ignore_eos``), stop strings, then
    length (``max_new_tokens``, ``max_total_len`` or the context).
    """
    p = req.sampling_params
    last = req.output_ids[-1]
    ids = req.stop_ids if req.stop_ids is not None else stop_ids_of(req, eos_token_ids)
    if last in ids:
        req.finish_reason = FinishReason.STOP
        req.matched_stop = last
    elif p.stop_strs and tokenizer is not None:
        window = _TAIL_TOKENS_PER_CHAR * max(len(s) for s in p.stop_strs) + 2
        tail = decode_text(tokenizer, req.output_ids[-window:], p.skip_special_tokens)
        for s in p.stop_strs:
            if s in tail:
                req.finish_reason = FinishReason.STOP
                req.matched_stop = s
                break
    if req.finish_reason is None and (
        len(req.output_ids) >= p.max_new_tokens or req.seq_len >= req.max_total_len or req.seq_len >= context_len
    ):
        req.finish_reason = FinishReason.LENGTH
    if req.finish_reason is not None:
        finalize_text(req, tokenizer)


def stable_text(req: Req, tokenizer=None) -> str:
    """The part of the output text safe to stream: while unfinished, the decoded output
    without a trailing replacement character (an incomplete UTF-8 sequence) and without any
    tail that could still be the start of a stop string. ``tokenizer`` decodes an
    unfinished request (without it, ``req.text`` is used as is)."""
    if req.finished:
        return req.text
    skip = req.sampling_params.skip_special_tokens
    text = decode_text(tokenizer, req.output_ids, skip) if tokenizer is not None else req.text
    while text.endswith("\ufffd"):
        text = text[:-1]
    hold = 0
    for s in req.sampling_params.stop_strs:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return text[: len(text) - hold]
