"""The per-head q/k RMSNorm of Qwen3 / Gemma 3 folded into the RoPE (+ KV store) launch, on
CPU under the Triton interpreter: the fused launch against the un-fused kernel sequence
(`rmsnorm` on q and k, then the rotation) bit for bit and against float64 (head_dim 64 and
128, GQA, NeoX and GPT-J pairing, Llama and Gemma gains, no / 16-bit / FP8 cache); the
argument checks; the dispatch rules of `Qwen3Attention`; and a tiny Qwen3's and a tiny
Gemma 3's greedy tokens with the fused launch forced on CPU tensors equal to those of the
norm-modules-then-rope path. The same kernel checks run at Qwen3-0.6B shapes in ``tests/gpu/test_fused_kernels_gpu.py``."""

import os

import pytest
import torch

import qk_norm_rope_checks as Q
from attnserve.forward_batch import ForwardMode
from attnserve.models.layers import fused_kernels as fk
from attnserve.models.layers import rotary
from attnserve.models.layers.rotary import RotaryEmbedding
from numeric_bounds import assert_within, forward_bound, llama_like_terms

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1", reason="needs CUDA or TRITON_INTERPRET=1"
)


@pytest.mark.parametrize(
    "dtype,tokens,hq,hk,head_dim,neox,gemma,buf_dtype",
    [
        (torch.bfloat16, 3, 4, 2, 128, True, False, torch.bfloat16),  # Qwen3's pairing, bf16 cache
        (torch.bfloat16, 2, 6, 2, 64, False, True, None),  # GPT-J pairing, Gemma gains, no store
        (torch.float16, 4, 4, 1, 64, True, True, torch.float16),
        (torch.float32, 2, 8, 2, 128, False, False, torch.float32),
        (torch.float32, 3, 4, 2, 64, True, False, None),
    ],
    ids=["bf16-d128-neox-store", "bf16-d64-gptj-gemma", "f16-d64-neox-gemma-store", "f32-d128-gptj-store",
         "f32-d64-neox"],
)
def test_fused_matches_rmsnorm_then_rope(dtype, tokens, hq, hk, head_dim, neox, gemma, buf_dtype):
    Q.check_qk_norm_rope(DEVICE, dtype, tokens, hq, hk, head_dim, neox, gemma, buf_dtype=buf_dtype,
                         seed=tokens * 31 + head_dim)


def test_fused_matches_with_fp8_store():
    """The quantising FP8 store after the fused norm: the same bytes as rmsnorm, then the
    rope launch with the store (both through the same casts)."""
    Q.check_qk_norm_rope(DEVICE, torch.bfloat16, 3, 4, 2, 64, True, False, buf_dtype=torch.float8_e4m3fn,
                         k_scale=0.02, v_scale=0.5, seed=5)


def test_rejects_bad_norm_arguments():
    q, k = torch.zeros(2, 4 * 16), torch.zeros(2, 2 * 16)
    pos, table, w = torch.zeros(2, dtype=torch.int64), torch.zeros(4, 16), torch.ones(16)
    with pytest.raises(ValueError, match="needs q_norm_weight"):
        fk.rotary_embedding_inplace(pos, q, k, table, 16, 16, True, q_norm_weight=w)
    with pytest.raises(ValueError, match="needs q_norm_weight"):
        fk.rotary_embedding_inplace(pos, q, None, table, 16, 16, True, q_norm_weight=w, k_norm_weight=w)
    with pytest.raises(ValueError, match="rotary_dim == head_dim"):
        fk.rotary_embedding_inplace(pos, q, k, torch.zeros(4, 8), 16, 8, True, q_norm_weight=w, k_norm_weight=w)
    with pytest.raises(ValueError, match="must be \\[16\\]"):
        fk.rotary_embedding_inplace(pos, q, k, table, 16, 16, True, q_norm_weight=w, k_norm_weight=torch.ones(8))


