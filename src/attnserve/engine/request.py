"""`Req`: one request's state inside the scheduler."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import List, Optional

import torch

from attnserve.engine.sampling_params import SamplingParams


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_new_tokens or the context length
    ABORT = "abort"  # cancelled by the client


@dataclass
class Req:
    """A request from admission to completion.

    ``fill_ids = prompt_ids + output_ids``; ``kv_len`` of them have K/V in the cache (their
    slots are ``req_to_token[req_pool_idx, :kv_len]``). ``max_total_len`` bounds the tokens
    the request may ever hold and is what the scheduler reserves KV for at admission.
    """

    rid: str
    prompt_ids: List[int]
    sampling_params: SamplingParams
    max_total_len: int
    output_ids: List[int] = field(default_factory=list)
    req_pool_idx: Optional[int] = None
    kv_len: int = 0
    last_loc: int = 0
    finish_reason: Optional[FinishReason] = None
    matched_stop: Optional[object] = None
    text: str = ""
    generator: Optional[torch.Generator] = None
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
        """Prompt tokens (other than the last) still lack K/V."""
        return self.kv_len < len(self.prompt_ids)
