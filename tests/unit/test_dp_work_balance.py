"""Balancing data-parallel replicas by work (`attnserve.distributed.dp_request_cost`,
`LoadBalancer` with ``outstanding_work``, `LoadBalancer.select_many`): the request cost is
the request's share of the roofline floor; on bench.offline's random workload the slowest
of four replicas' floors comes within 0.5 % of the mean (256 requests each in turn: 3 %);
affinity holds within its bound in work; a client's outstanding work falls as requests end."""

import dataclasses
import multiprocessing
import random

import numpy as np
import pytest

from attnserve.bench.roofline import RooflineModel, random_lengths, workload_roofline
from attnserve.distributed.dp_balancer import LoadBalancer, ReplicaLoad
from attnserve.distributed.dp_request_cost import RequestCost

# the Llama-3-8B shape (input embedding left out), bf16 KV; nominal H100 rates
LLAMA = RooflineModel(params=7_504_924_672, weight_bytes=15_009_849_344, num_layers=32, num_q_heads=32,
                      head_dim=128, kv_bytes_per_token=131072)
BW, F = 3.0e12, 7.0e14


def _floors(ranks, isl, osl, dp):
    return [workload_roofline(LLAMA, [isl[i] for i, r in enumerate(ranks) if r == d],
                              [osl[i] for i, r in enumerate(ranks) if r == d], BW, F).roofline_s for d in range(dp)]


def test_the_cost_is_the_requests_share_of_the_floor():
    cost = RequestCost.from_roofline_facts(dataclasses.asdict(LLAMA), BW, F)
    # a workload's floor is the weights' per-step reads plus the sum of its requests' costs
    # (all steps memory-bound here: 1,000-token contexts)
    isl, osl = [900, 700, 1000], [300, 500, 120]
    floor = workload_roofline(LLAMA, isl, osl, BW, F)
    weights = floor.decode_steps * LLAMA.weight_bytes / BW
    assert floor.roofline_s == pytest.approx(weights + sum(cost(i, o) for i, o in zip(isl, osl)), rel=1e-9)
    assert RequestCost.from_roofline_facts(None)(10, 5) == RequestCost.tokens()(10, 5) == 15
    # an open-ended limit (the rest of a 40k context) counts as output_cap tokens
    assert cost.output_cap == 4096 and cost(100, 40_000) == cost(100, 4096) > cost(100, 4095)
    with pytest.raises(ValueError):
        RequestCost.from_roofline_facts(dataclasses.asdict(LLAMA), 0.0, F)


def test_lpt_balances_the_random_workload_within_half_a_percent():
    dp = 4
    isl, osl = random_lengths(1024, 1024, 1024, 0.098, 0)  # bench.offline's dp workload
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 128256) for _ in range(n)] for n in isl]
    cost = RequestCost.from_roofline_facts(dataclasses.asdict(LLAMA), BW, F)
    ranks = LoadBalancer(dp).select_many(prompts, [cost(i, o) for i, o in zip(isl, osl)], [ReplicaLoad(True)] * dp)
    by_work = _floors(ranks, isl, osl, dp)
    by_turn = _floors([i % dp for i in range(len(isl))], isl, osl, dp)  # equal counts, as before
    assert max(by_work) / np.mean(by_work) < 1.005, by_work
    assert max(by_turn) / np.mean(by_turn) > 1.02, by_turn
    assert max(by_work) < max(by_turn)


def test_select_many_goes_costliest_first_to_the_least_loaded():
    lb = LoadBalancer(2, "shortest_queue")
    # LPT on [5, 4, 3, 3, 3] over 2 replicas: 5 | 4, then 3 -> the 4, 3 -> the 5, 3 -> the 7
    costs = [3.0, 5.0, 3.0, 4.0, 3.0]
    ranks = lb.select_many([[k] for k in range(5)], costs, [ReplicaLoad(True)] * 2)
    work = [sum(c for c, r in zip(costs, ranks) if r == d) for d in range(2)]
    assert sorted(work) == [8.0, 10.0] and ranks[1] != ranks[3]
    # existing load counts: a replica already busy gets the batch's first placements elsewhere
    ranks = lb.select_many([[1], [2]], [1.0, 1.0], [ReplicaLoad(True, 3, 10.0), ReplicaLoad(True, 0, 0.0)])
    assert ranks == [1, 1]
    with pytest.raises(ValueError, match="costs"):
        lb.select_many([[1]], [], [ReplicaLoad(True)] * 2)


def test_work_not_count_decides_the_shortest_queue():
    lb = LoadBalancer(2, "shortest_queue")
    assert lb.select([1], [ReplicaLoad(True, 1, 900.0), ReplicaLoad(True, 5, 100.0)]) == 1
    assert lb.select([1], [ReplicaLoad(True, 5, 100.0), ReplicaLoad(True, 1, 900.0)]) == 0


