"""GGUF loading of the real SmolLM2 file against what HF transformers loads from it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnserve.model_loader.gguf import (
    GGUF_ARCH_SPECS,
    gguf_arch_spec,
    gguf_to_hf_name,
    iterate_gguf_weights,
    unpermute_qk,
)

pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def reader(smollm2_source):
    import gguf

    return gguf.GGUFReader(smollm2_source.gguf_path)


@pytest.fixture(scope="module")
def gguf_weights(reader, smollm2_loaded):
    """Every (HF name -> float32 tensor) our GGUF reader yields."""
    cfg = smollm2_loaded.model_config.hf_config
    return dict(iterate_gguf_weights(reader, cfg, progress=False))


def test_every_gguf_tensor_has_a_name(reader, gguf_weights):
    spec = gguf_arch_spec("llama")
    names = [gguf_to_hf_name(t.name, spec) for t in reader.tensors]
    assert None not in names and len(set(names)) == len(names) == len(reader.tensors)
    assert set(names) == set(gguf_weights)


def test_names_cover_hf_state_dict(gguf_weights, hf_smollm2):
    hf_names = set(hf_smollm2.state_dict())
    if hf_smollm2.config.tie_word_embeddings:
        hf_names.discard("lm_head.weight")
    assert set(gguf_weights) == hf_names


def test_weights_equal_hf(gguf_weights, hf_smollm2):
    hf = hf_smollm2.state_dict()
    for layer in (0, 1, 14, 29):
        for part in ("q_proj", "k_proj", "v_proj", "o_proj"):
            name = f"model.layers.{layer}.self_attn.{part}.weight"
            assert torch.equal(gguf_weights[name], hf[name]), name
        for part in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"):
            name = f"model.layers.{layer}.{part}.weight"
            assert torch.equal(gguf_weights[name], hf[name]), name
    for name in ("model.embed_tokens.weight", "model.norm.weight"):
        assert torch.equal(gguf_weights[name], hf[name]), name
    assert all(t.dtype == torch.float32 for t in gguf_weights.values())


def test_fused_parameters_equal_hf(smollm2_loaded, hf_smollm2):
    ours = smollm2_loaded.model
    hf = hf_smollm2.state_dict()
    for layer in (0, 29):
        p = f"model.layers.{layer}"
        qkv = torch.cat([hf[f"{p}.self_attn.{x}_proj.weight"] for x in "qkv"])
        assert torch.equal(ours.model.layers[layer].self_attn.qkv_proj.weight, qkv)
        gate_up = torch.cat([hf[f"{p}.mlp.gate_proj.weight"], hf[f"{p}.mlp.up_proj.weight"]])
        assert torch.equal(ours.model.layers[layer].mlp.gate_up_proj.weight, gate_up)
    assert ours.lm_head is None  # tied: logits use the embedding matrix
    assert torch.equal(ours.lm_head_weight, hf_smollm2.get_output_embeddings().weight)


@pytest.mark.parametrize("heads,head_dim", [(9, 64), (3, 64), (2, 8)])
def test_unpermute_inverts_llama_cpp_permute(heads, head_dim):
    w = np.random.default_rng(0).standard_normal((heads * head_dim, 5)).astype(np.float32)
    # llama.cpp convert_hf_to_gguf: reshape(H, 2, hd/2, in).swapaxes(1, 2)
    permuted = w.reshape(heads, 2, head_dim // 2, 5).swapaxes(1, 2).reshape(w.shape)
    np.testing.assert_array_equal(unpermute_qk(permuted, heads), w)
    bias = w[:, 0].copy()
    np.testing.assert_array_equal(unpermute_qk(bias.reshape(heads, 2, -1).swapaxes(1, 2).reshape(-1), heads), bias)


def test_config_from_gguf_matches_dummy_shape(smollm2_loaded):
    from attnserve.model_loader.dummy import dummy_hf_config
    from attnserve.model_loader.model_config import ModelConfig

    real = smollm2_loaded.model_config
    dummy = ModelConfig.from_hf_config(dummy_hf_config("smollm2-135m"))
    for field in (
        "architecture",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "context_len",
    ):
        assert getattr(real, field) == getattr(dummy, field), field
    r, d = real.hf_config, dummy.hf_config
    assert r.intermediate_size == d.intermediate_size and r.tie_word_embeddings == d.tie_word_embeddings
    assert r.rope_parameters["rope_theta"] == d.rope_parameters["rope_theta"]
    assert abs(r.rms_norm_eps - d.rms_norm_eps) < 1e-9
    assert real.architecture == "LlamaForCausalLM"  # GGUF configs have no `architectures`
    assert 2 in real.eos_token_ids


def test_gguf_config_and_spec_errors(smollm2_loaded):
    assert smollm2_loaded.model_config.hf_config.model_type == "llama"  # via load_gguf_config
    with pytest.raises(ValueError, match="llama"):
        gguf_arch_spec("mamba")
    with pytest.raises(KeyError):
        gguf_to_hf_name("blk.0.ssm_conv1d.weight", GGUF_ARCH_SPECS["llama"])
    assert gguf_to_hf_name("rope_freqs.weight", GGUF_ARCH_SPECS["llama"]) is None
    assert gguf_to_hf_name("output.weight", GGUF_ARCH_SPECS["llama"]) == "lm_head.weight"
    gemma = GGUF_ARCH_SPECS["gemma3_text"]
    assert gguf_to_hf_name("blk.2.ffn_norm.weight", gemma) == "model.layers.2.pre_feedforward_layernorm.weight"
    assert gguf_to_hf_name("blk.2.attn_k_norm.weight", gemma) == "model.layers.2.self_attn.k_norm.weight"


def test_tensor_reader_skips_the_metadata_but_maps_the_same_tensors(reader, smollm2_source):
    """`open_gguf_tensors` (metadata scanned, not parsed) against the library's full reader."""
    from attnserve.model_loader.gguf import open_gguf_tensors

    fast = open_gguf_tensors(smollm2_source.gguf_path)
    assert type(fast).__name__ == "_TensorReader"  # not the fallback
    assert "tokenizer.ggml.tokens" in reader.fields and "tokenizer.ggml.tokens" not in fast.fields
    assert (fast.alignment, fast.data_offset, len(fast.tensors)) == (reader.alignment, reader.data_offset,
                                                                     len(reader.tensors))
    for a, b in zip(fast.tensors, reader.tensors):
        assert (a.name, a.tensor_type, list(a.shape), a.data_offset) == (b.name, b.tensor_type, list(b.shape),
                                                                        b.data_offset)
        assert np.array_equal(np.asarray(a.data), np.asarray(b.data))
