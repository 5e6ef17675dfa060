"""The draft model of STANDALONE speculative decoding: a second checkpoint sharing the
target's tokenizer, or the target's own first K layers (``--speculative-draft-layers``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import nn

from attnserve.speculative_config import SpeculativeConfig


class SelfDraftModel(nn.Module):
    """The target's embedding, first ``num_layers`` decoder layers, final norm and head
    (shared weights): a draft model that needs nothing but the target. Its own KV pool
    holds ``num_layers`` layers (layer ids ``0 .. num_layers - 1``, as in the target).

    Shapes as the target's ``forward`` / ``compute_logits``.
    """

    def __init__(self, target: nn.Module, num_layers: int):
        super().__init__()
        self.target = target
        self.num_layers = int(num_layers)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch) -> torch.Tensor:
        return self.target(input_ids, positions, forward_batch, num_layers=self.num_layers)

    def compute_logits(self, hidden_states: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.target.compute_logits(hidden_states, out=out)


def load_draft_model(config: SpeculativeConfig, server_args, target):
    """The draft of ``config`` as a `LoadedModel` (``target``: the target's `LoadedModel`).

    Raises:
        ValueError: ``--speculative-draft-layers`` not below the target's layer count, a
            draft model whose vocabulary differs from the target's, or one whose context is
            shorter than the target's (the message says what to change).
    """
    mc = target.model_config
    if config.draft_layers is not None:
        if config.draft_layers >= mc.num_hidden_layers:
            raise ValueError(f"--speculative-draft-layers {config.draft_layers} must be below the target's "
                             f"{mc.num_hidden_layers} layers")
        draft_config = dataclasses.replace(mc, num_hidden_layers=config.draft_layers)
        return dataclasses.replace(target, model=SelfDraftModel(target.model, config.draft_layers),
                                   model_config=draft_config)
    from attnserve.model_loader.loader import load_model

    draft = load_model(config.draft_model_path, load_format=server_args.load_format,
                       dtype=server_args.resolved_dtype(), device=server_args.resolved_device())
    dc = draft.model_config
    if dc.vocab_size != mc.vocab_size or not _same_tokenizer(draft.tokenizer, target.tokenizer):
        raise ValueError(f"the draft model {config.draft_model_path!r} has another vocabulary ({dc.vocab_size} "
                         f"tokens) than the target ({mc.vocab_size}); a draft must share the target's tokenizer")
    context = server_args.context_length or mc.context_len
    if dc.context_len < context:
        raise ValueError(f"the draft model's context ({dc.context_len}) is shorter than the target's ({context}); "
                         f"pass --context-length {dc.context_len} or a longer-context draft")
    return draft


def _same_tokenizer(a: Optional[object], b: Optional[object]) -> bool:
    """Same vocabulary when both tokenizers are known (dummy shapes have none)."""
    if a is None or b is None:
        return True
    return a.get_vocab() == b.get_vocab()
