"""The roofline arithmetic of `attnserve.bench.roofline` against hand-computed cases."""

import pytest

from attnserve.bench.roofline import RooflineModel, random_lengths, workload_roofline

# a toy model: P = 1000 parameters of 2 bytes, L = 2 layers, Hq = 4 heads, D = 8, 64 KV bytes a token
TOY = RooflineModel(params=1000, weight_bytes=2000, num_layers=2, num_q_heads=4, head_dim=8, kv_bytes_per_token=64)
BW, F = 1000.0, 100000.0  # bytes/s and FLOP/s: slow enough that every term is visible


def test_hand_computed_two_requests():
    # request a: isl 10, osl 3; request b: isl 4, osl 1; L*Hq*D = 64
    # prefill = (2*1000*10 + 2*64*100) + (2*1000*4 + 2*64*16) = 32800 + 10048 = 42848 FLOPs -> 0.42848 s
    # decode steps: 3 (the longest output)
    #  s=0: both run, ctx 10+4 = 14: mem (2000 + 14*64)/1000 = 2.896 s; flops (2*1000*2 + 4*64*14)/1e5 = 0.07584
    #  s=1: a alone, ctx 11: mem (2000 + 704)/1000 = 2.704 s
    #  s=2: a alone, ctx 12: mem (2000 + 768)/1000 = 2.768 s
    r = workload_roofline(TOY, [10, 4], [3, 1], BW, F)
    assert r.prefill_s == pytest.approx(0.42848)
    assert r.decode_steps == 3
    assert r.decode_s == pytest.approx(2.896 + 2.704 + 2.768)
    assert r.roofline_s == pytest.approx(0.42848 + 8.368)


def test_compute_bound_steps_take_the_flops_term():
    # a fast copy engine: every decode step is bound by FLOPs
    r = workload_roofline(TOY, [10, 4], [3, 1], 1e12, F)
    steps = [(2 * 1000 * 2 + 4 * 64 * 14), (2 * 1000 + 4 * 64 * 11), (2 * 1000 + 4 * 64 * 12)]
    assert r.decode_s == pytest.approx(sum(steps) / F)


def test_serial_floor_adds_the_linears_compute_to_the_attention_memory():
    """Hand-computed, with 1024 KV bytes a token and BW = F = 1e5 (ridge 1 FLOP/byte): the
    attention is memory-bound (4*64 / 1024 = 0.25 FLOP/byte) and the linears of two running
    requests compute-bound (2*1000*2 / 2000 = 2 FLOP/byte), so at step 0 the serial floor pays
    the KV bytes and the linears' FLOPs one after the other where the floor overlaps them."""
    big_kv = RooflineModel(params=1000, weight_bytes=2000, num_layers=2, num_q_heads=4, head_dim=8,
                           kv_bytes_per_token=1024)
    r = workload_roofline(big_kv, [10, 4], [3, 1], 1e5, 1e5)
    # s=0 (ctx 14, 2 running): kv 14*1024/1e5 = 0.14336, weights 0.02, linears 4000/1e5 = 0.04,
    #   attention 4*64*14/1e5 = 0.03584: floor max(0.16336, 0.07584) = 0.16336; serial 0.14336 + 0.04 = 0.18336
    # s=1 (ctx 11, 1 running): kv 0.11264, weights = linears = 0.02: both 0.13264
    # s=2 (ctx 12): kv 0.12288: both 0.14288
    assert r.decode_s == pytest.approx(0.16336 + 0.13264 + 0.14288)
    assert r.decode_serial_s == pytest.approx(0.18336 + 0.13264 + 0.14288)
    assert r.roofline_serial_s == pytest.approx(r.prefill_s + r.decode_serial_s)
    # memory-bound everywhere (the first test's rates): the serial floor is the floor
    slow = workload_roofline(TOY, [10, 4], [3, 1], BW, F)
    assert slow.decode_serial_s == pytest.approx(slow.decode_s)


def test_fp8_parameters_run_at_the_fp8_rate():
    # 600 of the 1000 parameters in FP8 at F8 = 2F: linear seconds per token 2*(400/F + 600/(2F)) = 1400/F
    fp8 = RooflineModel(params=1000, weight_bytes=1400, num_layers=2, num_q_heads=4, head_dim=8,
                        kv_bytes_per_token=64, fp8_params=600)
    r = workload_roofline(fp8, [10, 4], [3, 1], 1e12, F, fp8_matmul_flops_per_s=2 * F)
    assert r.prefill_s == pytest.approx((1400 * 10 + 2 * 64 * 100 + 1400 * 4 + 2 * 64 * 16) / F)
    assert r.decode_s == pytest.approx((1400 * 2 + 4 * 64 * 14 + 1400 + 4 * 64 * 11 + 1400 + 4 * 64 * 12) / F)
    # without an FP8 rate every FLOP is counted at F, as for bf16
    same = workload_roofline(fp8, [10, 4], [3, 1], 1e12, F)
    assert same.roofline_s == pytest.approx(workload_roofline(TOY, [10, 4], [3, 1], 1e12, F).roofline_s)


