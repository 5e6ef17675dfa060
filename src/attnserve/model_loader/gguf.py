"""GGUF checkpoints (llama.cpp's format): config, and weights under HF names.

Parsing and dequantisation use the ``gguf`` package (imported lazily, so the engine imports
without it); the HF config comes from ``transformers.AutoConfig`` with ``gguf_file=``.

Conversions undone here (llama.cpp ``convert_hf_to_gguf.py``):

* Llama-family ``attn_q``/``attn_k`` rows are permuted so that RoPE pairs are
  interleaved: within each head, row ``2i + j`` of the GGUF tensor is HF row
  ``j * head_dim/2 + i``. `unpermute_qk` inverts it.
* Gemma norms are stored as ``1 + w``; HF's Gemma modules add the 1 themselves, so 1 is
  subtracted (transformers does the same when it loads a Gemma GGUF).
* Mixture-of-experts FFNs: llama.cpp stacks the experts of a layer into one tensor each
  (``ffn_gate_exps``/``ffn_up_exps`` ``[E, I, H]``, ``ffn_down_exps`` ``[E, H, I]`` in torch
  order; the router is ``ffn_gate_inp`` ``[E, H]``). They are split back into one HF tensor per
  expert (``mlp.experts.{e}.gate_proj`` for Qwen3-MoE, ``block_sparse_moe.experts.{e}.w1``
  for Mixtral), dequantised one expert at a time. Stacked expert biases (gpt-oss:
  ``ffn_{gate,up}_exps.bias`` ``[E, I]``, ``ffn_down_exps.bias`` ``[E, H]``) are split the same
  way into ``...experts.{e}.{proj}.bias``.
* gpt-oss (llama.cpp arch ``gpt-oss``, spec ``gpt_oss``): NEOX RoPE (no q/k permutation),
  biased q/k/v/o, ``post_attention_norm`` -> ``post_attention_layernorm``, the router
  ``ffn_gate_inp`` -> ``mlp.router``, separate (not interleaved) gate / up experts, MXFP4 or
  any other ggml type (dequantised per expert). ``attn_sinks.weight`` is HF's bare parameter
  ``self_attn.sinks`` (``GGUFArchSpec.bare_params``: no ``.weight`` suffix). The config is
  built by `attnserve.model_loader.gguf_gpt_oss` (transformers' reader fails on these files).
  A fused ``ffn_gate_up_exps`` (llama.cpp's optional fused layout) is refused.

What transformers' GGUF config reader (transformers 5.x, ``integrations/ggml.py``) makes of
MoE files, and what `load_gguf_config` does about it:

* ``qwen3moe``: supported; transformers drops ``qwen3moe.expert_feed_forward_length``
  (``moe_intermediate_size`` keeps its default, 768), so it is read here and set.
* Mixtral (llama.cpp arch ``llama`` with ``llama.expert_count`` > 0): transformers maps no
  expert key for ``llama`` and would build a dense ``LlamaConfig``; refused with a message.
  The weight names are mapped (``mixtral`` spec) for a caller that brings a ``MixtralConfig``.
* ``deepseek2`` and any other architecture the reader lacks: refused with a message.

Dense families whose settings the reader drops (llama.cpp ``convert_hf_to_gguf.py`` writes
them; `load_gguf_config` restores them):

* ``phi3``: ``rope.scaling.original_context_length`` -> ``original_max_position_embeddings``;
  ``rope.dimension_count`` below the head size -> ``partial_rotary_factor`` (Phi-4-mini);
  ``attention.sliding_window`` (0 = none); LongRoPE (``rope.scaling.attn_factor`` and the
  ``rope_factors_long`` / ``rope_factors_short`` tensors) -> ``rope_type`` ``longrope``
  with ``long_factor`` / ``short_factor`` / ``attention_factor``.
* ``gemma2``: ``attn_logit_softcapping`` / ``final_logit_softcapping``; the softmax scale,
  which llama.cpp derives from the size (``hidden / heads`` for the 46-layer 27B, else
  ``head_dim``: its ``f_attention_scale``), -> ``query_pre_attn_scalar``.

Tensor shapes: ``GGUFReader`` reports ``tensor.shape`` in ggml order (fastest dimension
first, i.e. ``[in, out]`` for a matrix), while ``gguf.quants.dequantize`` returns a numpy
array in row-major torch order ``[out, in]``; the latter is what is yielded.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

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
_GEMMA2_BLOCK = {k: v for k, v in _GEMMA3_BLOCK.items() if k not in _QK_NORM}
#: Phi-3: fused ``attn_qkv`` and ``ffn_up`` holding [gate | up] (split by `Phi3ForCausalLM`);
#: some converters write separate ``attn_q``/``attn_k``/``attn_v`` instead
_PHI3_BLOCK = {**_BLOCK_COMMON, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_QWEN3_MOE_EXPERTS = {
    "ffn_gate_exps": "mlp.experts.{expert}.gate_proj",
    "ffn_up_exps": "mlp.experts.{expert}.up_proj",
    "ffn_down_exps": "mlp.experts.{expert}.down_proj",
}
_MIXTRAL_EXPERTS = {  # Mixtral: w1 = gate, w3 = up, w2 = down
    "ffn_gate_exps": "block_sparse_moe.experts.{expert}.w1",
    "ffn_up_exps": "block_sparse_moe.experts.{expert}.w3",
    "ffn_down_exps": "block_sparse_moe.experts.{expert}.w2",
}
_GPT_OSS_BLOCK = {
    **{k: v for k, v in _BLOCK_COMMON.items() if not k.startswith("ffn_")},
    "post_attention_norm": "post_attention_layernorm",
    "attn_sinks": "self_attn.sinks",
    "ffn_gate_inp": "mlp.router",
}
#: llama.cpp stacked expert tensors whose torch shape is [E, H, I] (the others are [E, I, H])
_DOWN_EXPERTS = ("ffn_down_exps",)


@dataclass(frozen=True)
class GGUFArchSpec:
    """How one HF ``model_type`` is stored in GGUF.

    Attributes:
        block_names: llama.cpp per-block base name -> HF name under ``model.layers.N.``.
        permute_qk: undo llama.cpp's RoPE row permutation of ``attn_q``/``attn_k``.
        norm_minus_one: subtract 1 from ``*norm.weight`` (Gemma's ``1 + w`` storage).
        skip: llama.cpp tensors with no HF counterpart (e.g. ``rope_freqs``, recomputed).
        expert_names: llama.cpp stacked expert tensor base name -> HF per-expert name under
            ``model.layers.N.`` with an ``{expert}`` field (empty for dense models).
        expert_ffn_attr: HF config attribute holding one expert's intermediate size ``I``.
        bare_params: llama.cpp per-block base names whose ``.weight`` is an HF parameter
            without a suffix (gpt-oss ``attn_sinks`` -> ``self_attn.sinks``).
    """

    block_names: Dict[str, str]
    permute_qk: bool = False
    norm_minus_one: bool = False
    skip: Tuple[str, ...] = ("rope_freqs",)
    expert_names: Dict[str, str] = field(default_factory=dict)
    expert_ffn_attr: str = "intermediate_size"
    bare_params: Tuple[str, ...] = ()


#: HF model_type -> storage spec (static table; add a model with one line)
GGUF_ARCH_SPECS: Dict[str, GGUFArchSpec] = {
    "llama": GGUFArchSpec(_BLOCK_COMMON, permute_qk=True),
    "qwen3": GGUFArchSpec({**_BLOCK_COMMON, **_QK_NORM}),
    "gemma3_text": GGUFArchSpec(_GEMMA3_BLOCK, norm_minus_one=True),
    "qwen3_moe": GGUFArchSpec(
        {**_BLOCK_COMMON, **_QK_NORM, "ffn_gate_inp": "mlp.gate"},
        expert_names=_QWEN3_MOE_EXPERTS,
        expert_ffn_attr="moe_intermediate_size",
    ),
    "mixtral": GGUFArchSpec(
        {**_BLOCK_COMMON, "ffn_gate_inp": "block_sparse_moe.gate"}, permute_qk=True, expert_names=_MIXTRAL_EXPERTS
    ),
    # llama.cpp converts Qwen2, Phi-3 and Gemma 2 with NEOX RoPE (no row permutation); a
    # Mistral GGUF is a ``llama`` file (transformers names it ``mistral`` only when
    # ``general.name`` is exactly "mistral"; otherwise it loads as Llama)
    "qwen2": GGUFArchSpec(_BLOCK_COMMON),
    "mistral": GGUFArchSpec(_BLOCK_COMMON, permute_qk=True),
    "phi3": GGUFArchSpec(_PHI3_BLOCK, skip=("rope_freqs", "rope_factors_long", "rope_factors_short")),
    "gemma2": GGUFArchSpec(_GEMMA2_BLOCK, norm_minus_one=True),
    "gpt_oss": GGUFArchSpec(_GPT_OSS_BLOCK, expert_names=_QWEN3_MOE_EXPERTS, bare_params=("attn_sinks",)),
}

# GGUF metadata value types (ggml docs/gguf.md): scalar struct formats; 8 = string, 9 = array
_GGUF_SCALAR_FORMATS = {
    **{0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?"},
    **{10: "<Q", 11: "<q", 12: "<d"},
}
_GGUF_STRING, _GGUF_ARRAY = 8, 9

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^(.+)\.(weight|bias)$")


def split_gguf_path(path: str) -> Tuple[str, str]:
    """``/dir/model.gguf`` -> (``/dir``, ``model.gguf``), the form transformers takes."""
    path = os.path.abspath(path)
    return os.path.dirname(path), os.path.basename(path)


def _scan_metadata(buf: Any) -> Tuple[Dict[str, Any], int]:
    """``(scalar and string key/values, byte offset of the first tensor info)`` of a
    little-endian GGUF v2/v3 file; arrays are skipped over.

    Raises:
        ValueError: for a file that is not such a GGUF (bad magic, version, nested array).
    """
    magic, version = struct.unpack_from("<4sI", buf, 0)
    if magic != b"GGUF" or version not in (2, 3):
        raise ValueError(f"not a little-endian GGUF v2/v3 header (magic {magic!r}, version {version})")
    (kv_count,) = struct.unpack_from("<Q", buf, 16)
    off, meta = 24, {}

    def string(at: int) -> Tuple[str, int]:
        (n,) = struct.unpack_from("<Q", buf, at)
        return bytes(buf[at + 8 : at + 8 + n]).decode("utf-8"), at + 8 + n

    for _ in range(kv_count):
        key, off = string(off)
        (vtype,) = struct.unpack_from("<I", buf, off)
        off += 4
        if vtype == _GGUF_STRING:
            meta[key], off = string(off)
        elif vtype in _GGUF_SCALAR_FORMATS:
            fmt = _GGUF_SCALAR_FORMATS[vtype]
            (meta[key],) = struct.unpack_from(fmt, buf, off)
            off += struct.calcsize(fmt)
        elif vtype == _GGUF_ARRAY:
            etype, count = struct.unpack_from("<IQ", buf, off)
            off += 12
            if etype == _GGUF_STRING:
                for _ in range(count):
                    off += 8 + struct.unpack_from("<Q", buf, off)[0]
            elif etype in _GGUF_SCALAR_FORMATS:
                off += count * struct.calcsize(_GGUF_SCALAR_FORMATS[etype])
            else:
                raise ValueError(f"metadata {key!r}: array of type {etype} not scanned")
        else:
            raise ValueError(f"metadata {key!r}: unknown value type {vtype}")
    return meta, off


def open_gguf_tensors(path: str) -> Any:
    """A ``gguf.GGUFReader`` of ``path`` whose metadata section is skipped by `_scan_metadata`
    (only ``general.alignment`` is kept, which the tensor layout needs): the library still
    reads the tensor infos and maps the tensors, but no longer turns every vocabulary string
    into numpy views (Gemma 3's 262k-token vocabulary took ~15 s of a 54 s single-thread load).
    Falls back to the plain reader for files the scan does not handle (big-endian, v1).
    """
    import gguf

    class _TensorReader(gguf.GGUFReader):
        def _build_fields(self, offs: int, count: int) -> int:  # gguf.GGUFReader's hook
            meta, end = _scan_metadata(memoryview(self.data))
            align = meta.get("general.alignment")
            if align is not None:
                part = np.array([align], dtype=np.uint32)
                self._push_field(gguf.ReaderField(offs, "general.alignment", [part], [0],
                                                  [gguf.GGUFValueType.UINT32]), skip_sum=True)
            return end

    try:
        return _TensorReader(path)
    except (ValueError, struct.error, TypeError, AttributeError):
        return gguf.GGUFReader(path)


def read_gguf_scalar_metadata(path: str) -> Dict[str, Any]:
    """Scalar and string metadata of a GGUF file (``general.architecture``,
    ``qwen3moe.expert_count`` ...), without the arrays (tokenizer vocabulary).

    A direct header scan skips the arrays in milliseconds, where ``gguf.GGUFReader`` spends
    seconds building the vocabulary fields; files it does not handle (big-endian, nested
    arrays) go through ``gguf.GGUFReader``.

    Returns:
        key -> int / float / bool / str.
    """
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            return _scan_metadata(buf)[0]
        except (ValueError, struct.error):
            pass
    import gguf

    reader = gguf.GGUFReader(path)
    fields = (f for f in reader.fields.values() if not f.name.startswith("GGUF."))  # header, not metadata
    return {f.name: f.contents() for f in fields if f.types and f.types[0] != gguf.GGUFValueType.ARRAY}


def load_gguf_config(path: str) -> Any:
    """HF config of a GGUF file via ``AutoConfig.from_pretrained(dir, gguf_file=name)``.

    For ``qwen3moe`` files ``moe_intermediate_size`` is set from
    ``qwen3moe.expert_feed_forward_length``, which transformers' reader drops; ``phi3``
    and ``gemma2`` get back the settings listed in the module docstring (a Phi-3 file with
    LongRoPE reads its two factor tensors through `open_gguf_tensors`).
    A ``gpt-oss`` file's config is built by `gguf_gpt_oss.gpt_oss_config` (which raises
    ValueError for what it cannot map).

    Raises:
        ValueError: for a Mixtral GGUF (llama.cpp arch ``llama`` with experts: transformers
            would build a dense ``LlamaConfig``), for an architecture transformers' GGUF reader
            does not support (e.g. ``deepseek2``), for a ``qwen3moe`` file without
            ``expert_feed_forward_length``, and for a Phi-3 file with a LongRoPE attention
            factor but no factor tensors.
    """
    from transformers import AutoConfig

    from attnserve.model_loader.gguf_meta_cache import cached

    meta = read_gguf_scalar_metadata(path)
    arch = meta.get("general.architecture")
    if arch == "gpt-oss":
        from attnserve.model_loader.gguf_gpt_oss import gpt_oss_config

        return gpt_oss_config(path, meta)
    if arch == "llama" and int(meta.get("llama.expert_count", 0) or 0) > 0:
        raise ValueError(
            f"{path}: a llama-architecture GGUF with {meta['llama.expert_count']} experts (Mixtral); transformers' "
            "GGUF reader maps no expert keys for llama and would build a dense LlamaConfig, so it cannot be loaded "
            "from GGUF; use the HF safetensors checkpoint"
        )
    directory, name = split_gguf_path(path)
    try:
        config = cached(path, "config", lambda: AutoConfig.from_pretrained(directory, gguf_file=name),
                        AutoConfig.from_pretrained)  # parsed once per file (gguf_meta_cache)
    except ValueError as e:
        if "not supported" not in str(e):  # transformers: "GGUF model with architecture X is not supported yet."
            raise
        raise ValueError(
            f"GGUF for {arch} is not supported by transformers' GGUF reader ({e}); use the HF safetensors checkpoint"
        ) from e
    if config.model_type == "qwen3_moe":
        key = f"{arch}.expert_feed_forward_length"
        if key not in meta:
            raise ValueError(f"{path}: Qwen3-MoE GGUF without {key!r}; the experts' intermediate size is unknown")
        config.moe_intermediate_size = int(meta[key])
    elif config.model_type == "phi3":
        _restore_phi3(path, meta, config)
    elif config.model_type == "gemma2":
        _restore_gemma2(meta, config)
    return config


def _set_rope(config: Any, **values: Any) -> None:
    """Set keys of the config's RoPE dict (``rope_parameters`` in transformers >= 5, else
    ``rope_scaling``) and the same-named top-level attributes that are already there."""
    attr = "rope_parameters" if getattr(config, "rope_parameters", None) is not None else "rope_scaling"
    params = dict(getattr(config, attr, None) or {})
    params.update(values)
    setattr(config, attr, params)
    for key, value in values.items():
        if hasattr(config, key):
            setattr(config, key, value)


def _restore_phi3(path: str, meta: Dict[str, Any], config: Any) -> None:
    """Phi-3 settings transformers' reader drops (module docstring); see `load_gguf_config`."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    orig = meta.get("phi3.rope.scaling.original_context_length")
    if orig:
        _set_rope(config, original_max_position_embeddings=int(orig))
    dims = meta.get("phi3.rope.dimension_count")
    if dims and int(dims) != head_dim:
        _set_rope(config, partial_rotary_factor=int(dims) / head_dim)
    window = int(meta.get("phi3.attention.sliding_window", 0) or 0)
    config.sliding_window = window or None
    if "phi3.rope.scaling.attn_factor" not in meta:  # written only with LongRoPE factors
        return
    import gguf

    reader = open_gguf_tensors(path)
    factors = {}
    for tensor in reader.tensors:
        if tensor.name in ("rope_factors_long.weight", "rope_factors_short.weight"):
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            factors[tensor.name.split(".")[0]] = [float(v) for v in np.asarray(values, dtype=np.float32).ravel()]
    if len(factors) != 2:
        raise ValueError(f"{path}: Phi-3 GGUF with phi3.rope.scaling.attn_factor but without the rope_factors_long "
                         "and rope_factors_short tensors; its LongRoPE scaling cannot be rebuilt")
    _set_rope(config, rope_type="longrope", long_factor=factors["rope_factors_long"],
              short_factor=factors["rope_factors_short"],
              attention_factor=float(meta["phi3.rope.scaling.attn_factor"]))


