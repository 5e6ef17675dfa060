"""GGUF checkpoints (llama.cpp's format): config, and weights under HF names.

Parsing and dequantisation use the ``gguf`` package (imported lazily, so the engine imports
without it); the HF config comes from ``transformers.AutoConfig`` with ``gguf_file=``.

Conversions undone here (llama.cpp ``convert_hf_to_gguf.py``):

* Llama-family ``attn_q``/``attn_k`` rows are permuted so that RoPE pairs are
  interleaved: within each head, row ``2i + j`` of the GGUF tensor is HF row
  ``j * head_dim/2 + i``. `unpermute_qk` inverts it.
* Gemma norms are stored as ``1 + w``; HF's Gemma modules add the 1 themselves, so 1 is
  subtracted (transformers does the same when it loads a Gemma GGUF).

Tensor shapes: ``GGUFReader`` reports ``tensor.shape`` in ggml order (fastest dimension
first, i.e. ``[in, out]`` for a matrix), while ``gguf.quants.dequantize`` returns a numpy
array in row-major torch order ``[out, in]``; the latter is what is yielded.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import numpy as np
import torch

# llama.cpp per-block tensor name -> HF name inside ``model.layers.N.``
_BLOCK_COMMON: Dict[str, str] = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL: Dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_GEMMA3_BLOCK = {
    **_BLOCK_COMMON,
    **_QK_NORM,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


@dataclass(frozen=True)
class GGUFArchSpec:
    """How one HF ``model_type`` is stored in GGUF.

    Attributes:
        block_names: llama.cpp per-block base name -> HF name under ``model.layers.N.``.
        permute_qk: undo llama.cpp's RoPE row permutation of ``attn_q``/``attn_k``.
        norm_minus_one: subtract 1 from ``*norm.weight`` (Gemma's ``1 + w`` storage).
        skip: llama.cpp tensors with no HF counterpart (e.g. ``rope_freqs``, recomputed).
    """

    block_names: Dict[str, str]
    permute_qk: bool = False
    norm_minus_one: bool = False
    skip: Tuple[str, ...] = ("rope_freqs",)


#: HF model_type -> storage spec (static table; add a model with one line)
GGUF_ARCH_SPECS: Dict[str, GGUFArchSpec] = {
    "llama": GGUFArchSpec(_BLOCK_COMMON, permute_qk=True),
    "qwen3": GGUFArchSpec({**_BLOCK_COMMON, **_QK_NORM}),
    "gemma3_text": GGUFArchSpec(_GEMMA3_BLOCK, norm_minus_one=True),
}

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^(.+)\.(weight|bias)$")


def split_gguf_path(path: str) -> Tuple[str, str]:
    """``/dir/model.gguf`` -> (``/dir``, ``model.gguf``), the form transformers takes."""
    path = os.path.abspath(path)
    return os.path.dirname(path), os.path.basename(path)


def load_gguf_config(path: str) -> Any:
    """HF config of a GGUF file via ``AutoConfig.from_pretrained(dir, gguf_file=name)``."""
    from transformers import AutoConfig

    directory, name = split_gguf_path(path)
    return AutoConfig.from_pretrained(directory, gguf_file=name)


def gguf_arch_spec(model_type: str) -> GGUFArchSpec:
    """Storage spec for an HF ``model_type``.

    Raises:
        ValueError: for a model type without a spec (lists the supported ones).
    """
    if model_type not in GGUF_ARCH_SPECS:
        raise ValueError(
            f"GGUF loading is not supported for model_type {model_type!r}; supported: {', '.join(sorted(GGUF_ARCH_SPECS))}"
        )
    return GGUF_ARCH_SPECS[model_type]


def gguf_to_hf_name(name: str, spec: GGUFArchSpec) -> Optional[str]:
    """Map a llama.cpp tensor name to its HF parameter name.

    ``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``;
    ``token_embd.weight`` -> ``model.embed_tokens.weight``.

    Returns:
        the HF name, or None for tensors in ``spec.skip``.

    Raises:
        KeyError: for a name the spec does not know.
    """
    m = _BLOCK_RE.match(name)
    if m:
        layer, base, suffix = m.groups()
        if base in spec.skip:
            return None
        if base in spec.block_names:
            return f"model.layers.{layer}.{spec.block_names[base]}.{suffix}"
    else:
        m = _GLOBAL_RE.match(name)
        if m:
            base, suffix = m.groups()
            if base in spec.skip:
                return None
            if base in _GLOBAL:
                return f"{_GLOBAL[base]}.{suffix}"
    raise KeyError(f"GGUF tensor {name!r} has no HF name mapping")


def unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's RoPE permutation of a q or k projection.

    Args:
        w: ``[num_heads * head_dim, ...]`` (weight ``[out, in]`` or bias ``[out]``), as read
            from the GGUF (rows of each head in interleaved pair order).
        num_heads: query heads for ``attn_q``, key/value heads for ``attn_k``.

    Returns:
        the same shape with each head's rows in HF "rotate_half" order:
        ``w.reshape(H, hd//2, 2, ...).swapaxes(1, 2).reshape(w.shape)``.
    """
    out = w.shape[0]
    return w.reshape(num_heads, out // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _processor(config: Any, spec: GGUFArchSpec) -> Callable[[str, np.ndarray], np.ndarray]:
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads

    def process(hf_name: str, w: np.ndarray) -> np.ndarray:
        if spec.permute_qk and ".self_attn.q_proj." in hf_name:
            w = unpermute_qk(w, heads)
        elif spec.permute_qk and ".self_attn.k_proj." in hf_name:
            w = unpermute_qk(w, kv_heads)
        if spec.norm_minus_one and hf_name.endswith("norm.weight"):
            w = w - 1.0
        return w

    return process


def iterate_gguf_weights(path: Any, config: Any, progress: bool = True) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, float32 CPU tensor)`` for every tensor of a GGUF file.

    Each tensor is dequantised with ``gguf.quants.dequantize`` to float32, mapped with
    `gguf_to_hf_name` and post-processed (q/k un-permutation, Gemma norm offset).
    Tensors are produced one at a time, so peak host memory is one float32 tensor on top of
    the memory-mapped file.

    Args:
        path: the ``.gguf`` file, or an open ``gguf.GGUFReader`` (parsing the metadata of
            a file with a large vocabulary takes seconds; reuse a reader when you have one).
        config: its HF config (`load_gguf_config`); ``model_type`` selects the spec and the
            head counts drive the un-permutation.
        progress: show a tqdm progress bar.

    Raises:
        ValueError: for an unsupported ``model_type``.
        KeyError: for a tensor without a name mapping.
    """
    import gguf
    from tqdm import tqdm

    spec = gguf_arch_spec(config.model_type)
    process = _processor(config, spec)
    reader = path if isinstance(path, gguf.GGUFReader) else gguf.GGUFReader(path)
    desc = f"Loading {os.path.basename(str(getattr(reader.data, 'filename', 'GGUF')))}"
    for tensor in tqdm(reader.tensors, desc=desc, disable=not progress, unit="tensor"):
        hf_name = gguf_to_hf_name(tensor.name, spec)
        if hf_name is None:
            continue
        w = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        w = process(hf_name, np.asarray(w, dtype=np.float32))
        if np.may_share_memory(w, tensor.data) or not (w.flags.writeable and w.flags.c_contiguous):
            w = np.array(w, dtype=np.float32, copy=True)  # never alias the mapped file
        yield hf_name, torch.from_numpy(w)
