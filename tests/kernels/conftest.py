"""Shared setup of the Triton kernel tests.

Without a GPU the kernels run in Triton's CPU interpreter, which must be chosen before
``triton`` is imported anywhere, hence the environment variable at import time of this
conftest (pytest loads it before the test modules). The ``cuda`` marker is declared in
pyproject.toml.
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def gen(request) -> torch.Generator:
    """CPU generator seeded from the test id: fresh inputs per case, reproducible runs."""
    g = torch.Generator()
    g.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    return g


def build_paged_req_to_token(lens, page_size, gen, extra_rows=2, extra_cols=3):
    """A ``req_to_token`` table whose requests own randomly permuted pages.

    Returns ``(req_to_token int32 [rows, cols], req_pool_indices int32 [bs], num_slots)``;
    each request sits in a random row, its token t lives at slot
    ``page[t // page_size] * page_size + t % page_size`` with pages drawn without
    replacement from a shuffled pool (page 0 is reserved as in the KV pools), so slots are
    non-contiguous across pages. Unused entries hold junk (they must never be read).
    """
    bs = len(lens)
    pages_per_req = [-(-n // page_size) for n in lens]
    num_pages = 1 + sum(pages_per_req) + 3
    pool = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    rows = torch.randperm(bs + extra_rows, generator=gen)[:bs]
    cols = max([1] + list(lens)) + extra_cols
    r2t = torch.randint(0, num_pages * page_size, (bs + extra_rows, cols), generator=gen, dtype=torch.int32)
    for i, n in enumerate(lens):
        pages = [pool.pop() for _ in range(pages_per_req[i])]
        t = torch.arange(n)
        slots = torch.tensor(pages, dtype=torch.int64)[t // page_size] * page_size + t % page_size if n else t
        r2t[rows[i], :n] = slots.to(torch.int32)
    return r2t, rows.to(torch.int32), num_pages * page_size


@pytest.fixture
def paged():
    return build_paged_req_to_token
