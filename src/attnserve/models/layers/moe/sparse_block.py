"""The sparse mixture-of-experts block of a decoder layer, and how its checkpoint names map.

`SparseMoeBlock` is what Mixtral (``block_sparse_moe``), Qwen3-MoE and DeepSeek-V2/V3
(``mlp``) call their MoE feed-forward: a router (`MoEGate`, HF name ``gate``) scores the
experts, `select_experts` picks ``top_k`` of them per token, `FusedMoE` runs the chosen
experts' SwiGLU MLPs, and DeepSeek adds ``shared_experts``, a dense SwiGLU MLP every token
passes through (Jiang et al., "Mixtral of Experts", arXiv:2401.04088; DeepSeek-V2,
arXiv:2405.04434, section 2.2; DeepSeek-V3, arXiv:2412.19437, section 2.1.2).

Under tensor parallelism each rank holds a slice of every expert's intermediate rows (and of
the shared experts'); the routed and shared partial sums are added first and all-reduced
once, so a layer costs one collective, as a dense MLP does.

OpenAI's gpt-oss (HF ``GptOssMLP``: ``router`` + ``experts``; model card arXiv:2508.10925)
has a router bias (``MoEGate(bias=True)``, HF ``router.bias``), per-expert biases and the
clamped ``swigluoai`` activation (`FusedMoE` ``has_bias`` / ``activation``), all passed by
`SparseMoeBlock`'s keyword arguments (``router_bias``, ``expert_bias``, ``activation``,
``swiglu_alpha``, ``swiglu_limit``). Its routing -- top-k of the biased logits, softmax
over the k chosen (HF ``GptOssTopKRouter.forward``) -- is ``RoutingConfig(top_k,
renormalize=True)``: softmax over all ``E`` then dividing the top k by their sum is the
same softmax of the chosen logits (the common ``exp(-max)`` / sum cancels), in float32.

Checkpoint names: per-expert HF tensors ``...experts.{e}.{gate_proj|up_proj|down_proj}.weight``
(Mixtral: ``w1|w3|w2``) go to `FusedMoE.load_expert_weight` (`route_expert_tensor`), and so
do FP8 checkpoints' ``.weight_scale`` / ``.weight_scale_inv`` / ``.input_scale`` of experts;
``....bias`` of such an expert goes to `FusedMoE.load_expert_bias` (gpt-oss's fused
``experts.gate_up_proj_bias`` / ``down_proj_bias`` are its model's to split).
"""

from __future__ import annotations

import re
from typing import Any, Dict, Iterable, Iterator, List, Optional, Set, Tuple

import torch
from torch import nn

from attnserve.distributed.group import TPGroup
from attnserve.models.layers.linear import Linear
from attnserve.models.layers.moe.layer import FusedMoE
from attnserve.models.layers.moe.native import SWIGLU_ALPHA, SWIGLU_LIMIT
from attnserve.models.layers.moe.routing import RoutingConfig, select_experts

#: HF per-expert projection name -> `FusedMoE` shard id (gate = w1, up = w3, down = w2)
_EXPERT_SHARDS: Dict[str, str] = {
    "gate_proj": "w1", "up_proj": "w3", "down_proj": "w2", "w1": "w1", "w3": "w3", "w2": "w2",
}
_EXPERT_RE = re.compile(r"^(?P<block>.+)\.experts\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)"
                        r"\.(?P<kind>weight|weight_scale|weight_scale_inv|input_scale|bias)$")
#: `FusedMoE` parameter names (weights; FP8 scales)
_EXPERT_PARAMS = tuple(f".experts.{p}" for p in ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale",
                                                 "w13_weight_scale_inv", "w2_weight_scale_inv", "w13_bias",
                                                 "w2_bias"))
