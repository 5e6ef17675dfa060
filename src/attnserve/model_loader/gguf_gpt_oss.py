"""The HF ``GptOssConfig`` of an OpenAI gpt-oss GGUF (llama.cpp arch ``gpt-oss``).

transformers' GGUF config reader cannot be used for these files: its ``gpt_oss`` path reads
``rope.scaling.*`` values from ``field.parts[0]`` (the key's length, not its value) and raises
``TypeError`` on the ``rope.scaling.factor`` every llama.cpp conversion writes; it also maps the
window from ``gpt-oss.sliding_window`` (llama.cpp writes ``gpt-oss.attention.sliding_window``)
and drops ``attention.key_length`` and ``expert_feed_forward_length``. So the config is built
here from the scalar metadata (llama.cpp ``convert_hf_to_gguf.py`` ``GptOssModel`` and the
generic ``TextModel.set_gguf_parameters``):

=====================================================  ==========================================
``gpt-oss.`` key                                       ``GptOssConfig`` field
=====================================================  ==========================================
``block_count``                                        ``num_hidden_layers``
``context_length``                                     ``max_position_embeddings``
``embedding_length``                                   ``hidden_size``
``expert_feed_forward_length`` (else                   ``intermediate_size`` (one expert's)
``feed_forward_length``)
``attention.head_count`` / ``head_count_kv``           ``num_attention_heads`` / ``num_key_value_heads``
``attention.key_length`` (= ``value_length``)          ``head_dim`` (else ``hidden / heads``)
``attention.layer_norm_rms_epsilon``                   ``rms_norm_eps``
``attention.sliding_window``                           ``sliding_window``
``expert_count`` / ``expert_used_count``               ``num_local_experts`` / ``num_experts_per_tok``
``rope.freq_base``                                     ``rope_parameters.rope_theta``
``rope.scaling.type`` = ``yarn``, ``.factor``,         ``rope_parameters`` ``rope_type="yarn"``,
``.original_context_length``, ``.yarn_beta_fast``,     ``factor``, ``original_max_position_embeddings``,
``.yarn_beta_slow``                                    ``beta_fast`` (32), ``beta_slow`` (1)
``tokenizer.ggml.bos_token_id`` / ``eos_token_id``     ``bos_token_id`` / ``eos_token_id``
=====================================================  ==========================================

Fixed, as llama.cpp's gpt-oss graph fixes them (no metadata carries them): ``layer_types`` with
the even layers sliding and the odd ones full (llama.cpp's SWA pattern 2; HF's default),
``swiglu_limit`` 7.0 and ``swiglu_alpha`` 1.702, biased attention, YaRN ``truncate=False``
(HF's gpt-oss setting). ``vocab_size`` is the row count of ``token_embd``; the embeddings are
tied when the file has no ``output`` tensor.

Refused (`ValueError`): a missing required key; ``value_length`` != ``key_length``;
``rope.dimension_count`` != the head size (partial rotary); a ``rope.scaling.type`` other than
``yarn`` / ``none``; YaRN without ``factor`` or ``original_context_length``; the YaRN knobs HF's
gpt-oss has no counterpart for (``yarn_ext_factor`` != 1, ``yarn_attn_factor`` != 1,
``yarn_log_multiplier`` != 0); no ``attention.sliding_window`` (or 0).
"""

from __future__ import annotations

from typing import Any, Dict

ARCH = "gpt-oss"
_P = ARCH + "."
_REQUIRED = ("block_count", "embedding_length", "attention.head_count", "expert_count", "expert_used_count")


