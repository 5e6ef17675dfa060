"""`attnserve.models.layers.l2_prefetch.l2_prefetch_lines`: the L2 hint's size, by hand."""

from __future__ import annotations

import pytest

from attnserve.models.layers.l2_prefetch import PREFETCH_ENV, l2_prefetch_budget, l2_prefetch_lines

MB = 1 << 20


def test_tp4_shards_at_16_mib():
    # qkv shard 1536 x 4096 bf16: 16 MiB / (1536 * 128 B) = 85.3 lines a row -> 64; the row's
    # 8 KB after a 512-column first tile is 56 lines, covered by 64: the whole shard (12 MiB)
    assert l2_prefetch_lines(1536, 4096, 2, 512, 16 * MB) == 64
    # gate_up shard 7168 x 4096: 16 MiB / (7168 * 128) = 18.3 -> 16 lines (2 KB of each 8 KB row)
    assert l2_prefetch_lines(7168, 4096, 2, 512, 16 * MB) == 16
    # o shard 4096 x 1024: 32 lines fit, the 1 KB after a 512-column tile is 8 lines -> 8
    assert l2_prefetch_lines(4096, 1024, 2, 512, 16 * MB) == 8
    # FP8 rows are half the bytes: 4096 x 14336 at 1 byte, 3584-column tile -> (10752 B) 84 lines
    # after it, covered by 128; 16 MiB / (4096 * 128) = 32
    assert l2_prefetch_lines(4096, 14336, 1, 3584, 16 * MB) == 32


def test_nothing_to_hint():
    assert l2_prefetch_lines(1536, 4096, 2, 512, 0) == 0  # off
    assert l2_prefetch_lines(128256, 4096, 2, 512, 8 * MB) == 0  # less than a line a row
    assert l2_prefetch_lines(576, 512, 2, 512, 16 * MB) == 0  # the first tile is the whole row
    with pytest.raises(ValueError):
        l2_prefetch_lines(0, 4096, 2, 512, MB)


def test_budget_from_the_environment(monkeypatch):
    monkeypatch.setenv(PREFETCH_ENV, "1.5")
    assert l2_prefetch_budget() == 3 * MB // 2
    # 1.5 MiB / (1024 * 128) = 12 -> 8
    assert l2_prefetch_lines(1024, 4096, 2, 512) == 8
    monkeypatch.setenv(PREFETCH_ENV, "-1")
    with pytest.raises(ValueError, match=PREFETCH_ENV):
        l2_prefetch_budget()
