"""``bench.offline --dataset random --dp-size 2`` on CPU (`attnserve.bench.offline_dp.bench_random_dp`):
two engine processes of the tiny dummy Qwen3 shape take a random batch through
`DataParallelLLM.generate` (placed by work, costliest first: `DataParallelController.submit_many`)
and the row reports every token, both replicas' requests, finish times and floors."""

import pytest

pytest.importorskip("fastapi")

from attnserve.bench.offline_dp import bench_random_dp  # noqa: E402
from attnserve.bench.roofline import random_lengths  # noqa: E402

RATES = {"copy_bytes_per_s": 3.0e12, "matmul_flops_per_s": 7.0e14}  # nominal: the floor's arithmetic only


def test_dp2_random_batch_on_cpu_replicas():
    n, isl_max, osl_max = 24, 48, 6
    row = bench_random_dp("qwen3-tiny", n, isl_max, osl_max, 0.1, 0, dp_size=2, load_format="dummy", device="cpu",
                          warmup_output_len=2, rates=RATES)
    isl, osl = random_lengths(n, isl_max, osl_max, 0.1, 0)
    assert row["output_tokens"] == sum(osl) and row["input_tokens"] == sum(isl)
    assert sum(row["requests_per_replica"]) == n and min(row["requests_per_replica"]) > 0, row["requests_per_replica"]
    walls = row["replica_wall_s"]
    assert len(walls) == 2 and min(walls) > 0 and max(walls) <= row["wall_s"] + 1e-6, (walls, row["wall_s"])
    floors = row["replica_roofline_s"]
    assert len(floors) == 2 and all(f is not None and f > 0 for f in floors) and row["roofline_s"] == max(floors)
