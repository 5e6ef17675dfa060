"""DeepSeek-V2/V3 (MLA, dense layers; the MoE layers are in test_moe_models.py) against HF transformers built from small random configs.

Each variant is an HF ``DeepseekV2ForCausalLM`` / ``DeepseekV3ForCausalLM`` with random
weights (norm weights perturbed away from 1 so that every norm is exercised), saved with
``save_pretrained`` plus a tiny word-level tokenizer, and loaded by our loader. Float32
throughout; the references are HF full forwards (no HF KV cache involved). Logits agree
within `numeric_bounds.forward_bound` (float32 rounding of the whole forward, relative to the
largest logit; `_terms` counts the summed terms).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from attnserve.forward_batch import ForwardMode
from attnserve.mem_cache.memory_pool import MLATokenToKVPool
from numeric_bounds import assert_within, forward_bound, mla_terms

VOCAB = 1000
BASE = dict(
    hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=16,
    q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
    first_k_dense_replace=2, vocab_size=VOCAB, max_position_embeddings=2048, rope_theta=10000.0,
    bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
)
YARN = dict(type="yarn", factor=4.0, original_max_position_embeddings=512, beta_fast=32, beta_slow=1,
            mscale=1.0, mscale_all_dim=0.8)
VARIANTS = {
    "v2": ("v2", {}),
    "v2_no_q_lora": ("v2", dict(q_lora_rank=None)),
    "v2_yarn": ("v2", dict(rope_scaling=YARN)),
    "v3": ("v3", {}),
    "v3_no_q_lora_yarn": ("v3", dict(q_lora_rank=None, rope_scaling=YARN)),
    "v3_neox_rope": ("v3", dict(rope_interleave=False)),
}


def _hf_classes(kind):
    import transformers

    if kind == "v2":
        return transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM
    return transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM


def _save_tokenizer(path, vocab: int = VOCAB):
    """A word-level tokenizer of ``vocab`` tokens ``t0..`` (unk t0, bos t1, eos t2) at ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2").save_pretrained(path)


@pytest.fixture(scope="module")
def hf_variant(tmp_path_factory):
    """variant name -> (checkpoint dir, HF model in eval mode); built once per module."""
    cache = {}

    def get(name):
        if name not in cache:
            kind, extra = VARIANTS[name]
            config_cls, model_cls = _hf_classes(kind)
            torch.manual_seed(1234 + len(cache))
            model = model_cls(config_cls(**{**BASE, **extra})).eval()
            with torch.no_grad():
                for pname, p in model.named_parameters():
                    if "norm" in pname:
                        p.copy_(1.0 + 0.2 * torch.randn_like(p))
            path = tmp_path_factory.mktemp(name)
            model.save_pretrained(path)
            _save_tokenizer(path)
            cache[name] = (str(path), model)
        return cache[name]

    return get


@pytest.fixture(scope="module")
def ours():
    cache = {}

    def get(path):
        from attnserve.model_loader.loader import load_model

        if path not in cache:
            cache[path] = load_model(path, load_tokenizer=False, progress=False)
        return cache[path]

    return get


def _mla_runner(step_runner, loaded, page_size=1):
    """The shared `StepRunner` (torch_native) with its KV pool swapped for a latent pool."""
    from attnserve.attention.backend_config import AttentionBackendConfig
    from attnserve.attention.torch_native import TorchNativeAttnBackend

    mc = loaded.model_config
    runner = step_runner(loaded.model, mc, page_size=page_size)
    runner.kv_pool = MLATokenToKVPool(runner.allocator.size, page_size, torch.float32, mc.kv_lora_rank,
                                      mc.qk_rope_head_dim, mc.num_hidden_layers, "cpu")
    runner.backend = TorchNativeAttnBackend(
        AttentionBackendConfig.from_pools(runner.req_pool, runner.kv_pool, mc.num_attention_heads))
    return runner


def _terms(model_config, context_len: int) -> int:
    """`numeric_bounds.mla_terms`; BASE: 2 layers x (512 + 256 + 160 + 128 + 1024 + 512 + 1024
    + context) + 512 ~ 7.8e3 at 41 tokens, so 4 u sqrt(N) = 2.1e-5 of max|ref|."""
    return mla_terms(model_config.hf_config, context_len)


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _hf_greedy(model, ids, n):
    """Greedy continuation by HF full forwards (no HF cache)."""
    seq, out = list(ids), []
    for _ in range(n):
        tok = int(_hf_logits(model, seq)[-1].argmax())
        out.append(tok)
        seq.append(tok)
    return out


def _prompt(seed, n):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


