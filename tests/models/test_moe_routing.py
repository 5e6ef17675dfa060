"""`select_experts` against the installed HF transformers routers themselves (Mixtral,
Qwen3-MoE, DeepSeek-V2 greedy / group-limited, DeepSeek-V3 noaux_tc), and the errors of
bad routing configs."""

from __future__ import annotations

import pytest
import torch

from attnserve.models.layers.moe.routing import RoutingConfig, routing_config_from_hf, select_experts

T, H = 37, 24


def _sorted_by_id(weights: torch.Tensor, ids: torch.Tensor):
    """Rows reordered by expert id (slot order is not part of the contract)."""
    ids = ids.long()
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


def _compare_with_hf(hf_config, router_cls, seed: int, bias: bool = False):
    torch.manual_seed(seed)
    router = router_cls(hf_config)
    with torch.no_grad():
        router.weight.copy_(torch.randn_like(router.weight.float()))
        if bias:  # DeepSeek-V3's balancing bias, large enough to change choices
            router.e_score_correction_bias.copy_(torch.randn_like(router.e_score_correction_bias) * 0.3)
    x = torch.randn(T, H)
    with torch.no_grad():
        logits, hf_weights, hf_ids = router(x)
    cfg = routing_config_from_hf(hf_config)
    corr = router.e_score_correction_bias if bias else None
    weights, ids = select_experts(logits, cfg, corr)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (T, hf_config.num_experts_per_tok)
    w, i = _sorted_by_id(weights, ids)
    hw, hi = _sorted_by_id(hf_weights.float(), hf_ids)
    assert torch.equal(i, hi)
    torch.testing.assert_close(w, hw, rtol=1e-6, atol=1e-7)
    return cfg, weights


@pytest.mark.parametrize("seed", [0, 1])
def test_mixtral_router(seed):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    config = MixtralConfig(hidden_size=H, num_local_experts=8, num_experts_per_tok=2)
    cfg, weights = _compare_with_hf(config, MixtralTopKRouter, seed)
    assert cfg.renormalize and cfg.topk_method == "greedy"
    torch.testing.assert_close(weights.sum(-1), torch.ones(T))


@pytest.mark.parametrize("norm", [False, True])
def test_qwen3_moe_router(norm):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = Qwen3MoeConfig(hidden_size=H, num_experts=16, num_experts_per_tok=4, norm_topk_prob=norm)
    cfg, weights = _compare_with_hf(config, Qwen3MoeTopKRouter, seed=2)
    assert cfg.renormalize is norm
    assert bool((weights.sum(-1) < 0.999).any()) is not norm  # un-normalised softmax mass < 1


@pytest.mark.parametrize("method,norm", [("greedy", False), ("greedy", True), ("group_limited_greedy", False)])
def test_deepseek_v2_router(method, norm):
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    config = DeepseekV2Config(hidden_size=H, num_attention_heads=4, n_routed_experts=16, num_experts_per_tok=3,
                              n_group=4, topk_group=2, topk_method=method, norm_topk_prob=norm, routed_scaling_factor=2.5)
    cfg, _ = _compare_with_hf(config, DeepseekV2TopkRouter, seed=3)
    # HF's DeepSeek-V2 router never normalises (even with norm_topk_prob) and always scales
    assert not cfg.renormalize and cfg.routed_scaling_factor == 2.5


@pytest.mark.parametrize("norm", [True, False])
def test_deepseek_v3_router(norm):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = DeepseekV3Config(hidden_size=H, n_routed_experts=32, num_experts_per_tok=4, n_group=8, topk_group=3,
                              norm_topk_prob=norm, routed_scaling_factor=2.5)
    cfg, weights = _compare_with_hf(config, DeepseekV3TopkRouter, seed=4, bias=True)
    assert cfg.topk_method == "noaux_tc" and cfg.scoring_func == "sigmoid"
    if norm:
        torch.testing.assert_close(weights.sum(-1), torch.full((T,), 2.5))


def test_v3_choice_uses_bias_but_weights_do_not():
    cfg = RoutingConfig(top_k=1, scoring_func="sigmoid", topk_method="noaux_tc", num_expert_group=2, topk_group=2)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])
    w, ids = select_experts(logits, cfg, bias)
    assert ids.tolist() == [[3]]
    torch.testing.assert_close(w, torch.sigmoid(torch.tensor([[-1.0]])))


