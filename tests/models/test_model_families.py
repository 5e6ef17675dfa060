"""Qwen2, Mistral, Phi-3 and Gemma 2 against HF transformers (issue 39).

Each variant is a random tiny HF model saved with ``save_pretrained`` (+ a word-level
tokenizer) and loaded by our loader. Float32 throughout. Checked: prefill logits against an
HF full forward within `numeric_bounds.forward_bound`; 32 greedy tokens equal to HF
``generate`` (our model through the paged KV cache, `conftest.StepRunner`, and for two
variants the whole engine); tensor parallelism on CPU ranks equal to tp 1; GGUF files
written from the same weights; refusals. Weights that HF initialises to zero or one (biases,
norms) are drawn at random so that a missing bias or norm would show, and Gemma 2's q/k
and embedding weights are drawn wide enough that both soft-caps change the result.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from attnserve.forward_batch import ForwardMode
from numeric_bounds import assert_within, forward_bound, llama_like_terms
from tiny_hf import (assert_tp2_matches_tp1, hf_logits as _hf_logits, hf_variant_getter, load_checkpoint as _load,
                     random_prompt)

VOCAB = 256
BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=VOCAB, max_position_embeddings=256, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
            tie_word_embeddings=False)
ORIG = 32  # Phi-3 longrope: original_max_position_embeddings
_g = torch.Generator().manual_seed(39)
# 8 = rotary_dim / 2: head_dim 32 (hidden 64, 2 heads), partial_rotary_factor 0.5
SHORT = (1.0 + 0.5 * torch.rand(8, generator=_g)).tolist()
LONG = (1.0 + 7.0 * torch.rand(8, generator=_g)).tolist()
VARIANTS = {
    # q/k/v bias, tied embeddings, layer 1 sliding (max_window_layers=1) with a window of 8
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        BASE, tie_word_embeddings=True, use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(BASE, sliding_window=None)),
    "mistral_window": ("MistralConfig", "MistralForCausalLM", dict(BASE, sliding_window=8)),
    # longrope past original_max_position_embeddings, Phi-4-mini's partial rotary (head 32: 16 rotated)
    "phi3_longrope": ("Phi3Config", "Phi3ForCausalLM", dict(
        BASE, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128, pad_token_id=0,
        original_max_position_embeddings=ORIG, partial_rotary_factor=0.5,
        rope_scaling=dict(type="longrope", short_factor=SHORT, long_factor=LONG))),
    # layers local (window 8) / global / local; caps small enough to bite on these weights
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        BASE, num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
        attn_logit_softcapping=2.0, final_logit_softcapping=3.0, tie_word_embeddings=True)),
}


def _randomise(model, name):
    for pname, p in model.named_parameters():
        if "norm" in pname:  # Gemma's 1 + w norms: w around 0; the others around 1
            p.copy_((0.0 if name == "gemma2" else 1.0) + 0.2 * torch.randn_like(p))
        elif pname.endswith("bias"):
            p.normal_(0.0, 0.3)
        elif pname.endswith(("q_proj.weight", "k_proj.weight", "qkv_proj.weight")):
            p.normal_(0.0, 0.25)  # sharp attention: positions (RoPE, windows) matter
        elif name == "gemma2" and "embed" in pname:
            p.normal_(0.0, 0.25)  # logits of a few units: the final cap of 3 bites


@pytest.fixture(scope="module")
def hf_variant(tmp_path_factory):
    """variant -> (checkpoint dir, HF model in eval mode), built once per module."""
    return hf_variant_getter(tmp_path_factory, VARIANTS, 3900, _randomise, VOCAB)


def _prompt(seed, n):
    return random_prompt(seed, n, VOCAB)


def _hf_greedy(model, prompt, n=32):
    from transformers import GenerationConfig

    with torch.no_grad():
        model.generation_config.eos_token_id = None  # HF merges its own generation config: no EOS there either
        out = model.generate(torch.tensor([prompt]), generation_config=GenerationConfig(
            max_new_tokens=n, do_sample=False, pad_token_id=0))
    assert out.shape[1] == len(prompt) + n
    return out[0, len(prompt):].tolist()


def _hf_cached_greedy(model, prompt, n=32):
    """Greedy tokens of HF's model run step by step on its own KV cache. Unlike ``generate``,
    this keeps Phi-3's cached keys when the sequence crosses original_max_position_embeddings
    (``Phi3ForCausalLM.prepare_inputs_for_generation`` drops the cache there and recomputes
    the whole sequence with the long factors; our engine does not, see phi3.py)."""
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        tokens = [int(out.logits[0, -1].argmax())]
        for _ in range(n - 1):
            out = model(torch.tensor([tokens[-1:]]), cache=out.past_key_values, use_cache=True)
            tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def _greedy(runner, prompts, n=32):
    """Prefill every prompt in one step, then ``n - 1`` decode steps of all of them."""
    rows = [runner.new_request() for _ in prompts]
    logits = runner.step(ForwardMode.EXTEND, list(zip(rows, prompts)))
    ends = np.cumsum([len(p) for p in prompts]) - 1
    out = [[int(logits[e].argmax())] for e in ends]
    for _ in range(n - 1):
        logits = runner.step(ForwardMode.DECODE, [(r, [o[-1]]) for r, o in zip(rows, out)])
        for o, row_logits in zip(out, logits):
            o.append(int(row_logits.argmax()))
    return out


# a prompt past every window (8) and past Phi-3's original 32 positions, one inside both
PREFILL_LEN = 41


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_logits_and_greedy_match_hf(variant, hf_variant, step_runner):
    path, hf = hf_variant(variant)
    loaded = _load(path)
    assert type(loaded.model).__name__ == VARIANTS[variant][1]
    runner = step_runner(loaded.model, loaded.model_config, page_size=4)
    for ids in (_prompt(7, PREFILL_LEN), _prompt(8, 6)):
        logits = runner.step(ForwardMode.EXTEND, [(runner.new_request(), ids)])
        ref = _hf_logits(hf, ids)
        assert_within(logits, ref, forward_bound(ref, llama_like_terms(loaded.model_config.hf_config, len(ids))),
                      f"{variant} prefill of {len(ids)} vs HF")
    # 20 + 32 tokens cross Phi-3's original 32 positions during decode; 29 + 32 cross every window
    prompts = [_prompt(21, 20), _prompt(22, 29)]
    reference = _hf_cached_greedy if variant == "phi3_longrope" else _hf_greedy
    assert _greedy(runner, prompts) == [reference(hf, p) for p in prompts]


@pytest.mark.parametrize("variant", ["phi3_longrope", "gemma2"])
def test_engine_greedy_matches_hf_generate(variant, hf_variant):
    from attnserve.engine.llm import LLM
    from attnserve.engine.sampling_params import SamplingParams

    path, hf = hf_variant(variant)
    prompts = [_prompt(31, 33), _prompt(32, 40)]  # Phi-3: past the original 32 positions from the prompt on
    with LLM(model=path, device="cpu", dtype="float32", attention_backend="torch_native", page_size=4,
             max_total_tokens=1024) as llm:
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == [_hf_greedy(hf, p) for p in prompts]


def test_soft_caps_and_longrope_change_the_result(hf_variant, step_runner):
    """The checks above could not pass with a soft-cap left out or the short factors used
    past the original length: each changes these logits by far more than the bound."""
    def prefill(loaded):
        runner = step_runner(loaded.model, loaded.model_config)
        return runner.step(ForwardMode.EXTEND, [(runner.new_request(), ids)])

    ids = _prompt(7, PREFILL_LEN)
    loaded = _load(hf_variant("gemma2")[0])
    capped = prefill(loaded)
    for layer in loaded.model.model.layers:
        layer.self_attn.attn.logit_cap = 0.0
    assert (capped - prefill(loaded)).abs().max() > 0.1
    assert capped.abs().max() < 3.0  # final cap 3
    loaded.model.final_logit_softcapping = 0.0
    assert prefill(loaded).abs().max() > 3.0

    loaded = _load(hf_variant("phi3_longrope")[0])
    rope = loaded.model.model.rotary_emb
    assert rope.cos_sin_cache.shape == (2 * 128, 16)
    long = prefill(loaded)
    rope.original_max_position = 10**6  # short factors everywhere
    assert (long - prefill(loaded)).abs().max() > 0.05


def test_longrope_factors_chosen_per_request():
    """Extend tokens follow their request's length after the step (a 3-token chunk ending at 40
    is long, a 10-token prompt short, in one batch); decode tokens their own position."""
    from types import SimpleNamespace

    from attnserve.models.layers.rotary import get_rope

    rope = get_rope(32, 128, dict(rope_type="longrope", rope_theta=1e4, short_factor=SHORT, long_factor=LONG,
                                  original_max_position_embeddings=ORIG, partial_rotary_factor=0.5))
    pos = torch.tensor([37, 38, 39] + list(range(10)))
    fb = SimpleNamespace(forward_mode=ForwardMode.MIXED, seq_lens=torch.tensor([40, 10], dtype=torch.int32),
                         extend_seq_lens=torch.tensor([3, 10], dtype=torch.int32))
    assert rope.table_positions(pos, fb).tolist() == [128 + 37, 128 + 38, 128 + 39] + list(range(10))
    fb = SimpleNamespace(forward_mode=ForwardMode.DECODE, seq_lens=torch.tensor([32, 33], dtype=torch.int32),
                         extend_seq_lens=None)
    assert rope.table_positions(torch.tensor([31, 32]), fb).tolist() == [31, 128 + 32]
    scale = math.sqrt(1 + math.log(128 / ORIG) / math.log(ORIG))  # HF's default attention factor
    assert rope.cos_sin_cache[[0, 128], 0].tolist() == pytest.approx([scale, scale])  # cos(0) * factor, both tables


@pytest.mark.parametrize("variant", ["qwen2", "phi3_longrope"])
def test_tp2_matches_tp1(variant, hf_variant):
    """tp 2 on CPU ranks loads the HF checkpoint (Qwen2's q/k/v bias, Phi-3's fused qkv_proj and
    gate_up_proj, both split by heads / rows; Phi-3's single KV head replicated) and gives tp 1's
    tokens."""
    path, _ = hf_variant(variant)
    assert_tp2_matches_tp1(path, [_prompt(41, 36), _prompt(42, 5)])


def test_phi3_fused_tensors_sharded_by_heads_and_rows(hf_variant):
    """Each rank's fused parameters are its heads of q, k, v and its rows of gate and up,
    cut from the HF checkpoint's fused tensors (checked without running the ranks)."""
    from attnserve.distributed.group import TPGroup
    from attnserve.models.phi3 import Phi3ForCausalLM

    _, hf = hf_variant("phi3_longrope")
    sd = hf.state_dict()
    cfg = hf.config
    hd, inter = cfg.hidden_size // cfg.num_attention_heads, cfg.intermediate_size
    qkv, gate_up = sd["model.layers.1.self_attn.qkv_proj.weight"], sd["model.layers.1.mlp.gate_up_proj.weight"]
    q, k, v = qkv.split([2 * hd, hd, hd])
    for rank in range(2):
        model = Phi3ForCausalLM(cfg, tp=TPGroup(rank=rank, size=2))
        model.load_weights(sd.items())
        got = dict(model.named_parameters())
        want_qkv = torch.cat([q[rank * hd:(rank + 1) * hd], k, v])  # one KV head: replicated on both ranks
        assert torch.equal(got["model.layers.1.self_attn.qkv_proj.weight"], want_qkv)
        half = inter // 2
        rows = slice(rank * half, (rank + 1) * half)
        want_gu = torch.cat([gate_up[:inter][rows], gate_up[inter:][rows]])
        assert torch.equal(got["model.layers.1.mlp.gate_up_proj.weight"], want_gu)
    with pytest.raises(ValueError, match=r"qkv_proj.weight' has 127 rows; the config's q/k/v need 64 \+ 2 x 32 = 128"):
        Phi3ForCausalLM(cfg).load_weights([("model.layers.0.self_attn.qkv_proj.weight", qkv[:-1])])


# ---- GGUF: files written from the HF weights, read back by our loader ------------------------
def _to_gguf(hf, variant):
    """llama.cpp tensor name -> float32 array (HF weights in llama.cpp's storage conventions)."""
    cfg = hf.config
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "qkv_proj": "attn_qkv", "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
             "gate_up_proj": "ffn_up", "input_layernorm": "attn_norm"}
    names["post_attention_layernorm"] = "post_attention_norm" if variant == "gemma2" else "ffn_norm"
    names.update(pre_feedforward_layernorm="ffn_norm", post_feedforward_layernorm="post_ffw_norm")
    out = {}
    for name, t in hf.state_dict().items():
        a = t.float().numpy().copy()
        if name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            out["output.weight"] = a
            continue
        if name in ("model.embed_tokens.weight", "model.norm.weight"):
            gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}[name]
        else:
            parts = name.split(".")  # model.layers.N.(self_attn|mlp).X.(weight|bias) or model.layers.N.X.weight
            gname = f"blk.{parts[2]}.{names[parts[-2]]}.{parts[-1]}"
        if variant == "mistral" and (".attn_q." in gname or ".attn_k." in gname):
            n = heads if ".attn_q." in gname else kv  # llama.cpp's RoPE row permutation
            a = a.reshape(n, 2, a.shape[0] // n // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
        if variant == "gemma2" and gname.endswith("norm.weight"):
            a = a + 1.0
        out[gname] = a
    return out


def _write_gguf(path, arch, hf, variant, extra=None):
    import gguf

    cfg = hf.config
    w = gguf.GGUFWriter(path, arch)
    w.add_name("mistral" if variant == "mistral" else f"tiny-{variant}")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(VOCAB)
    if extra:
        extra(w)
    tensors = _to_gguf(hf, variant)
    if variant == "phi3_longrope":
        tensors["rope_factors_long.weight"] = np.array(LONG, dtype=np.float32)
        tensors["rope_factors_short.weight"] = np.array(SHORT, dtype=np.float32)
    for name, a in tensors.items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _gguf_meta(variant, cfg):
    def phi3(w):
        w.add_rope_dimension_count(16)  # partial rotary: 16 of 32 channels
        w.add_rope_scaling_orig_ctx_len(ORIG)
        w.add_sliding_window(0)
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(128 / ORIG) / math.log(ORIG)))

    def gemma2(w):
        w.add_key_length(16)
        w.add_value_length(16)
        w.add_sliding_window(8)
        w.add_attn_logit_softcapping(2.0)
        w.add_final_logit_softcapping(3.0)

    def llama(w):
        w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)

    return {"phi3_longrope": ("phi3", phi3), "gemma2": ("gemma2", gemma2), "qwen2": ("qwen2", None),
            "mistral": ("llama", llama)}[variant]