def test_errors():
    with pytest.raises(ValueError):
        workload_roofline(TOY, [1, 2], [1], BW, F)
    with pytest.raises(ValueError):
        workload_roofline(TOY, [1], [1], 0.0, F)


def test_random_lengths_are_seeded_and_in_range():
    isl, osl = random_lengths(500, 1024, 512, 0.098, seed=3)
    assert (isl, osl) == random_lengths(500, 1024, 512, 0.098, seed=3)
    assert isl != random_lengths(500, 1024, 512, 0.098, seed=4)[0]
    assert min(isl) >= 100 and max(isl) <= 1024 and min(osl) >= 50 and max(osl) <= 512
    assert max(isl) > 1000 and min(isl) < 130  # spans the range (500 draws)
    fixed_in, fixed_out = random_lengths(4, 512, 256, 1.0, seed=0)
    assert fixed_in == [512] * 4 and fixed_out == [256] * 4
    with pytest.raises(ValueError):
        random_lengths(4, 512, 256, 1.5, seed=0)


def test_from_runner_counts_an_untied_embedding_out(tmp_path):
    from attnserve.engine.llm import LLM

    llm = LLM("qwen3-tiny", load_format="dummy", device="cpu", context_length=64)
    model = llm.engine.model_runner.model
    rm = RooflineModel.from_runner(llm.engine.model_runner)
    total = sum(p.numel() for p in model.parameters())
    embed = model.model.embed_tokens.weight.numel()
    assert model.lm_head is not None  # qwen3-tiny has an untied head
    assert rm.params == total - embed
    assert rm.weight_bytes == rm.params * 4  # float32 on CPU
    mc = llm.engine.model_config
    assert rm.kv_bytes_per_token == mc.num_hidden_layers * mc.num_key_value_heads * 2 * mc.head_dim * 4
    assert rm.fp8_params == 0


def test_from_runner_counts_fp8_parameters():
    import torch

    from attnserve.engine.llm import LLM

    with LLM("qwen3-tiny", load_format="dummy", device="cpu", context_length=64, quantization="fp8") as llm:
        model = llm.engine.model_runner.model
        rm = RooflineModel.from_runner(llm.engine.model_runner)
    fp8 = sum(p.numel() for p in model.parameters() if p.dtype == torch.float8_e4m3fn)
    assert 0 < rm.fp8_params == fp8 < rm.params  # the linears; norms and the head stay wide


def test_moe_counts_distinct_experts_and_active_params():
    # one MoE layer of E = 4 experts, top 2, 100 params (200 bytes) an expert
    moe = RooflineModel(params=1000, weight_bytes=2000, num_layers=2, num_q_heads=4, head_dim=8,
                        kv_bytes_per_token=64, moe_layers=1, num_experts=4, top_k=2, expert_params=100,
                        expert_bytes=200)
    assert moe.active_params == 1000 + 2 * 100
    # D(1) = 4 (1 - 1/2) = 2 experts; D(2) = 4 (1 - 1/4) = 3; D(n) -> 4
    assert moe.distinct_experts(1) == pytest.approx(2.0)
    assert moe.distinct_experts(2) == pytest.approx(3.0)
    assert moe.distinct_experts(64) == pytest.approx(4.0)
    assert moe.step_weight_bytes(2) == pytest.approx(2000 + 3 * 200)
    # isl 10 / osl 1 and isl 4 / osl 1: prefill 2*1200*14 + 2*64*(100+16); one step of 2 tokens, ctx 14
    r = workload_roofline(moe, [10, 4], [1, 1], BW, F)
    assert r.prefill_s == pytest.approx((2 * 1200 * 14 + 2 * 64 * 116) / F)
    assert r.decode_s == pytest.approx((2000 + 600 + 14 * 64) / BW)


def test_from_runner_counts_experts_apart():
    from attnserve.engine.llm import LLM

    with LLM("qwen3-moe-tiny", load_format="dummy", device="cpu", context_length=64) as llm:
        model = llm.engine.model_runner.model
        rm = RooflineModel.from_runner(llm.engine.model_runner)
    cfg = model.config
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    sparse = cfg.num_hidden_layers - len(cfg.mlp_only_layers)
    total = sum(p.numel() for p in model.parameters())
    assert (rm.moe_layers, rm.num_experts, rm.top_k, rm.expert_params) == (sparse, 8, 2, per_expert)
    assert rm.params == total - model.model.embed_tokens.weight.numel() - sparse * 8 * per_expert
    assert rm.expert_bytes == per_expert * 4


