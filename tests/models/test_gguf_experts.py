"""GGUF mixture-of-experts checkpoints: tiny files written with ``gguf.GGUFWriter``, read back
through `iterate_gguf_weights` and compared with the tensors written and with what
transformers' own GGUF loader makes of the same file."""

from __future__ import annotations

from typing import Callable, Dict, Tuple

import numpy as np
import pytest
import torch

from attnserve.model_loader.gguf import (
    GGUF_ARCH_SPECS,
    gguf_expert_hf_names,
    gguf_to_hf_name,
    iterate_gguf_weights,
    load_gguf_config,
    read_gguf_scalar_metadata,
)

gguf = pytest.importorskip("gguf")

L, E, TOP_K, H, I, FF, V, NH, NKV, HD = 2, 4, 2, 32, 8, 48, 64, 4, 2, 8
Q = gguf.GGMLQuantizationType
#: GGUF storage type of some tensors (the rest are F32): expected value = round trip
STORAGE = {
    "blk.0.ffn_up_exps.weight": Q.F16,
    "blk.1.ffn_gate_exps.weight": Q.Q8_0,
    "blk.1.ffn_down_exps.weight": Q.BF16,
    "blk.1.attn_v.weight": Q.F16,
}


def _round_trip(a: np.ndarray, qtype) -> np.ndarray:
    """What a reader must give back for ``a`` stored as ``qtype`` (whole-tensor dequantisation)."""
    if qtype == Q.F32:
        return a
    return gguf.quants.dequantize(gguf.quants.quantize(a, qtype), qtype).astype(np.float32)


def _write(path: str, arch: str, meta: Callable, tensors: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """Write a GGUF (tensors given in torch order); returns the values a reader must yield."""
    w = gguf.GGUFWriter(path, arch)
    meta(w)
    expected = {}
    for name, a in tensors.items():
        qtype = STORAGE.get(name, Q.F32)
        if qtype == Q.F32:
            w.add_tensor(name, a)
        else:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        expected[name] = _round_trip(a, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def _common_meta(w, expert_ffn: bool = True) -> None:
    w.add_block_count(L)
    w.add_context_length(128)
    w.add_embedding_length(H)
    w.add_feed_forward_length(FF if expert_ffn else I)
    w.add_head_count(NH)
    w.add_head_count_kv(NKV)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(E)
    w.add_expert_used_count(TOP_K)
    w.add_vocab_size(V)
    w.add_token_list([f"t{i}" for i in range(V)])  # arrays: skipped by the metadata scan
    w.add_token_scores([float(i) for i in range(V)])


def _tensors(rng, qk_norm: bool) -> Dict[str, np.ndarray]:
    shapes = {"token_embd.weight": (V, H), "output_norm.weight": (H,), "output.weight": (V, H)}
    for b in (f"blk.{i}." for i in range(L)):
        shapes.update({b + "attn_norm.weight": (H,), b + "ffn_norm.weight": (H,), b + "attn_q.weight": (NH * HD, H)})
        shapes.update({b + "attn_k.weight": (NKV * HD, H), b + "attn_v.weight": (NKV * HD, H)})
        shapes.update({b + "attn_output.weight": (H, NH * HD)})
        shapes.update({b + "ffn_gate_inp.weight": (E, H), b + "ffn_gate_exps.weight": (E, I, H)})
        shapes.update({b + "ffn_up_exps.weight": (E, I, H), b + "ffn_down_exps.weight": (E, H, I)})
        if qk_norm:
            shapes.update({b + "attn_q_norm.weight": (HD,), b + "attn_k_norm.weight": (HD,)})
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}


@pytest.fixture(scope="module")
def qwen3moe(tmp_path_factory) -> Tuple[str, Dict[str, np.ndarray]]:
    path = str(tmp_path_factory.mktemp("qwen3moe") / "tiny-qwen3moe.gguf")

    def meta(w):
        _common_meta(w)
        w.add_key_length(HD)
        w.add_value_length(HD)
        w.add_expert_feed_forward_length(I)

    return path, _write(path, "qwen3moe", meta, _tensors(np.random.default_rng(0), qk_norm=True))


def _expected_hf(written: Dict[str, np.ndarray], model_type: str) -> Dict[str, np.ndarray]:
    """HF name -> value, experts split by hand (independent of the loader's split)."""
    spec = GGUF_ARCH_SPECS[model_type]
    out = {}
    for name, a in written.items():
        names = gguf_expert_hf_names(name, spec, E)
        if names is None:
            out[gguf_to_hf_name(name, spec)] = a
        else:
            out.update({n: a[e] for e, n in enumerate(names)})
    return out


def test_qwen3moe_config_reads_expert_ffn_length(qwen3moe):
    cfg = load_gguf_config(qwen3moe[0])
    assert cfg.model_type == "qwen3_moe"
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size) == (E, TOP_K, H)
    assert (cfg.moe_intermediate_size, cfg.intermediate_size, cfg.head_dim) == (I, FF, HD)