def test_rope_module_fusable_only_where_the_kernel_applies():
    """`RotaryEmbedding.qk_norm_fusable`: never for CPU tensors, a missing key or a partial
    rotation; `forward` with norm weights outside it raises instead of normalising silently."""
    full, partial = RotaryEmbedding(16, 16, 32, 1e4), RotaryEmbedding(16, 8, 32, 1e4)
    q, k = torch.zeros(2, 4 * 16), torch.zeros(2, 2 * 16)
    assert not full.qk_norm_fusable(q, k)  # CPU tensors keep the PyTorch path
    meta_q, meta_k = q.to("meta"), k.to("meta")
    is_cuda = torch.Tensor.is_cuda
    try:  # the rules apart from the device
        torch.Tensor.is_cuda = property(lambda self: True)
        assert full.qk_norm_fusable(meta_q, meta_k)
        assert not full.qk_norm_fusable(meta_q, None) and not partial.qk_norm_fusable(meta_q, meta_k)
        full.use_fused = False
        assert not full.qk_norm_fusable(meta_q, meta_k)
    finally:
        torch.Tensor.is_cuda = is_cuda
    with pytest.raises(ValueError, match="need the fused path"):
        full(torch.zeros(2, dtype=torch.int64), q, k, q_norm_weight=torch.ones(16), k_norm_weight=torch.ones(16))


# ---- tiny Qwen3 / Gemma 3 through the engine's step path --------------------------------------
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, vocab_size=500, max_position_embeddings=128, rms_norm_eps=1e-6,
            rope_theta=1000000.0)
TINY_GEMMA3 = dict(TINY, head_dim=32, sliding_window=16, layer_types=["sliding_attention", "full_attention"],
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
                   query_pre_attn_scalar=24)
del TINY_GEMMA3["rope_theta"]


@pytest.fixture(scope="module", params=["qwen3", "gemma3"])
def tiny_model(request, tmp_path_factory):
    """Our Qwen3 (or Gemma 3: ``(1 + w)`` q/k norms, two RoPE tables) loaded from a random HF
    model whose norm gains are perturbed away from their defaults, float32."""
    transformers = pytest.importorskip("transformers")
    from attnserve.model_loader.loader import load_model

    torch.manual_seed(0)
    if request.param == "qwen3":
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**TINY))
    else:
        hf = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**TINY_GEMMA3))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    path = tmp_path_factory.mktemp(f"{request.param}-qk-norm-rope")
    hf.eval().save_pretrained(path)
    return load_model(str(path), load_tokenizer=False, progress=False)


def _greedy(loaded, step_runner, steps: int):
    """Two requests (19 and 7 prompt tokens) prefilled together, then decoded together;
    returns their greedy tokens and every step's logits."""
    runner = step_runner(loaded.model, loaded.model_config)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, TINY["vocab_size"], (n,), generator=gen).tolist() for n in (19, 7)]
    rows = [runner.new_request() for _ in prompts]
    logits = runner.step(ForwardMode.EXTEND, list(zip(rows, prompts)))
    last = [len(prompts[0]) - 1, len(prompts[0]) + len(prompts[1]) - 1]
    tokens = [[int(logits[i].argmax())] for i in last]
    all_logits = [logits[last]]
    for _ in range(steps - 1):
        logits = runner.step(ForwardMode.DECODE, [(r, [t[-1]]) for r, t in zip(rows, tokens)])
        all_logits.append(logits)
        for t, row in zip(tokens, logits):
            t.append(int(row.argmax()))
    return tokens, all_logits