def test_group_limited_keeps_only_best_groups():
    # group 0 (experts 0..3) holds the best expert, group 1 the next three: greedy takes
    # 0 and two of 4..6; keeping one group (by its max) takes 0 and two more of group 0
    logits = torch.tensor([[5.0, -9.0, -8.0, -7.0, 4.0, 4.1, 4.2, -9.0]])
    _, ids = select_experts(logits, RoutingConfig(top_k=3))
    assert sorted(ids[0].tolist()) == [0, 5, 6]
    cfg = RoutingConfig(top_k=3, topk_method="group_limited_greedy", num_expert_group=2, topk_group=1)
    _, ids = select_experts(logits, cfg)
    assert sorted(ids[0].tolist()) == [0, 2, 3]


@pytest.mark.parametrize("cfg", [
    RoutingConfig(top_k=2, renormalize=True),
    RoutingConfig(top_k=2, topk_method="group_limited_greedy", num_expert_group=2, topk_group=1),
    RoutingConfig(top_k=2, scoring_func="sigmoid", topk_method="noaux_tc", num_expert_group=2, topk_group=1,
                  renormalize=True, routed_scaling_factor=2.0),
])
def test_empty_batch(cfg):
    w, ids = select_experts(torch.zeros(0, 8), cfg)
    assert w.shape == ids.shape == (0, 2) and w.dtype == torch.float32 and ids.dtype == torch.int32


@pytest.mark.parametrize("kwargs,field", [
    (dict(top_k=2, topk_method="bogus"), "topk_method"),
    (dict(top_k=2, scoring_func="tanh"), "scoring_func"),
    (dict(top_k=2, scoring_func="sigmoid"), "scoring_func"),  # greedy is softmax in HF
    (dict(top_k=0), "top_k"),
    (dict(top_k=2, topk_method="group_limited_greedy", num_expert_group=2, topk_group=3), "topk_group"),
    (dict(top_k=2, topk_method="group_limited_greedy", topk_group=1), "num_expert_group"),
    (dict(top_k=2, routed_scaling_factor=0.0), "routed_scaling_factor"),
])
def test_bad_routing_config(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RoutingConfig(**kwargs)


def test_experts_not_divisible_by_groups():
    cfg = RoutingConfig(top_k=2, scoring_func="sigmoid", topk_method="noaux_tc", num_expert_group=4, topk_group=2)
    with pytest.raises(ValueError, match="num_expert_group 4 does not divide the 10 experts"):
        select_experts(torch.randn(3, 10), cfg)
    with pytest.raises(ValueError, match="top_k"):
        select_experts(torch.randn(3, 8), RoutingConfig(top_k=5, topk_method="group_limited_greedy",
                                                        num_expert_group=4, topk_group=2))


def test_bias_only_for_noaux_tc():
    with pytest.raises(ValueError, match="correction_bias"):
        select_experts(torch.randn(3, 8), RoutingConfig(top_k=2), torch.zeros(8))


def test_unsupported_hf_routing():
    from transformers import DeepseekV2Config, DeepseekV3Config, LlamaConfig

    with pytest.raises(ValueError, match="topk_method 'noaux_tc'"):
        routing_config_from_hf(DeepseekV2Config(n_routed_experts=8, num_experts_per_tok=2, topk_method="noaux_tc"))
    with pytest.raises(ValueError, match="scoring_func 'softmax'"):
        routing_config_from_hf(DeepseekV3Config(n_routed_experts=16, n_group=4, topk_group=2, scoring_func="softmax"))
    with pytest.raises(ValueError, match="topk_method 'greedy'"):
        routing_config_from_hf(DeepseekV3Config(n_routed_experts=16, n_group=4, topk_group=2, topk_method="greedy"))
    with pytest.raises(ValueError, match="num_expert_group"):
        routing_config_from_hf(DeepseekV2Config(n_routed_experts=8, num_experts_per_tok=2,
                                                topk_method="group_limited_greedy", n_group=3, topk_group=1))
    with pytest.raises(ValueError, match="model_type 'llama'"):
        routing_config_from_hf(LlamaConfig())
