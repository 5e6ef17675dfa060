"""MLA decode kernel (`attention/triton_ops/mla_decode.py`) against a float64 reference.

Runs on CPU under the Triton interpreter (small shapes: kv_lora_rank 64 + rope 16) and on
a GPU as is. Every case: fresh random inputs, a paged latent cache reached through a
shuffled block table, NaN in every slot no request owns (so a read past ``seq_lens`` shows
up as NaN), and NaN-poisoned outputs.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402

import pytest  # noqa: E402

from attnserve.attention.triton_ops.mla_common import _merge_tiles  # noqa: E402
from attnserve.attention.triton_ops.mla_decode import (  # noqa: E402
    MLADecodeConfig,
    mla_decode_fwd,
    mla_num_kv_splits,
    mla_num_kv_splits_device,
    mla_num_work_items,
    mla_stage1_kernel,
    mla_workspace_rows,
    mla_workspace_size,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
D_C, D_R = 64, 16  # small kv_lora_rank + qk_rope_head_dim
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _cdiv(a, b):
    return -(-a // b)


def make_case(seq_lens, num_heads, page_size, dtype, *, d_c=D_C, d_r=D_R, spare_pages=3, extra_cols=2, seed=0):
    """Random latent cache in shuffled pages; unowned slots are NaN. Returns a dict."""
    g = torch.Generator().manual_seed(seed)
    bs = len(seq_lens)
    n_blocks = [_cdiv(n, page_size) for n in seq_lens]
    num_pages = 1 + sum(n_blocks) + spare_pages  # page 0 reserved, as in the KV pool
    perm = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
    width = max(1, max(n_blocks)) + extra_cols
    table = torch.full((bs, width), -1, dtype=torch.int32)
    kv = torch.full((num_pages * page_size, 1, d_c + d_r), float("nan"), dtype=dtype)
    rows = []
    it = iter(perm)
    for i, n in enumerate(seq_lens):
        pages = [next(it) for _ in range(n_blocks[i])]
        table[i, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        t = torch.arange(n)
        slots = torch.tensor(pages, dtype=torch.int64)[t // page_size] * page_size + t % page_size if n else t
        lat = torch.randn(n, d_c + d_r, generator=g).to(dtype)
        kv[slots, 0] = lat
        rows.append(lat.double())
    q_nope = torch.randn(bs, num_heads, d_c, generator=g).to(dtype)
    q_pe = torch.randn(bs, num_heads, d_r, generator=g).to(dtype)
    return dict(
        q_nope=q_nope.to(DEVICE), q_pe=q_pe.to(DEVICE), kv=kv.to(DEVICE), table=table.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), rows=rows,
        q_nope64=q_nope.double(), q_pe64=q_pe.double(), sm_scale=1.0 / math.sqrt(d_c + d_r), d_c=d_c,
    )


def reference(case):
    """float64 o [bs, H, d_c] and natural-log lse [bs, H]."""
    d_c = case["d_c"]
    outs, lses = [], []
    for i, lat in enumerate(case["rows"]):
        qn, qp = case["q_nope64"][i], case["q_pe64"][i]
        if lat.shape[0] == 0:
            outs.append(torch.zeros_like(qn))
            lses.append(torch.full((qn.shape[0],), float("-inf"), dtype=torch.float64))
            continue
        s = (qn @ lat[:, :d_c].T + qp @ lat[:, d_c:].T) * case["sm_scale"]
        outs.append(torch.softmax(s, dim=-1) @ lat[:, :d_c])
        lses.append(torch.logsumexp(s, dim=-1))
    return torch.stack(outs), torch.stack(lses)


def run_kernel(case, page_size, num_kv_splits, max_kv_splits, *, config=None, with_lse=True, workspace=None, o=None,
               work=None):
    bs, h, d_c = case["q_nope"].shape
    if o is None:
        o = torch.full((bs, h, d_c), float("nan"), dtype=case["q_nope"].dtype, device=DEVICE)
    lse = torch.full((bs, h), float("nan"), dtype=torch.float32, device=DEVICE) if with_lse else None
    ret = mla_decode_fwd(
        case["q_nope"], case["q_pe"], case["kv"], case["table"], case["seq_lens"], page_size, o,
        case["sm_scale"], num_kv_splits, max_kv_splits, workspace=workspace, lse=lse, config=config, work=work,
    )
    assert ret is o
    return o, lse


def check(case, o, lse, dtype):
    ref_o, ref_lse = reference(case)
    got = o.double().cpu()
    assert not torch.isnan(got).any(), "NaN in output (unwritten or read past seq_lens)"
    err = (got - ref_o).abs().max().item()
    assert err <= TOL[dtype] * max(1.0, ref_o.abs().max().item()), f"max abs err {err}"
    if lse is not None:
        got_lse = lse.double().cpu()
        fin = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(got_lse), fin)
        assert (got_lse[fin] - ref_lse[fin]).abs().max().item() <= max(TOL[dtype], 1e-5) * 10


# ---- split heuristic --------------------------------------------------------------------
@pytest.mark.parametrize(
    "max_seq_len,bs,sm,expected",
    [
        # max_splits, sms_per_batch, split, k_waves -> split
        (16384, 32, 132, 4),   # 128, 4, 4, 32 -> 4
        (1024, 32, 132, 4),    # 8, 4, 4, 2 -> 4
        (1152, 32, 132, 3),    # 9, 4, 4, 3 -> cdiv(9, 3) = 3
        (1280, 32, 132, 4),    # 10, 4, 4, 3 -> cdiv(10, 3) = 4
        (65536, 1, 132, 128),  # 512, 132, 132, 4 -> 128
        (1000, 1, 132, 8),     # 8, 132, 8, 1 -> 8
        (300, 1, 132, 3),      # 3 -> 3
        (4096, 128, 132, 1),   # 32, 1, 1, 32 -> 1
        (4096, 64, 132, 2),    # 32, 2, 2, 16 -> 2
        (4096, 200, 132, 1),   # sms_per_batch clamps at 1
        (1, 8, 132, 1),
        (0, 8, 132, 1),        # empty batch still one split
    ],
)
def test_num_kv_splits_formula(max_seq_len, bs, sm, expected):
    assert mla_num_kv_splits(max_seq_len, bs, sm) == expected


def test_split_sm_count_divides_by_head_tiles():
    from attnserve.attention.triton_ops.mla_decode import mla_split_sm_count

    assert mla_split_sm_count(132, 128) == 66  # two 64-head programs per request and split
    assert mla_split_sm_count(132, 16) == 132 and mla_split_sm_count(132, 64) == 132
    assert mla_split_sm_count(132, 65) == 66 and mla_split_sm_count(1, 128) == 1
    # an fp8 cache of <= 16 heads counts two programs per SM; more heads or 16-bit do not
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        assert mla_split_sm_count(132, 16, fp8) == 264 and mla_split_sm_count(132, 8, fp8) == 264
        assert mla_split_sm_count(132, 32, fp8) == 132 and mla_split_sm_count(132, 128, fp8) == 66
    assert mla_split_sm_count(132, 16, torch.bfloat16) == 132
    assert mla_num_kv_splits(4096, 128, mla_split_sm_count(132, 16, torch.float8_e4m3fn)) == 2
    # DeepSeek-V3 at b32 x 16K on 132 SMs: 2 splits (one wave of 128 programs), not 4
    assert mla_num_kv_splits(16384, 32, mla_split_sm_count(132, 128)) == 2
    assert mla_num_kv_splits(16384, 32, 132) == 4
    with pytest.raises(ValueError):
        mla_split_sm_count(0, 128)


def test_num_kv_splits_rejects_bad_args():
    with pytest.raises(ValueError):
        mla_num_kv_splits(100, 0, 132)
    with pytest.raises(ValueError):
        mla_num_kv_splits(100, 1, 0)


def test_num_kv_splits_device_uniform_matches_host():
    """Equal lengths: the device counts are the CUTLASS heuristic's (`mla_num_kv_splits`)."""
    for n, bs in ((1, 3), (127, 5), (1000, 8), (4096, 32), (16384, 32), (65536, 2), (4096, 200)):
        seq = torch.full((bs,), n, dtype=torch.int32, device=DEVICE)
        for sm, cap in ((66, 32), (132, 64), (132, 3), (20, 64), (1, 8)):
            out = torch.full((bs,), -7, dtype=torch.int32, device=DEVICE)
            got = mla_num_kv_splits_device(seq, sm, cap, out=out)
            assert got is out
            assert got.cpu().tolist() == [min(cap, mla_num_kv_splits(n, bs, sm))] * bs, (n, bs, sm, cap)


