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


def test_floor_speedup_is_the_ratio_of_floors_and_below_the_replica_count():
    """`add_speedups` sets ``floor_speedup_vs_dp1`` = dp 1's floor over the dp row's. On a
    1,024-request random workload split round-robin over 4 replicas, each replica's floor is
    more than a quarter of the single engine's (a smaller batch reads the weights once for
    fewer tokens), so equal shares give less than 4x."""
    from attnserve.bench.offline_dp import add_speedups, format_dp_row
    from attnserve.bench.roofline import random_lengths

    isl, osl = random_lengths(1024, 1024, 1024, 0.098, 0)
    one = workload_roofline(RM, isl, osl, RATES["copy_bytes_per_s"], RATES["matmul_flops_per_s"]).roofline_s
    four = replicas_roofline(RM, isl, osl, [i % 4 for i in range(1024)], 4, RATES)
    assert one / 4 < four["roofline_s"] < one
    one_serial = workload_roofline(RM, isl, osl, RATES["copy_bytes_per_s"], RATES["matmul_flops_per_s"]).roofline_serial_s
    each = [workload_roofline(RM, isl[r::4], osl[r::4], RATES["copy_bytes_per_s"], RATES["matmul_flops_per_s"])
            for r in range(4)]
    assert four["roofline_serial_s"] == max(f.roofline_serial_s for f in each)
    # at these rates one engine's ~500-request batches make its linears compute-bound, the replicas' less so:
    # its serial floor exceeds its floor by more than theirs do, so equal serial shares allow more than 4x / floors
    assert one_serial / four["roofline_serial_s"] > one / four["roofline_s"]
    base = {"model": "m", "kv_cache_dtype": "bf16", "dp_size": 1, "output_tokens_per_s": 100.0, "roofline_s": one,
            "roofline_serial_s": one_serial}
    row = {"model": "m", "kv_cache_dtype": "bf16", "dp_size": 4, "output_tokens_per_s": 330.0,
           "roofline_s": four["roofline_s"], "roofline_serial_s": four["roofline_serial_s"], "num_prompts": 1024,
           "random_input_len": 1024,
           "random_output_len": 1024, "random_range_ratio": 0.098, "flags": "", "total_tokens_per_s": 1.0,
           "wall_s": 1.0, "prefill_wall_s": 0.1, "requests_per_replica": [256] * 4, "roofline_share": 0.5}
    no_floor = {**row, "model": "other"}
    add_speedups([base, row, no_floor])
    assert abs(row["speedup_vs_dp1"] - 3.3) < 1e-12
    assert row["floor_speedup_vs_dp1"] == one / four["roofline_s"] and row["floor_speedup_vs_dp1"] < 4
    assert "speedup_vs_dp1" not in no_floor and "floor_speedup_vs_dp1" not in no_floor  # no dp 1 row of its own
    assert row["serial_floor_speedup_vs_dp1"] == one_serial / four["roofline_serial_s"]
    assert "serial_floor_speedup_vs_dp1" not in no_floor
    text = format_dp_row(row)
    assert f"the floors allow {row['floor_speedup_vs_dp1']:.2f}x" in text
    assert f"the serial floors {row['serial_floor_speedup_vs_dp1']:.2f}x" in text
