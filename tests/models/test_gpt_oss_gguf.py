"""gpt-oss from GGUF (llama.cpp arch ``gpt-oss``) against HF transformers: test_gpt_oss.py's random
tiny ``GptOssForCausalLM`` written with llama.cpp's tensor names and metadata (what
``convert_hf_to_gguf.py`` ``GptOssModel`` writes: separate gate / up experts, stacked expert
biases, ``attn_sinks.weight``, YaRN keys), loaded by our loader. Float32 experts, and experts
quantised to MXFP4 by ``gguf.quants`` (then HF holds the dequantised values).

A GGUF cannot carry ``swiglu_limit`` (llama.cpp fixes 7.0), so the HF model here has 7.0 where
test_gpt_oss.py's has 1.0; everything else is that file's config and randomisation.
"""

from __future__ import annotations

import copy

import pytest
import torch

from attnserve.forward_batch import ForwardMode
from numeric_bounds import assert_within, forward_bound, llama_like_terms
from test_gpt_oss import CONFIG, PREFILL_LEN, VARIANTS, VOCAB, WINDOW, _randomise
from tiny_hf import hf_logits as _hf_logits, hf_variant_getter, load_checkpoint as _load, random_prompt

_cfg_name, _arch, _ = VARIANTS["gpt_oss"]
GGUF_VARIANTS = {"gpt_oss_gguf": (_cfg_name, _arch, {**CONFIG, "swiglu_limit": 7.0})}
ROPE = CONFIG["rope_parameters"]


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    return hf_variant_getter(tmp_path_factory, GGUF_VARIANTS, 4200, _randomise, VOCAB)("gpt_oss_gguf")[1]


def _gguf_tensors(hf):
    """llama.cpp name -> float32 array of ``hf``'s weights (torch order)."""
    blk = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
           "self_attn.sinks": "attn_sinks.weight", "mlp.router.weight": "ffn_gate_inp.weight",
           "mlp.router.bias": "ffn_gate_inp.bias"}
    for p, g in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")):
        blk.update({f"self_attn.{p}.weight": f"{g}.weight", f"self_attn.{p}.bias": f"{g}.bias"})
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    out = {}
    for name, t in hf.state_dict().items():
        a = t.float()
        if name in top:
            out[top[name]] = a.numpy().copy()
            continue
        layer, rest = name.split(".")[2], ".".join(name.split(".")[3:])
        pre = f"blk.{layer}."
        if rest == "mlp.experts.gate_up_proj":  # [E, H, 2I], gate / up interleaved by column
            out[pre + "ffn_gate_exps.weight"] = a[:, :, 0::2].transpose(1, 2).numpy().copy()
            out[pre + "ffn_up_exps.weight"] = a[:, :, 1::2].transpose(1, 2).numpy().copy()
        elif rest == "mlp.experts.gate_up_proj_bias":
            out[pre + "ffn_gate_exps.bias"] = a[:, 0::2].numpy().copy()
            out[pre + "ffn_up_exps.bias"] = a[:, 1::2].numpy().copy()
        elif rest == "mlp.experts.down_proj":  # [E, I, H]
            out[pre + "ffn_down_exps.weight"] = a.transpose(1, 2).numpy().copy()
        elif rest == "mlp.experts.down_proj_bias":
            out[pre + "ffn_down_exps.bias"] = a.numpy().copy()
        else:
            out[pre + blk[rest]] = a.numpy().copy()
    return out