#: `FusedMoE` shard id -> HF projection name, for error messages
_SHARD_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class MoEGate(Linear):
    """The router: ``logits = x @ weight.T (+ bias)`` (``weight`` ``[E, hidden]``, HF
    ``gate.weight``; with ``bias`` a ``bias`` ``[E]`` in the model dtype, gpt-oss's
    ``router.bias``), plus DeepSeek-V3's ``e_score_correction_bias`` ``[E]`` (float32, as HF
    keeps it) when ``correction_bias`` is set.

    Shapes: ``x`` ``[T, hidden]`` -> float32 ``[T, E]``. With ``float32_logits`` the product
    is taken in float32 (DeepSeek-V2 and V3 routers cast both operands, HF
    ``DeepseekV2TopkRouter.forward`` / ``DeepseekV3TopkRouter.forward``); otherwise in the
    model dtype through `Linear` (the skinny GEMM for decode batches on CUDA), then cast:
    Mixtral and Qwen3-MoE apply their softmax in float32 to model-dtype logits.

    On CUDA, half-precision ``x`` and ``weight`` of one dtype take the float32 product as one
    tensor-core GEMM with a float32 output (``torch.mm(..., out_dtype=torch.float32)``): a
    bf16 x bf16 product is exact in float32 and the sum is accumulated in float32, so this is
    HF's float32 product up to summation order, without the two casts and the float32 SIMT
    GEMM of ``F.linear(x.float(), weight.float())`` (three kernels a MoE layer in each
    DeepSeek decode step; benchmarks/NOTES.md, session 2026-11-27 tenth). CPUs, float32
    weights and a PyTorch without ``out_dtype`` keep the cast form.

    The router bias: in the model-dtype form it is added by the GEMM in the model dtype, as
    HF's ``F.linear(x, weight, bias)`` (gpt-oss); with ``float32_logits`` it is added in
    float32 to the float32 product. Either way the logits returned are float32 (HF gpt-oss
    takes its top-k softmax in the model dtype; ours, `select_experts`, in float32).
    """

    def __init__(self, num_experts: int, hidden_size: int, dtype: torch.dtype, correction_bias: bool = False,
                 float32_logits: bool = False, bias: bool = False):
        super().__init__(hidden_size, num_experts, bias=bias, dtype=dtype)
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(num_experts, dtype=torch.float32), requires_grad=False) if correction_bias else None
        )
        self.float32_logits = float32_logits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.float32_logits:
            w = self.weight
            if x.is_cuda and x.dtype == w.dtype and x.dtype in (torch.bfloat16, torch.float16):
                try:
                    out = torch.mm(x.reshape(-1, x.shape[-1]), w.t(), out_dtype=torch.float32).view(
                        *x.shape[:-1], w.shape[0])
                    return out if self.bias is None else out + self.bias.float()
                except (TypeError, RuntimeError, NotImplementedError):
                    pass  # no out_dtype for this build or device: the cast form below
            return torch.nn.functional.linear(x.float(), w.float(), None if self.bias is None else self.bias.float())
        return self.matmul(x, self.bias).float()