def gpt_oss_config(path: str, meta: Dict[str, Any]) -> Any:
    """``GptOssConfig`` of the gpt-oss GGUF at ``path`` whose scalar metadata is ``meta``
    (module docstring: the keys read, what is fixed and what is refused).

    Raises:
        ValueError: for what the module docstring lists as refused.
    """
    from transformers import GptOssConfig

    def get(key: str, default: Any = None) -> Any:
        return meta.get(_P + key, default)

    missing = [_P + k for k in _REQUIRED if get(k) is None]
    inter = get("expert_feed_forward_length", get("feed_forward_length"))
    if inter is None:
        missing.append(_P + "expert_feed_forward_length")
    if missing:
        raise ValueError(f"{path}: gpt-oss GGUF without {', '.join(missing)}")
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    value_len = get("attention.value_length")
    if value_len is not None and int(value_len) != head_dim:
        raise ValueError(f"{path}: gpt-oss GGUF with attention.value_length {value_len} != key_length {head_dim}; "
                         "HF's GptOssConfig has one head_dim")
    rope_dims = get("rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise ValueError(f"{path}: gpt-oss GGUF with rope.dimension_count {rope_dims} != head size {head_dim} "
                         "(partial rotary); gpt-oss rotates whole heads")
    window = int(get("attention.sliding_window", 0) or 0)
    if window <= 0:
        raise ValueError(f"{path}: gpt-oss GGUF without {_P}attention.sliding_window; its local layers' window "
                         "is unknown")
    vocab, tied = _embedding_shape(path)
    layers = int(get("block_count"))
    kw = {}
    for key in ("bos_token_id", "eos_token_id"):
        if meta.get(f"tokenizer.ggml.{key}") is not None:
            kw[key] = int(meta[f"tokenizer.ggml.{key}"])
    return GptOssConfig(
        architectures=["GptOssForCausalLM"], num_hidden_layers=layers, hidden_size=hidden,
        intermediate_size=int(inter), num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads)), head_dim=head_dim,
        num_local_experts=int(get("expert_count")), num_experts_per_tok=int(get("expert_used_count")),
        vocab_size=vocab, tie_word_embeddings=tied, sliding_window=window,
        max_position_embeddings=int(get("context_length", GptOssConfig.max_position_embeddings)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", GptOssConfig.rms_norm_eps)),
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        rope_parameters=_rope_parameters(path, get), swiglu_limit=7.0, swiglu_alpha=1.702, attention_bias=True,
        **kw)


def _rope_parameters(path: str, get: Any) -> Dict[str, Any]:
    theta = float(get("rope.freq_base", 150000.0))
    kind = get("rope.scaling.type")
    if kind in (None, "none"):
        return {"rope_type": "default", "rope_theta": theta}
    if kind != "yarn":
        raise ValueError(f"{path}: gpt-oss GGUF with rope.scaling.type {kind!r}; only yarn (or none) is mapped")
    for key, neutral in (("yarn_ext_factor", 1.0), ("yarn_attn_factor", 1.0), ("yarn_log_multiplier", 0.0)):
        value = get(f"rope.scaling.{key}")
        if value is not None and float(value) != neutral:
            raise ValueError(f"{path}: gpt-oss GGUF with rope.scaling.{key} = {value}; HF's gpt-oss YaRN has no "
                             f"counterpart (only {neutral} is accepted)")
    factor, orig = get("rope.scaling.factor"), get("rope.scaling.original_context_length")
    if factor is None or orig is None:
        raise ValueError(f"{path}: gpt-oss GGUF with YaRN but without rope.scaling.factor and "
                         "rope.scaling.original_context_length")
    return {"rope_type": "yarn", "rope_theta": theta, "factor": float(factor),
            "original_max_position_embeddings": int(orig), "beta_fast": float(get("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(get("rope.scaling.yarn_beta_slow", 1.0)), "truncate": False}


def _embedding_shape(path: str) -> tuple:
    """``(vocab_size, tie_word_embeddings)`` from the tensor infos: ``token_embd``'s rows, and
    whether ``output.weight`` is absent."""
    from attnserve.model_loader.gguf import open_gguf_tensors

    shapes = {t.name: [int(d) for d in t.shape] for t in open_gguf_tensors(path).tensors}
    if "token_embd.weight" not in shapes:
        raise ValueError(f"{path}: gpt-oss GGUF without a token_embd.weight tensor")
    return shapes["token_embd.weight"][-1], "output.weight" not in shapes  # ggml order [H, V]