def _weighted_splits(lens, sm, cap):
    """The device formula in Python: SMs shared by length, then the CUTLASS wave balancing."""
    total = max(1, sum(lens))
    out = []
    for n in lens:
        share = max(1, sm * n // total)
        max_splits = max(1, _cdiv(n, 128))
        split = min(max_splits, share)
        split = _cdiv(max_splits, _cdiv(max_splits, split))
        out.append(min(cap, split))
    return out


def test_num_kv_splits_device_ragged_shares_sms_by_length():
    lens = [0, 1, 127, 128, 129, 1000, 1152, 4096, 16384, 65536, 300, 777]
    seq = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    for sm, cap in ((132, 64), (132, 3), (20, 64), (1, 8)):
        got = mla_num_kv_splits_device(seq, sm, cap).cpu().tolist()
        assert got == _weighted_splits(lens, sm, cap), (sm, cap)
    # one long request among short ones (66 SMs a head tile): 22 splits of 6 pairs for the
    # 16K request instead of the batch's 2 (CUTLASS: 66 // 32)
    seq = torch.tensor([16384] + [1024] * 31, dtype=torch.int32, device=DEVICE)
    got = mla_num_kv_splits_device(seq, 66, 32).cpu().tolist()
    assert got == [22] + [1] * 31
    assert mla_num_kv_splits(16384, 32, 66) == 2


@pytest.mark.parametrize("seed", range(7))
def test_work_list_holds_every_split_once(seed):
    g = torch.Generator().manual_seed(seed)
    bs = int(torch.randint(1, 300, (1,), generator=g)) if seed < 6 else 1100  # 1100: two 1024-request chunks
    lens = torch.randint(0, 40000, (bs,), generator=g)
    lens[torch.rand(bs, generator=g) < 0.2] = 0
    sm, cap = (66, 132, 7, 1)[seed % 4], (32, 8, 64, 1)[seed % 4]
    n_work = mla_num_work_items(bs, sm, cap)
    work = torch.full((n_work + 5,), -9, dtype=torch.int32, device=DEVICE)
    splits = mla_num_kv_splits_device(lens.to(torch.int32).to(DEVICE), sm, cap, work=work).cpu().tolist()
    want = [b * 256 + s for b in range(bs) for s in range(splits[b])]
    assert len(want) <= n_work  # the bound holds
    assert work.cpu().tolist() == want + [-1] * (n_work + 5 - len(want))


def test_work_list_errors():
    seq = torch.tensor([10, 20], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="work"):
        mla_num_kv_splits_device(seq, 66, 32, work=torch.empty(3, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="max_kv_splits <= 256"):
        mla_num_kv_splits_device(seq, 600, 300, work=torch.empty(600, dtype=torch.int32, device=DEVICE))


# ---- kernel vs reference ----------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("split_mode", ["int", "device", "work"])
def test_decode_matches_reference(dtype, page_size, split_mode):
    lens = [1, 17, 64, 130, 257]  # ragged; one-token, page-edge and multi-split requests
    case = make_case(lens, 16, page_size, dtype, seed=page_size * 10 + (dtype == torch.float16) * 3 + (split_mode == "int"))
    max_kv_splits = 4
    work = None
    if split_mode == "int":
        splits = 3
    else:
        if split_mode == "work":  # one program per (request, split) entry; 12 of the 20 entries unused
            work = torch.empty(mla_num_work_items(len(lens), 20, max_kv_splits), dtype=torch.int32, device=DEVICE)
        splits = mla_num_kv_splits_device(case["seq_lens"], 20, max_kv_splits, work=work)  # 20 SMs by length
        assert splits.cpu().tolist() == [1, 1, 1, 2, 3]
    o, lse = run_kernel(case, page_size, splits, max_kv_splits, work=work)
    check(case, o, lse, dtype)


@pytest.mark.parametrize(
    "page_size,cfg",
    [
        (16, MLADecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=1)),  # one page per tile
        (64, MLADecodeConfig(block_h=32, block_n=64, num_warps=4, num_stages=1)),  # head tile > H
        (1, MLADecodeConfig(block_h=16, block_n=64, num_warps=4, num_stages=1)),
    ],
)
def test_decode_tile_configs(page_size, cfg):
    lens = [5, 70, 200]
    case = make_case(lens, 20, page_size, torch.float32, seed=page_size + cfg.block_n)  # 20 heads: ragged head tiles
    o, lse = run_kernel(case, page_size, 4, 4, config=cfg)
    check(case, o, lse, torch.float32)


def test_decode_bf16_and_non_pow2_dims():
    # bf16 loads (interpreter: cast to fp32 in the kernel); kv_lora_rank 48, rope 8 are padded
    case = make_case([33, 90], 16, 16, torch.bfloat16, d_c=48, d_r=8, seed=7)
    o, lse = run_kernel(case, 16, 2, 2)
    check(case, o, lse, torch.bfloat16)


def test_decode_empty_request_and_no_lse():
    case = make_case([0, 40, 0, 3], 16, 16, torch.float32, seed=11)
    o, _ = run_kernel(case, 16, 2, 2, with_lse=False)
    check(case, o, None, torch.float32)
    o, lse = run_kernel(case, 16, 2, 2)
    assert torch.isneginf(lse[0].cpu()).all() and (o[0] == 0).all()
    check(case, o, lse, torch.float32)


@pytest.mark.parametrize("max_kv_splits,d_c", [(16, 512), (32, 256), (32, 200)])
def test_decode_many_splits_merge(max_kv_splits, d_c):
    """16 / 32 splits a request: the merge loads all split rows of a column block in one step
    and several programs share a row (512 columns in 256-column blocks, 256 / 200 in 128-column
    blocks, the last one masked; `_merge_tiles`). Ragged split counts: 32 (1000 tokens in
    32-token tiles), 10, 1 and an empty request."""
    case = make_case([0, 5, 300, 1000], 16, 16, torch.float32, d_c=d_c, seed=max_kv_splits + d_c)
    o, lse = run_kernel(case, 16, max_kv_splits, max_kv_splits)
    check(case, o, lse, torch.float32)


def test_decode_work_list_long_request_loops_merge_chunks():
    """A work list sized for 8 requests on 16 SMs (24 entries): the merge tiles are picked for
    the uniform count (2 splits), so the long request's 8 splits are merged in 4 steps."""
    lens = [1000, 5, 40, 0, 17, 64, 3, 90]
    case = make_case(lens, 16, 16, torch.float16, seed=31)
    work = torch.empty(mla_num_work_items(len(lens), 16, 32), dtype=torch.int32, device=DEVICE)
    assert work.numel() == 24
    splits = mla_num_kv_splits_device(case["seq_lens"], 16, 32, work=work)
    assert splits.cpu().tolist() == [8, 1, 1, 1, 1, 1, 1, 1]
    o, lse = run_kernel(case, 16, splits, 32, work=work)
    assert (o[3] == 0).all() and torch.isneginf(lse[3].cpu()).all()
    check(case, o, lse, torch.float16)


def test_merge_tiles_keep_32_registers_a_thread():
    assert _merge_tiles(512, 2) == (512, 2)
    assert _merge_tiles(512, 8) == (512, 8)
    assert _merge_tiles(512, 16) == (256, 16)
    assert _merge_tiles(512, 32) == (128, 32)
    assert _merge_tiles(512, 64) == (128, 32)  # more splits: several steps
    assert _merge_tiles(64, 32) == (64, 32)  # never wider than the padded row


@pytest.mark.parametrize("variant", [None, "tma_n32"])
def test_decode_strided_q_and_o_and_shared_workspace(variant):
    """q_nope/q_pe as slices of one [bs, H, 80] tensor, o a slice of a wider buffer, and a
    workspace sized for a larger batch and more splits than used (original kernel, and the
    TMA variant with its peeled loop)."""
    case = make_case([50, 9, 300], 16, 16, torch.float16, seed=5)
    bs, h = 3, 16
    q = torch.cat([case["q_nope"], case["q_pe"]], dim=-1)
    case["q_nope"], case["q_pe"] = q[..., :D_C], q[..., D_C:]
    big = torch.full((bs, h, D_C + 32), float("nan"), dtype=torch.float16, device=DEVICE)
    o = big[..., 16 : 16 + D_C]
    ws = torch.empty(mla_workspace_size(4096, 8, 8, h, D_C), dtype=torch.uint8, device=DEVICE)
    o, lse = run_kernel(case, 16, 3, 3, workspace=ws, o=o, config=variant and _variant(variant))
    check(case, o, lse, torch.float16)
    assert torch.isnan(big[..., :16]).all() and torch.isnan(big[..., 16 + D_C :]).all()


def test_workspace_size_and_errors():
    assert mla_workspace_size(1024, 2, 4, 16, 512) == 4 * 2 * 16 * 4 * 513
    with pytest.raises(ValueError):
        mla_workspace_size(1024, 0, 4, 16, 512)
    case = make_case([10, 20], 16, 16, torch.float32, seed=3)
    small = torch.empty(mla_workspace_size(0, 2, 4, 16, D_C) - 4, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match="workspace"):
        run_kernel(case, 16, 4, 4, workspace=small)
    with pytest.raises(ValueError, match="num_kv_splits"):
        run_kernel(case, 16, 5, 4)
    bad = dict(case, q_pe=case["q_pe"][:, :8])
    with pytest.raises(ValueError, match="q_pe"):
        run_kernel(bad, 16, 2, 4)
    bad = dict(case, table=case["table"].long())
    with pytest.raises(ValueError, match="block_kv_indices"):
        run_kernel(bad, 16, 2, 4)
    empty = {k: (v[:0] if torch.is_tensor(v) and k != "kv" else v) for k, v in case.items()}
    with pytest.raises(ValueError, match="bs must be >= 1"):  # an empty batch is refused
        run_kernel(empty, 16, 2, 4)


@pytest.mark.parametrize(
    "max_bs,num_sms,num_heads,max_kv_splits,deterministic,expected",
    [
        # 128 heads on 132 SMs: 66 SMs a head tile; below 34 requests the work list (stride 32),
        # at 33 requests 33 x 32 rows; from 34 on one split (grid 1, no list)
        (1024, 132, 128, 32, False, 33 * 32),
        (20, 132, 128, 32, False, 20 * 32),
        (1024, 132, 128, 32, True, 1024 * 32),  # deterministic: the grid is always max_kv_splits
        # max_kv_splits past the work-list span, no list: grid x requests 128 x 1, 64 x 2, 32 x 3, ..., 2 x 33
        (100, 132, 128, 300, False, 128),
        (6, 8, 16, 4, False, 16),  # 8 SMs: 4 requests x 4 splits on the work list
    ],
)
def test_workspace_rows_values(max_bs, num_sms, num_heads, max_kv_splits, deterministic, expected):
    assert mla_workspace_rows(max_bs, num_sms, num_heads, max_kv_splits, deterministic) == expected


def test_workspace_rows_match_the_backend_launches():
    """The rows equal what the `triton_mla` backend sizes its workspace for, brute force over
    the batch sizes it launches with (its split stride per batch size)."""
    from attnserve.attention.mla_triton import MLASplitPolicy

    for sms, heads, cap in ((132, 128, 32), (78, 128, 32), (132, 16, 32), (64, 8, 64), (132, 128, 300), (7, 192, 1)):
        for deterministic in (False, True):
            for kv_dtype in (None, torch.float8_e4m3fn):
                policy = MLASplitPolicy(sms, heads, cap, deterministic, kv_dtype)
                for max_bs in (1, 2, 33, 34, 200):
                    assert mla_workspace_rows(max_bs, sms, heads, cap, deterministic, kv_dtype) == max(
                        bs * policy.split_stride(bs) for bs in range(1, max_bs + 1)), (
                        sms, heads, cap, deterministic, kv_dtype, max_bs)
    with pytest.raises(ValueError, match="max_bs"):
        mla_workspace_rows(0, 132, 128, 32, False)


def test_workspace_rows_hold_the_largest_launch():
    """8 SMs, 16 heads, 4 splits, up to 6 requests: the largest launch is 4 requests over a
    work list with stride 4 (16 rows). A workspace of exactly those rows runs it; a byte less
    is refused."""
    rows = mla_workspace_rows(6, 8, 16, 4, False)
    assert rows == 16
    case = make_case([70, 5, 33, 0], 16, 16, torch.float32, seed=19)
    work = torch.empty(mla_num_work_items(4, 8, 4), dtype=torch.int32, device=DEVICE)
    splits = mla_num_kv_splits_device(case["seq_lens"], 8, 4, work=work)
    nbytes = mla_workspace_size(0, rows, 1, 16, D_C)
    with pytest.raises(ValueError, match="workspace"):
        run_kernel(case, 16, splits, 4, work=work, workspace=torch.empty(nbytes - 1, dtype=torch.uint8, device=DEVICE))
    o, lse = run_kernel(case, 16, splits, 4, work=work, workspace=torch.empty(nbytes, dtype=torch.uint8, device=DEVICE))
    check(case, o, lse, torch.float32)


# ---- opt-in kernel variants (MLADecodeConfig variant fields -> the PEEL loop of stage 1) ----
# Under the interpreter the TMA mode runs through Triton's emulation of host tensor
# descriptors, so its indexing (row page*page_size + offset, zero-filled columns past
# kv_lora_rank / rope) is checked here; pipelining is GPU-only (tests/gpu).
_VAR_BASE = dict(block_h=16, block_n=16, num_warps=4, num_stages=1)
VARIANTS = {
    "peel": dict(peel_tail=True),
    "tma": dict(kv_load="tma"),
    "tma_n32": dict(kv_load="tma", block_n=32),
}


def _variant(name, **over):
    kw = dict(_VAR_BASE)
    kw.update(VARIANTS[name])
    kw.update(over)
    return MLADecodeConfig(**kw)


def test_variant_config_fields():
    base = MLADecodeConfig(block_h=64, block_n=64, num_warps=8, num_stages=2)
    assert not base.is_variant  # defaults keep the original kernel
    for name in VARIANTS:
        assert _variant(name).is_variant, name
    with pytest.raises(ValueError, match="kv_load"):
        MLADecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=1, kv_load="tma_device")
    with pytest.raises(ValueError, match="gluon"):
        MLADecodeConfig(block_h=32, block_n=64, num_warps=8, num_stages=2, stage1="gluon")
    with pytest.raises(ValueError, match="num_stages >= 2"):
        MLADecodeConfig(block_h=64, block_n=64, num_warps=8, num_stages=1, stage1="gluon")
    with pytest.raises(ValueError, match="seesaw"):
        MLADecodeConfig(block_h=32, block_n=64, num_warps=8, num_stages=2, stage1="seesaw")
    with pytest.raises(ValueError, match="stage1 must be one of"):
        MLADecodeConfig(block_h=64, block_n=64, num_warps=8, num_stages=2, stage1="gluon_and_seesaw")
    MLADecodeConfig(block_h=16, block_n=64, num_warps=4, num_stages=4, stage1="transposed")
    for bad in ((64, 64, 8, 2), (16, 64, 4, 3), (16, 32, 4, 2), (16, 64, 8, 2)):
        with pytest.raises(ValueError, match="transposed"):
            MLADecodeConfig(block_h=bad[0], block_n=bad[1], num_warps=bad[2], num_stages=bad[3], stage1="transposed")


