"""Index kernels vs a plain Python reference (exact integer results)."""

from __future__ import annotations

import pytest
import torch

from attnserve.attention.triton_ops.kv_indices import (
    block_table_width,
    compute_kv_indptr,
    create_block_kv_indices,
    create_kv_indices,
    create_page_table,
)

POISON = -777


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("with_start", [False, True])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_create_kv_indices(page_size, with_start, idx_dtype, gen, paged, device):
    lens = [0, 1, 5, 17, 600, 33]  # 600 > one copy block of the kernel
    r2t, rows, _ = paged(lens, page_size, gen)
    bs = len(lens)
    seq_lens = torch.tensor(lens, dtype=idx_dtype)
    if with_start:
        start = torch.tensor([torch.randint(0, n + 1, (1,), generator=gen).item() for n in lens], dtype=idx_dtype)
    else:
        start = torch.zeros(bs, dtype=idx_dtype)
    kernel_lens = seq_lens - start
    indptr_ref = [0]
    for n in kernel_lens.tolist():
        indptr_ref.append(indptr_ref[-1] + n)
    total = indptr_ref[-1]

    kv_indptr = compute_kv_indptr(kernel_lens.to(device))
    assert kv_indptr.dtype == torch.int32
    assert kv_indptr.cpu().tolist() == indptr_ref
    kv_indices = torch.full((total + 7,), POISON, dtype=idx_dtype, device=device)
    create_kv_indices(
        r2t.to(device), rows.to(idx_dtype).to(device), kernel_lens.to(device), kv_indptr,
        start.to(device) if with_start else None, kv_indices,
    )
    out = kv_indices.cpu()
    ref = []
    for i in range(bs):
        s = int(start[i])
        ref += r2t[rows[i], s : s + int(kernel_lens[i])].tolist()
    assert out[:total].tolist() == ref
    assert (out[total:] == POISON).all(), "wrote past the end of the CSR array"


def test_compute_kv_indptr_out_buffer(gen, device):
    lens = torch.randint(0, 50, (9,), generator=gen, dtype=torch.int64)
    buf = torch.full((16,), POISON, dtype=torch.int32, device=device)
    got = compute_kv_indptr(lens.to(device), out=buf)
    ref = [0] + torch.cumsum(lens, 0).tolist()
    assert got.shape == (10,) and got.cpu().tolist() == ref
    assert got.data_ptr() == buf.data_ptr()
    assert (buf[10:].cpu() == POISON).all()
    assert compute_kv_indptr(torch.zeros(0, dtype=torch.int32, device=device)).cpu().tolist() == [0]


def _page_table_ref(r2t, rows, lens, page_size, width, pad):
    ref = []
    for i, n in enumerate(lens):
        npages = -(-n // page_size)
        row = [int(r2t[rows[i], j * page_size]) // page_size if j < npages else pad for j in range(width)]
        ref.append(row)
    return ref


@pytest.mark.parametrize("page_size", [1, 4, 16, 64])
@pytest.mark.parametrize("pad_value", [-1, 0])
def test_create_page_table(page_size, pad_value, gen, paged, device):
    lens = [1, page_size, page_size + 1, 3 * page_size - 1, 0, 130]
    r2t, rows, _ = paged(lens, page_size, gen)
    width = max(-(-n // page_size) for n in lens) + 2
    table = torch.full((len(lens), width), POISON, dtype=torch.int32, device=device)
    create_page_table(r2t.to(device), rows.to(device), torch.tensor(lens, device=device), page_size, table, pad_value)
    assert table.cpu().tolist() == _page_table_ref(r2t, rows, lens, page_size, width, pad_value)


@pytest.mark.parametrize("page_size,multiple", [(64, 1), (64, 4), (16, 8), (1, 16)])
def test_block_kv_indices(page_size, multiple, gen, paged, device):
    lens = [3, 200, 64, 1, 129]
    r2t, rows, _ = paged(lens, page_size, gen)
    width = block_table_width(max(lens), page_size, multiple)
    pages = -(-max(lens) // page_size)
    assert width % multiple == 0 and pages <= width < pages + multiple
    table = torch.full((len(lens), width), POISON, dtype=torch.int32, device=device)
    create_block_kv_indices(r2t.to(device), rows.to(device), torch.tensor(lens, dtype=torch.int32, device=device), page_size, table)
    assert table.cpu().tolist() == _page_table_ref(r2t, rows, lens, page_size, width, -1)


def test_block_table_width_values():
    assert block_table_width(0, 64, 4) == 0
    assert block_table_width(1, 64, 4) == 4
    assert block_table_width(64 * 4, 64, 4) == 4
    assert block_table_width(64 * 4 + 1, 64, 4) == 8
    assert block_table_width(1000, 1, 16) == 1008
    with pytest.raises(ValueError):
        block_table_width(10, 0, 1)


def test_argument_errors(device):
    r2t = torch.zeros(4, 8, dtype=torch.int32, device=device)
    rows = torch.zeros(2, dtype=torch.int32, device=device)
    lens = torch.ones(2, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="req_to_token"):
        create_kv_indices(r2t.float(), rows, lens, torch.zeros(3, dtype=torch.int32, device=device), None,
                          torch.zeros(4, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="kv_indptr"):
        create_kv_indices(r2t, rows, lens, torch.zeros(2, dtype=torch.int32, device=device), None,
                          torch.zeros(4, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="same length"):
        create_page_table(r2t, rows, lens[:1], 1, torch.zeros(2, 4, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="page_size"):
        create_page_table(r2t, rows, lens, 0, torch.zeros(2, 4, dtype=torch.int32, device=device))
