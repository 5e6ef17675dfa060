"""The memory-sizing rules (`attnserve.engine.memory_sizing`) on fake memory figures."""

import pytest

from attnserve.engine.memory_sizing import (
    MAX_RUNNING_REQUESTS_CAP,
    SPECULATIVE_MAX_RUNNING_REQUESTS,
    TOKENS_PER_RUNNING_REQUEST,
    default_max_running_requests,
    gpu_batch_defaults,
    kv_pool_tokens,
    resolve_serving_limits,
)

GiB = 2**30


def test_kv_pool_tokens_is_the_static_budget_left_after_weights():
    # an 80 GiB card with 64 GiB free after 16 GiB of weights, fraction 0.8:
    # budget = 64 - 80 * 0.2 - 0.5 (workspace) = 47.5 GiB; Llama-3-8B bf16 KV = 128 KiB a token
    tokens = kv_pool_tokens(64 * GiB, 80 * GiB, 0.8, GiB // 2, 128 * 1024)
    assert tokens == int(47.5 * GiB) // (128 * 1024) == 389120
    assert kv_pool_tokens(10 * GiB, 80 * GiB, 0.8, 0, 1024) == 0  # weights already past the fraction
    with pytest.raises(ValueError):
        kv_pool_tokens(GiB, GiB, 0.8, 0, 0)


def test_running_requests_follow_the_pool_within_the_cap():
    assert default_max_running_requests(389120) == MAX_RUNNING_REQUESTS_CAP
    assert default_max_running_requests(100 * TOKENS_PER_RUNNING_REQUEST + 5) == 100
    assert default_max_running_requests(10) == 1


@pytest.mark.parametrize("gib,expected", [(16, (2048, 32)), (24, (4096, 96)), (40, (4096, 160)),
                                          (79.1, (8192, 512)), (139.8, (16384, 1024))])
def test_gpu_tiers(gib, expected):
    assert gpu_batch_defaults(int(gib * GiB)) == expected


def test_resolve_fills_only_unset_limits_and_caps_graphs():
    h100 = int(79.1 * GiB)
    auto = resolve_serving_limits(389120, "cuda", h100)
    # the pool allows 389120 // 64 = 6080 requests and the cap 1024; the 80 GB card's graph batch,
    # 512, bounds both, so no default batch runs eagerly
    assert (auto.max_running_requests, auto.chunked_prefill_size, auto.cuda_graph_max_bs) == (512, 8192, 512)
    assert set(auto.chosen) == {"max_total_tokens", "max_running_requests", "chunked_prefill_size",
                                "cuda_graph_max_bs"}
    flags = resolve_serving_limits(389120, "cuda", h100, max_running_requests=48, chunked_prefill_size=512,
                                   max_total_tokens_chosen=False)
    # explicit flags win; the graph batch never exceeds the running requests
    assert (flags.max_running_requests, flags.chunked_prefill_size, flags.cuda_graph_max_bs) == (48, 512, 48)
    assert flags.chosen == ("cuda_graph_max_bs",)
    small_pool = resolve_serving_limits(4096, "cuda", h100)
    assert small_pool.max_running_requests == 64 and small_pool.cuda_graph_max_bs == 64
    assert "(auto)" in auto.describe() and "max_running_requests=512" in auto.describe()
    h200 = resolve_serving_limits(898353, "cuda", int(139.8 * GiB))
    assert (h200.max_running_requests, h200.cuda_graph_max_bs) == (1024, 1024)
    # an explicit graph batch does not move the running-request default (the card's table does)
    low = resolve_serving_limits(389120, "cuda", h100, cuda_graph_max_bs=64)
    assert (low.max_running_requests, low.cuda_graph_max_bs) == (512, 64)


def test_speculative_default_running_requests_as_sglang():
    """With a speculative algorithm the GPU default is at most 48 running requests (SGLang's
    reset), so the graph batch, which the verify graphs share, is 48 too; flags still win,
    a smaller pool still bounds it, and the CPU keeps its measured 64."""
    h100 = int(79.1 * GiB)
    spec = resolve_serving_limits(389120, "cuda", h100, speculative=True)
    assert SPECULATIVE_MAX_RUNNING_REQUESTS == 48
    assert (spec.max_running_requests, spec.cuda_graph_max_bs, spec.chunked_prefill_size) == (48, 48, 8192)
    flag = resolve_serving_limits(389120, "cuda", h100, max_running_requests=256, speculative=True)
    assert (flag.max_running_requests, flag.cuda_graph_max_bs) == (256, 256)
    assert resolve_serving_limits(20 * TOKENS_PER_RUNNING_REQUEST, "cuda", h100,
                                  speculative=True).max_running_requests == 20
    assert resolve_serving_limits(32768, "cpu", speculative=True).max_running_requests == 64


def test_cpu_defaults_stay_as_measured():
    cpu = resolve_serving_limits(32768, "cpu")
    assert (cpu.max_running_requests, cpu.chunked_prefill_size, cpu.cuda_graph_max_bs) == (64, 8192, 0)
    assert resolve_serving_limits(32768, "cpu", max_running_requests=3).max_running_requests == 3


def test_engine_on_cpu_uses_the_cpu_limits():
    from attnserve import LLM, SamplingParams

    llm = LLM("qwen3-tiny", load_format="dummy", device="cpu", context_length=128)
    limits = llm.engine.model_runner.serving_limits
    assert limits.max_running_requests == 64 and limits.chunked_prefill_size == 8192
    assert llm.engine.model_runner.req_to_token_pool.req_to_token.shape[0] == 65
    assert llm.server_args.max_running_requests is None  # the user's args are left as given
    out = llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3, temperature=0.0))
    assert len(out[0].token_ids) == 3


