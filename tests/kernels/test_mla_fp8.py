"""FP8 latent cache in the paged MLA decode (`attention/triton_ops/mla_decode.py`) against a
float64 reference.

The cache holds float8 (e4m3fn / e5m2) latent rows quantised with one per-tensor scale,
``stored = (x / kv_scale).clamp(-max, max).to(fp8)``; the reference attends over the
fp8-ROUNDED rows dequantised in float64 (``stored.double() * kv_scale``), so the kernel must
match it at the tolerances of the query dtype (the quantisation error itself is not part of
the comparison). Every case: fresh random inputs, pages reached through a shuffled block
table, NaN in every slot no request owns and NaN-poisoned outputs (`test_mla_decode`'s
helpers).

Runs on CPU under the Triton interpreter (small shapes: kv_lora_rank 64 + rope 16, as
`test_mla_decode`) and on a GPU with DeepSeek's 512 + 64. Under the interpreter (Triton
3.x) fp8 loads and their conversion to fp32 / fp16 / bf16 are exact for every finite code;
only the NaN codes are decoded as finite numbers there (e4m3fn 0x7f as 480), so the NaN
poison of unowned slots catches a stray read on a GPU only (the masked loads are the same
as for a 16-bit cache, which `test_mla_decode` checks with NaN on CPU too).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from test_mla_decode import _variant, check, make_case, run_kernel  # noqa: E402

from attnserve.attention.triton_ops.mla_decode import (  # noqa: E402
    MLA_FP8_DTYPES,
    MLADecodeConfig,
    mla_decode_config,
    mla_decode_fwd,
    mla_gluon_applicable,
    mla_kv_pairs_applicable,
    mla_num_kv_splits_device,
    mla_num_work_items,
    mla_stage1_kernel,
)
from attnserve.mem_cache.kv_quant import quantize_kv  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# DeepSeek's kv_lora_rank + rope on a GPU; the interpreter takes the small dims of test_mla_decode
D_C, D_R = (512, 64) if DEVICE == "cuda" else (64, 16)
FP8 = list(MLA_FP8_DTYPES)
FP8_IDS = ["e4m3fn", "e5m2"]


def make_fp8_case(seq_lens, num_heads, page_size, q_dtype, fp8, kv_scale, *, d_c=D_C, d_r=D_R, amp=1.0, seed=0):
    """`make_case` with the latent cache quantised to ``fp8`` with ``kv_scale`` (unowned slots
    stay NaN) and the reference rows replaced by the stored values times ``kv_scale``.
    ``amp`` scales the true latent values before the quantisation."""
    case = make_case(seq_lens, num_heads, page_size, torch.float32, d_c=d_c, d_r=d_r, seed=seed)
    g = torch.Generator().manual_seed(seed + 1000)
    bs = len(seq_lens)
    # queries in their dtype (make_case drew them in fp32); the reference takes the rounded ones
    q_nope = torch.randn(bs, num_heads, d_c, generator=g).to(q_dtype)
    q_pe = torch.randn(bs, num_heads, d_r, generator=g).to(q_dtype)
    case.update(q_nope=q_nope.to(DEVICE), q_pe=q_pe.to(DEVICE), q_nope64=q_nope.double(), q_pe64=q_pe.double())
    stored = quantize_kv(case["kv"].cpu() * amp, kv_scale, fp8)  # NaN (unowned) stays NaN
    table = case["table"].cpu()
    rows = []
    for i, n in enumerate(seq_lens):
        t = torch.arange(n)
        slots = table[i, t // page_size].long() * page_size + t % page_size
        rows.append(stored[slots, 0].double() * kv_scale)
    assert all(torch.isfinite(r).all() for r in rows)
    case.update(kv=stored.to(DEVICE), rows=rows)
    return case


def run_fp8(case, page_size, num_kv_splits, max_kv_splits, kv_scale, **kw):
    """`run_kernel` with ``kv_scale`` (poisoned o / lse, returns them)."""
    bs, h, d_c = case["q_nope"].shape
    o = torch.full((bs, h, d_c), float("nan"), dtype=case["q_nope"].dtype, device=DEVICE)
    lse = torch.full((bs, h), float("nan"), dtype=torch.float32, device=DEVICE)
    ret = mla_decode_fwd(case["q_nope"], case["q_pe"], case["kv"], case["table"], case["seq_lens"], page_size, o,
                         case["sm_scale"], num_kv_splits, max_kv_splits, lse=lse, kv_scale=kv_scale, **kw)
    assert ret is o
    return o, lse


# ragged: an empty request, one token, a page edge, several pages with a tail; a few hundred
# tokens in all (the interpreter's cost)
LENS = [0, 1, 64, 130, 257]


@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("page_size", [64, 128])
@pytest.mark.parametrize("num_heads", [16, 128])
def test_fp8_decode_matches_reference(fp8, page_size, num_heads):
    """The default config for the shape (on an sm_90 GPU the transposed kernel for 16 heads
    and the fp8 seesaw kernel for 128; under the interpreter the Triton kernel), bf16
    queries, kv_scale != 1, 3 splits."""
    kv_scale = 0.02 if fp8 == torch.float8_e4m3fn else 0.5
    case = make_fp8_case(LENS, num_heads, page_size, torch.bfloat16, fp8, kv_scale,
                         seed=page_size + num_heads + 7 * FP8.index(fp8))
    o, lse = run_fp8(case, page_size, 3, 4, kv_scale)
    check(case, o, lse, torch.bfloat16)
    assert (o[0] == 0).all() and torch.isneginf(lse[0].cpu()).all()


def _device_splits(case, sm_count: int, max_splits: int, split_mode: str):
    """``(splits, work)``: the requests' split counts computed on the device
    (`mla_num_kv_splits_device` over ``sm_count`` SMs, at most ``max_splits``), with a work
    list of `mla_num_work_items` entries when ``split_mode == "work"`` (else ``work`` None)."""
    work = None
    if split_mode == "work":
        n = mla_num_work_items(len(case["seq_lens"]), sm_count, max_splits)
        work = torch.empty(n, dtype=torch.int32, device=DEVICE)
    return mla_num_kv_splits_device(case["seq_lens"], sm_count, max_splits, work=work), work


@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.float16], ids=["q_fp32", "q_fp16"])
@pytest.mark.parametrize("split_mode", ["device", "work"])
def test_fp8_query_dtypes_and_device_splits(fp8, q_dtype, split_mode):
    """fp32 / fp16 queries (the tiles are converted to them), per-request split counts on
    the device, with and without a work list."""
    lens = [17, 0, 300, 64, 1]
    kv_scale = 4.0
    seed = 11 + FP8.index(fp8) + 2 * (q_dtype == torch.float16)
    case = make_fp8_case(lens, 16, 64, q_dtype, fp8, kv_scale, amp=8.0, seed=seed)
    splits, work = _device_splits(case, 16, 4, split_mode)
    assert splits.cpu().tolist()[2] > 1  # the long request is split (merge of scaled partials)
    o, lse = run_fp8(case, 64, splits, 4, kv_scale, work=work)
    check(case, o, lse, q_dtype)


@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("page_size", [64, 128])
def test_fp8_tma_loads(fp8, page_size):
    """The Triton kernel's TMA mode reads fp8 boxes (1-byte elements) and converts them;
    under the interpreter through Triton's emulation of host descriptors. 20 heads: a
    ragged head tile; the tail tile of each split takes the masked pointer path."""
    cfg = _variant("tma", block_n=32)
    kv_scale = 0.125
    case = make_fp8_case(LENS, 20, page_size, torch.float16, fp8, kv_scale, seed=page_size + 3 * FP8.index(fp8))
    assert mla_stage1_kernel(case["q_nope"], case["q_pe"], case["kv"], page_size, cfg) == "tma"
    o, lse = run_fp8(case, page_size, 3, 4, kv_scale, config=cfg)
    check(case, o, lse, torch.float16)


@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
def test_fp8_one_split_and_default_scale(fp8):
    """One split (stage 1 writes o itself, scaled there) and kv_scale left at its default
    1.0 (the stored values are the true ones)."""
    case = make_fp8_case([5, 200, 64], 16, 64, torch.bfloat16, fp8, 1.0, seed=23 + FP8.index(fp8))
    bs, h, d_c = case["q_nope"].shape
    o = torch.full((bs, h, d_c), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    mla_decode_fwd(case["q_nope"], case["q_pe"], case["kv"], case["table"], case["seq_lens"], 64, o,
                   case["sm_scale"], 1, 1)
    check(case, o, None, torch.bfloat16)
    case = make_fp8_case([5, 200, 64], 16, 64, torch.bfloat16, fp8, 0.03, seed=29 + FP8.index(fp8))
    o, lse = run_fp8(case, 64, 1, 1, 0.03)
    check(case, o, lse, torch.bfloat16)


def test_fp8_page_size_one_pointer_gathers():
    """A token-level table (page 1): per-row page lookups, pointer loads only."""
    case = make_fp8_case([3, 90, 0, 33], 16, 1, torch.float32, torch.float8_e4m3fn, 0.05, seed=31)
    assert mla_stage1_kernel(case["q_nope"], case["q_pe"], case["kv"], 1, _variant("tma")) == "triton"
    o, lse = run_fp8(case, 1, 2, 2, 0.05, config=_variant("tma"))
    check(case, o, lse, torch.float32)


def _sm90():
    return DEVICE == "cuda" and torch.cuda.get_device_capability()[0] == 9


def _pairs_device():
    """A GPU with ``cvt.rn.f16x2.e4m3x2`` (sm_89+): where the Triton pairs path can run."""
    return DEVICE == "cuda" and torch.cuda.get_device_capability() >= (8, 9)


# a config preferring the seesaw kernel: the fp8 seesaw kernel for an fp8 cache on sm_90
SEESAW_CFG = MLADecodeConfig(block_h=64, block_n=64, num_warps=8, num_stages=2, kv_load="tma", stage1="seesaw")


def _transposed_cfg(num_stages=2):
    """A config preferring the transposed kernel (`mla_decode_transposed`)."""
    return MLADecodeConfig(block_h=16, block_n=64, num_warps=4, num_stages=num_stages, stage1="transposed")


def test_fp8_cache_stage1_names():
    """Which stage 1 an fp8 cache runs on sm_90 where pages hold whole 64-token blocks: the
    transposed kernel (``"transposed_fp8"``) for the default config up to 16 heads and a
    config preferring ``"transposed"``, the fp8 seesaw kernel (``"seesaw_fp8"``) for the
    default config above 16 heads and a config preferring ``"seesaw"``; the Triton kernel
    for the ``"gluon"`` preference (no fp8 variant), for pages of 32 and elsewhere (other
    devices, the interpreter). `mla_gluon_applicable` is False for fp8 rows."""
    from attnserve.attention.triton_ops.mla_decode import mla_seesaw_fp8_applicable

    q_nope = torch.zeros(1, 128, D_C, dtype=torch.bfloat16, device=DEVICE)
    q_pe = torch.zeros(1, 128, D_R, dtype=torch.bfloat16, device=DEVICE)
    fast = _sm90() and D_C == 512
    pairs = _pairs_device() and D_C == 512
    for fp8 in FP8:
        kv = torch.zeros(256, 1, D_C + D_R, dtype=fp8, device=DEVICE)
        rows = kv.view(-1, D_C + D_R)
        assert not mla_gluon_applicable(q_nope, q_pe, rows, 64, 64)
        assert mla_seesaw_fp8_applicable(q_nope, q_pe, rows, 64) == fast
        assert not mla_seesaw_fp8_applicable(q_nope, q_pe, rows, 32)
        assert mla_kv_pairs_applicable(q_nope, q_pe, rows) == pairs
        # no pairs for fp32 queries or an odd row stride (a pair would straddle two int16)
        assert not mla_kv_pairs_applicable(q_nope.float(), q_pe.float(), rows)
        odd = torch.zeros(256, D_C + D_R + 1, dtype=fp8, device=DEVICE)[:, : D_C + D_R]
        assert not mla_kv_pairs_applicable(q_nope, q_pe, odd)
        gluon_cfg = MLADecodeConfig(block_h=64, block_n=64, num_warps=8, num_stages=2, kv_load="tma", stage1="gluon")
        pairs_cfg = MLADecodeConfig(block_h=16, block_n=64, num_warps=8, num_stages=1, kv_pairs=True)
        for page in (64, 128):
            assert mla_stage1_kernel(q_nope, q_pe, kv, page, gluon_cfg) == "tma"
            assert mla_stage1_kernel(q_nope, q_pe, kv, page, SEESAW_CFG) == ("seesaw_fp8" if fast else "tma")
            assert mla_stage1_kernel(q_nope, q_pe, kv, page, _transposed_cfg()) == (
                "transposed_fp8" if fast else "triton")
            assert mla_stage1_kernel(q_nope, q_pe, kv, page, pairs_cfg) == ("triton_pairs" if pairs else "triton")
            assert mla_stage1_kernel(q_nope, q_pe, odd, page, pairs_cfg) == "triton"  # the byte path
            # the default: where they apply the transposed kernel up to 16 heads and the fp8
            # seesaw kernel above (fastest on an H100, session 12), else the pairs path up to
            # 32 heads, else the byte path
            byte_path = ("tma", "triton")  # the 16-bit default config (interpreter: no TMA)
            for h in (1, 16, 17, 32, 128):
                gluon_pick = "transposed_fp8" if h <= 16 else "seesaw_fp8"
                assert mla_stage1_kernel(q_nope[:, :h], q_pe[:, :h], kv, page) in (
                    (gluon_pick,) if fast else ("triton_pairs",) if pairs and h <= 32 else byte_path)
        for cfg in (gluon_cfg, SEESAW_CFG, _transposed_cfg()):
            assert mla_stage1_kernel(q_nope, q_pe, kv, 32, cfg) == "triton"  # a tile spans pages
        # pages of 32 tokens: no seesaw kernel; the pairs path up to 32 heads
        for h in (16, 32, 128):
            assert mla_stage1_kernel(q_nope[:, :h], q_pe[:, :h], kv, 32) == (
                "triton_pairs" if pairs and h <= 32 else "triton")
    if fast:
        # the same shape with a bf16 cache takes the 16-bit seesaw kernel where Gluon is importable
        bf16 = torch.zeros(256, 1, D_C + D_R, dtype=torch.bfloat16, device=DEVICE)
        gluon = mla_gluon_applicable(q_nope, q_pe, bf16.view(-1, D_C + D_R), 64, 64)
        assert mla_stage1_kernel(q_nope, q_pe, bf16, 64) == ("seesaw" if gluon else "tma")


needs_sm90 = pytest.mark.skipif(not (_sm90() and D_C == 512), reason="fp8 seesaw kernel: sm_90 GPU")


@needs_sm90
@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("page_size", [64, 128])
@pytest.mark.parametrize("num_heads", [16, 128])
@pytest.mark.parametrize("splits", [1, 3])
def test_fp8_seesaw_ragged(fp8, page_size, num_heads, splits):
    """The fp8 seesaw kernel against float64: ragged lengths (empty, 1 token, one block, an
    odd number of blocks so the last pair has one block, partial last blocks, a few hundred
    tokens a split so every barrier phase turns over several times), bf16 queries, kv_scale
    != 1 (e4m3 small, e5m2 large), one split (stage 1 writes o itself, zeros for the empty
    request) and three (the merge of scaled partials)."""
    lens = [0, 1, 64, 130, 257, 1000, 2049, 4095]
    kv_scale = 0.02 if fp8 == torch.float8_e4m3fn else 3.0
    case = make_fp8_case(lens, num_heads, page_size, torch.bfloat16, fp8, kv_scale,
                         amp=kv_scale * (100 if fp8 == torch.float8_e4m3fn else 2),
                         seed=3 * page_size + num_heads + 11 * FP8.index(fp8) + splits)
    assert mla_stage1_kernel(case["q_nope"], case["q_pe"], case["kv"], page_size, SEESAW_CFG) == "seesaw_fp8"
    o, lse = run_fp8(case, page_size, splits, splits, kv_scale, config=SEESAW_CFG)
    check(case, o, lse, torch.bfloat16)
    assert (o[0] == 0).all() and torch.isneginf(lse[0].cpu()).all()


@needs_sm90
@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("split_mode", ["device", "work"])
def test_fp8_seesaw_fp16_queries_device_splits(fp8, split_mode):
    """fp16 queries (no conversion of q), per-request split counts on the device with and
    without a work list, 20 heads (a ragged head tile), page 64."""
    lens = [17, 0, 3000, 64, 1, 640]
    kv_scale = 0.5
    case = make_fp8_case(lens, 20, 64, torch.float16, fp8, kv_scale, amp=4.0, seed=77 + FP8.index(fp8))
    splits, work = _device_splits(case, 20, 8, split_mode)
    assert splits.cpu().tolist()[2] > 1
    assert mla_stage1_kernel(case["q_nope"], case["q_pe"], case["kv"], 64, SEESAW_CFG) == "seesaw_fp8"
    o, lse = run_fp8(case, 64, splits, 8, kv_scale, work=work, config=SEESAW_CFG)
    check(case, o, lse, torch.float16)


@needs_sm90
@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
def test_fp8_seesaw_matches_triton_kernel(fp8):
    """The fp8 seesaw kernel and the Triton kernel (forced by a config preferring it) agree
    on the same inputs (both also against float64), 128 heads, page 64."""
    kv_scale = 0.07
    case = make_fp8_case([700, 64, 1], 128, 64, torch.bfloat16, fp8, kv_scale, amp=2.0, seed=5 + FP8.index(fp8))
    triton_cfg = MLADecodeConfig(block_h=64, block_n=64, num_warps=8, num_stages=2, kv_load="tma")
    assert mla_stage1_kernel(case["q_nope"], case["q_pe"], case["kv"], 64, triton_cfg) == "tma"
    o_t, lse_t = run_fp8(case, 64, 2, 2, kv_scale, config=triton_cfg)
    o_s, lse_s = run_fp8(case, 64, 2, 2, kv_scale, config=SEESAW_CFG)
    check(case, o_t, lse_t, torch.bfloat16)
    check(case, o_s, lse_s, torch.bfloat16)
    torch.testing.assert_close(o_s.float(), o_t.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse_s, lse_t, atol=1e-3, rtol=1e-4)


# (fp8, page, heads, splits, q dtype, kv_scale, num_stages): each axis takes each of its values
TRANSPOSED_CASES = [
    (torch.float8_e4m3fn, 64, 16, 1, torch.bfloat16, 0.02, 2),
    (torch.float8_e4m3fn, 128, 16, 3, torch.float16, 3.0, 4),
    (torch.float8_e5m2, 64, 16, 3, torch.bfloat16, 3.0, 2),
    (torch.float8_e5m2, 128, 16, 1, torch.float16, 0.02, 4),
    (torch.float8_e4m3fn, 64, 128, 3, torch.bfloat16, 0.02, 2),
    (torch.float8_e5m2, 128, 128, 1, torch.bfloat16, 3.0, 2),
    (torch.float8_e4m3fn, 64, 20, 2, torch.float16, 3.0, 4),
]


@needs_sm90
@pytest.mark.parametrize("fp8,page_size,num_heads,splits,q_dtype,kv_scale,num_stages", TRANSPOSED_CASES)
def test_fp8_transposed_ragged(fp8, page_size, num_heads, splits, q_dtype, kv_scale, num_stages):
    """The transposed fp8 kernel (`mla_decode_transposed`) against float64: ragged lengths
    (empty, 1 token, one tile, partial last tiles, enough tiles a split that every stage's
    barrier phase turns over), 16 / 20 (a ragged head tile) / 128 heads, pages 64 / 128,
    e4m3 / e5m2, kv_scale 0.02 / 3.0, bf16 / fp16 queries, 1 to 3 splits, 2 / 4 stages."""
    lens = [0, 1, 64, 130, 257, 1000, 2049, 4095]
    big = kv_scale < 1 and fp8 == torch.float8_e4m3fn
    case = make_fp8_case(lens, num_heads, page_size, q_dtype, fp8, kv_scale, amp=kv_scale * (100 if big else 2),
                         seed=7 * page_size + num_heads + 13 * FP8.index(fp8) + splits + num_stages)
    cfg = _transposed_cfg(num_stages)
    assert mla_stage1_kernel(case["q_nope"], case["q_pe"], case["kv"], page_size, cfg) == "transposed_fp8"
    o, lse = run_fp8(case, page_size, splits, splits, kv_scale, config=cfg)
    check(case, o, lse, q_dtype)
    assert (o[0] == 0).all() and torch.isneginf(lse[0].cpu()).all()


@needs_sm90
@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("split_mode", ["device", "work"])
def test_fp8_transposed_device_splits_matches_seesaw(fp8, split_mode):
    """Per-request split counts on the device with and without a work list, 16 heads, page
    64: the transposed kernel against float64 and against the fp8 seesaw kernel."""
    lens = [17, 0, 3000, 64, 1, 640]
    kv_scale = 0.5
    case = make_fp8_case(lens, 16, 64, torch.bfloat16, fp8, kv_scale, amp=4.0, seed=91 + FP8.index(fp8))
    splits, work = _device_splits(case, 16, 8, split_mode)
    o, lse = run_fp8(case, 64, splits, 8, kv_scale, work=work, config=_transposed_cfg())
    check(case, o, lse, torch.bfloat16)
    o_s, lse_s = run_fp8(case, 64, splits, 8, kv_scale, work=work, config=SEESAW_CFG)
    torch.testing.assert_close(o.float(), o_s.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, lse_s, atol=1e-3, rtol=1e-4)


needs_pairs = pytest.mark.skipif(not (_pairs_device() and D_C == 512), reason="fp8 pairs path: sm_89+ GPU")
E4M3, E5M2 = FP8

# (fp8, page, heads, splits, q dtype, kv_scale, (block_h, block_n, num_warps)): every axis
# takes each of its values at least once; pages 16 / 32 and 64-token pages under 128-token
# tiles take the per-row page lookups, 64 / 128 under 32 / 64-token tiles one page a tile
PAIRS_CASES = [
    (E4M3, 64, 16, 1, torch.bfloat16, 0.02, (16, 64, 8)),
    (E4M3, 128, 16, 3, torch.float16, 3.0, (16, 128, 8)),
    (E5M2, 64, 128, 3, torch.bfloat16, 3.0, (16, 64, 8)),
    (E5M2, 128, 16, 1, torch.float16, 0.02, (16, 32, 4)),
    (E4M3, 16, 16, 2, torch.bfloat16, 3.0, (16, 64, 8)),
    (E4M3, 64, 128, 1, torch.float16, 0.02, (32, 32, 8)),
    (E5M2, 32, 16, 3, torch.bfloat16, 0.02, (16, 128, 8)),
    (E4M3, 64, 128, 2, torch.bfloat16, 3.0, (32, 64, 8)),
]


@needs_pairs
@pytest.mark.parametrize("fp8,page_size,num_heads,splits,q_dtype,kv_scale,tiles", PAIRS_CASES,
                         ids=[f"{FP8_IDS[FP8.index(c[0])]}-p{c[1]}-h{c[2]}-s{c[3]}-{str(c[4])[6:]}-{c[5]}-"
                              f"{'x'.join(map(str, c[6]))}" for c in PAIRS_CASES])
def test_fp8_pairs_ragged(fp8, page_size, num_heads, splits, q_dtype, kv_scale, tiles):
    """The Triton pairs path (int16 pairs converted to fp16 in registers, fp16 dots) against
    float64 on the fp8-rounded cache: ragged lengths (empty, 1 token, one page, lengths that
    are not multiples of the tile, a few thousand tokens), kv_scale != 1, one split (stage 1
    writes o itself) and several (merge of scaled partials)."""
    lens = [0, 1, 64, 130, 257, 1000, 2049, 4095]
    bh, bn, nw = tiles
    cfg = MLADecodeConfig(block_h=bh, block_n=bn, num_warps=nw, num_stages=1, kv_pairs=True)
    case = make_fp8_case(lens, num_heads, page_size, q_dtype, fp8, kv_scale,
                         amp=kv_scale * (100 if fp8 == E4M3 else 2), seed=page_size + num_heads + 7 * splits + bn)
    assert mla_stage1_kernel(case["q_nope"], case["q_pe"], case["kv"], page_size, cfg) == "triton_pairs"
    o, lse = run_fp8(case, page_size, splits, splits, kv_scale, config=cfg)
    check(case, o, lse, q_dtype)
    assert (o[0] == 0).all() and torch.isneginf(lse[0].cpu()).all()


@needs_pairs
@pytest.mark.parametrize("split_mode", ["device", "work"])
def test_fp8_pairs_default_device_splits(split_mode):
    """The default pick for 16 heads and pages of 32 tokens (no fp8 seesaw kernel there) is
    the pairs path; per-request split counts on the device, with and without a work list;
    the byte path (the same kernel without pairs) and the pairs path agree."""
    lens = [17, 0, 3000, 64, 1, 640]
    kv_scale = 0.5
    case = make_fp8_case(lens, 16, 32, torch.bfloat16, E4M3, kv_scale, amp=40.0, seed=91 + len(split_mode))
    splits, work = _device_splits(case, 16, 8, split_mode)
    assert splits.cpu().tolist()[2] > 1
    assert mla_stage1_kernel(case["q_nope"], case["q_pe"], case["kv"], 32) == "triton_pairs"
    o, lse = run_fp8(case, 32, splits, 8, kv_scale, work=work)
    check(case, o, lse, torch.bfloat16)
    byte_cfg = MLADecodeConfig(block_h=16, block_n=64, num_warps=4, num_stages=2)
    assert mla_stage1_kernel(case["q_nope"], case["q_pe"], case["kv"], 32, byte_cfg) == "triton"
    o_b, lse_b = run_fp8(case, 32, splits, 8, kv_scale, work=work, config=byte_cfg)
    check(case, o_b, lse_b, torch.bfloat16)
    # the same function up to the bf16 rounding of o (outputs of magnitude ~10 here)
    assert ((o.float() - o_b.float()).norm() / o_b.float().norm()).item() < 5e-3
    torch.testing.assert_close(lse, lse_b, atol=1e-3, rtol=1e-4)


def test_fp8_pairs_config_fallback():
    """``kv_pairs`` needs the Triton kernel's plain pointer loop; where the pairs path does
    not apply (the interpreter, fp32 queries) the byte path runs, with the same results."""
    for bad in (dict(kv_load="tma"), dict(peel_tail=True)):
        with pytest.raises(ValueError, match="kv_pairs"):
            MLADecodeConfig(block_h=16, block_n=32, num_warps=4, num_stages=1, kv_pairs=True, **bad)
    with pytest.raises(ValueError, match="kv_pairs"):
        MLADecodeConfig(block_h=64, block_n=64, num_warps=8, num_stages=2, stage1="seesaw", kv_pairs=True)
    cfg = MLADecodeConfig(block_h=16, block_n=32, num_warps=4, num_stages=1, kv_pairs=True)
    case = make_fp8_case([3, 70, 0], 16, 16, torch.float32, torch.float8_e4m3fn, 0.25, seed=53)
    assert mla_stage1_kernel(case["q_nope"], case["q_pe"], case["kv"], 16, cfg) == "triton"
    o, lse = run_fp8(case, 16, 2, 2, 0.25, config=cfg)
    check(case, o, lse, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_default_kv_scale_leaves_16bit_results_identical(dtype):
    """A 16/32-bit cache: passing kv_scale=1.0 (or any scale: 16-bit entries are the values
    themselves, `RadixAttention.k_scale`'s convention) gives bit-identical results to a call
    without the argument."""
    case = make_case([0, 9, 130, 257], 16, 64, dtype, d_c=D_C, d_r=D_R, seed=41)
    o0, lse0 = run_kernel(case, 64, 3, 4)
    check(case, o0, lse0, dtype)
    for kv_scale in (1.0, 0.37):
        o1, lse1 = run_fp8(case, 64, 3, 4, kv_scale)
        assert torch.equal(o0, o1) and torch.equal(lse0, lse1), kv_scale


def test_kv_scale_and_dtype_errors():
    case = make_fp8_case([10, 20], 16, 64, torch.bfloat16, torch.float8_e4m3fn, 0.1, seed=43)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="kv_scale"):
            run_fp8(case, 64, 2, 2, bad)
    with pytest.raises(ValueError, match="host float"):
        run_fp8(case, 64, 2, 2, torch.tensor(0.1, device=DEVICE))
    # an fp8 query, or a cache of another 8/16-bit dtype than the queries', is refused
    bad = dict(case, q_nope=case["q_nope"].to(torch.float8_e4m3fn), q_pe=case["q_pe"].to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="dtype"):
        run_fp8(bad, 64, 2, 2, 0.1)
    bad = dict(case, kv=case["kv"].view(torch.int8))
    with pytest.raises(ValueError, match="dtype mismatch"):
        run_fp8(bad, 64, 2, 2, 0.1)
    bad = dict(case, kv=case["kv"].to(torch.float16))
    with pytest.raises(ValueError, match="dtype mismatch"):
        run_fp8(bad, 64, 2, 2, 0.1)
