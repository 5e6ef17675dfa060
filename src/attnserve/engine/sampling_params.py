"""`SamplingParams`: how one request is decoded (names as in SGLang/vLLM)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

from attnserve.engine.logprobs import verify_logprob_params
from attnserve.engine.penalties import verify_controls

#: temperatures below this are greedy (SGLang's ``_SAMPLING_EPS`` is 1e-6; 1e-5 keeps
#: ``logits / T`` well inside float32 for any logit a model produces, so a tiny temperature
#: can never turn into inf/NaN probabilities).
SAMPLING_EPS = 1e-5


@dataclass
class SamplingParams:
    """Decoding settings of one request.

    Attributes:
        max_new_tokens: tokens to generate at most (>= 1).
        temperature: 0 (or anything below `SAMPLING_EPS`) means greedy; otherwise logits
            are divided by it (>= 0, finite).
        top_k: keep the k most likely tokens (-1 or 0: all).
        top_p: nucleus sampling, keep the smallest set with cumulative probability >= top_p,
            in (0, 1] (Holtzman et al., arXiv:1904.09751).
        min_p: drop tokens whose probability is below ``min_p * p_max``, in [0, 1].
        stop: strings that end generation; the text is cut before the stop string.
        stop_token_ids: token ids that end generation (kept in ``token_ids``).
        ignore_eos: keep generating past the end-of-sequence token.
        seed: per-request random seed (sampled requests are then reproducible).
        json_schema / regex / ebnf: constrain the output to a JSON Schema (JSON text or a
            dict), a regular expression or an EBNF grammar (xgrammar's dialect, a ``root``
            rule); at most one (`attnserve.engine.constrained`).

    Logit controls (`attnserve.engine.penalties`; applied on the device, in this order,
    before temperature and the filters):
        logit_bias: token id -> value in [-100, 100] added to that token's logit (OpenAI);
            ids are checked against the vocabulary when the request is admitted.
        min_tokens: EOS (unless ``ignore_eos``) and ``stop_token_ids`` are masked until this
            many tokens were generated (>= 0, <= ``max_new_tokens``).
        repetition_penalty: > 0; 1 is off. The CTRL rule (Keskar et al., arXiv:1909.05858,
            as HF's ``RepetitionPenaltyLogitsProcessor``): the logit of every token already in
            the prompt or the output is divided by it when positive, multiplied when negative.
        frequency_penalty / presence_penalty: in [-2, 2] (OpenAI): ``logit -= frequency *
            count + presence * (count > 0)``, count = occurrences in the output so far.

    Logprobs (`attnserve.engine.logprobs`; of the model's own distribution: ``log_softmax``
    of the float32 logits before the controls above and before temperature):
        logprobs: return each output token's logprob.
        top_logprobs: also the most likely tokens at each position, 0..20 (needs
            ``logprobs`` or ``prompt_logprobs``).
        prompt_logprobs: return the logprobs of the prompt tokens (the first has none);
            such a request computes its whole prompt (no prefix-cache reuse).

    Detokenization (SGLang's and vLLM's name):
        skip_special_tokens: special tokens (control tokens such as gpt-oss's harmony
            markers ``<|channel|>`` ...) are left out of the output text. The server takes
            it from the request, and sets it False for the chat requests a gpt-oss parser
            reads, whose markers the parser removes
            (`attnserve.server.chat_output.harmony_sampling_params`).

    Samples (SGLang's and vLLM's ``n``):
        n: outputs per prompt (>= 1). `attnserve.engine.llm.LLM.generate` / ``chat`` run each
            prompt ``n`` times (sample ``i`` seeded ``seed + i`` when ``seed`` is set; the
            prompt's KV is computed once and shared through the prefix cache); the engine
            itself takes one sample per request (`Engine.check_prompt` refuses ``n > 1``).
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    ignore_eos: bool = False
    seed: Optional[int] = None
    # constrained decoding (attnserve.engine.constrained)
    json_schema: Optional[Union[str, Dict[str, Any]]] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    # ---- logit controls and logprobs (issue 35) ----
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Optional[Dict[int, float]] = None
    min_tokens: int = 0
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: bool = False
    n: int = 1
    skip_special_tokens: bool = True
    stop_strs: List[str] = field(init=False, default_factory=list)

    def __post_init__(self):
        if self.stop is None:
            self.stop_strs = []
        elif isinstance(self.stop, str):
            self.stop_strs = [self.stop]
        else:
            self.stop_strs = list(self.stop)
        from attnserve.engine.constrained.spec import normalize_json_schema

        self.json_schema = normalize_json_schema(self.json_schema)
        self.verify()

    def verify(self) -> None:
        """Raise ValueError naming the first invalid field."""
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if (not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool)
                or not 0 <= self.temperature < float("inf")):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k not in (0, -1)):
            raise ValueError(f"top_k must be -1, 0 or >= 1, got {self.top_k!r}")
        if not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if any(not isinstance(s, str) or not s for s in self.stop_strs):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        if self.stop_token_ids is not None and any(
            not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.stop_token_ids
        ):
            raise ValueError("stop_token_ids must be non-negative integers")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if not isinstance(self.skip_special_tokens, bool):
            raise ValueError(f"skip_special_tokens must be a boolean, got {self.skip_special_tokens!r}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63 - self.n:  # int64 (seed + i for n samples)
            raise ValueError(f"seed must fit in a signed 64-bit integer, got {self.seed}")
        from attnserve.engine.constrained.spec import check_fields

        check_fields(self)  # grammar fields: types, at most one
        verify_controls(self)
        verify_logprob_params(self)

    def sample(self, i: int) -> "SamplingParams":
        """The params of sample ``i`` of this request (the rule of `LLM.generate`'s ``n`` and of
        the server's ``n`` choices): ``n`` 1 and, when seeded, seed ``seed + i``, so the samples
        differ but the call is reproducible. ``self`` itself where nothing changes."""
        if self.n == 1 and (i == 0 or self.seed is None):
            return self
        import dataclasses

        return dataclasses.replace(self, n=1, seed=None if self.seed is None else self.seed + i)

    @property
    def has_logit_controls(self) -> bool:
        """Any penalty, logit bias or ``min_tokens`` (`attnserve.engine.penalties`)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or bool(self.logit_bias) or self.min_tokens > 0)

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.logprobs or self.prompt_logprobs)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1