def test_qwen3_attention_dispatch(tiny_model, monkeypatch):
    """The fusion is on by default for Qwen3 and Gemma 3 blocks (Gemma's with the ``1 + w``
    offset), off with the env switch (read when the block is built), and a step on CPU
    tensors takes the norm modules, not the fused launch."""
    from attnserve.models.qwen3 import Qwen3Attention

    attn = tiny_model.model.model.layers[0].self_attn
    assert isinstance(attn, Qwen3Attention) and attn.qk_norm_rope_fusion
    d = attn.head_dim
    assert attn.q_norm.fused_weight_offset == (1.0 if tiny_model.model_config.architecture.startswith("Gemma") else 0.0)
    q, k = torch.zeros(3, 4 * d), torch.zeros(3, 2 * d)
    assert not attn.qk_norm_in_rope(q, k, None)
    monkeypatch.setenv("ATTNSERVE_QK_NORM_ROPE_FUSION", "0")
    off = Qwen3Attention(tiny_model.model.config, 0, attn.rotary_emb, torch.float32)
    assert not off.qk_norm_rope_fusion
    monkeypatch.setenv("ATTNSERVE_QK_NORM_ROPE_FUSION", "1")
    on = Qwen3Attention(tiny_model.model.config, 0, attn.rotary_emb, torch.float32)
    assert on.qk_norm_rope_fusion
    on.k_norm.use_fused = False  # --disable-fused-kernels reaches the norms: no fusion
    monkeypatch.setattr(RotaryEmbedding, "qk_norm_fusable", lambda self, q, k: True)
    assert on.qk_norm_in_rope(q, k, None) is False


def test_tiny_greedy_tokens_unchanged(tiny_model, step_runner, monkeypatch):
    """The fused norm + rope launch (reached on CPU tensors through the interpreter by
    letting `RotaryEmbedding.qk_norm_fusable` ignore the device) gives the greedy tokens of
    the norm-modules-then-rope path, and logits within float32 forward rounding."""
    steps = 6
    ref_tokens, ref_logits = _greedy(tiny_model, step_runner, steps)

    calls = []
    launch = rotary.rotary_embedding_inplace

    def spy(*args, **kwargs):
        calls.append(kwargs.get("q_norm_weight") is not None)
        return launch(*args, **kwargs)

    monkeypatch.setattr(RotaryEmbedding, "qk_norm_fusable",
                        lambda self, q, k: k is not None and self.rotary_dim == self.head_dim
                        and fk.rope_layout_supported(q, k, self.head_dim))  # the rules but the device
    monkeypatch.setattr(rotary, "rotary_embedding_inplace", spy)
    tokens, logits = _greedy(tiny_model, step_runner, steps)
    assert calls == [True] * (TINY["num_hidden_layers"] * steps)  # every layer, every step: the fused launch
    assert tokens == ref_tokens
    terms = llama_like_terms(tiny_model.model.config, 19 + steps)
    for got, ref in zip(logits, ref_logits):
        assert_within(got, ref, forward_bound(ref, terms), "tiny model logits, fused norm+rope vs modules")


def test_fp8_cache_keeps_the_norms_apart(tiny_model, monkeypatch):
    """With an FP8 KV pool `Qwen3Attention` runs its q/k norm modules and then the plain
    rotation (the FP8-store fused variant is not bit-identical on an H100); with a 16-bit
    pool, or none, the same fusable step hands the norms to the RoPE launch."""
    from types import SimpleNamespace

    from attnserve.models.qwen3 import Qwen3Attention

    attn = tiny_model.model.model.layers[0].self_attn
    assert isinstance(attn, Qwen3Attention) and attn.qk_norm_rope_fusion
    monkeypatch.setattr(RotaryEmbedding, "qk_norm_fusable", lambda self, q, k: True)
    for norm in (attn.q_norm, attn.k_norm):
        monkeypatch.setattr(norm, "use_fused", True)
    d = attn.head_dim
    q, k = torch.zeros(3, 4 * d), torch.zeros(3, 2 * d)

    def batch(dtype):
        return SimpleNamespace(token_to_kv_pool=SimpleNamespace(dtype=dtype))

    assert attn.qk_norm_in_rope(q, k, batch(torch.bfloat16)) is True
    assert attn.qk_norm_in_rope(q, k, None) is True
    assert attn.qk_norm_in_rope(q, k, batch(torch.float8_e4m3fn)) is False
    assert attn.qk_norm_in_rope(q, k, batch(torch.float8_e5m2)) is False