def test_affinity_holds_within_the_work_bound_and_yields_beyond():
    lb = LoadBalancer(2, balance_abs_threshold=2, balance_rel_threshold=1.5)
    prefix = list(range(100, 164))
    home = lb.select(prefix + [1], [ReplicaLoad(True)] * 2)
    away = 1 - home

    def loads(home_work, away_work, n=4):
        ld = [None, None]
        ld[home], ld[away] = ReplicaLoad(True, n, home_work), ReplicaLoad(True, n, away_work)
        return ld

    # mean request = (w_home + w_away) / 8; home over by less than 2 of them: affinity holds
    assert lb.select(prefix + [2], loads(90.0, 60.0)) == home  # 30 < 2 * 18.75
    # over by more than 2 mean requests and more than 1.5x: it yields
    assert lb.select(prefix + [3], loads(300.0, 20.0)) == away  # 280 > 2 * 40, 300 > 30
    assert lb.affinity_hits == 1 and lb.affinity_overrides == 1
    # far over in requests but not in work: affinity holds (work is what is balanced)
    ld = [None, None]
    ld[home], ld[away] = ReplicaLoad(True, 40, 50.0), ReplicaLoad(True, 1, 50.0)
    assert lb.select(prefix + [4], ld) == home


class _Stream:
    def __init__(self):
        self.events = []

    def put(self, ev):
        self.events.append(ev)

    push = put


class _Proc:
    pid = None
    exitcode = None

    def is_alive(self):
        return True


def test_a_clients_outstanding_work_falls_as_requests_end():
    from attnserve.engine.sampling_params import SamplingParams
    from attnserve.server.engine_client import EngineClient
    from attnserve.server.engine_loop import EngineError, StreamEvent, SubmitCommand

    ours, theirs = multiprocessing.Pipe()
    try:
        client = EngineClient(_Proc(), ours)
        sp = SamplingParams(max_new_tokens=4)
        cmds = [SubmitCommand(f"r{k}", [1, 2, 3], sp, _Stream()) for k in range(3)]
        for cmd, cost in zip(cmds, (5.0, 7.0, 11.0)):
            client.submit(cmd, cost)
        assert client.outstanding_work == 23.0 and client.num_in_flight == 3
        client._on_event(0.0, "r1", StreamEvent(completion_tokens=4, prompt_tokens=3, finish_reason="length"))
        assert client.outstanding_work == 16.0 and client.num_in_flight == 2
        client._on_tokens(0.0, "r0", [7, 8], 4, "length")
        assert client.outstanding_work == 11.0
        client._close(EngineError(503, "gone", "server_error", "engine_dead"))
        assert client.outstanding_work == 0.0 and client.num_in_flight == 0
        assert cmds[2].stream.events[-1].error is not None
    finally:
        ours.close()
        theirs.close()


class _FakeClient:
    def __init__(self, rank):
        self.dp_rank, self.thread_id, self.process, self.on_closed = rank, 1, _Proc(), None
        self.sent = []
        self.outstanding_work = 0.0

    def is_alive(self):
        return True

    @property
    def num_in_flight(self):
        return len(self.sent)

    def submit(self, cmd, cost=0.0):
        self.sent.append(cmd.rid)
        self.outstanding_work += cost


def test_the_controller_places_a_batch_by_work_and_sends_it_in_order():
    from attnserve.engine.sampling_params import SamplingParams
    from attnserve.server.data_parallel import DataParallelController
    from attnserve.server.engine_loop import SubmitCommand

    clients = [_FakeClient(0), _FakeClient(1)]
    ctl = DataParallelController(clients, LoadBalancer(2), request_cost=RequestCost.tokens())
    lens = [(10, 500), (10, 10), (10, 10), (10, 10), (10, 10), (10, 400)]  # costs 510, 20 x 4, 410
    cmds = [SubmitCommand(f"r{k}", [k] * i, SamplingParams(max_new_tokens=o), _Stream())
            for k, (i, o) in enumerate(lens)]
    ranks = ctl.submit_many(cmds)
    assert ranks[0] != ranks[5]  # the two long ones apart
    assert sorted(c.outstanding_work for c in clients) == [490.0, 510.0]
    for c in clients:  # each replica gets its requests in the batch's order
        assert c.sent == sorted(c.sent, key=lambda rid: int(rid[1:]))
    assert ctl.routed == [ranks.count(0), ranks.count(1)]
    assert [ld.outstanding_work for ld in ctl.loads()] == [c.outstanding_work for c in clients]
