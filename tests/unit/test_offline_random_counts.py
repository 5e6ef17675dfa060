"""`run_random_workload`'s counters on the CPU, where no decode step has a CUDA graph."""


def test_every_cpu_decode_step_is_counted_eager():
    from attnserve import LLM
    from attnserve.bench.offline_random import run_random_workload
    from attnserve.bench.roofline import random_lengths

    isl, osl = random_lengths(4, 24, 12, 0.5, seed=0)
    llm = LLM("llama-tiny", load_format="dummy", device="cpu", context_length=128)
    try:
        res = run_random_workload(llm, isl, osl, seed=0, warmup_output_len=2)
    finally:
        llm.shutdown()
    assert res["output_tokens"] == sum(osl)
    assert res["decode_steps"] >= max(osl) - 1  # one step per output token of the longest request, at least
    assert res["eager_decode_steps"] == res["decode_steps"]  # the CPU has no graphs
    assert res["wait_ms_per_step"] >= 0.0


def test_a_row_with_rates_reports_both_floors():
    """`bench_random` with (nominal) rates: the row carries the floor and the serial floor of
    `attnserve.bench.roofline` over the same wall, the serial one never below the floor, and
    `format_row` prints both shares."""
    from attnserve.bench.offline_random import bench_random, format_row

    rates = {"copy_bytes_per_s": 1e9, "matmul_flops_per_s": 1e9}  # slow: both bounds show on a tiny model
    row = bench_random("llama-tiny", 4, 24, 12, 0.5, 0, rates, device="cpu", context_length=128,
                       warmup_output_len=2)
    assert row["roofline_serial_s"] >= row["roofline_s"] > 0
    assert row["serial_share"] == row["roofline_serial_s"] / row["wall_s"]
    assert row["roofline_share"] == row["roofline_s"] / row["wall_s"]
    assert f"serial floor {row['serial_share']:.2f}" in format_row(row)


def test_a_row_reports_the_capacity_floor():
    """With a pool of 64 tokens for 4 requests of up to 24 + 12 tokens, they cannot all decode
    at once: the row's capacity floor (`bench.roofline_capacity`) is above the rule's floor and
    `format_row` names it, `capacity_note` explains it; the same row with room for all equals the rule."""
    from attnserve.bench.offline_random import bench_random, capacity_note, format_row

    # memory-bound steps (the matmul 1,000x the copy rate): fewer requests a step, more steps
    rates = {"copy_bytes_per_s": 1e9, "matmul_flops_per_s": 1e12}
    tight = bench_random("llama-tiny", 4, 24, 12, 0.5, 0, rates, device="cpu", context_length=128,
                         warmup_output_len=2, max_total_tokens=64)
    assert tight["max_total_tokens"] == 64
    assert tight["roofline_capacity_s"] > tight["roofline_s"] > 0
    assert tight["capacity_share"] == tight["roofline_capacity_s"] / tight["wall_s"]
    assert f"capacity floor {tight['capacity_share']:.2f}" in format_row(tight)
    note = capacity_note(tight)
    assert note is not None and "64-token KV pool" in note and f"{tight['roofline_capacity_s']:.2f} s" in note
    roomy = bench_random("llama-tiny", 4, 24, 12, 0.5, 0, rates, device="cpu", context_length=128,
                         warmup_output_len=2, max_total_tokens=1024)
    assert roomy["roofline_capacity_s"] == roomy["roofline_s"]
    assert "capacity floor" not in format_row(roomy) and capacity_note(roomy) is None