@pytest.mark.parametrize("variant", ["qwen2", "mistral", "phi3_longrope", "gemma2"])
def test_gguf_matches_hf(variant, hf_variant, tmp_path, step_runner):
    """A GGUF holding the variant's weights (llama.cpp names, Mistral's q/k permutation, Gemma's
    ``1 + w`` norms, Phi-3's fused tensors and LongRoPE factor tensors) loads as the HF model:
    same config settings and prefill logits. The Qwen2 file is its windowless form (llama.cpp
    writes no window for qwen2), compared on a prompt inside the window."""
    _, hf = hf_variant(variant)
    arch, meta = _gguf_meta(variant, hf.config)
    path = str(tmp_path / f"{variant}.gguf")
    _write_gguf(path, arch, hf, variant, meta)
    loaded = _load(path)
    cfg = loaded.model_config.hf_config
    assert type(loaded.model).__name__ == VARIANTS[variant][1]
    if variant == "phi3_longrope":
        params = cfg.rope_parameters
        assert params["rope_type"] == "longrope" and params["original_max_position_embeddings"] == ORIG
        assert params["partial_rotary_factor"] == 0.5 and cfg.sliding_window is None
    scaling = {}
    if variant == "gemma2":
        assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping, cfg.query_pre_attn_scalar) == (2.0, 3.0, 16)
        # llama.cpp's rule (head_dim, 16) replaces the HF variant's query_pre_attn_scalar of 24
        scaling = {layer.self_attn: layer.self_attn.scaling for layer in hf.model.layers}
    ids = _prompt(7, PREFILL_LEN if variant != "qwen2" else 8)
    runner = step_runner(loaded.model, loaded.model_config)
    logits = runner.step(ForwardMode.EXTEND, [(runner.new_request(), ids)])
    try:
        for attn in scaling:
            attn.scaling = 16**-0.5
        ref = _hf_logits(hf, ids)
    finally:
        for attn, value in scaling.items():
            attn.scaling = value
    assert_within(logits, ref, forward_bound(ref, llama_like_terms(cfg, len(ids))), f"{variant} GGUF vs HF")


