"""vLLM's per-choice extras on the OpenAI routes (`attnserve.server.openai_api`,
`attnserve.server.completion_api`):

* ``stop_reason`` (`stop_reason`): on every choice of a response, and on the streamed chunk
  that carries a choice's ``finish_reason``: the stop string that ended the choice (str), or
  the token id (int) when it was one of the request's ``stop_token_ids``; null when the
  choice ended otherwise (EOS or a grammar's end without being in ``stop_token_ids``,
  ``length``, ``abort``), as vLLM reports it.
* ``stream_options.continuous_usage_stats`` with ``include_usage`` (`ChoiceExtras.decorate`):
  every streamed chunk that holds a choice carries ``usage`` for that choice alone,
  ``{"prompt_tokens": tokens of its prompt, "completion_tokens": tokens it generated so far,
  "total_tokens": their sum}`` (no ``prompt_tokens_details``), as vLLM's
  ``serving_completion`` / ``serving_chat`` do; the final usage chunk (``choices`` empty)
  still counts the whole request.

Sources (facts only): vLLM's ``CompletionResponseStreamChoice`` / ``ChatCompletionResponse
StreamChoice`` ``stop_reason`` and its streaming generators' ``include_continuous_usage``.
"""

from __future__ import annotations

from typing import Any, Collection, List, Optional

from attnserve.server.engine_loop import StreamEvent
from attnserve.server.protocol import StopReason, UsageInfo


def stop_reason(ev: StreamEvent, stop_token_ids: Optional[Collection[int]]) -> StopReason:
    """vLLM's ``stop_reason`` of a choice whose final event is ``ev`` (see the module
    docstring): ``ev.matched_stop`` when it is a string, or an id among ``stop_token_ids``."""
    matched = ev.matched_stop
    if ev.finish_reason != "stop" or matched is None:
        return None
    if isinstance(matched, str):
        return matched
    return matched if stop_token_ids and matched in stop_token_ids else None


class ChoiceExtras:
    """The extras of one OpenAI request's choices.

    Args:
        prompt_lens: tokens of each prompt; choice ``i`` belongs to prompt ``i // n``.
        n: choices per prompt.
        stop_token_ids: the request's ``stop_token_ids`` (None: none).
        continuous: put a per-choice ``usage`` on every chunk (`StreamOptions`).
        scoring: the choices are prompts only (``echo`` with ``max_tokens: 0``): they report
            0 completion tokens and no ``stop_reason``.
    """

    def __init__(self, prompt_lens: List[int], n: int, stop_token_ids: Optional[Collection[int]],
                 continuous: bool = False, scoring: bool = False):
        self.prompt_lens, self.n = prompt_lens, n
        self.stop_token_ids = frozenset(stop_token_ids or ())
        self.continuous, self.scoring = continuous, scoring

    def stop_reason(self, ev: StreamEvent) -> StopReason:
        """`stop_reason` of a choice's final event (None for a scoring request)."""
        return None if self.scoring else stop_reason(ev, self.stop_token_ids)

    def usage(self, i: int, completion_tokens: int) -> UsageInfo:
        """Choice ``i``'s usage after ``completion_tokens`` generated tokens."""
        prompt = self.prompt_lens[i // self.n]
        done = 0 if self.scoring else completion_tokens
        return UsageInfo(prompt_tokens=prompt, completion_tokens=done, total_tokens=prompt + done)

    def decorate(self, chunk: Any, i: int, completion_tokens: int, final: Optional[StreamEvent] = None) -> Any:
        """``chunk`` (a streamed response holding choice ``i``) with its ``usage`` when
        continuous usage is on, and with its choice's ``stop_reason`` when ``final`` (the
        choice's final event) is given; returns ``chunk``."""
        if final is not None and chunk.choices:
            chunk.choices[0].stop_reason = self.stop_reason(final)
        if self.continuous:
            chunk.usage = self.usage(i, completion_tokens)
        return chunk
