"""`QuantizationConfig`: which FP8 scheme a model's linears use, from ``--quantization`` or
the checkpoint's HF ``quantization_config``.

Accepted sources:

* ``--quantization fp8`` on an unquantised (bf16 / float32 / GGUF / dummy) checkpoint:
  every linear quantised as its weight is loaded, e4m3 with one scale per output channel
  and dynamic per-token activation scales (W8A8);
* HF ``quant_method: "fp8"`` (the format of DeepSeek-V3 and of the ``*-FP8`` releases):
  ``weight_block_size: [128, 128]`` -> block scales ``weight_scale_inv``
  ``[cdiv(N, 128), cdiv(K, 128)]`` with dynamic ``1 x 128`` activation groups; without
  it, one scale per tensor (``weight_scale``) and, for ``activation_scheme: "static"``, an
  ``input_scale`` per tensor. ``ignored_layers`` / ``modules_to_not_convert`` stay bf16;
* ``quant_method: "compressed-tensors"`` with 8-bit float weights (``strategy`` ``tensor``,
  ``channel`` or ``block``; ``weight_scale``) and optional 8-bit float input activations
  (dynamic per token, or static per tensor with ``input_scale``); ``ignore`` stays bf16.

Any other ``quant_method`` or scheme is refused with a ValueError that names it. The LM
head, the embeddings and the norms are not `Linear` layers here and stay in the model
dtype; the MoE router (``mlp.gate``) and DeepSeek's ``kv_b_proj`` (read as a raw matrix
by MLA) stay in the model dtype too. MoE routed experts are FP8 (W8A16, `fp8_moe`): block
scales for ``"block"``, per-channel scales otherwise; a ``...mlp.experts`` entry in the
ignored layers keeps them in the model dtype.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

#: values of ``--quantization``
QUANTIZATION_METHODS = ("fp8",)
#: module-name suffixes never quantised (router; MLA's absorbed up-projection)
ALWAYS_UNQUANTIZED = ("mlp.gate", "kv_b_proj")
WEIGHT_STRATEGIES = ("tensor", "channel", "block")


@dataclass(frozen=True)
class QuantizationConfig:
    """An FP8 linear scheme.

    Attributes:
        weight_strategy: ``"tensor"``, ``"channel"`` (one scale per output row) or ``"block"``.
        weight_block_size: ``(rows, cols)`` of a weight block (``"block"`` only; (128, 128)).
        activation_scheme: ``"dynamic"`` (per token; per ``1 x 128`` group for blocks) or
            ``"static"`` (one ``input_scale`` per tensor from the checkpoint).
        is_checkpoint_fp8: the checkpoint holds FP8 weights and scales (else they are
            quantised at load).
        checkpoint_format: ``"online"``, ``"fp8"`` or ``"compressed-tensors"``.
        ignored: module names (or ``re:`` patterns) kept in the model dtype.
    """

    weight_strategy: str = "channel"
    weight_block_size: Optional[Tuple[int, int]] = None
    activation_scheme: str = "dynamic"
    is_checkpoint_fp8: bool = False
    checkpoint_format: str = "online"
    ignored: Tuple[str, ...] = ()

    def __post_init__(self):
        if self.weight_strategy not in WEIGHT_STRATEGIES:
            raise ValueError(f"FP8 weight strategy {self.weight_strategy!r} is not supported "
                             f"(supported: {', '.join(WEIGHT_STRATEGIES)})")
        if (self.weight_strategy == "block") != (self.weight_block_size is not None):
            raise ValueError("weight_block_size goes with the block strategy only")
        if self.weight_block_size is not None and tuple(self.weight_block_size) != (128, 128):
            raise ValueError(f"FP8 weight_block_size {list(self.weight_block_size)} is not supported (only [128, 128])")
        if self.activation_scheme not in ("dynamic", "static"):
            raise ValueError(f"FP8 activation_scheme {self.activation_scheme!r} is not supported (dynamic or static)")
        if self.activation_scheme == "static" and (not self.is_checkpoint_fp8 or self.weight_strategy == "block"):
            raise ValueError("static FP8 activation scales come from a per-tensor or per-channel checkpoint only")

    @property
    def weight_scale_name(self) -> str:
        """Checkpoint suffix of the weight scale: ``weight_scale_inv`` for blocks, else ``weight_scale``."""
        return "weight_scale_inv" if self.weight_strategy == "block" else "weight_scale"

    def is_ignored(self, module_name: str, packed_modules_mapping: Mapping[str, Sequence[Tuple[str, int]]] = ()
                   ) -> bool:
        """Whether the linear ``module_name`` (e.g. ``model.layers.0.self_attn.qkv_proj``)
        stays unquantised: it or one of the HF shards it is fused from is in ``ignored``
        (exact name, a dotted suffix, or an ``re:`` pattern), or it ends with an
        `ALWAYS_UNQUANTIZED` suffix."""
        if module_name.endswith(ALWAYS_UNQUANTIZED):
            return True
        names = [module_name]
        leaf = module_name.rsplit(".", 1)[-1]
        mapping = dict(packed_modules_mapping)
        if leaf in mapping:
            base = module_name[: -len(leaf)]
            names += [base + hf for hf, _ in mapping[leaf]]
        for pattern in self.ignored:
            for name in names:
                if pattern.startswith("re:"):
                    if re.fullmatch(pattern[3:], name):
                        return True
                elif name == pattern or name.endswith("." + pattern):
                    return True
        return False


def _hf_fp8(qc: Mapping[str, Any]) -> QuantizationConfig:
    block = qc.get("weight_block_size")
    scheme = qc.get("activation_scheme", "dynamic")
    ignored = tuple(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or ())
    if block is not None:
        if scheme != "dynamic":
            raise ValueError(f"quantization_config: block-scaled FP8 with activation_scheme {scheme!r} is not "
                             "supported (dynamic only)")
        return QuantizationConfig("block", tuple(int(b) for b in block), "dynamic", True, "fp8", ignored)
    return QuantizationConfig("tensor", None, scheme, True, "fp8", ignored)


def _ct_fp8(qc: Mapping[str, Any]) -> QuantizationConfig:
    groups: Dict[str, Any] = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"compressed-tensors: exactly one config group is supported, got {len(groups)}")
    group = next(iter(groups.values()))
    w = group.get("weights") or {}
    if w.get("type") != "float" or int(w.get("num_bits", 0)) != 8:
        raise ValueError(f"compressed-tensors weights {w.get('type')!r} {w.get('num_bits')}-bit are not supported "
                         "(8-bit float only)")
    strategy = w.get("strategy", "tensor")
    if strategy not in WEIGHT_STRATEGIES:
        raise ValueError(f"compressed-tensors weight strategy {strategy!r} is not supported "
                         f"({', '.join(WEIGHT_STRATEGIES)})")
    if w.get("dynamic", False):
        raise ValueError("compressed-tensors dynamic weight scales are not supported")
    block = tuple(int(b) for b in w["block_structure"]) if strategy == "block" else None
    a = group.get("input_activations")
    scheme = "dynamic"
    if a is not None:
        if a.get("type") != "float" or int(a.get("num_bits", 0)) != 8:
            raise ValueError(f"compressed-tensors input activations {a.get('type')!r} {a.get('num_bits')}-bit are "
                             "not supported (8-bit float only)")
        if not a.get("dynamic", False):
            if a.get("strategy", "tensor") != "tensor":
                raise ValueError(f"compressed-tensors static activation strategy {a.get('strategy')!r} is not "
                                 "supported (tensor only)")
            scheme = "static"
    return QuantizationConfig(strategy, block, scheme, True, "compressed-tensors", tuple(qc.get("ignore") or ()))


def parse_hf_quantization_config(qc: Any) -> QuantizationConfig:
    """A checkpoint's ``quantization_config`` (dict or HF config object) -> `QuantizationConfig`.

    Raises:
        ValueError: an unknown ``quant_method`` (named) or an unsupported scheme.
    """
    if not isinstance(qc, Mapping):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))
    method = qc.get("quant_method")
    if method == "fp8":
        return _hf_fp8(qc)
    if method == "compressed-tensors":
        return _ct_fp8(qc)
    raise ValueError(f"checkpoint quant_method {method!r} is not supported (supported: fp8, compressed-tensors)")


def resolve_quantization(quantization: Any, hf_config: Any) -> Optional[QuantizationConfig]:
    """The scheme for a model: the checkpoint's ``quantization_config`` if it has one, else
    online FP8 for ``quantization == "fp8"``, else None (no quantisation). A
    `QuantizationConfig` given as ``quantization`` is used as it is (tests, tools).

    Raises:
        ValueError: an unknown ``--quantization`` value or ``quant_method`` (each named).
    """
    if isinstance(quantization, QuantizationConfig):
        return quantization
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"--quantization {quantization!r} is not supported (supported: "
                         f"{', '.join(QUANTIZATION_METHODS)})")
    qc = getattr(hf_config, "quantization_config", None)
    if qc:
        return parse_hf_quantization_config(qc)
    if quantization == "fp8":
        return QuantizationConfig()
    return None


def check_quantization_device(config: Optional[QuantizationConfig], device: Any) -> None:
    """Refuse FP8 on a CUDA device below compute capability 8.9 (no FP8 tensor cores).

    Raises:
        ValueError: naming the GPU and its compute capability.
    """
    if config is None:
        return
    import torch

    from attnserve.models.layers.quantization.fp8_utils import fp8_supported

    dev = torch.device(device)
    if dev.type != "cuda":
        return
    ok, what = fp8_supported(dev)
    if not ok:
        raise ValueError(f"--quantization fp8 needs a GPU of compute capability 8.9 or newer; {what} has none")