# ---- refusals ---------------------------------------------------------------------------------
def test_unsupported_config_fields_are_refused():
    import transformers

    from attnserve.models.gemma2 import Gemma2ForCausalLM
    from attnserve.models.mistral import MistralForCausalLM
    from attnserve.models.phi3 import Phi3ForCausalLM
    from attnserve.models.qwen2 import Qwen2ForCausalLM
    from attnserve.models.registry import get_model_class

    dyn = transformers.Qwen2Config(**dict(BASE, rope_scaling=dict(rope_type="dynamic", factor=2.0)))
    with pytest.raises(ValueError, match="unsupported rope_type 'dynamic'; supported: default, linear, llama3, "
                                         "longrope, yarn"):
        Qwen2ForCausalLM(dyn)
    mistral = transformers.MistralConfig(**BASE)
    mistral.rope_parameters = dict(rope_type="ntk-by-parts", rope_theta=1e4)
    with pytest.raises(ValueError, match="unsupported rope_type 'ntk-by-parts'"):
        MistralForCausalLM(mistral)
    phi = transformers.Phi3Config(**VARIANTS["phi3_longrope"][2])
    phi.rope_parameters = {k: v for k, v in phi.rope_parameters.items() if k != "long_factor"}
    with pytest.raises(ValueError, match="longrope RoPE needs long_factor with rotary_dim / 2 = 8 values; missing"):
        Phi3ForCausalLM(phi)
    with pytest.raises(ValueError, match="Qwen2: hidden_act='gelu' is not supported"):
        Qwen2ForCausalLM(transformers.Qwen2Config(**dict(BASE, hidden_act="gelu")))
    with pytest.raises(ValueError, match="Gemma 2 with use_bidirectional_attention"):
        Gemma2ForCausalLM(transformers.Gemma2Config(**dict(BASE, use_bidirectional_attention=True)))
    with pytest.raises(ValueError, match="unsupported model architecture 'Phi3SmallForCausalLM'; supported: .*"
                                         "Gemma2ForCausalLM.*MistralForCausalLM.*Phi3ForCausalLM.*Qwen2ForCausalLM"):
        get_model_class("Phi3SmallForCausalLM")


def test_dummy_shapes_have_the_published_sizes():
    """The named shapes build (on ``meta``) with the parameter counts of the HF releases."""
    from attnserve.model_loader.loader import load_model

    published = {"qwen2.5-7b": 7_615_616_512, "mistral-7b": 7_248_023_552, "phi-3-mini": 3_821_079_552,
                 "gemma-2-9b": 9_241_705_984}
    for name, count in published.items():
        loaded = load_model(name, load_format="dummy", device="meta", load_tokenizer=False)
        assert sum(p.numel() for p in loaded.model.parameters()) == count, name
    assert loaded.model_config.is_sliding_layer[:3] == (True, False, True)  # gemma-2-9b