class SparseMoeBlock(nn.Module):
    """Router, routed experts and optional shared experts of one layer.

    Args:
        hidden_size: model width ``H``.
        num_experts: routed experts ``E``.
        moe_intermediate_size: each routed expert's intermediate size ``I`` (full, tp 1).
        routing: how experts are chosen (`RoutingConfig`).
        dtype: parameter dtype.
        tp: this rank's group; the block's output is all-reduced over it.
        shared_intermediate_size: the shared experts' total intermediate size (DeepSeek:
            ``moe_intermediate_size * n_shared_experts``), or 0 for none.
        correction_bias / float32_logits: `MoEGate` options (DeepSeek-V3).
        router_bias: `MoEGate`'s ``bias`` (gpt-oss ``router.bias``).
        expert_bias: `FusedMoE`'s ``has_bias`` (gpt-oss's per-expert biases).
        activation, swiglu_alpha, swiglu_limit: the routed experts' `FusedMoE` options
            (gpt-oss: ``"swigluoai", 1.702, 7.0``); the shared experts, if any, stay
            bias-free SwiGLU (SiLU).

    Shapes: ``x`` ``[T, H]`` -> ``[T, H]`` in ``x``'s dtype.

    Raises:
        ValueError: a ``tp.size`` that does not divide an intermediate size.
    """

    def __init__(self, hidden_size: int, num_experts: int, moe_intermediate_size: int, routing: RoutingConfig,
                 dtype: torch.dtype, tp: Optional[TPGroup] = None, shared_intermediate_size: int = 0,
                 correction_bias: bool = False, float32_logits: bool = False, router_bias: bool = False,
                 expert_bias: bool = False, activation: str = "silu", swiglu_alpha: float = SWIGLU_ALPHA,
                 swiglu_limit: float = SWIGLU_LIMIT):
        super().__init__()
        from attnserve.models.llama import LlamaMLP  # the dense SwiGLU MLP (models import layers, not back)

        self.tp = tp or TPGroup.single()
        self.routing = routing
        self.gate = MoEGate(num_experts, hidden_size, dtype, correction_bias, float32_logits, bias=router_bias)
        self.experts = FusedMoE(num_experts, hidden_size, moe_intermediate_size, dtype, tp=self.tp,
                                reduce_results=False, has_bias=expert_bias, activation=activation,
                                swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)
        self.shared_experts = (LlamaMLP(hidden_size, shared_intermediate_size, False, dtype, self.tp)
                               if shared_intermediate_size else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = select_experts(self.gate.forward(x), self.routing, self.gate.e_score_correction_bias)
        out = self.experts.forward(x, topk_weights, topk_ids)
        if self.shared_experts is not None:
            shared = self.shared_experts
            # this rank's partial sum of the shared MLP, reduced together with the experts'
            out = out + shared.down_proj.matmul(shared.gate_up_proj.forward_gated(x, "silu"), None)
        return self.tp.all_reduce(out)


def route_expert_tensors(model: nn.Module, weights: Iterable[Tuple[str, torch.Tensor]],
                         loaded: Set[Tuple[str, int, str]]) -> Iterator[Tuple[str, torch.Tensor]]:
    """Load the per-expert tensors of ``weights`` into their `FusedMoE` and yield the rest.

    Args:
        model: the model whose modules hold the `FusedMoE` layers (by HF module path,
            e.g. ``model.layers.3.mlp.experts``).
        weights: ``(HF name, full tensor)`` pairs.
        loaded: receives ``(FusedMoE path, expert id, shard id)`` of every tensor loaded
            (for `check_experts_complete`).

    Raises:
        KeyError: an expert tensor whose block has no `FusedMoE` (e.g. a dense layer).
    """
    modules = dict(model.named_modules())
    for name, tensor in weights:
        m = _EXPERT_RE.match(name)
        if m is None:
            yield name, tensor
            continue
        path = f"{m['block']}.experts"
        moe = modules.get(path)
        if not isinstance(moe, FusedMoE):
            raise KeyError(f"checkpoint tensor {name!r}: {m['block']} has no routed experts in {type(model).__name__}")
        shard = _EXPERT_SHARDS[m["proj"]]
        if m["kind"] == "bias":
            moe.load_expert_bias(shard, int(m["expert"]), tensor, name)
            continue
        moe.load_expert_weight(shard, int(m["expert"]), tensor, name, m["kind"])
        if m["kind"] == "weight":
            loaded.add((path, int(m["expert"]), shard))


def is_expert_param(name: str) -> bool:
    """True for the `FusedMoE` parameters (checked by `check_experts_complete` instead)."""
    return name.endswith(_EXPERT_PARAMS)


def check_experts_complete(model: nn.Module, loaded: Set[Tuple[str, int, str]], mixtral_names: bool = False) -> None:
    """Raise ValueError naming the first checkpoint tensors that no expert received.

    Args:
        loaded: what `route_expert_tensors` loaded in this pass.
        mixtral_names: name missing tensors as Mixtral checkpoints do
            (``block_sparse_moe.experts.{e}.w1/w3/w2``) instead of
            ``mlp.experts.{e}.gate_proj/up_proj/down_proj``.
    """
    missing: List[str] = []
    for path, module in model.named_modules():
        if not isinstance(module, FusedMoE):
            continue
        for expert, shard in module.missing_expert_scales():
            kind = module.quant_method.scale_kind
            missing.append(f"{path}.{expert}.{_SHARD_NAMES[shard]}.{kind}")
        for expert, shard in module.missing_expert_biases():
            missing.append(f"{path}.{expert}.{_SHARD_NAMES[shard]}.bias")
        for expert in range(module.num_experts):
            for shard in ("w1", "w3", "w2"):
                if (path, expert, shard) in loaded:
                    continue
                if mixtral_names:
                    missing.append(f"{path.replace('.mlp.experts', '.block_sparse_moe.experts')}.{expert}.{shard}.weight")
                else:
                    missing.append(f"{path}.{expert}.{_SHARD_NAMES[shard]}.weight")
    if missing:
        shown = ", ".join(missing[:4]) + (" ..." if len(missing) > 4 else "")
        raise ValueError(f"checkpoint is missing {len(missing)} expert tensors: {shown}")


def moe_config_value(config: Any, *names: str, default: Any = None) -> Any:
    """The first of ``names`` that ``config`` sets (HF MoE configs name the same field
    differently: ``num_experts`` / ``num_local_experts`` / ``n_routed_experts``)."""
    for n in names:
        value = getattr(config, n, None)
        if value is not None:
            return value
    return default
