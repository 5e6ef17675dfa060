"""The skew check that keeps a second tensor-parallel engine in one process from hanging."""

from attnserve.distributed.symm_mem_rendezvous import skew_reason


def test_equal_counts_meet():
    assert skew_reason([0, 0, 0, 0]) is None
    assert skew_reason([3, 3]) is None


def test_rank0_ahead_of_fresh_ranks_is_refused_with_the_counts():
    why = skew_reason([1, 0, 0, 0])
    assert why is not None and "[1, 0, 0, 0]" in why and "per process" in why

