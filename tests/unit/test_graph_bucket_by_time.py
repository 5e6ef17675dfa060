"""`fastest_bucket_at_or_above`: which captured decode graph a bucket replays, from the graphs'
replay times measured at start-up (the CUDA side runs in tests/gpu/test_engine_gpu.py)."""

import random

import pytest

from attnserve.engine.cuda_graph_runner import REPLAY_MARGIN, fastest_bucket_at_or_above


def test_monotonic_times_keep_every_bucket():
    sizes = [1, 2, 4, 8, 16, 24, 32]
    ms = {b: 1.0 + 0.1 * b for b in sizes}
    assert fastest_bucket_at_or_above(sizes, ms) == {b: b for b in sizes}


def test_a_slow_bucket_moves_to_its_faster_larger_neighbour():
    # the H200's Llama-3-8B layer GEMMs: 442 us at 448 rows, 345 at 464 (gemm_rows_sweep.py)
    sizes = [416, 432, 448, 464, 480]
    ms = {416: 10.1, 432: 10.3, 448: 14.0, 464: 10.9, 480: 11.2}
    assert fastest_bucket_at_or_above(sizes, ms) == {416: 416, 432: 432, 448: 464, 464: 464, 480: 480}


def test_margin_keeps_buckets_within_noise():
    sizes = [8, 16]
    assert fastest_bucket_at_or_above(sizes, {8: 1.00, 16: 0.99}) == {8: 8, 16: 16}
    assert fastest_bucket_at_or_above(sizes, {8: 1.00, 16: 0.99}, margin=0.0) == {8: 16, 16: 16}
    assert fastest_bucket_at_or_above(sizes, {8: 1.00, 16: 1.0 - 2 * REPLAY_MARGIN}) == {8: 16, 16: 16}


def test_the_fastest_of_all_larger_buckets_is_chosen():
    sizes = [8, 16, 24, 32]
    ms = {8: 5.0, 16: 4.0, 24: 3.0, 32: 3.5}
    assert fastest_bucket_at_or_above(sizes, ms) == {8: 24, 16: 24, 24: 24, 32: 32}


@pytest.mark.parametrize("seed", range(5))
def test_choice_is_never_smaller_nor_slower(seed):
    rnd = random.Random(seed)
    sizes = sorted(rnd.sample(range(1, 600), 40))
    ms = {b: rnd.uniform(1.0, 3.0) for b in sizes}
    choice = fastest_bucket_at_or_above(sizes, ms)
    assert set(choice) == set(sizes)
    for b, c in choice.items():
        assert c >= b
        # it is the fastest graph at or above b, and chosen only when clearly faster
        fastest = min((s for s in sizes if s >= b), key=lambda s: (ms[s], s))
        if c != b:
            assert c == fastest and ms[c] < ms[b] * (1 - REPLAY_MARGIN)
        else:
            assert ms[fastest] >= ms[b] * (1 - REPLAY_MARGIN)
