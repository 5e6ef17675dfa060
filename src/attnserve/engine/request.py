"""`Req`: one request's state inside the scheduler."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, List, Optional

from attnserve.engine.sampling_params import SamplingParams


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_new_tokens or the context length
    ABORT = "abort"  # cancelled by the client, or failed alone (``Req.error`` says why)


def sglang_finish_reason(reason: Optional[str], matched: object, length: int,
                         message: str = "Aborted") -> Optional[dict]:
    """SGLang's ``meta_info.finish_reason`` (its ``FINISH_*.to_json``) of a request that ended
    with ``reason`` ("stop", "length", "abort"; None while it runs): ``{"type": "stop",
    "matched": token id (int) or stop string (str)}``, ``{"type": "length", "length":
    length}`` (tokens generated), ``{"type": "abort", "message": message, "status_code":
    None, "err_type": None}``. Used by the offline `GenerateOutput` and the native
    ``/generate`` route."""
    if reason is None:
        return None
    if reason == "stop":
        return {"type": "stop", "matched": matched}
    if reason == "length":
        return {"type": "length", "length": length}
    if reason == "abort":
        return {"type": "abort", "message": message, "status_code": None, "err_type": None}
    return {"type": reason}


@dataclass(eq=False)  # identity equality: `list.remove` / `in` over the running batch stay C-fast
class Req:
    """A request from admission to completion.

    ``fill_ids = prompt_ids + output_ids``; ``kv_len`` tokens have K/V in the cache or
    being computed by a launched step (their slots are ``req_to_token[req_pool_idx,
    :kv_len]``). ``max_total_len`` bounds the tokens the request may ever hold.

    ``prefill_target`` is how many of ``fill_ids`` the request prefills after admission
    (the prompt, or prompt + output after a retraction); once ``kv_len`` reaches it the
    request decodes. ``num_inflight`` counts tokens sampled by launched steps whose ids
    have not reached the host yet (overlap scheduling). ``seed`` keys the request's
    sampling noise (`attnserve.engine.sampler`).

    Prefix cache (`attnserve.engine.prefix_cache`): the first ``cache_own_len`` slots of the
    row belong to the tree (locked through ``last_node``), the rest to the request;
    ``cached_tokens`` counts prompt tokens served from the cache; ``kv_committed`` is False
    when the step computing the request's K/V failed (they are then not cached).

    ``stop_ids``: the token ids that end the request (stop token ids, plus EOS unless
    ``ignore_eos``), fixed at arrival by the scheduler (`attnserve.engine.detokenizer.stop_ids_of`);
    None: worked out at each check.

    ``spec_verify_ct``: speculative verify steps the request took part in (SGLang's name;
    accept length = output tokens / ``spec_verify_ct``).

    ``grammar``: the `attnserve.engine.constrained.RequestGrammar` of a constrained request
    (None otherwise). ``error_status``: the HTTP status of ``error`` (400: the request
    itself was at fault, e.g. a grammar that does not compile; 500 otherwise).
    Sampling extras (`attnserve.engine.sampling_extras`): ``control_slot`` is the request's
    row of the logit-control tensors (None: no controls; -1: not taken yet); ``logprobs``
    its `LogprobRecord` when it asked for logprobs.
    """

    rid: str
    prompt_ids: List[int]
    sampling_params: SamplingParams
    max_total_len: int
    output_ids: List[int] = field(default_factory=list)
    req_pool_idx: Optional[int] = None
    kv_len: int = 0
    prefill_target: int = 0
    num_inflight: int = 0
    seed: int = 0
    num_retractions: int = 0
    error: Optional[str] = None
    error_status: int = 500
    last_node: Optional[Any] = None
    cache_own_len: int = 0
    cached_tokens: int = 0
    kv_committed: bool = True
    spec_verify_ct: int = 0
    grammar: Optional[Any] = None
    control_slot: Optional[int] = None
    logprobs: Optional[Any] = None
    finish_reason: Optional[FinishReason] = None
    matched_stop: Optional[object] = None
    stop_ids: Optional[frozenset] = None
    text: str = ""
    created_at: float = field(default_factory=time.perf_counter)
    first_token_at: Optional[float] = None
    finished_at: Optional[float] = None

    @property
    def fill_ids(self) -> List[int]:
        return self.prompt_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def is_prefilling(self) -> bool:
        """Tokens of ``fill_ids`` up to ``prefill_target`` still lack K/V."""
        return self.kv_len < self.prefill_target

    @property
    def num_launched_outputs(self) -> int:
        """Output tokens on the host plus those still being sampled."""
        return len(self.output_ids) + self.num_inflight

    def can_decode_more(self) -> bool:
        """Another decode step may still produce a token this request keeps: its launched
        outputs are below ``max_new_tokens`` and its length below ``max_total_len``."""
        n = len(self.output_ids) + self.num_inflight  # num_launched_outputs, inlined (per request per step)
        return (self.finish_reason is None and n < self.sampling_params.max_new_tokens
                and len(self.prompt_ids) + n < self.max_total_len)