def test_small_models_get_a_longer_prefill_chunk():
    from attnserve.engine.memory_sizing import host_bound_prefill_chunk

    # Qwen3-0.6B: 28 layers, ~0.6e9 params: 28 * 1.1e-3 * 6.8e14 / 1.2e9 = 17,453 tokens -> capped at 2 x 8192
    assert host_bound_prefill_chunk(8192, 596_049_920, 28) == 16384
    # Llama-3-8B: 32 * 1.1e-3 * 6.8e14 / 1.5e10 = 1,596 tokens -> the tier's 8192
    assert host_bound_prefill_chunk(8192, 7_504_924_672, 32) == 8192
    assert host_bound_prefill_chunk(8192, 0, 32) == 8192  # unknown size: the tier
    h100 = int(79.1 * GiB)
    small = resolve_serving_limits(500_000, "cuda", h100, params=596_049_920, num_layers=28)
    assert small.chunked_prefill_size == 16384
    assert resolve_serving_limits(500_000, "cuda", h100, chunked_prefill_size=4096, params=596_049_920,
                                  num_layers=28).chunked_prefill_size == 4096  # the flag wins
    assert resolve_serving_limits(500_000, "cpu", params=596_049_920, num_layers=28).chunked_prefill_size == 8192


def test_default_mem_fraction_static_reserves_like_sglang():
    from attnserve.engine.memory_sizing import CPU_MEM_FRACTION_STATIC, default_mem_fraction_static

    gib = 2**30
    h100 = int(79.19 * gib)  # torch.cuda.mem_get_info total of an H100 80GB HBM3
    # 9.5 GiB + 0.5 GiB per rank
    assert default_mem_fraction_static(h100, 1) == round((79.19 - 10.0) / 79.19, 3)
    assert default_mem_fraction_static(h100, 4) == round((79.19 - 11.5) / 79.19, 3)
    assert default_mem_fraction_static(h100, 1, speculative=True) == round((79.19 - 12.0) / 79.19, 3)
    h200 = int(139.8 * gib)  # 12 GiB + 0.5 per rank
    assert default_mem_fraction_static(h200, 2) == round((139.8 - 13.0) / 139.8, 3)
    assert default_mem_fraction_static(int(24 * gib)) == round((24 - 2.9) / 24, 3)
    assert default_mem_fraction_static(0) == CPU_MEM_FRACTION_STATIC
    # more memory left to weights + KV than the old fixed 0.8 on 24 GB, H100, H200 and B200
    # cards; a 40 GB A100 keeps SGLang's 10 GiB reserve (0.75)
    assert all(default_mem_fraction_static(int(g * gib)) > 0.8 for g in (24, 79.19, 139.8, 180))
    assert default_mem_fraction_static(int(40 * gib)) == 0.75
