"""`SpeculativeConfig`: the speculative-decoding flags, checked once.

Flag names and meanings follow SGLang (``--speculative-algorithm``,
``--speculative-num-draft-tokens``, ``--speculative-num-steps``,
``--speculative-eagle-topk``, ``--speculative-ngram-*``). ``num_draft_tokens`` counts the
nodes verified per request and step, the last sampled token (the tree's root) included,
so ``num_draft_tokens == 1`` verifies nothing drafted (a plain decode step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

ALGORITHMS = ("NGRAM", "STANDALONE")
#: most nodes verified per request and step (the verify mask grows with its square)
MAX_DRAFT_TOKENS = 64
NGRAM_DEFAULT_DRAFT_TOKENS = 8
STANDALONE_DEFAULT_STEPS = 3
STANDALONE_DEFAULT_TOPK = 1


def _given(value: Optional[int], default: int) -> int:
    return default if value is None else int(value)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Checked speculative-decoding settings (see the module doc).

    Attributes:
        algorithm: ``"NGRAM"`` or ``"STANDALONE"``.
        num_draft_tokens: nodes verified per request and step, root included (1..64).
        num_steps / topk: draft decode steps and candidates kept per step (STANDALONE).
        draft_model_path / draft_layers: the draft model, or the target's first K layers.
        ngram_min_window / ngram_max_window / ngram_max_bfs_breadth: NGRAM matching.
    """

    algorithm: str
    num_draft_tokens: int
    num_steps: int = 0
    topk: int = 1
    draft_model_path: Optional[str] = None
    draft_layers: Optional[int] = None
    ngram_min_window: int = 1
    ngram_max_window: int = 12
    ngram_max_bfs_breadth: int = 10

    @classmethod
    def from_server_args(cls, args) -> Optional["SpeculativeConfig"]:
        """The config of ``args`` (a `ServerArgs`), None without ``--speculative-algorithm``.

        Raises:
            ValueError: an unknown algorithm (lists the valid ones), a count out of range,
                STANDALONE without exactly one of a draft model and ``--speculative-draft-layers``,
                or draft flags without an algorithm; the message names the flag.
        """
        alg = args.speculative_algorithm
        if alg is None:
            given = [f for f in ("speculative_draft_model_path", "speculative_draft_layers", "speculative_num_steps",
                                 "speculative_eagle_topk", "speculative_num_draft_tokens") if getattr(args, f) is not None]
            if given:
                raise ValueError(f"--{given[0].replace('_', '-')} needs --speculative-algorithm "
                                 f"({' or '.join(ALGORITHMS)})")
            return None
        alg = str(alg).upper()
        if alg not in ALGORITHMS:
            raise ValueError(f"unknown --speculative-algorithm {args.speculative_algorithm!r}; valid: "
                             f"{', '.join(ALGORITHMS)}")
        if alg == "NGRAM":
            for f in ("speculative_draft_model_path", "speculative_draft_layers", "speculative_num_steps",
                      "speculative_eagle_topk"):
                if getattr(args, f) is not None:
                    raise ValueError(f"--{f.replace('_', '-')} is for STANDALONE; NGRAM drafts from the request itself")
            n = _given(args.speculative_num_draft_tokens, NGRAM_DEFAULT_DRAFT_TOKENS)
            lo, hi = args.speculative_ngram_min_match_window_size, args.speculative_ngram_max_match_window_size
            if not 1 <= lo <= hi:
                raise ValueError("--speculative-ngram-min-match-window-size must be >= 1 and <= "
                                 f"--speculative-ngram-max-match-window-size, got {lo} and {hi}")
            if args.speculative_ngram_max_bfs_breadth < 1:
                raise ValueError("--speculative-ngram-max-bfs-breadth must be >= 1")
            cfg = cls(alg, n, ngram_min_window=lo, ngram_max_window=hi,
                      ngram_max_bfs_breadth=args.speculative_ngram_max_bfs_breadth)
        else:
            path, layers = args.speculative_draft_model_path, args.speculative_draft_layers
            if (path is None) == (layers is None):
                raise ValueError("STANDALONE needs exactly one of --speculative-draft-model-path (a draft model "
                                 "sharing the target's tokenizer) and --speculative-draft-layers K (self-draft)")
            if layers is not None and layers < 1:
                raise ValueError(f"--speculative-draft-layers must be >= 1, got {layers}")
            steps = _given(args.speculative_num_steps, STANDALONE_DEFAULT_STEPS)
            topk = _given(args.speculative_eagle_topk, STANDALONE_DEFAULT_TOPK)
            if steps < 1 or topk < 1:
                raise ValueError(f"--speculative-num-steps and --speculative-eagle-topk must be >= 1, got {steps}, {topk}")
            n = _given(args.speculative_num_draft_tokens, steps * topk + 1)
            if n > steps * topk + 1:
                raise ValueError(f"--speculative-num-draft-tokens {n} exceeds what {steps} steps of top-{topk} can "
                                 f"draft ({steps * topk + 1} with the root)")
            cfg = cls(alg, n, num_steps=steps, topk=topk, draft_model_path=path, draft_layers=layers)
        if not 1 <= cfg.num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"--speculative-num-draft-tokens must be in 1..{MAX_DRAFT_TOKENS}, "
                             f"got {cfg.num_draft_tokens}")
        return cfg
