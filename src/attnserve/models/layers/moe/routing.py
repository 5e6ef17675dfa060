"""Top-k expert selection ("routing") of the mixture-of-experts models, exactly as HF
transformers (5.24) defines each router.

`select_experts` maps router logits ``[T, E]`` to float32 weights and int32 expert ids
``[T, top_k]``. All math is in float32, with pure tensor ops whose shapes depend only on
``T``, ``E`` and the `RoutingConfig` (no host sync: it runs inside CUDA graphs).

The four routers, from ``transformers/models/<model>/modeling_<model>.py``:

* Mixtral (``MixtralTopKRouter.forward``): ``softmax(logits.float())``, ``topk``, then
  always ``router_top_value /= router_top_value.sum(dim=-1, keepdim=True)``.
* Qwen3-MoE (``Qwen3MoeTopKRouter.forward``): the same, normalised only
  ``if self.norm_topk_prob``.
* DeepSeek-V2 (``DeepseekV2TopkRouter.forward``): softmax scores; ``greedy`` is a plain
  top-k; ``group_limited_greedy`` scores each of ``n_group`` groups by its *max* expert
  score, keeps the ``topk_group`` best groups (``scores.masked_fill(~score_mask.bool(),
  0.0)``) and takes the top-k of what is left. HF never normalises (the modular source has
  ``del self.norm_topk_prob``) and always applies
  ``topk_weights = topk_weights * self.routed_scaling_factor``.
* DeepSeek-V3 (``DeepseekV3TopkRouter.forward``, the ``noaux_tc`` method): ``sigmoid``
  scores; ``scores_for_choice = scores + self.e_score_correction_bias`` is used only to
  choose; a group scores the *sum of its top 2* choice scores; the other groups are masked
  with ``-inf``; the weights are ``scores.gather(1, topk_indices)`` (un-biased); ``if
  self.norm_topk_prob`` they are divided by ``sum + 1e-20``; then times
  ``routed_scaling_factor``.

References: Jiang et al., "Mixtral of Experts", arXiv:2401.04088; DeepSeek-V2,
arXiv:2405.04434 (device-limited routing); DeepSeek-V3, arXiv:2412.19437 section 2.1.2
(auxiliary-loss-free balancing bias).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch

SCORING_FUNCS = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
#: scoring function each routing method is defined with in HF transformers
_METHOD_SCORING = {"greedy": "softmax", "group_limited_greedy": "softmax", "noaux_tc": "sigmoid"}
#: HF DeepSeek-V3's denominator epsilon (``topk_weights.sum(dim=-1, keepdim=True) + 1e-20``)
NOAUX_TC_NORM_EPS = 1e-20


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class RoutingConfig:
    """How a token's experts are chosen and weighted.

    Attributes:
        top_k: experts per token (HF ``num_experts_per_tok``), >= 1.
        scoring_func: ``"softmax"`` (Mixtral, Qwen3-MoE, DeepSeek-V2) or ``"sigmoid"``
            (DeepSeek-V3); each method takes the one HF defines it with.
        renormalize: divide the top-k weights by their sum (HF ``norm_topk_prob``; always
            on for Mixtral). ``noaux_tc`` adds HF's ``1e-20`` to the sum, the others add none.
        topk_method: ``"greedy"`` (plain top-k), ``"group_limited_greedy"`` (DeepSeek-V2)
            or ``"noaux_tc"`` (DeepSeek-V3).
        num_expert_group: expert groups (HF ``n_group``); needed by the group methods,
            ignored by ``greedy``.
        topk_group: groups kept per token (HF ``topk_group``), ``<= num_expert_group``.
        routed_scaling_factor: multiplies the final weights (after any normalisation).

    Raises:
        ValueError: naming the field, for an unsupported ``scoring_func``/``topk_method``,
            a method/scoring mismatch, a non-positive ``top_k``/group count, missing group
            counts for a group method, or ``topk_group > num_expert_group``.
    """

    top_k: int
    scoring_func: str = "softmax"
    renormalize: bool = False
    topk_method: str = "greedy"
    num_expert_group: Optional[int] = None
    topk_group: Optional[int] = None
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if not _is_int(self.top_k) or self.top_k < 1:
            raise ValueError(f"RoutingConfig.top_k must be an integer >= 1, got {self.top_k!r}")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"RoutingConfig.topk_method {self.topk_method!r} is not a supported routing method "
                             f"(supported: {', '.join(TOPK_METHODS)})")
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"RoutingConfig.scoring_func {self.scoring_func!r} is not supported "
                             f"(supported: {', '.join(SCORING_FUNCS)})")
        want = _METHOD_SCORING[self.topk_method]
        if self.scoring_func != want:
            raise ValueError(f"RoutingConfig.scoring_func {self.scoring_func!r} does not go with topk_method "
                             f"{self.topk_method!r}, which scores with {want!r}")
        if not isinstance(self.routed_scaling_factor, (int, float)) or isinstance(self.routed_scaling_factor, bool) \
                or not self.routed_scaling_factor > 0:
            raise ValueError(f"RoutingConfig.routed_scaling_factor must be a number > 0, "
                             f"got {self.routed_scaling_factor!r}")
        if self.topk_method == "greedy":
            return
        for field in ("num_expert_group", "topk_group"):
            v = getattr(self, field)
            if not _is_int(v) or v < 1:
                raise ValueError(f"RoutingConfig.{field} must be an integer >= 1 for topk_method "
                                 f"{self.topk_method!r}, got {v!r}")
        if self.topk_group > self.num_expert_group:
            raise ValueError(f"RoutingConfig.topk_group {self.topk_group} > num_expert_group "
                             f"{self.num_expert_group}: cannot keep more groups than there are")

    @property
    def grouped(self) -> bool:
        """True for the group-limited methods."""
        return self.topk_method != "greedy"

    def check_num_experts(self, num_experts: int) -> None:
        """Raise ValueError when this config cannot route over ``num_experts`` experts:
        ``top_k`` above the experts (of the kept groups, for the group methods), ``E`` not
        divisible by ``num_expert_group``, or (``noaux_tc``) fewer than 2 experts a group."""
        if num_experts < self.top_k:
            raise ValueError(f"RoutingConfig.top_k {self.top_k} > the {num_experts} experts")
        if not self.grouped:
            return
        g = self.num_expert_group
        if num_experts % g:
            raise ValueError(f"RoutingConfig.num_expert_group {g} does not divide the {num_experts} experts")
        per = num_experts // g
        if self.topk_method == "noaux_tc" and per < 2:
            raise ValueError(f"RoutingConfig.num_expert_group {g}: noaux_tc scores a group by its top 2 experts, "
                             f"but {num_experts} experts give {per} per group")
        if self.top_k > self.topk_group * per:
            raise ValueError(f"RoutingConfig.top_k {self.top_k} > the {self.topk_group * per} experts of the "
                             f"topk_group {self.topk_group} kept groups ({per} experts each)")


def _group_mask(group_scores: torch.Tensor, topk_group: int, per_group: int) -> torch.Tensor:
    """bool ``[T, E]``: True for the experts of each row's ``topk_group`` best groups."""
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    t, g = group_scores.shape
    return keep.unsqueeze(-1).expand(t, g, per_group).reshape(t, g * per_group)