@pytest.mark.parametrize("kernel", ["gluon", "seesaw"])
def test_gluon_config_falls_back_off_sm90(kernel):
    """The many-heads default asks for the seesaw Gluon stage 1; off an sm_90 GPU (here: the
    CPU / interpreter) neither Gluon kernel applies and the Triton kernel gives the reference
    result."""
    from attnserve.attention.triton_ops.mla_decode import mla_decode_config, mla_gluon_applicable

    cfg = mla_decode_config(128, 512, 64, torch.bfloat16)
    assert cfg.stage1 == "seesaw" and cfg.block_h == 64 and cfg.num_warps == 8
    rows = torch.zeros(128, 576, dtype=torch.bfloat16)
    q_nope, q_pe = torch.zeros(1, 128, 512, dtype=torch.bfloat16), torch.zeros(1, 128, 64, dtype=torch.bfloat16)
    assert not mla_gluon_applicable(q_nope, q_pe, rows, 64, 64)  # CPU tensors
    gcfg = MLADecodeConfig(block_h=64, block_n=16, num_warps=8, num_stages=2, stage1=kernel)
    case = make_case([0, 1, 40, 70], 20, 16, torch.float32, seed=77)
    o, lse = run_kernel(case, 16, 2, 2, config=gcfg)
    check(case, o, lse, torch.float32)


