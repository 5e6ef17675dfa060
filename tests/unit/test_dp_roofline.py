"""The floor of data-parallel replicas: the slowest replica's share of the workload."""

from attnserve.bench.offline_dp import replicas_roofline
from attnserve.bench.roofline import RooflineModel, workload_roofline

RM = RooflineModel(params=8_000_000_000, weight_bytes=16_000_000_000, num_layers=32, num_q_heads=32, head_dim=128,
                   kv_bytes_per_token=131072)
RATES = {"copy_bytes_per_s": 3.0e12, "matmul_flops_per_s": 7.0e14}


def test_the_slowest_replica_sets_the_floor():
    isl, osl = [100, 900, 300, 800, 50], [10, 500, 20, 400, 30]
    ranks = [0, 1, 0, 1, 2]
    res = replicas_roofline(RM, isl, osl, ranks, 4, RATES)
    each = [workload_roofline(RM, [isl[i] for i in range(5) if ranks[i] == r], [osl[i] for i in range(5)
                              if ranks[i] == r], RATES["copy_bytes_per_s"], RATES["matmul_flops_per_s"]).roofline_s
            for r in range(3)]
    assert res["replica_roofline_s"] == each + [None]  # replica 3 took nothing
    assert res["roofline_s"] == max(each) == each[1]  # the long requests went to replica 1
    whole = workload_roofline(RM, isl, osl, RATES["copy_bytes_per_s"], RATES["matmul_flops_per_s"]).roofline_s
    assert res["roofline_s"] < whole  # replicas in parallel beat one engine doing everything


def test_no_rates_no_floor():
    assert replicas_roofline(RM, [10], [10], [0], 1, {}) is None
