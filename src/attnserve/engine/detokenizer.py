"""Incremental detokenisation and stop conditions of one request."""

from __future__ import annotations

from typing import Iterable, Optional, Set

from attnserve.engine.request import FinishReason, Req


def decode_text(tokenizer, token_ids) -> str:
    if tokenizer is None:
        return ""
    return tokenizer.decode(token_ids, skip_special_tokens=True)


def update_text_and_check_stop(req: Req, tokenizer, eos_token_ids: Iterable[int], context_len: int) -> None:
    """After a token was appended to ``req.output_ids``: refresh ``req.text`` and set
    ``req.finish_reason`` when a stop condition holds.

    Order of checks: stop token ids and EOS (unless ``ignore_eos``), stop strings (the text
    is cut before the earliest match), then length (``max_new_tokens`` or the context).
    """
    p = req.sampling_params
    last = req.output_ids[-1]
    stop_ids: Set[int] = set(p.stop_token_ids or ())
    if not p.ignore_eos:
        stop_ids |= set(eos_token_ids)
    # EOS / stop tokens are not part of the text
    text_ids = req.output_ids[:-1] if last in stop_ids else req.output_ids
    req.text = decode_text(tokenizer, text_ids)
    if last in stop_ids:
        req.finish_reason = FinishReason.STOP
        req.matched_stop = last
        return
    if p.stop_strs:
        cut: Optional[int] = None
        for s in p.stop_strs:
            pos = req.text.find(s)
            if pos >= 0 and (cut is None or pos < cut):
                cut, req.matched_stop = pos, s
        if cut is not None:
            req.text = req.text[:cut]
            req.finish_reason = FinishReason.STOP
            return
    if len(req.output_ids) >= p.max_new_tokens or req.seq_len >= req.max_total_len or req.seq_len >= context_len:
        req.finish_reason = FinishReason.LENGTH


def stable_text(req: Req) -> str:
    """The part of ``req.text`` safe to stream: while unfinished, hold back a trailing
    replacement character (an incomplete UTF-8 sequence) and any tail that could still be
    the start of a stop string."""
    text = req.text
    if req.finished:
        return text
    while text.endswith("\ufffd"):
        text = text[:-1]
    hold = 0
    for s in req.sampling_params.stop_strs:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return text[: len(text) - hold]