def test_stage1_kernel_names_what_runs():
    """Off sm_90 the Gluon choices fall back to the Triton kernel; TMA loads where the pages
    hold whole tiles, pointer loads elsewhere."""
    case = make_case([10], 16, 16, torch.float32, seed=2)
    q_nope, q_pe, kv = case["q_nope"], case["q_pe"], case["kv"]
    assert mla_stage1_kernel(q_nope, q_pe, kv, 16) == "triton"  # the interpreter's default config
    assert mla_stage1_kernel(q_nope, q_pe, kv, 16, _variant("tma")) == "tma"
    assert mla_stage1_kernel(q_nope, q_pe, kv, 1, _variant("tma")) == "triton"  # a tile spans pages
    assert mla_stage1_kernel(q_nope, q_pe, kv, 16, _variant("peel")) == "triton"
    seesaw = MLADecodeConfig(block_h=64, block_n=16, num_warps=8, num_stages=2, kv_load="tma", stage1="seesaw")
    assert mla_stage1_kernel(q_nope, q_pe, kv, 16, seesaw) == "tma"
    with pytest.raises(ValueError, match="kv_buffer"):
        mla_stage1_kernel(q_nope, q_pe, kv[..., :-1], 16)


def test_tma_applicable():
    from attnserve.attention.triton_ops.mla_decode import mla_tma_applicable

    rows = torch.zeros(256, D_C + D_R, dtype=torch.float16)
    assert mla_tma_applicable(rows, D_C, 64, 64) and mla_tma_applicable(rows, D_C, 64, 16)
    assert not mla_tma_applicable(rows, D_C, 1, 16)  # a tile spans pages
    assert not mla_tma_applicable(rows, D_C, 16, 32)
    assert not mla_tma_applicable(torch.zeros(256, 60, dtype=torch.float16), 52, 16, 16)  # row stride 120 B
    assert not mla_tma_applicable(rows[:, 4:], D_C - 4, 16, 16)  # base not 16-byte aligned