# ---- model-level parity ---------------------------------------------------------------------
def test_model_config_and_registry(hf_variant, ours):
    loaded = ours(hf_variant("v2")[0])
    mc = loaded.model_config
    assert type(loaded.model).__name__ == "DeepseekV2ForCausalLM"
    assert (mc.attention_arch, mc.num_key_value_heads, mc.head_dim, mc.v_head_dim) == ("mla", 1, 96, 64)
    assert (mc.kv_lora_rank, mc.qk_rope_head_dim, mc.qk_nope_head_dim) == (128, 32, 64)
    assert mc.kv_cache_bytes_per_token(torch.float32) == 2 * (128 + 32) * 4
    assert type(ours(hf_variant("v3")[0]).model).__name__ == "DeepseekV3ForCausalLM"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_logits_match_hf(variant, hf_variant, ours, step_runner):
    path, hf = hf_variant(variant)
    loaded = ours(path)
    ids = _prompt(7, 41)
    runner = _mla_runner(step_runner, loaded)
    logits = runner.step(ForwardMode.EXTEND, [(runner.new_request(), ids)])
    ref = _hf_logits(hf, ids)
    assert logits.shape == ref.shape and logits.dtype == torch.float32
    assert_within(logits, ref, forward_bound(ref, _terms(loaded.model_config, len(ids))), f"{variant} prefill vs HF")


def test_yarn_scales_match_hf(hf_variant, ours):
    """The YaRN variant really scales: softmax scale x mscale^2 and cos/sin x attention factor,
    with HF's numbers (its attention module's ``scaling``, its rotary ``attention_scaling``)."""
    path, hf = hf_variant("v2_yarn")
    attn = ours(path).model.model.layers[0].self_attn
    hf_attn = hf.model.layers[0].self_attn
    m = 0.1 * 0.8 * math.log(4.0) + 1.0
    assert attn.scaling == pytest.approx(96**-0.5 * m * m, rel=1e-12)
    assert attn.scaling == pytest.approx(hf_attn.scaling, rel=1e-12)
    assert attn.rotary_emb.cos_sin_scale == pytest.approx(hf.model.rotary_emb.attention_scaling, rel=1e-12)
    assert attn.rotary_emb.cos_sin_scale != 1.0
    inv = hf.model.rotary_emb.inv_freq
    pos = torch.arange(2048, dtype=torch.float32)
    freqs = torch.outer(pos, inv)
    ref = torch.cat([freqs.cos(), freqs.sin()], -1) * hf.model.rotary_emb.attention_scaling
    assert torch.allclose(attn.rotary_emb.cos_sin_cache, ref, atol=1e-6, rtol=0)


