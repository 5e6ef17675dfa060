"""The FP8 mid GEMM's PDL form (`fp8_mid_gemm`, ``MidGemmConfig.pdl`` / ``prefetch``; opt-in per
tile) on the GPU: it reads only weight bytes before its ``griddepcontrol.wait``, so a chain of
FP8 kernels with it gives the bits of the same chain with ``ATTNSERVE_PDL=0``, eagerly and
replayed from a CUDA graph, its tiles equal their plain twins, and the engine's greedy tokens
do not change."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available() or
                                                   torch.cuda.get_device_capability() < (9, 0), reason="PDL: Hopper")]


def _chain(m: int, gen: torch.Generator):
    """A decode layer's FP8 kernels on ``m`` rows, as closures over fixed inputs; returns
    ``run() -> list of outputs`` (each call restores the residual it updates in place)."""
    from attnserve.models.layers.mid_gemm import MidGemmConfig
    from attnserve.models.layers.quantization import fp8_kernels as fk
    from attnserve.models.layers.quantization.fp8_mid_gemm import fp8_mid_linear
    from attnserve.models.layers.quantization.fp8_utils import quantize_per_row
    from attnserve.models.layers.split_k_workspace import SplitKWorkspace

    h, i = 512, 768
    dev = "cuda"
    x = torch.randn(m, h, device=dev, generator=gen, dtype=torch.bfloat16)
    res0 = torch.randn(m, h, device=dev, generator=gen, dtype=torch.bfloat16)
    res = res0.clone()
    norm_w = torch.rand(h, device=dev, generator=gen, dtype=torch.bfloat16) + 0.5
    wqkv, sqkv = quantize_per_row(torch.randn(3 * h, h, device=dev, generator=gen) * h ** -0.5)
    wgu, sgu = quantize_per_row(torch.randn(2 * i, h, device=dev, generator=gen) * h ** -0.5)
    wdown, sdown = quantize_per_row(torch.randn(h, i, device=dev, generator=gen) * i ** -0.5)
    plain = MidGemmConfig(block_n=64, block_k=128, num_warps=4, num_stages=3)
    split = dataclasses.replace(plain, split_k=2, pdl=True, prefetch=2)
    gated = dataclasses.replace(plain, pdl=True)
    ws = SplitKWorkspace()
    bf16 = torch.bfloat16

    def run():
        res.copy_(res0)
        q, s = fk.fused_add_rmsnorm_quant_fp8(x, res, norm_w, 1e-6)
        qkv = fp8_mid_linear(q, wqkv, sqkv.reshape(-1), x_scale=s, out_dtype=bf16, config=plain)
        qkv_pdl = fp8_mid_linear(q, wqkv, sqkv.reshape(-1), x_scale=s, out_dtype=bf16,
                                 config=dataclasses.replace(plain, pdl=True, prefetch=3))
        qa, sa = fk.quantize_activation(qkv[:, :h])
        scaled = fk.scale_rows_cols(qa.float(), sa, sqkv.reshape(-1)[:h], bf16)
        q2, s2 = fk.fused_add_rmsnorm_quant_fp8(scaled, res, norm_w, 1e-6)
        act = fp8_mid_linear(q2, wgu, sgu.reshape(-1), None, "silu", x_scale=s2, out_dtype=bf16, config=gated)
        g_up = fp8_mid_linear(q2, wgu, sgu.reshape(-1), x_scale=s2, out_dtype=bf16, config=plain)
        q3, s3 = fk.silu_and_mul_quant_fp8(g_up)
        down = fp8_mid_linear(q3, wdown, sdown.reshape(-1), x_scale=s3, out_dtype=bf16, config=split, workspace=ws)
        return [q.view(torch.uint8), s, qkv, qkv_pdl, qa.view(torch.uint8), sa, scaled, q2.view(torch.uint8), s2,
                act, q3.view(torch.uint8), s3, down, res.clone()]

    return run


def _graph_run(run):
    run()  # compile / warm up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = run()
    g.replay()
    torch.cuda.synchronize()
    return [t.clone() for t in outs]


@pytest.mark.parametrize("m", [24, 64, 144])
def test_chain_bits_with_and_without_pdl(m, monkeypatch):
    """Eager and CUDA-graph runs with PDL on equal the runs with it off, output by output
    (the split-K ``down`` to the accumulation bound: its atomics add in any order), and the
    mid GEMM's PDL twin equals its plain tile."""
    from attnserve.pdl import pdl_enabled

    got = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("ATTNSERVE_PDL", flag)
        assert pdl_enabled(torch.device("cuda")) == (flag == "1")
        run = _chain(m, torch.Generator(device="cuda").manual_seed(m))
        got[flag] = (run(), _graph_run(run))
    for mode in (0, 1):
        on, off = got["1"][mode], got["0"][mode]
        assert torch.equal(on[2], on[3])  # PDL twin of the qkv tile: same accumulation order
        for k, (a, b) in enumerate(zip(on, off)):
            if k == 12:  # split-K down
                torch.testing.assert_close(a.float(), b.float(), rtol=2**-7, atol=1e-3 * float(b.abs().max()))
            else:
                assert torch.equal(a, b), f"output {k} differs (graph={bool(mode)})"
        assert float(on[12].float().abs().max()) > 0


def test_engine_tokens_with_mid_pdl_tiles(monkeypatch):
    """80 requests x 8 greedy tokens of the tiny FP8 Llama (CUDA graphs; decode batches on the
    mid GEMM's W8A8 tiles, all in their PDL form): the same tokens with ``ATTNSERVE_PDL`` on
    and off."""
    import attnserve.models.layers.quantization.fp8_mid_gemm as mid
    from attnserve.engine.llm import LLM
    from attnserve.engine.sampling_params import SamplingParams

    pdl_rows = {cls: {b: (*row[:4], 1, False, True, 2) for b, row in buckets.items()}
                for cls, buckets in mid.FP8_MID_TABLE.items()}
    monkeypatch.setitem(mid.FP8_MID_MODE_OVERRIDES, "w8a8", pdl_rows)  # split-K 1: deterministic sums
    monkeypatch.setenv(mid.FP8_MID_ENV, "w8a8")
    launched = []
    real = mid.fp8_mid_linear
    monkeypatch.setattr(mid, "fp8_mid_linear", lambda *a, **kw: launched.append(kw["config"].pdl) or real(*a, **kw))
    sp = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[1 + i % 200, 2, 3 + i % 150, 4] for i in range(80)]
    res = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("ATTNSERVE_PDL", flag)
        launched.clear()
        llm = LLM("llama-tiny", load_format="dummy", device="cuda", quantization="fp8")
        res[flag] = [o.token_ids for o in llm.generate(prompts, sp)]
        llm.shutdown()
        assert launched and all(launched)
    assert res["1"] == res["0"]