def _write(path, hf, mxfp4=False, meta=None, drop=()):
    """The GGUF of ``hf``; with ``mxfp4`` the expert weights are MXFP4 and ``hf``'s experts are
    replaced by the dequantised values. ``meta(w)`` adds / overrides metadata; ``drop`` names
    metadata setters of the standard set to leave out."""
    import gguf

    cfg = hf.config
    w = gguf.GGUFWriter(path, "gpt-oss")
    setters = dict(
        name=lambda: w.add_name("tiny-gpt-oss"), block_count=lambda: w.add_block_count(cfg.num_hidden_layers),
        context_length=lambda: w.add_context_length(cfg.max_position_embeddings),
        embedding_length=lambda: w.add_embedding_length(cfg.hidden_size),
        feed_forward_length=lambda: w.add_feed_forward_length(cfg.intermediate_size),
        head_count=lambda: w.add_head_count(cfg.num_attention_heads),
        head_count_kv=lambda: w.add_head_count_kv(cfg.num_key_value_heads),
        key_length=lambda: w.add_key_length(cfg.head_dim), value_length=lambda: w.add_value_length(cfg.head_dim),
        rope_freq_base=lambda: w.add_rope_freq_base(ROPE["rope_theta"]),
        rms_eps=lambda: w.add_layer_norm_rms_eps(cfg.rms_norm_eps),
        expert_count=lambda: w.add_expert_count(cfg.num_local_experts),
        expert_used_count=lambda: w.add_expert_used_count(cfg.num_experts_per_tok),
        sliding_window=lambda: w.add_sliding_window(cfg.sliding_window),
        expert_ffn=lambda: w.add_expert_feed_forward_length(cfg.intermediate_size),
        rope_type=lambda: w.add_rope_scaling_type(gguf.RopeScalingType.YARN),
        rope_factor=lambda: w.add_rope_scaling_factor(ROPE["factor"]),
        rope_orig=lambda: w.add_rope_scaling_orig_ctx_len(ROPE["original_max_position_embeddings"]),
        beta_fast=lambda: w.add_rope_scaling_yarn_beta_fast(ROPE["beta_fast"]),
        beta_slow=lambda: w.add_rope_scaling_yarn_beta_slow(ROPE["beta_slow"]),
        bos=lambda: w.add_bos_token_id(cfg.bos_token_id), eos=lambda: w.add_eos_token_id(cfg.eos_token_id))
    for key, setter in setters.items():
        if key not in drop:
            setter()
    if meta:
        meta(w)
    tensors = _gguf_tensors(hf)
    qtype = gguf.GGMLQuantizationType.MXFP4
    for name, a in tensors.items():
        if mxfp4 and name.endswith("_exps.weight"):
            q = gguf.quants.quantize(a, qtype)
            tensors[name] = gguf.quants.dequantize(q, qtype)
            w.add_tensor(name, q, raw_dtype=qtype)
        else:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if mxfp4:
        with torch.no_grad():
            for i, layer in enumerate(hf.model.layers):
                ex, pre = layer.mlp.experts, f"blk.{i}."
                ex.gate_up_proj[:, :, 0::2] = torch.from_numpy(tensors[pre + "ffn_gate_exps.weight"]).transpose(1, 2)
                ex.gate_up_proj[:, :, 1::2] = torch.from_numpy(tensors[pre + "ffn_up_exps.weight"]).transpose(1, 2)
                ex.down_proj.copy_(torch.from_numpy(tensors[pre + "ffn_down_exps.weight"]).transpose(1, 2))


@pytest.mark.parametrize("mxfp4", [False, True], ids=["f32", "mxfp4"])
def test_gguf_matches_hf(mxfp4, hf_model, tmp_path, step_runner):
    """The GGUF's config restores what transformers' reader drops (head_dim, window, YaRN,
    layer_types) and its prefill logits match HF's (the dequantised HF model for MXFP4)."""
    hf = copy.deepcopy(hf_model) if mxfp4 else hf_model
    path = str(tmp_path / "gpt-oss.gguf")
    _write(path, hf, mxfp4=mxfp4)
    if mxfp4:
        import gguf

        types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
        assert types["blk.0.ffn_down_exps.weight"] == gguf.GGMLQuantizationType.MXFP4
        assert not torch.equal(hf.model.layers[0].mlp.experts.down_proj, hf_model.model.layers[0].mlp.experts.down_proj)
    loaded = _load(path)
    cfg = loaded.model_config.hf_config
    assert type(loaded.model).__name__ == "GptOssForCausalLM"
    assert (cfg.head_dim, cfg.sliding_window, cfg.intermediate_size, cfg.num_local_experts) == (16, WINDOW, 32, 4)
    assert cfg.layer_types == CONFIG["layer_types"] and loaded.model_config.is_sliding_layer == (True, False, True)
    assert {k: cfg.rope_parameters[k] for k in ROPE} == ROPE
    assert (cfg.vocab_size, cfg.tie_word_embeddings, cfg.bos_token_id, cfg.eos_token_id) == (VOCAB, False, 1, 2)
    ids = random_prompt(7, PREFILL_LEN, VOCAB)
    runner = step_runner(loaded.model, loaded.model_config)
    logits = runner.step(ForwardMode.EXTEND, [(runner.new_request(), ids)])
    ref = _hf_logits(hf, ids)
    assert_within(logits, ref, forward_bound(ref, llama_like_terms(cfg, len(ids))), f"gpt-oss GGUF (mxfp4={mxfp4}) vs HF")