def test_qwen3moe_weights_equal_written(qwen3moe):
    path, written = qwen3moe
    ours = dict(iterate_gguf_weights(path, load_gguf_config(path), progress=False))
    expected = _expected_hf(written, "qwen3_moe")
    assert set(ours) == set(expected)
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in ours and "model.layers.0.mlp.gate.weight" in ours
    assert ours["model.layers.0.self_attn.q_norm.weight"].shape == (HD,)
    for name, want in expected.items():
        assert ours[name].dtype == torch.float32, name
        assert torch.equal(ours[name], torch.from_numpy(np.ascontiguousarray(want))), name
    # the split follows torch order: gate/up experts [I, H], down [H, I]
    assert ours["model.layers.1.mlp.experts.2.gate_proj.weight"].shape == (I, H)
    assert ours["model.layers.1.mlp.experts.2.down_proj.weight"].shape == (H, I)


def test_qwen3moe_equals_transformers_gguf_loader(qwen3moe):
    from transformers import AutoModelForCausalLM

    path, _ = qwen3moe
    cfg = load_gguf_config(path)
    directory, name = path.rsplit("/", 1)
    hf = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, config=cfg, dtype=torch.float32).state_dict()
    ours = dict(iterate_gguf_weights(path, cfg, progress=False))
    compared = 0
    for layer in range(L):
        p = f"model.layers.{layer}.mlp.experts"
        gate_up, down = hf.pop(f"{p}.gate_up_proj"), hf.pop(f"{p}.down_proj")  # transformers 5: fused [E, 2I, H]
        for e in range(E):
            assert torch.equal(ours.pop(f"{p}.{e}.gate_proj.weight"), gate_up[e, :I])
            assert torch.equal(ours.pop(f"{p}.{e}.up_proj.weight"), gate_up[e, I:])
            assert torch.equal(ours.pop(f"{p}.{e}.down_proj.weight"), down[e])
            compared += 3
    assert set(ours) == set(hf)
    for n in hf:
        assert torch.equal(ours[n], hf[n]), n
    assert compared == L * E * 3


def test_experts_dequantised_one_at_a_time(qwen3moe, monkeypatch):
    path, _ = qwen3moe
    cfg = load_gguf_config(path)
    reader = gguf.GGUFReader(path)
    seen = []
    real = gguf.quants.dequantize

    def spy(data, qtype):
        seen.append(tuple(data.shape))
        return real(data, qtype)

    monkeypatch.setattr(gguf.quants, "dequantize", spy)
    stream = iterate_gguf_weights(reader, cfg, progress=False)
    items = 0
    for name, _ in stream:
        items += 1
        if name == "model.layers.0.mlp.experts.0.gate_proj.weight":
            assert seen[-1][0] == I  # one expert's rows, not the stacked [E, ...] tensor
            before = len(seen)
            assert next(stream)[0] == "model.layers.0.mlp.experts.1.gate_proj.weight"
            items += 1
            assert len(seen) == before + 1  # the next expert is dequantised only when asked for
    assert items == len(seen) == len(reader.tensors) + 3 * L * (E - 1)  # one dequantisation per yielded tensor
    assert all(len(s) <= 2 for s in seen)  # never a stacked 3-D block


def test_qwen3moe_expert_shape_checked_against_config(qwen3moe):
    path, _ = qwen3moe
    cfg = load_gguf_config(path)
    cfg.moe_intermediate_size = 768  # what transformers' config reader alone would leave
    with pytest.raises(ValueError, match=r"ffn_gate_exps.*moe_intermediate_size"):
        list(iterate_gguf_weights(path, cfg, progress=False))