# page 1: the TMA mode falls back to pointer gathers (a tile spans pages); the pointer-only
# variant covers the per-row page lookup without masks
_VARIANT_CASES = [(n, p) for n in VARIANTS for p in (16, 64)] + [(n, 1) for n in ("peel", "tma")]


@pytest.mark.parametrize("name,page_size", _VARIANT_CASES)
def test_variant_matches_reference(name, page_size):
    # ragged lengths: empty, one token, tile / page edges, a tail tile, several splits
    lens = [0, 1, 17, 64, 130, 257]
    case = make_case(lens, 20, page_size, torch.float32, seed=page_size + 31 * len(name))  # 20 heads: ragged tiles
    o, lse = run_kernel(case, page_size, 3, 4, config=_variant(name))
    check(case, o, lse, torch.float32)
    assert (o[0] == 0).all() and torch.isneginf(lse[0].cpu()).all()


@pytest.mark.parametrize("name", ["tma", "peel"])
def test_variant_device_splits_fp16(name):
    lens = [40, 0, 300, 16]
    case = make_case(lens, 16, 16, torch.float16, seed=41)
    splits = mla_num_kv_splits_device(case["seq_lens"], 8, 4)  # 2 SMs per request
    o, lse = run_kernel(case, 16, splits, 4, config=_variant(name))
    check(case, o, lse, torch.float16)