def test_gguf_expert_bias_and_sink_names():
    from attnserve.model_loader.gguf import gguf_arch_spec, gguf_expert_hf_names, gguf_to_hf_name

    spec = gguf_arch_spec("gpt_oss")
    assert gguf_to_hf_name("blk.2.attn_sinks.weight", spec) == "model.layers.2.self_attn.sinks"
    assert gguf_to_hf_name("blk.2.ffn_gate_inp.bias", spec) == "model.layers.2.mlp.router.bias"
    assert gguf_to_hf_name("blk.2.post_attention_norm.weight", spec) == "model.layers.2.post_attention_layernorm.weight"
    assert gguf_expert_hf_names("blk.1.ffn_down_exps.bias", spec, 2) == [
        "model.layers.1.mlp.experts.0.down_proj.bias", "model.layers.1.mlp.experts.1.down_proj.bias"]
    with pytest.raises(KeyError, match="fuses the gate and up experts"):
        gguf_to_hf_name("blk.0.ffn_gate_up_exps.weight", spec)


@pytest.mark.parametrize("case, match", [
    ("no_window", r"without gpt-oss\.attention\.sliding_window"),
    ("linear_rope", r"rope\.scaling\.type 'linear'; only yarn"),
    ("partial_rotary", r"rope\.dimension_count 8 != head size 16"),
    ("no_expert_ffn", r"without gpt-oss\.expert_feed_forward_length"),
])
def test_unmappable_metadata_is_refused(case, match, hf_model, tmp_path):
    import gguf

    from attnserve.model_loader.gguf import load_gguf_config

    drop, meta = (), None
    if case == "no_window":
        drop = ("sliding_window",)
    elif case == "linear_rope":
        drop = ("rope_type",)
        meta = lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)  # noqa: E731
    elif case == "partial_rotary":
        meta = lambda w: w.add_rope_dimension_count(8)  # noqa: E731
    else:
        drop = ("expert_ffn", "feed_forward_length")
    path = str(tmp_path / f"{case}.gguf")
    _write(path, hf_model, meta=meta, drop=drop)
    with pytest.raises(ValueError, match=match):
        load_gguf_config(path)


def test_sinks_are_loaded_from_gguf(hf_model, tmp_path):
    """``attn_sinks.weight`` reaches ``self_attn.sinks`` (a bare HF parameter, no ``.weight``)."""
    path = str(tmp_path / "gpt-oss.gguf")
    _write(path, hf_model)
    model = _load(path).model
    for ours, theirs in zip(model.model.layers, hf_model.model.layers):
        assert torch.equal(ours.self_attn.sinks, theirs.self_attn.sinks.float())


def test_unreadable_gguf_tokenizer_names_tokenizer_path(hf_model, tmp_path):
    """transformers 5.24's gpt-oss GGUF reader fails on the ``rope.scaling.*`` keys every
    llama.cpp conversion writes; the tokenizer load says what to pass instead of a TypeError."""
    from attnserve.model_loader.tokenizer import get_tokenizer

    path = tmp_path / "gpt-oss.gguf"
    _write(str(path), hf_model)
    with pytest.raises(ValueError, match=r"could not read the tokenizer of gpt-oss.gguf .*--tokenizer-path"):
        get_tokenizer(str(tmp_path), gguf_file="gpt-oss.gguf")