def select_experts(router_logits: torch.Tensor, cfg: RoutingConfig,
                   correction_bias: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Choose ``cfg.top_k`` experts per token and their weights (HF semantics, see module doc).

    Args:
        router_logits: ``[T, E]`` gate logits, any float dtype (math in float32; DeepSeek's
            HF routers compute the logits themselves in float32, Mixtral/Qwen3-MoE's in the
            model dtype: that is the caller's gate).
        cfg: the `RoutingConfig`.
        correction_bias: float ``[E]``, DeepSeek-V3's ``e_score_correction_bias``, added to
            the scores for the choice only (``noaux_tc``; None = zeros, HF's initial buffer).

    Returns:
        ``(topk_weights, topk_ids)``: float32 ``[T, top_k]`` and int32 ``[T, top_k]`` with
        ids in ``[0, E)``; slot order is not meaningful (``sorted=False`` as in HF DeepSeek).

    Raises:
        ValueError: ``router_logits`` not 2-D, ``E`` incompatible with ``cfg``
            (`RoutingConfig.check_num_experts`), or a ``correction_bias`` of the wrong shape
            or with a method other than ``noaux_tc``.
    """
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [T, E], got shape {tuple(router_logits.shape)}")
    t, e = router_logits.shape
    cfg.check_num_experts(e)
    if correction_bias is not None:
        if cfg.topk_method != "noaux_tc":
            raise ValueError(f"correction_bias is only used by topk_method 'noaux_tc', not {cfg.topk_method!r}")
        if tuple(correction_bias.shape) != (e,):
            raise ValueError(f"correction_bias must be [{e}], got shape {tuple(correction_bias.shape)}")
    logits = router_logits.float()
    k = cfg.top_k
    if cfg.topk_method == "greedy":
        scores = torch.softmax(logits, dim=-1)
        # Mixtral/Qwen3 call torch.topk sorted, DeepSeek-V2 unsorted: the same set and weights
        topk_weights, topk_ids = torch.topk(scores, k=k, dim=-1, sorted=False)
    elif cfg.topk_method == "group_limited_greedy":
        scores = torch.softmax(logits, dim=-1)
        g = cfg.num_expert_group
        per = e // g
        group_scores = scores.view(t, g, per).max(dim=-1).values
        masked = scores.masked_fill(~_group_mask(group_scores, cfg.topk_group, per), 0.0)
        topk_weights, topk_ids = torch.topk(masked, k=k, dim=-1, sorted=False)
    else:  # noaux_tc
        scores = logits.sigmoid()
        choice = scores if correction_bias is None else scores + correction_bias.float()
        g = cfg.num_expert_group
        per = e // g
        group_scores = choice.view(t, g, per).topk(2, dim=-1).values.sum(dim=-1)
        masked = choice.masked_fill(~_group_mask(group_scores, cfg.topk_group, per), float("-inf"))
        topk_ids = torch.topk(masked, k=k, dim=-1, sorted=False).indices
        topk_weights = scores.gather(1, topk_ids)
    if cfg.renormalize:
        denom = topk_weights.sum(dim=-1, keepdim=True)
        if cfg.topk_method == "noaux_tc":
            denom = denom + NOAUX_TC_NORM_EPS
        topk_weights = topk_weights / denom
    if cfg.routed_scaling_factor != 1.0:  # x * 1.0 == x exactly: skipping it changes nothing
        topk_weights = topk_weights * cfg.routed_scaling_factor
    return topk_weights, topk_ids.to(torch.int32)


def routing_config_from_hf(config: Any) -> RoutingConfig:
    """The `RoutingConfig` of an HF MoE config, keyed on ``config.model_type``.

    * ``mixtral``: softmax greedy, always renormalised (``MixtralTopKRouter``).
    * ``qwen3_moe``: softmax greedy, renormalised iff ``norm_topk_prob``.
    * ``deepseek_v2``: softmax, ``topk_method`` ``greedy`` or ``group_limited_greedy``
      (``n_group``, ``topk_group``), never renormalised, times ``routed_scaling_factor``:
      HF's ``DeepseekV2TopkRouter`` ignores ``norm_topk_prob`` (DeepSeek's original remote
      code normalised *instead of* scaling when it was set; no released V2 checkpoint sets it).
    * ``deepseek_v3``: ``noaux_tc`` with sigmoid scores, renormalised iff
      ``norm_topk_prob``, times ``routed_scaling_factor``. HF's class reads neither
      ``topk_method`` nor ``scoring_func``; when a config.json sets them they must be
      ``"noaux_tc"`` and ``"sigmoid"``.

    Raises:
        ValueError: an unsupported ``model_type``, ``topk_method`` or ``scoring_func``
            (the message names the field and its value), or group counts that do not fit
            the number of experts.
    """
    mt = getattr(config, "model_type", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if mt == "mixtral":
        cfg = RoutingConfig(top_k=top_k, renormalize=True)
        num_experts = config.num_local_experts
    elif mt == "qwen3_moe":
        cfg = RoutingConfig(top_k=top_k, renormalize=bool(config.norm_topk_prob))
        num_experts = config.num_experts
    elif mt in ("deepseek_v2", "deepseek_v3"):
        v3 = mt == "deepseek_v3"
        method = getattr(config, "topk_method", "noaux_tc" if v3 else "greedy")
        scoring = getattr(config, "scoring_func", "sigmoid" if v3 else "softmax")
        methods = ("noaux_tc",) if v3 else ("greedy", "group_limited_greedy")
        if method not in methods:
            raise ValueError(f"{mt} config: topk_method {method!r} is not a supported routing method "
                             f"(HF {mt} routes with {' or '.join(map(repr, methods))})")
        if scoring != _METHOD_SCORING[method]:
            raise ValueError(f"{mt} config: scoring_func {scoring!r} is not supported "
                             f"(HF {mt} scores with {_METHOD_SCORING[method]!r})")
        grouped = method != "greedy"
        cfg = RoutingConfig(
            top_k=top_k, scoring_func=scoring, renormalize=bool(config.norm_topk_prob) if v3 else False,
            topk_method=method, num_expert_group=config.n_group if grouped else None,
            topk_group=config.topk_group if grouped else None,
            routed_scaling_factor=float(config.routed_scaling_factor),
        )
        num_experts = config.n_routed_experts
    else:
        raise ValueError(f"routing: unsupported model_type {mt!r} (supported: mixtral, qwen3_moe, deepseek_v2, "
                         f"deepseek_v3)")
    cfg.check_num_experts(num_experts)
    return cfg