def test_capacity_floor_hand_computed():
    """`roofline_capacity.capacity_decode_s`: request a (isl 10, osl 3, footprint 13) and b
    (isl 4, osl 1, footprint 5) on the toy model at the first test's rates."""
    from attnserve.bench.roofline_capacity import capacity_decode_s

    # a pool that holds both: the rule's decode floor (2.896 + 2.704 + 2.768)
    s, steps = capacity_decode_s(TOY, [10, 4], [3, 1], BW, F, max_total_tokens=18)
    assert (s, steps) == (pytest.approx(8.368), 3)
    # 13 tokens: a alone (ctx 10, 11, 12: 2.64 + 2.704 + 2.768), then b (ctx 4: (2000 + 256) / 1000)
    one_at_a_time = 2.64 + 2.704 + 2.768 + 2.256
    s, steps = capacity_decode_s(TOY, [10, 4], [3, 1], BW, F, max_total_tokens=13)
    assert (s, steps) == (pytest.approx(one_at_a_time), 4)
    # a one-request cap does the same with any pool
    s, _ = capacity_decode_s(TOY, [10, 4], [3, 1], BW, F, max_total_tokens=10**6, max_running_requests=1)
    assert s == pytest.approx(one_at_a_time)
    # b first: b then a (FCFS); a request larger than the pool runs alone
    s, _ = capacity_decode_s(TOY, [4, 10], [1, 3], BW, F, max_total_tokens=6)
    assert s == pytest.approx(one_at_a_time)
    with pytest.raises(ValueError, match="max_total_tokens"):
        capacity_decode_s(TOY, [10], [3], BW, F, max_total_tokens=0)


def test_capacity_floor_equals_the_rule_when_everything_fits():
    from attnserve.bench.roofline_capacity import capacity_decode_s

    isl, osl = random_lengths(64, 300, 200, 0.1, seed=3)
    rule = workload_roofline(TOY, isl, osl, BW, F)
    s, steps = capacity_decode_s(TOY, isl, osl, BW, F, max_total_tokens=sum(isl) + sum(osl))
    assert s == pytest.approx(rule.decode_s) and steps == rule.decode_steps
    # half the pool: more steps, a higher floor (the weights are read for fewer tokens a step)
    s_half, steps_half = capacity_decode_s(TOY, isl, osl, BW, F, max_total_tokens=(sum(isl) + sum(osl)) // 2)
    assert steps_half > steps and s_half > s


def test_sliding_layers_clip_their_context():
    """TOY with one of its two layers windowed at w = 6 (hand-computed from the module docstring):
    request a (isl 10, osl 3) and b (isl 4, osl 1).
    prefill pairs: a: (100 + (2*6*10 - 36)) / 2 = 92; b: 16 (inside the window)
      -> (2*1000*10 + 2*64*92) + (2*1000*4 + 2*64*16) = 31776 + 10048 = 41824 FLOPs
    decode effective contexts: s=0: (10 + 6)/2 + (4 + 4)/2 = 12; s=1: (11 + 6)/2 = 8.5; s=2: 9
      -> mem (2000 + 64 * ctx) / 1000 each."""
    from dataclasses import replace

    windowed = replace(TOY, sliding_layers=1, sliding_window=6)
    r = workload_roofline(windowed, [10, 4], [3, 1], BW, F)
    assert r.prefill_s == pytest.approx(0.41824)
    assert r.decode_s == pytest.approx(sum((2000 + 64 * c) / 1000 for c in (12, 8.5, 9)))
    assert windowed.effective_ctx([3, 20]) == pytest.approx((23 + 3 + 6) / 2)
    # a window longer than every context changes nothing
    wide = replace(TOY, sliding_layers=2, sliding_window=1000)
    assert workload_roofline(wide, [10, 4], [3, 1], BW, F) == workload_roofline(TOY, [10, 4], [3, 1], BW, F)


def test_from_runner_reads_the_sliding_layers():
    from types import SimpleNamespace

    from attnserve.engine.model_facts import roofline_facts
    from attnserve.model_loader.loader import load_model

    loaded = load_model("gpt-oss-tiny", load_format="dummy", device="meta", load_tokenizer=False)
    runner = SimpleNamespace(model=loaded.model, model_config=loaded.model_config, kv_cache_dtype=None)
    facts = roofline_facts(runner)
    assert (facts["sliding_layers"], facts["sliding_window"]) == (2, 128)