def _restore_gemma2(meta: Dict[str, Any], config: Any) -> None:
    """Gemma 2 settings transformers' reader drops (module docstring); see `load_gguf_config`."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if f"gemma2.{key}" in meta:
            setattr(config, key, float(meta[f"gemma2.{key}"]))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    is_27b = config.num_hidden_layers == 46
    config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads if is_27b else head_dim


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
            bare = base in spec.bare_params and suffix == "weight"
            return f"model.layers.{layer}.{spec.block_names[base]}" + ("" if bare else f".{suffix}")
        if base in spec.expert_names:
            raise KeyError(f"GGUF tensor {name!r} stacks experts: see gguf_expert_hf_names")
        if base == "ffn_gate_up_exps":
            raise KeyError(f"GGUF tensor {name!r} fuses the gate and up experts (llama.cpp's fused layout); "
                           "only separate ffn_gate_exps / ffn_up_exps are supported: reconvert without fusing")
    else:
        m = _GLOBAL_RE.match(name)
        if m:
            base, suffix = m.groups()
            if base in spec.skip:
                return None
            if base in _GLOBAL:
                return f"{_GLOBAL[base]}.{suffix}"
    raise KeyError(f"GGUF tensor {name!r} has no HF name mapping")


def gguf_expert_hf_names(name: str, spec: GGUFArchSpec, num_experts: int) -> Optional[List[str]]:
    """HF names of the experts stacked in one llama.cpp tensor, in expert order.

    ``blk.3.ffn_gate_exps.weight`` (Qwen3-MoE, 4 experts) ->
    ``[model.layers.3.mlp.experts.0.gate_proj.weight, ..., ...experts.3.gate_proj.weight]``.

    Returns:
        ``num_experts`` names, or None when ``name`` is not a stacked expert tensor of ``spec``.
    """
    m = _BLOCK_RE.match(name)
    if not m or m.group(2) not in spec.expert_names:
        return None
    layer, base, suffix = m.groups()
    template = f"model.layers.{layer}.{spec.expert_names[base]}.{suffix}"
    return [template.format(expert=e) for e in range(num_experts)]


def _num_experts(config: Any) -> Optional[int]:
    for attr in ("num_local_experts", "num_experts", "n_routed_experts"):
        if getattr(config, attr, None):
            return int(getattr(config, attr))
    return None


def _check_expert_shape(tensor: Any, spec: GGUFArchSpec, config: Any) -> int:
    """Number of experts of a stacked tensor (weight ``[E, out, in]`` or bias ``[E, out]``)
    after checking its shape against ``config``."""
    shape = tuple(int(d) for d in reversed(tensor.shape))  # ggml order -> torch order
    _, base, suffix = _BLOCK_RE.match(tensor.name).groups()
    num, inter, hidden = _num_experts(config), getattr(config, spec.expert_ffn_attr, None), config.hidden_size
    expected = (num, hidden, inter) if base in _DOWN_EXPERTS else (num, inter, hidden)
    names = "[E, H, I]" if base in _DOWN_EXPERTS else "[E, I, H]"
    if suffix == "bias":
        expected, names = expected[:2], names[:5] + "]"
    if len(shape) != len(expected) or any(e is not None and e != s for e, s in zip(expected, shape)):
        raise ValueError(
            f"GGUF tensor {tensor.name!r} has shape {list(shape)}, the config expects {names} = {list(expected)} "
            f"(E = experts, I = {spec.expert_ffn_attr}, H = hidden_size)"
        )
    return shape[0]


def _owned(w: np.ndarray, mapped: np.ndarray) -> torch.Tensor:
    """float32 CPU tensor over ``w``, copied when it is a view of the mapped file or not writeable."""
    if np.may_share_memory(w, mapped) or not (w.flags.writeable and w.flags.c_contiguous):
        w = np.array(w, dtype=np.float32, copy=True)  # never alias the mapped file
    return torch.from_numpy(w)


def _iterate_experts(tensor: Any, names: List[str]) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield one expert of a stacked tensor at a time, each dequantised on its own from
    ``tensor.data[e]`` (the reader's data keeps the expert axis first for every ggml type), so
    peak memory is one float32 expert slice on top of the memory-mapped file."""
    import gguf

    for e, hf_name in enumerate(names):
        w = gguf.quants.dequantize(tensor.data[e], tensor.tensor_type)
        yield hf_name, _owned(np.asarray(w, dtype=np.float32), tensor.data)


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
    A stacked expert tensor (``blk.N.ffn_{gate,up,down}_exps``) yields one HF tensor per
    expert (`gguf_expert_hf_names`): ``[I, H]`` for gate/up, ``[H, I]`` for down (a stacked
    bias: ``[I]`` / ``[H]``).
    Tensors are produced one at a time, so peak host memory is one float32 tensor (one
    expert for stacked ones) on top of the memory-mapped file.

    Args:
        path: the ``.gguf`` file, or an open ``gguf.GGUFReader`` (parsing the metadata of
            a file with a large vocabulary takes seconds; reuse a reader when you have one).
        config: its HF config (`load_gguf_config`); ``model_type`` selects the spec and the
            head counts drive the un-permutation.
        progress: show a tqdm progress bar.

    Raises:
        ValueError: for an unsupported ``model_type``, or a stacked expert tensor whose shape
            does not match the config's experts, intermediate and hidden sizes.
        KeyError: for a tensor without a name mapping.
    """
    import gguf
    from tqdm import tqdm

    spec = gguf_arch_spec(config.model_type)
    process = _processor(config, spec)
    reader = path if isinstance(path, gguf.GGUFReader) else open_gguf_tensors(path)
    desc = f"Loading {os.path.basename(str(getattr(reader.data, 'filename', 'GGUF')))}"
    for tensor in tqdm(reader.tensors, desc=desc, disable=not progress, unit="tensor"):
        m = _BLOCK_RE.match(tensor.name)
        if m and m.group(2) in spec.expert_names:
            num = _check_expert_shape(tensor, spec, config)
            yield from _iterate_experts(tensor, gguf_expert_hf_names(tensor.name, spec, num))
            continue
        hf_name = gguf_to_hf_name(tensor.name, spec)
        if hf_name is None:
            continue
        w = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        yield hf_name, _owned(process(hf_name, np.asarray(w, dtype=np.float32)), tensor.data)
