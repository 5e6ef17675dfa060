"""Fused Triton kernels (`attnserve.models.layers.fused_kernels`) against the PyTorch
reference layers and float64 formulas, on CPU under the Triton interpreter (small shapes,
float32 and float16). The same checks run in bfloat16 on a GPU in
``tests/gpu/test_fused_kernels_gpu.py``."""

import os

import pytest
import torch

import fused_kernel_checks as C
from attnserve.mem_cache.memory_pool import MHATokenToKVPool
from attnserve.models.layers import fused_kernels as fk
from attnserve.models.layers.activation import GeluAndMul, SiluAndMul
from attnserve.models.layers.norm import GemmaRMSNorm, RMSNorm
from attnserve.models.layers.rotary import RotaryEmbedding

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1", reason="needs CUDA or TRITON_INTERPRET=1"
)
DTYPES = [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens,hidden", [(1, 576), (3, 80), (7, 64), (2, 96)])
@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
def test_rmsnorm(dtype, tokens, hidden, gemma):
    C.check_rmsnorm(DEVICE, dtype, tokens, hidden, gemma, "contiguous", seed=tokens * 7 + hidden)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["strided", "heads3d"])
def test_rmsnorm_views(dtype, layout):
    """Column slices of a wider tensor and per-head ``[T, H, D]`` views (QK-norm) in place."""
    C.check_rmsnorm(DEVICE, dtype, 5, 80, False, layout, seed=1)
    C.check_rmsnorm(DEVICE, dtype, 2, 64, True, layout, seed=2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens,hidden", [(1, 576), (4, 80), (7, 64)])
@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
def test_fused_add_rmsnorm(dtype, tokens, hidden, gemma):
    C.check_fused_add_rmsnorm(DEVICE, dtype, tokens, hidden, gemma, "contiguous", seed=tokens + hidden)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["strided", "heads3d"])
def test_fused_add_rmsnorm_views(dtype, layout):
    C.check_fused_add_rmsnorm(DEVICE, dtype, 3, 80, False, layout, seed=3)


def test_norm_launch_tiles_short_rows():
    """Short rows share a program (a 4096-element tile), long rows keep one each; the
    choice depends on the row width alone (one compiled variant per width)."""
    for n, block, block_m in [(64, 64, 64), (80, 128, 32), (128, 128, 32), (256, 256, 16), (512, 512, 8),
                              (576, 1024, 1), (1024, 1024, 1), (4096, 4096, 1), (5000, 8192, 1)]:
        got_block, got_m, warps = fk._norm_launch(n)
        assert (got_block, got_m) == (block, block_m), n
        assert 1 <= warps <= 16 and got_block * got_m >= 32 * warps  # no idle lane


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("dim,tokens_2d,tokens_3d", [(64, 67, 23), (128, 37, 13), (256, 19, 7)])
@pytest.mark.parametrize("layout", ["strided2d", "heads3d"])
def test_norm_short_rows_multi_row_programs(dtype, dim, tokens_2d, tokens_3d, layout):
    """Several rows per program (per-head q/k norm widths), a partly masked last program,
    2-D strided and 3-D ``[T, H, D]`` views, against float64 (bf16 sums: the interpreter
    truncates, so the residual is checked to one rounding)."""
    tokens = tokens_2d if layout == "strided2d" else tokens_3d
    assert tokens * (1 if layout == "strided2d" else 3) > fk._norm_launch(dim)[1]  # several programs
    C.check_norm_short_rows(DEVICE, dtype, tokens, 3, dim, layout, gemma=dim == 128,
                            exact_sum=dtype != torch.bfloat16 or DEVICE != "cpu", seed=dim + tokens)