def test_scalar_metadata_scan_equals_reader(qwen3moe):
    path, _ = qwen3moe
    reader = gguf.GGUFReader(path)
    want = {k: f.contents() for k, f in reader.fields.items() if f.types and f.types[0] != gguf.GGUFValueType.ARRAY}
    want = {k: v for k, v in want.items() if not k.startswith("GGUF.")}
    got = read_gguf_scalar_metadata(path)
    assert "tokenizer.ggml.tokens" in reader.fields and "tokenizer.ggml.tokens" not in got
    assert got.keys() == want.keys() and got["qwen3moe.expert_feed_forward_length"] == I
    for k in want:
        assert got[k] == pytest.approx(want[k]) if isinstance(want[k], float) else got[k] == want[k], k


def test_scalar_metadata_big_endian_goes_through_reader(tmp_path):
    path = str(tmp_path / "big-endian.gguf")
    w = gguf.GGUFWriter(path, "qwen3moe", endianess=gguf.GGUFEndian.BIG)
    _common_meta(w)
    w.add_expert_feed_forward_length(I)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    got = read_gguf_scalar_metadata(path)
    assert got["general.architecture"] == "qwen3moe"
    assert (got["qwen3moe.expert_count"], got["qwen3moe.expert_feed_forward_length"]) == (E, I)
    assert "tokenizer.ggml.tokens" not in got and not any(k.startswith("GGUF.") for k in got)


def _llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's q/k row permutation (HF -> GGUF)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_mixtral_gguf(tmp_path):
    from transformers import AutoConfig, MixtralConfig

    hf_order = _tensors(np.random.default_rng(1), qk_norm=False)
    stored = dict(hf_order)
    for b in (f"blk.{i}." for i in range(L)):
        stored[b + "attn_q.weight"] = _llama_permute(hf_order[b + "attn_q.weight"], NH)
        stored[b + "attn_k.weight"] = _llama_permute(hf_order[b + "attn_k.weight"], NKV)
    path = str(tmp_path / "tiny-mixtral.gguf")
    written = _write(path, "llama", lambda w: _common_meta(w, expert_ffn=False), stored)

    # transformers' reader makes a dense llama config of it: refused with a message
    raw = AutoConfig.from_pretrained(str(tmp_path), gguf_file="tiny-mixtral.gguf")
    assert raw.model_type == "llama" and not getattr(raw, "num_local_experts", None)
    with pytest.raises(ValueError, match=r"4 experts \(Mixtral\).*safetensors"):
        load_gguf_config(path)

    # with a MixtralConfig from elsewhere the weights map to the HF checkpoint names
    cfg = MixtralConfig(
        vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=L, num_attention_heads=NH,
        num_key_value_heads=NKV, head_dim=HD, num_local_experts=E, num_experts_per_tok=TOP_K,
    )  # fmt: skip
    ours = dict(iterate_gguf_weights(path, cfg, progress=False))
    expected = _expected_hf(written, "mixtral")
    for b, layer in ((f"blk.{i}.", i) for i in range(L)):  # un-permuted q/k = the HF rows written
        expected[f"model.layers.{layer}.self_attn.q_proj.weight"] = hf_order[b + "attn_q.weight"]
        expected[f"model.layers.{layer}.self_attn.k_proj.weight"] = hf_order[b + "attn_k.weight"]
    assert set(ours) == set(expected)
    for e in range(E):
        for w in ("w1", "w2", "w3"):
            assert f"model.layers.1.block_sparse_moe.experts.{e}.{w}.weight" in ours
    assert "model.layers.0.block_sparse_moe.gate.weight" in ours
    for name, want in expected.items():
        assert torch.equal(ours[name], torch.from_numpy(np.ascontiguousarray(want))), name
    w1 = ours["model.layers.0.block_sparse_moe.experts.1.w1.weight"]
    assert torch.equal(w1, torch.from_numpy(hf_order["blk.0.ffn_gate_exps.weight"][1]))  # w1 = gate


def test_deepseek2_gguf_refused(tmp_path):
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    assert not any("deepseek" in a for a in GGUF_SUPPORTED_ARCHITECTURES)  # the premise of the refusal
    path = str(tmp_path / "tiny-deepseek2.gguf")
    _write(path, "deepseek2", _common_meta, {"token_embd.weight": np.zeros((V, H), np.float32)})
    msg = "GGUF for deepseek2 is not supported by transformers' GGUF reader.*safetensors"
    with pytest.raises(ValueError, match=msg):
        load_gguf_config(path)
