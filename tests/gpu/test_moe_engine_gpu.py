"""MoE models on a GPU: the Triton fused-MoE path with CUDA graphs against the native expert
loop (eager, torch_native attention), greedy tokens equal.

Dummy shapes ``qwen3-moe-tiny`` (8 experts, top 2, a dense first layer) and
``deepseek-v2-moe-tiny`` (MLA, 8 routed experts top 3 by group-limited greedy, 1 shared),
float32 with IEEE matmuls so that greedy argmax is not decided by rounding; router weights
are drawn wide (std 0.5) so that routing decisions are far from ties. Then the published
shapes at bf16 run one batch each (graphs on), as a smoke test of the kernels at real sizes.
"""

import random

import pytest
import torch

from attnserve.engine.engine import Engine
from attnserve.server_args import ServerArgs
from engine_drive import greedy_generate as _generate

pytestmark = pytest.mark.cuda


def _engine(model, monkeypatch, backend, **kw):
    monkeypatch.setenv("ATTNSERVE_MOE_BACKEND", backend)  # read when the layers are built
    args = dict(model=model, load_format="dummy", device="cuda", dtype="float32", max_total_tokens=8192,
                max_running_requests=16, context_length=512, chunked_prefill_size=128)  # qwen3-moe-tiny: 512 positions
    args.update(kw)
    engine = Engine(ServerArgs(**args))
    with torch.no_grad():  # routers away from ties (same seed for both engines)
        g = torch.Generator(device="cuda").manual_seed(7)
        for name, p in engine.model_runner.model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5, generator=g)
    return engine


@pytest.mark.parametrize("model", ["qwen3-moe-tiny", "deepseek-v2-moe-tiny"])
def test_triton_moe_with_graphs_matches_native(model, monkeypatch, no_tf32):
    rnd = random.Random(5)
    vocab = 300
    prompts = [[rnd.randrange(3, vocab) for _ in range(rnd.randrange(2, 200))] for _ in range(11)]
    ref = _engine(model, monkeypatch, "native", attention_backend="torch_native", disable_cuda_graph=True)
    want = _generate(ref, prompts)
    ref.shutdown()
    fast = _engine(model, monkeypatch, "triton")  # the default backend: triton, or triton_mla for MLA
    assert fast.model_runner.cuda_graph_runner is not None
    got = _generate(fast, prompts)
    fast.shutdown()
    assert got == want


@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "deepseek-v2-lite"])
def test_published_shapes_run_bf16_with_graphs(model, monkeypatch):
    monkeypatch.delenv("ATTNSERVE_MOE_BACKEND", raising=False)
    engine = Engine(ServerArgs(model=model, load_format="dummy", device="cuda", dtype="bfloat16",
                               context_length=2048, max_running_requests=32))
    try:
        outs = _generate(engine, [[5 + i] * (40 + 30 * i) for i in range(20)], max_new=8)
        assert all(len(o) == 8 for o in outs)
        assert engine.model_runner.cuda_graph_runner is not None
    finally:
        engine.shutdown()