def test_norm_short_rows_other_layouts():
    """Head-padded 3-D views and a contiguous 4-D tensor (flattened rows)."""
    C.check_norm_short_rows(DEVICE, torch.float32, 11, 3, 128, "padded3d", gemma=False, seed=1)
    C.check_norm_short_rows(DEVICE, torch.float16, 5, 7, 64, "contig4d", gemma=True, seed=2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize(
    "tokens,hq,hk,head_dim,rotary_dim",
    [(1, 9, 3, 64, 64), (5, 4, 2, 64, 32), (3, 2, 1, 80, 40), (7, 3, 3, 16, 16), (2, 6, 1, 48, 24)],
)
def test_rope_qkv_views(dtype, neox, tokens, hq, hk, head_dim, rotary_dim):
    """q and k rotated in place inside one fused qkv tensor; v and pass-through channels
    untouched; full and partial rotary_dim (half of 20 or 12 pairs: non-power-of-two)."""
    C.check_rope(DEVICE, dtype, tokens, hq, hk, head_dim, rotary_dim, neox, "qkv", seed=tokens * 13 + hq)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
def test_rope_contiguous_mla_and_no_key(dtype, neox):
    C.check_rope(DEVICE, dtype, 4, 5, 5, 32, 32, neox, "contiguous", seed=4)
    C.check_rope(DEVICE, dtype, 3, 4, 1, 16, 16, neox, "mla", seed=5)  # DeepSeek's q_pe / k_pe views
    C.check_rope(DEVICE, dtype, 2, 3, None, 32, 16, neox, "qkv", seed=6)  # key=None
    C.check_rope(DEVICE, dtype, 3, 2, 1, 32, 32, neox, "qkv", cos_sin_scale=1.25, seed=7)  # YaRN-scaled table


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize(
    "dtype,buf_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16), (torch.float32, torch.float16)],
    ids=["f32", "f16", "f32-f16"],
)
@pytest.mark.parametrize("tokens,hq,hk,head_dim,rotary_dim", [(1, 9, 3, 64, 64), (5, 4, 2, 48, 24), (3, 2, 1, 80, 80)])
def test_rope_with_kv_store(neox, dtype, buf_dtype, tokens, hq, hk, head_dim, rotary_dim):
    """RoPE and the KV-cache write in one launch (full and partial rotary_dim)."""
    C.check_rope_store_kv(DEVICE, dtype, buf_dtype, tokens, hq, hk, head_dim, rotary_dim, neox, seed=tokens + hq)


@pytest.mark.parametrize("buf_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("tokens,hq,hk,head_dim,rotary_dim,neox", [(3, 9, 3, 64, 64, True), (2, 4, 2, 48, 24, False)])
def test_rope_with_fp8_kv_store(buf_dtype, tokens, hq, hk, head_dim, rotary_dim, neox):
    """RoPE and the quantising FP8 KV-cache write in one launch (scales != 1, saturation);
    on the CPU interpreter with inputs that need no rounding (see the check), on a GPU with
    random ones."""
    C.check_rope_store_kv_fp8(DEVICE, torch.float32, buf_dtype, tokens, hq, hk, head_dim, rotary_dim, neox,
                              k_scale=0.125, v_scale=0.5, on_grid=DEVICE == "cpu", seed=tokens + hq)


def test_rope_fp8_kv_store_rejects_bad_scales():
    q, k, v = torch.zeros(2, 4 * 16), torch.zeros(2, 2 * 16), torch.zeros(2, 2 * 16)
    buf = torch.zeros(8, 2, 16, dtype=torch.float8_e4m3fn)
    for scale in (0.0, -1.0, float("nan")):
        bad = fk.KVStoreTarget(buf, buf.clone(), torch.zeros(2, dtype=torch.int64), v, k_scale=scale)
        with pytest.raises(ValueError, match="k_scale"):
            fk.rotary_embedding_inplace(torch.zeros(2, dtype=torch.int64), q, k, torch.zeros(4, 16), 16, 16, True,
                                        kv_store=bad)
    mixed = fk.KVStoreTarget(buf, torch.zeros(8, 2, 16), torch.zeros(2, dtype=torch.int64), v)
    with pytest.raises(ValueError, match="both be FP8"):
        fk.rotary_embedding_inplace(torch.zeros(2, dtype=torch.int64), q, k, torch.zeros(4, 16), 16, 16, True,
                                    kv_store=mixed)


def test_rope_kv_store_rejects_mismatch():
    q = torch.zeros(2, 4 * 16)
    k = torch.zeros(2, 2 * 16)
    bad = fk.KVStoreTarget(torch.zeros(8, 3, 16), torch.zeros(8, 3, 16), torch.zeros(2, dtype=torch.int64),
                           torch.zeros(2, 2 * 16))
    with pytest.raises(ValueError, match="kv_store does not match"):
        fk.rotary_embedding_inplace(torch.zeros(2, dtype=torch.int64), q, k, torch.zeros(4, 16), 16, 16, True,
                                    kv_store=bad)
    with pytest.raises(ValueError, match="needs k"):
        fk.rotary_embedding_inplace(torch.zeros(2, dtype=torch.int64), q, None, torch.zeros(4, 16), 16, 16, True,
                                    kv_store=bad)


def test_rope_rejects_strided_last_dim():
    q = torch.zeros(2, 4, 16)[..., ::2]  # [2, 4, 8] with a stride-2 last dim
    assert not fk.rope_layout_supported(q, None, 8)
    with pytest.raises(ValueError):
        fk.rotary_embedding_inplace(torch.zeros(2, dtype=torch.int64), q, None, torch.zeros(4, 8), 8, 8, True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("tokens,inter,strided", [(1, 64, False), (3, 80, True), (7, 576, False), (2, 1536, True)])
def test_act_and_mul(dtype, kind, tokens, inter, strided):
    C.check_act_and_mul(DEVICE, dtype, kind, tokens, inter, strided, seed=tokens + inter)


@pytest.mark.parametrize(
    "src_dtype,buf_dtype",
    [(torch.float32, torch.float32), (torch.float16, torch.float16), (torch.float32, torch.float16),
     (torch.float16, torch.float32)],
    ids=["f32-f32", "f16-f16", "f32-f16", "f16-f32"],
)
@pytest.mark.parametrize("tokens,heads,dk,dv,strided", [(1, 3, 64, 64, True), (5, 2, 16, 16, False),
                                                        (7, 1, 80, 48, False), (4, 4, 8, 8, True)])
def test_store_kv(src_dtype, buf_dtype, tokens, heads, dk, dv, strided):
    C.check_store_kv(DEVICE, src_dtype, buf_dtype, tokens, heads, dk, dv, strided, seed=tokens * 3 + heads)


def test_empty_inputs_launch_nothing():
    x = torch.zeros(0, 64)
    assert fk.rmsnorm(x, torch.ones(64), 1e-6).shape == (0, 64)
    assert fk.fused_add_rmsnorm(x, torch.zeros(0, 64), torch.ones(64), 1e-6).shape == (0, 64)
    assert fk.silu_and_mul(torch.zeros(0, 32)).shape == (0, 16)
    fk.rotary_embedding_inplace(torch.zeros(0, dtype=torch.int64), x, x, torch.zeros(8, 64), 64, 64, True)
    fk.store_kv(torch.zeros(4, 1, 64), torch.zeros(4, 1, 64), torch.zeros(0, dtype=torch.int64),
                torch.zeros(0, 1, 64), torch.zeros(0, 1, 64))


def test_fused_add_rmsnorm_rejects_mismatch():
    with pytest.raises(ValueError):
        fk.fused_add_rmsnorm(torch.zeros(2, 64), torch.zeros(2, 64, dtype=torch.float16), torch.ones(64), 1e-6)
    with pytest.raises(ValueError):
        fk.fused_add_rmsnorm(torch.zeros(2, 64), torch.zeros(2, 128)[:, ::2], torch.ones(64), 1e-6)


def _modules():
    return [RMSNorm(64), GemmaRMSNorm(64), RotaryEmbedding(64, 64, 16, 1e4), SiluAndMul(), GeluAndMul("tanh")]


def test_switch_turns_a_models_fused_paths_off_and_on():
    """`set_fused_kernels` (``--disable-fused-kernels``) switches every fused-capable module
    of a model; a module without a fused path (erf GELU) stays off when switched on."""
    assert fk.fused_kernels_available()
    model = torch.nn.Sequential(*_modules(), GeluAndMul("none"))
    assert [m.use_fused for m in model] == [True] * 5 + [False]
    assert fk.set_fused_kernels(model, False) == 0
    assert not any(m.use_fused for m in model)
    assert fk.set_fused_kernels(model, True) == 5
    assert [m.use_fused for m in model] == [True] * 5 + [False]


def test_engine_flag_reaches_layers_and_pool():
    """``--disable-fused-kernels`` on the model runner: no module of the model takes a fused
    path; without the flag they all do (the CPU pool never has a fused store)."""
    from attnserve.engine.model_runner import ModelRunner
    from attnserve.model_loader.loader import load_model
    from attnserve.server_args import ServerArgs

    for disable in (True, False):
        args = ServerArgs(model="smollm2-135m", load_format="dummy", device="cpu", max_total_tokens=64,
                          max_running_requests=2, context_length=32, disable_fused_kernels=disable)
        loaded = load_model(args.model, load_format="dummy", device="cpu", load_tokenizer=False, progress=False)
        runner = ModelRunner(args, loaded)
        users = [m for m in runner.model.modules() if isinstance(m, fk.FusedKernelUser)]
        assert len(users) > 10 and all(m.use_fused != disable for m in users)
        assert not runner.token_to_kv_pool.use_fused_store
    import argparse

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert ServerArgs.from_cli_args(parser.parse_args(["--disable-fused-kernels"])).disable_fused_kernels


def test_cpu_tensors_keep_the_reference_path():
    """On CPU the modules never dispatch to Triton: results are the PyTorch path's, and RoPE
    returns new tensors (the inputs are left as they were)."""
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(80)
    x, r = torch.randn(3, 80, generator=gen), torch.randn(3, 80, generator=gen)
    r_before = r.clone()
    out, s = norm(x, r)
    assert torch.equal(r, r_before) and s is not r
    assert torch.equal(out, norm._norm(x + r_before))
    rope = RotaryEmbedding(16, 16, 32, 1e4)
    q = torch.randn(2, 32, generator=gen)
    q_before = q.clone()
    q2, _ = rope(torch.tensor([1, 5]), q, None)
    assert q2 is not q and torch.equal(q, q_before)
    pool = MHATokenToKVPool(8, 1, torch.float32, 1, 16, 1, "cpu")
    assert not pool.use_fused_store