@pytest.mark.parametrize("variant", ["v2", "v3_no_q_lora_yarn"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_absorbed_decode_equals_full_prefill(variant, page_size, hf_variant, ours, step_runner):
    """Decode (W_UK/W_UV absorbed, latent cache) == the non-absorbed prefill of the same tokens."""
    loaded = ours(hf_variant(variant)[0])
    ids = _prompt(11, 30)
    inc = _mla_runner(step_runner, loaded, page_size)
    row = inc.new_request()
    inc.step(ForwardMode.EXTEND, [(row, ids[:20])])
    decode_logits = [inc.step(ForwardMode.DECODE, [(row, [t])])[0] for t in ids[20:]]
    full = _mla_runner(step_runner, loaded, page_size)
    ref = full.step(ForwardMode.EXTEND, [(full.new_request(), ids)])[20:]
    # both ours, but the absorbed decode sums other terms in another order than the prefill
    assert_within(torch.stack(decode_logits), ref, forward_bound(ref, _terms(loaded.model_config, len(ids))),
                  f"{variant} absorbed decode vs prefill")


def test_chunked_extend_over_cached_prefix_matches_hf(hf_variant, ours, step_runner):
    """Extend on top of a cached prefix (latent read back from the pool and expanded), two
    requests with different prefixes in one ragged batch, page size 4."""
    path, hf = hf_variant("v3")
    loaded = ours(path)
    a_ids, b_ids = _prompt(3, 33), _prompt(4, 26)
    runner = _mla_runner(step_runner, loaded, page_size=4)
    a, b = runner.new_request(), runner.new_request()
    runner.step(ForwardMode.EXTEND, [(a, a_ids[:13])])
    runner.step(ForwardMode.EXTEND, [(b, b_ids[:5])])
    logits = runner.step(ForwardMode.EXTEND, [(a, a_ids[13:]), (b, b_ids[5:])])
    na = len(a_ids) - 13
    cases = ((logits[:na], a_ids, 13), (logits[na:], b_ids, 5))
    for got, ids, prefix in cases:
        ref = _hf_logits(hf, ids)[prefix:]
        assert_within(got, ref, forward_bound(ref, _terms(loaded.model_config, len(ids))), "extend over a prefix vs HF")


# ---- engine-level greedy parity -----------------------------------------------------------
@pytest.mark.parametrize("variant,page_size,mixed", [("v2", 1, False), ("v2", 16, False), ("v3", 1, False),
                                                    ("v3", 16, False), ("v2_yarn", 16, False), ("v3", 4, True)])
def test_engine_greedy_matches_hf(variant, page_size, mixed, hf_variant):
    from attnserve.engine.llm import LLM
    from attnserve.engine.sampling_params import SamplingParams

    path, hf = hf_variant(variant)
    prompts = [_prompt(21, 19), _prompt(22, 6), _prompt(23, 40)]
    llm = LLM(model=path, device="cpu", dtype="float32", attention_backend="torch_native", page_size=page_size,
              max_total_tokens=2048, chunked_prefill_size=32,  # the 40-token prompt is prefilled in 2 chunks
              enable_mixed_chunk=mixed)  # mixed: decoding requests ride along in the chunk's MIXED batch
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == _hf_greedy(hf, prompt, 20)


# ---- config handling --------------------------------------------------------------------
def test_moe_layers_follow_first_k_dense_replace():
    """Layers ``i >= first_k_dense_replace`` get routed experts (HF's rule); a config without
    ``n_routed_experts`` is dense everywhere."""
    from transformers import DeepseekV2Config, DeepseekV3Config

    from attnserve.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
    from attnserve.models.layers.moe.sparse_block import SparseMoeBlock

    small = {**BASE, "hidden_size": 64, "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2,
             "q_lora_rank": None, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8,
             "moe_intermediate_size": 16, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1}
    for cfg_cls, cls in ((DeepseekV2Config, DeepseekV2ForCausalLM), (DeepseekV3Config, DeepseekV3ForCausalLM)):
        model = cls(cfg_cls(**{**small, "first_k_dense_replace": 1, "n_routed_experts": 4}), dtype=torch.float32)
        assert [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers] == [False, True]
        assert (model.model.layers[1].mlp.gate.e_score_correction_bias is not None) == (cls is DeepseekV3ForCausalLM)
    dense = SimpleNamespace(**{**small, "n_routed_experts": None, "first_k_dense_replace": 0, "rms_norm_eps": 1e-6,
                               "hidden_act": "silu"})
    model = DeepseekV2ForCausalLM(dense, dtype=torch.float32)
    assert not any(isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers)


def test_load_weights_skips_extra_layers_and_rejects_unknown(hf_variant, ours):
    from safetensors.torch import load_file

    path, _ = hf_variant("v2")
    loaded = ours(path)
    import glob

    weights = {}
    for f in glob.glob(f"{path}/*.safetensors"):
        weights.update(load_file(f))
    mtp = {k.replace("model.layers.1.", "model.layers.2."): v for k, v in weights.items() if ".layers.1." in k}
    loaded.model.load_weights(list(weights.items()) + list(mtp.items()))  # V3's MTP layer index: skipped
    with pytest.raises(KeyError, match="matches no parameter"):
        loaded.model.load_weights([("model.layers.0.mlp.bogus_proj.weight", torch.zeros(1))])
    with pytest.raises(KeyError, match="model.layers.0.mlp has no routed experts"):  # dense layers
        loaded.model.load_weights([("model.layers.0.mlp.experts.0.gate_proj.weight", torch.zeros(1))])
    partial = [(k, v) for k, v in weights.items() if "up_proj" not in k]
    with pytest.raises(ValueError, match="gate_up_proj"):
        loaded.model.load_weights(partial)


def test_dummy_tiny_shape_runs_on_the_engine():
    from attnserve.engine.llm import LLM
    from attnserve.engine.sampling_params import SamplingParams

    llm = LLM(model="deepseek-v2-tiny", load_format="dummy", device="cpu", dtype="float32", max_total_tokens=1024)
    assert llm.engine.model_runner.token_to_kv_pool.kv_buffer[0].shape[1:] == (1, 128 + 32)
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 4


def test_chunked_prefill_expanded_prefix_matches_absorbed(monkeypatch):
    """Chunked prefill through the engine (16-token chunks: every chunk after the first has
    a request over its own cached prefix): the expanded form over the prefixes
    (`mla_expanded_prefix`, switched on) and the absorbed form give the same greedy tokens
    and prompt logprobs within float32 rounding; without chunking as well."""
    import random

    from attnserve.engine.llm import LLM
    from attnserve.engine.sampling_params import SamplingParams

    rnd = random.Random(3)
    prompts = [[rnd.randrange(3, 250) for _ in range(n)] for n in (37, 21, 50)]
    params = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True, prompt_logprobs=True)
    outs = {}
    for setting, chunk in (("0", 16), ("1", 16), ("0", None)):
        monkeypatch.setenv("ATTNSERVE_MLA_EXPANDED_PREFIX", setting)
        llm = LLM(model="deepseek-v2-tiny", load_format="dummy", device="cpu", dtype="float32", max_total_tokens=1024,
                  chunked_prefill_size=chunk, disable_radix_cache=True)
        try:
            outs[setting, chunk] = llm.generate(prompts, params)
        finally:
            llm.shutdown()
    ref = outs["0", None]
    for key in (("0", 16), ("1", 16)):
        for a, b in zip(ref, outs[key]):
            assert a.token_ids == b.token_ids, key
            lp_a = torch.tensor(a.prompt_token_logprobs[1:], dtype=torch.float64)
            lp_b = torch.tensor(b.prompt_token_logprobs[1:], dtype=torch.float64)
            # float32 forward of 2 small layers: logprob differences of a few 1e-6 (rounding
            # in other orders); a prefix read wrongly moves them by O(1)
            assert (lp_a - lp_b).abs().max().item() < 1e-4, key