def test_variant_tma_padded_dims_bf16():
    # kv_lora_rank 48 / rope 8: the descriptors' shapes cut the boxes, the padding is zero
    case = make_case([33, 90, 64], 16, 16, torch.bfloat16, d_c=48, d_r=8, seed=43)
    o, lse = run_kernel(case, 16, 2, 2, config=_variant("tma"))
    check(case, o, lse, torch.bfloat16)


def test_tile_override_parsing(monkeypatch):
    """``ATTNSERVE_MLA_DECODE_TILE`` (engine A/B runs): four integers, or a clear error."""
    from attnserve.attention.triton_ops.mla_decode import MLA_DECODE_TILE_ENV, mla_tile_override

    monkeypatch.delenv(MLA_DECODE_TILE_ENV, raising=False)
    assert mla_tile_override() is None
    monkeypatch.setenv(MLA_DECODE_TILE_ENV, " 16, 32,4,5 ")
    cfg = mla_tile_override()
    assert (cfg.block_h, cfg.block_n, cfg.num_warps, cfg.num_stages) == (16, 32, 4, 5)
    for bad in ("16,32,4", "16,24,4,5", "8,32,4,5", "16,32,x,5", "16,32,0,5"):
        monkeypatch.setenv(MLA_DECODE_TILE_ENV, bad)
        with pytest.raises(ValueError, match=MLA_DECODE_TILE_ENV):
            mla_tile_override()
