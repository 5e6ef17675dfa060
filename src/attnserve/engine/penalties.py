"""Logit controls, batched on the device: ``logit_bias``, ``min_tokens``, the repetition
penalty and OpenAI's frequency and presence penalties.

The rules (applied in this order to the float32 logits, before temperature and the
top-k/top-p/min-p filters of `attnserve.engine.sampler`; vLLM's order):

1. ``logit_bias`` (OpenAI): ``logit[t] += bias[t]``, values in [-100, 100].
2. ``min_tokens`` (HF ``MinNewTokensLengthLogitsProcessor``): while fewer than
   ``min_tokens`` tokens were generated, EOS (unless ``ignore_eos``) and ``stop_token_ids``
   get ``-inf``. A grammar's end wins over ``min_tokens``: a constrained row whose mask
   allows nothing but its stop tokens (``RequestGrammar.must_end``, set on the host when
   the mask is filled) is not masked, so the request finishes with its grammar, with
   fewer than ``min_tokens`` tokens (vLLM's rule for structured outputs; otherwise no
   token of the row could be sampled).
3. ``repetition_penalty`` (CTRL, Keskar et al., arXiv:1909.05858; HF
   ``RepetitionPenaltyLogitsProcessor``): for every token already in the prompt or the
   output, ``logit / p`` if the logit is positive, else ``logit * p`` (p > 0, 1 = off).
4. ``frequency_penalty`` / ``presence_penalty`` (OpenAI's formula, both in [-2, 2]):
   ``logit[t] -= frequency * c[t] + presence * (c[t] > 0)``, ``c[t]`` the number of times
   ``t`` occurs in the output so far.

State on the device, per request that uses a control: one row ("slot") of a few
``[slots, vocab]`` tensors, each created the first time a request needs it and grown by
doubling (requests without controls hold no slot, so none of this exists for them):

* ``counts`` float32: output occurrences (rules 3 and 4);
* ``seen`` bool: the prompt's tokens (rule 3);
* ``bias`` float32: the dense logit bias (rule 1; zero in the rows of other requests);
* ``stop`` bool: the tokens rule 2 masks.

Memory: 10 bytes x vocab per slot at most (1.3 MB for Llama-3's 128,256 tokens), for the
running requests that use controls only; a slot is taken at the request's first sampling
step and given back when it finishes or is aborted (kept through a retraction).

Counts are updated from the sampled ids on the device (`LogitControls.record`), in stream
order right after the step's sampling, so the next step, which overlap scheduling launches
before the host has seen this step's token, already counts it. A finished request's row is
zeroed when the slot is next handed out, also in stream order, i.e. after the one extra
token that an overlap step may still have counted for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

#: OpenAI's range of ``presence_penalty`` and ``frequency_penalty``: [-2, 2].
PENALTY_LIMIT = 2.0
#: OpenAI's range of ``logit_bias`` values: [-100, 100].
LOGIT_BIAS_LIMIT = 100.0

#: ``Req.control_slot`` of a request that uses controls but holds no slot yet.
NO_SLOT = -1


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def verify_controls(p) -> None:
    """Raise ValueError naming the first invalid logit-control field of `SamplingParams` ``p``."""
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(p, name)
        if not _is_number(v) or not -PENALTY_LIMIT <= v <= PENALTY_LIMIT:
            raise ValueError(f"{name} must be a number in [-2, 2], got {v!r}")
    if not _is_number(p.repetition_penalty) or p.repetition_penalty <= 0:
        raise ValueError(f"repetition_penalty must be a finite number > 0 (1 is off), got {p.repetition_penalty!r}")
    if not isinstance(p.min_tokens, int) or isinstance(p.min_tokens, bool) or p.min_tokens < 0:
        raise ValueError(f"min_tokens must be an integer >= 0, got {p.min_tokens!r}")
    if p.min_tokens > p.max_new_tokens:
        raise ValueError(f"min_tokens ({p.min_tokens}) must not exceed max_new_tokens ({p.max_new_tokens})")
    if p.logit_bias is not None:
        if not isinstance(p.logit_bias, dict):
            raise ValueError(f"logit_bias must map token ids to numbers, got {type(p.logit_bias).__name__}")
        for k, v in p.logit_bias.items():
            if not isinstance(k, int) or isinstance(k, bool) or k < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {k!r}")
            if not _is_number(v) or not -LOGIT_BIAS_LIMIT <= v <= LOGIT_BIAS_LIMIT:
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {v!r} for token {k}")


def check_logit_bias_vocab(p, vocab_size: int) -> None:
    """Raise ValueError when a ``logit_bias`` key of ``p`` is not a token id of the vocabulary."""
    for k in p.logit_bias or ():
        if k >= vocab_size:
            raise ValueError(f"logit_bias key {k} is not a token id of the vocabulary (ids are 0..{vocab_size - 1})")


# ---- the rules on a block of rows (also what the tests compare with HF) ------------------
def apply_min_tokens(logits: torch.Tensor, stop_mask: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """float32 ``[m, V]`` with ``-inf`` where ``stop_mask`` (bool ``[m, V]``) holds in the rows
    where ``active`` (bool ``[m]``: fewer than ``min_tokens`` generated)."""
    return logits.masked_fill(stop_mask & active[:, None], float("-inf"))


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """The CTRL rule: where ``seen`` (bool ``[m, V]``), positive logits are divided by
    ``penalty`` (float32 ``[m]``) and the others multiplied by it."""
    p = penalty[:, None]
    return torch.where(seen, torch.where(logits > 0, logits / p, logits * p), logits)


def apply_frequency_presence(logits: torch.Tensor, counts: torch.Tensor, frequency: torch.Tensor,
                             presence: torch.Tensor) -> torch.Tensor:
    """OpenAI's ``logit - frequency * count - presence * (count > 0)``; ``counts`` float32
    ``[m, V]``, ``frequency`` / ``presence`` float32 ``[m]``."""
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0).to(logits.dtype)


@dataclass
class ControlStep:
    """The controlled rows of one sampling step, on the device.

    Attributes:
        rows: int64 ``[m]`` rows of the step's logits, or None when every row is controlled.
        slots: int64 ``[m]`` their slots.
        presence / frequency / repetition: float32 ``[m]``.
        below_min: bool ``[m]``: fewer than ``min_tokens`` tokens generated (rule 2 applies).
        use_bias / use_min / use_repetition / use_freq_presence: host flags of the rules
            some row needs (the others are skipped).
    """

    rows: Optional[torch.Tensor]
    slots: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor
    below_min: torch.Tensor
    use_bias: bool
    use_min: bool
    use_repetition: bool
    use_freq_presence: bool


class LogitControls:
    """The device state of the requests that use logit controls (see the module doc).

    Args:
        device: the logits' device.
        eos_token_ids: the ids ``min_tokens`` masks (with each request's ``stop_token_ids``).
        vocab_size: width of the logits.
        initial_slots: slots of the first allocation.
    """

    def __init__(self, device, eos_token_ids: Sequence[int], vocab_size: int, initial_slots: int = 8):
        self.device = torch.device(device)
        self.eos_token_ids = list(eos_token_ids)
        self.vocab_size = vocab_size
        self.capacity = 0
        self.initial_slots = initial_slots
        self.free: List[int] = []
        self.tensors: Dict[str, torch.Tensor] = {}

    _DTYPES = {"counts": torch.float32, "seen": torch.bool, "bias": torch.float32, "stop": torch.bool}

    # ---- slots ---------------------------------------------------------------------------
    def _tensor(self, name: str) -> torch.Tensor:
        t = self.tensors.get(name)
        if t is None:
            t = torch.zeros(self.capacity, self.vocab_size, dtype=self._DTYPES[name], device=self.device)
            self.tensors[name] = t
        return t

    def _grow(self) -> None:
        old = self.capacity
        self.capacity = max(2 * old, self.initial_slots)
        for name, t in list(self.tensors.items()):
            new = torch.zeros(self.capacity, self.vocab_size, dtype=t.dtype, device=self.device)
            new[:old] = t
            self.tensors[name] = new
        self.free.extend(range(self.capacity - 1, old - 1, -1))

    def acquire(self, req) -> int:
        """Give ``req`` a slot and write its rows (prompt tokens, bias, stop tokens)."""
        if not self.free:
            self._grow()
        slot = self.free.pop()
        p = req.sampling_params
        dev = self.device
        if p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 \
                or "counts" in self.tensors:
            self._tensor("counts")[slot].zero_()
        if p.repetition_penalty != 1.0:
            seen = self._tensor("seen")
            seen[slot].zero_()
            seen[slot, torch.tensor(req.prompt_ids, dtype=torch.int64).to(dev)] = True
        if p.logit_bias or "bias" in self.tensors:
            bias = self._tensor("bias")
            bias[slot].zero_()
            if p.logit_bias:
                ids = torch.tensor(list(p.logit_bias), dtype=torch.int64).to(dev)
                bias[slot, ids] = torch.tensor([float(v) for v in p.logit_bias.values()], dtype=torch.float32).to(dev)
        if p.min_tokens > 0:
            stop = self._tensor("stop")
            stop[slot].zero_()
            ids = set(p.stop_token_ids or ()) | (set() if p.ignore_eos else set(self.eos_token_ids))
            ids = [t for t in ids if t < self.vocab_size]
            if ids:
                stop[slot, torch.tensor(ids, dtype=torch.int64).to(dev)] = True
        req.control_slot = slot
        return slot

    def release(self, req) -> None:
        """Give ``req``'s slot back (idempotent; the row is zeroed when it is next used)."""
        slot = req.control_slot
        if slot is not None and slot >= 0:
            self.free.append(slot)
        req.control_slot = NO_SLOT

    def release_all(self) -> None:
        """Drop the device tensors (the engine is shutting down)."""
        self.tensors = {}
        self.free = []
        self.capacity = 0

    # ---- one step ------------------------------------------------------------------------
    def prepare(self, reqs: Sequence, positions: Optional[Sequence[int]] = None) -> Optional[ControlStep]:
        """The controlled rows among ``reqs`` (the step's sampling rows, in order), with one
        host->device copy for the integers and one for the floats; None when no row is
        controlled. A request's first step here takes its slot (`acquire`).

        Args:
            positions: each row's output tokens before this step (default: the request's
                ``num_launched_outputs`` now).
        """
        rows: List[int] = []
        slots: List[int] = []
        below: List[int] = []
        pres: List[float] = []
        freq: List[float] = []
        rep: List[float] = []
        use_bias = False
        for i, r in enumerate(reqs):
            slot = r.control_slot
            if slot is None:
                continue
            if slot < 0:
                slot = self.acquire(r)
            p = r.sampling_params
            rows.append(i)
            slots.append(slot)
            pos = r.num_launched_outputs if positions is None else positions[i]
            grammar = getattr(r, "grammar", None)
            below.append(int(pos < p.min_tokens and not (grammar is not None and grammar.must_end)))
            pres.append(p.presence_penalty)
            freq.append(p.frequency_penalty)
            rep.append(p.repetition_penalty)
            use_bias = use_bias or bool(p.logit_bias)
        if not rows:
            return None
        ints = torch.tensor([rows, slots, below], dtype=torch.int64).to(self.device, non_blocking=True)
        floats = torch.tensor([pres, freq, rep], dtype=torch.float32).to(self.device, non_blocking=True)
        return ControlStep(
            rows=None if len(rows) == len(reqs) else ints[0], slots=ints[1], below_min=ints[2].bool(),
            presence=floats[0], frequency=floats[1], repetition=floats[2], use_bias=use_bias, use_min=any(below),
            use_repetition=any(x != 1.0 for x in rep), use_freq_presence=any(x != 0.0 for x in pres + freq),
        )

    @torch.inference_mode()  # the logits come from the model's inference-mode forward
    def apply(self, logits: torch.Tensor, step: ControlStep, inplace: bool = True) -> torch.Tensor:
        """Logits with the rules applied to the controlled rows.

        Args:
            logits: float32 ``[n, V]`` of the step's sampling rows.
            inplace: the untouched rows may be written in place (else a copy is made, when
                only some rows are controlled; ``logits`` itself is then left as it was).

        Returns:
            float32 ``[n, V]`` (``logits`` itself when ``inplace`` and some rows are not
            controlled; a new tensor when every row is).
        """
        sub = logits if step.rows is None else logits.index_select(0, step.rows)
        slots = step.slots
        if step.use_bias:
            sub = sub + self.tensors["bias"].index_select(0, slots)
        if step.use_min:
            sub = apply_min_tokens(sub, self.tensors["stop"].index_select(0, slots), step.below_min)
        if step.use_repetition or step.use_freq_presence:
            counts = self.tensors["counts"].index_select(0, slots)
            if step.use_repetition:
                seen = counts > 0
                if "seen" in self.tensors:
                    seen |= self.tensors["seen"].index_select(0, slots)
                sub = apply_repetition_penalty(sub, seen, step.repetition)
            if step.use_freq_presence:
                sub = apply_frequency_presence(sub, counts, step.frequency, step.presence)
        if step.rows is None:
            return sub
        out = logits if inplace else logits.clone()
        return out.index_copy_(0, step.rows, sub)

    def record(self, next_ids: torch.Tensor, step: ControlStep) -> None:
        """Count the step's sampled ids (int64 ``[n]`` on the device) in the controlled rows."""
        counts = self.tensors.get("counts")
        if counts is None:
            return
        ids = next_ids if step.rows is None else next_ids.index_select(0, step.rows)
        counts.index_put_((step.slots, ids), torch.ones_like(ids, dtype=counts.dtype), accumulate=True)
