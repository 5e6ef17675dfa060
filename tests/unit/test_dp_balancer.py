"""The data-parallel routing policy (`attnserve.distributed.dp_balancer.LoadBalancer`):
shortest queue, prefix affinity and its override, dead replicas, round robin, the LRU bound."""

import pytest

from attnserve.distributed.dp_balancer import LoadBalancer, NoLiveReplica, ReplicaLoad


def _loads(*counts, dead=()):
    return [ReplicaLoad(alive=i not in dead, num_requests=n) for i, n in enumerate(counts)]


def _prompt(prefix_id: int, n: int = 80, tail: int = 0):
    """``n`` tokens: a 64-token prefix named by ``prefix_id``, then a tail that differs by ``tail``."""
    return [1000 + prefix_id] * 64 + [tail + j for j in range(n - 64)]


def test_shortest_queue_picks_the_least_loaded_live_replica():
    lb = LoadBalancer(3, "shortest_queue")
    assert lb.select([1, 2, 3], _loads(5, 2, 4)) == 1
    assert lb.select([1, 2, 3], _loads(5, 2, 1, dead=(2,))) == 1
    # ties spread: an idle start does not pile on replica 0
    lb = LoadBalancer(3, "shortest_queue")
    picks = [lb.select([7], _loads(0, 0, 0)) for _ in range(3)]
    assert sorted(picks) == [0, 1, 2]


def test_round_robin_skips_dead_replicas():
    lb = LoadBalancer(3, "round_robin")
    assert [lb.select([1], _loads(0, 0, 0, dead=(1,))) for _ in range(4)] == [0, 2, 0, 2]


def test_requests_sharing_a_prefix_go_to_the_same_replica():
    lb = LoadBalancer(2)
    first = lb.select(_prompt(1, tail=0), _loads(0, 0))
    other = lb.select(_prompt(2, tail=0), _loads(*([1, 0] if first == 0 else [0, 1])))
    assert other != first  # a new prefix goes to the shortest queue
    loads = [0, 0]
    loads[first] = 3  # the prefix's replica is busier, within the thresholds
    for t in range(1, 5):
        assert lb.select(_prompt(1, tail=100 * t), _loads(*loads)) == first
    assert lb.affinity_hits == 4


def test_the_longest_known_prefix_wins():
    lb = LoadBalancer(2, affinity_lengths=(32, 128))
    base = list(range(200))
    a = lb.select(base[:40], _loads(0, 0))  # records the 32-token prefix for replica a
    b = 1 - a
    # a prompt sharing 128+ tokens, sent to b because a was overloaded: b owns the 128 prefix
    loads = [0, 0]
    loads[a] = 50
    assert lb.select(base[:150], _loads(*loads)) == b and lb.affinity_overrides == 1
    # now the 128-token prefix prefers b even though the 32-token one prefers a
    assert lb.select(base[:160], _loads(0, 0)) == b
    # a prompt sharing only the 32-token prefix still prefers a
    assert lb.select(base[:32] + [9999] * 20, _loads(0, 0)) == a


def test_affinity_yields_to_an_overloaded_replica_and_comes_back():
    lb = LoadBalancer(2, balance_abs_threshold=4, balance_rel_threshold=1.5)
    home = lb.select(_prompt(3), _loads(0, 0))
    away = 1 - home
    loads = [0, 0]
    loads[home], loads[away] = 10, 5  # 5 above, but not 1.5x of... 10 > 7.5: overloaded
    assert lb.select(_prompt(3, tail=1), _loads(*loads)) == away
    loads[home], loads[away] = 8, 5  # 3 above: within the absolute threshold
    assert lb.select(_prompt(3, tail=2), _loads(*loads)) == home
    loads[home], loads[away] = 30, 22  # 8 above, but below 1.5x
    assert lb.select(_prompt(3, tail=3), _loads(*loads)) == home


def test_short_prompts_carry_no_affinity():
    lb = LoadBalancer(2)
    assert lb.prefix_keys(list(range(32))) == []  # the prefix must be shorter than the prompt
    assert len(lb.prefix_keys(list(range(33)))) == 1 and len(lb.prefix_keys(list(range(600)))) == 3
    picks = [lb.select([5, 6, 7], _loads(0, 0)) for _ in range(4)]
    assert picks == [0, 1, 0, 1]


def test_a_dead_replica_loses_its_prefixes():
    lb = LoadBalancer(2)
    home = lb.select(_prompt(4), _loads(0, 0))
    dead = (home,)
    other = 1 - home
    assert lb.select(_prompt(4, tail=1), _loads(0, 0, dead=dead)) == other
    # the prefix now belongs to the survivor, even once the first is back
    assert lb.select(_prompt(4, tail=2), _loads(0, 0)) == other
    with pytest.raises(NoLiveReplica):
        lb.select(_prompt(4), _loads(0, 0, dead=(0, 1)))


def test_the_prefix_table_is_bounded():
    lb = LoadBalancer(2, affinity_lengths=(4,), max_entries=3)
    for i in range(10):
        lb.select([i] * 8, _loads(0, 0))
    assert len(lb._prefix_owner) == 3


def test_bad_arguments():
    with pytest.raises(ValueError, match="load-balance-method"):
        LoadBalancer(2, "random")
    with pytest.raises(ValueError):
        LoadBalancer(0)
    with pytest.raises(ValueError, match="replica loads"):
        LoadBalancer(2).select([1], _loads(0))


def test_the_flags_match_the_policy():
    import argparse

    from attnserve.distributed.dp_balancer import LOAD_BALANCE_METHODS
    from attnserve.server_args import ServerArgs

    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    a = p.parse_args(["--dp-size", "2", "--load-balance-method", "round_robin"])
    sa = ServerArgs.from_cli_args(a)
    assert (sa.dp_size, sa.load_balance_method) == (2, "round_robin")
    choices = next(x.choices for x in p._actions if x.dest == "load_balance_method")
    assert tuple(choices) == LOAD_BALANCE_METHODS
    with pytest.raises(ValueError, match="--dp-size"):
        ServerArgs(device="cpu", dp_size=0).check()
    with pytest.raises(ValueError, match="--load-balance-method"):
        ServerArgs(device="cpu", load_balance_method="random").check()
    with pytest.raises(ValueError, match="engine-process"):
        ServerArgs(device="cpu", dp_size=2, engine_process="off").check()
