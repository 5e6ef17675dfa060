"""Write an unquantised HF checkpoint as an FP8 checkpoint in one of the published formats.

`export_fp8_checkpoint` quantises each linear weight (and each routed expert's
``gate_proj`` / ``up_proj`` / ``down_proj``, Mixtral ``w1`` / ``w3`` / ``w2``) with the reference of `fp8_utils`
(the same functions ``--quantization`` uses at load), so loading the result gives the
same model as quantising the source at load with `fp8_format_config`:

* ``"fp8-block"``: HF ``quant_method: fp8``, ``weight_block_size: [128, 128]``,
  ``weight`` e4m3 + ``weight_scale_inv`` ``[cdiv(N, 128), cdiv(K, 128)]`` (DeepSeek-V3);
* ``"fp8-tensor"``: HF ``quant_method: fp8`` without blocks, ``weight_scale`` scalar;
* ``"compressed-tensors"``: ``float-quantized``, channel strategy, ``weight_scale``
  ``[N, 1]``, dynamic per-token input activations.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Dict, Optional

import torch

from attnserve.models.layers.quantization.config import QuantizationConfig
from attnserve.models.layers.quantization.fp8_utils import quantize_per_block, quantize_per_row, quantize_per_tensor

FORMATS = ("fp8-block", "fp8-tensor", "compressed-tensors")
_LINEAR_LEAVES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "q_a_proj", "q_b_proj",
                  "kv_a_proj_with_mqa")  # MLA (DeepSeek); kv_b_proj stays unquantised (config.ALWAYS_UNQUANTIZED)


_EXPERT_LEAVES = ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


def _is_linear(name: str) -> bool:
    parts = name.split(".")
    if len(parts) < 2 or parts[-1] != "weight":
        return False
    if len(parts) >= 4 and parts[-4] == "experts" and parts[-3].isdigit():
        return parts[-2] in _EXPERT_LEAVES
    return parts[-2] in _LINEAR_LEAVES


def fp8_format_config(fmt: str) -> QuantizationConfig:
    """The online `QuantizationConfig` that computes the same model as ``fmt`` loaded."""
    if fmt == "fp8-block":
        return QuantizationConfig("block", (128, 128))
    if fmt == "fp8-tensor":
        return QuantizationConfig("tensor")
    if fmt == "compressed-tensors":
        return QuantizationConfig("channel")
    raise ValueError(f"unknown FP8 checkpoint format {fmt!r} (one of {', '.join(FORMATS)})")


def _quantization_config(fmt: str) -> Dict:
    if fmt == "fp8-block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}
    if fmt == "fp8-tensor":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3"}
    return {
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False, "symmetric": True},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True,
                                  "symmetric": True},
        }},
    }


def export_fp8_checkpoint(src_dir: str, out_dir: str, fmt: str,
                          is_linear: Optional[Callable[[str], bool]] = None) -> None:
    """Read ``src_dir`` (``config.json`` + ``*.safetensors``) and write ``out_dir`` in ``fmt``.

    Args:
        src_dir: unquantised HF checkpoint directory.
        out_dir: created if missing; gets ``config.json`` (with ``quantization_config``) and
            ``model.safetensors``.
        fmt: one of `FORMATS`.
        is_linear: which tensor names are quantised (default: the ``*_proj.weight`` of
            attention, dense MLPs and routed experts).

    Raises:
        ValueError: an unknown ``fmt``.
    """
    import glob

    from safetensors import safe_open
    from safetensors.torch import save_file

    def iterate_safetensors_weights(path, progress=False):  # the loader sits above this layer
        for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
            with safe_open(f, framework="pt") as st:
                for key in st.keys():
                    yield key, st.get_tensor(key)

    fp8_format_config(fmt)  # validates fmt
    pick = is_linear or _is_linear
    out: Dict[str, torch.Tensor] = {}
    for name, t in iterate_safetensors_weights(src_dir, progress=False):
        if not pick(name):
            out[name] = t.contiguous()
            continue
        if fmt == "fp8-block":
            q, s = quantize_per_block(t)
            out[name.replace(".weight", ".weight_scale_inv")] = s
        elif fmt == "fp8-tensor":
            q, s = quantize_per_tensor(t)
            out[name.replace(".weight", ".weight_scale")] = s.reshape(())
        else:
            q, s = quantize_per_row(t)
            out[name.replace(".weight", ".weight_scale")] = s.unsqueeze(1)
        out[name] = q
    os.makedirs(out_dir, exist_ok=True)
    save_file(out, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(src_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = _quantization_config(fmt)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
