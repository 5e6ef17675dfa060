"""DeepSeek-V2 (MLA) on a GPU: the triton backend (MLA decode kernel, dense-prefix extend)
against torch_native, eager and with CUDA graphs.

The ``deepseek-v2-tiny`` dummy shape (2 layers, hidden 512, 16 heads, q_lora_rank 256,
kv_lora_rank 128, rope 32, nope 64, v 64; random weights from a fixed seed, so no HF
checkpoint is needed on the GPU box). Float32 with IEEE matmuls, so greedy argmax
comparisons are not decided by rounding. Prompts longer than ``chunked_prefill_size`` make
extend steps over a cached prefix (the latent read back and expanded).
"""

import copy
import random

import pytest
import torch

from attnserve.engine.engine import Engine
from attnserve.engine.sampling_params import SamplingParams
from attnserve.forward_batch import ForwardBatch, ForwardMode
from attnserve.mem_cache.memory_pool import MLATokenToKVPool, ReqToTokenPool, TokenToKVPoolAllocator
from attnserve.server_args import ServerArgs
from engine_drive import greedy_generate as _generate

pytestmark = pytest.mark.cuda

VOCAB = 1000


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def _engine(**kw):
    base = dict(model="deepseek-v2-tiny", load_format="dummy", device="cuda", dtype="float32",
                max_total_tokens=20000, max_running_requests=16, context_length=1024, chunked_prefill_size=128)
    base.update(kw)
    return Engine(ServerArgs(**base))


def _prompts(n, seed, lo=3, hi=300):
    rnd = random.Random(seed)
    return [[rnd.randrange(3, VOCAB) for _ in range(rnd.randrange(lo, hi))] for _ in range(n)]


def _run_schedule(engine, schedule, max_new):
    """schedule: {step_index: [prompts]} -- requests join while others decode."""
    reqs, step = [], 0
    while step <= max(schedule) or engine.has_work():
        for p in schedule.get(step, []):
            reqs.append(engine.add_request(p, SamplingParams(max_new_tokens=max_new[len(reqs)], temperature=0.0,
                                                             ignore_eos=True)))
        engine.step()
        step += 1
    return [r.output_ids for r in reqs]


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_triton_matches_torch_native_eager_and_graphs(page_size):
    prompts = _prompts(7, page_size)
    ref = _generate(_engine(attention_backend="torch_native", disable_cuda_graph=True, page_size=page_size), prompts)
    eager = _generate(_engine(attention_backend="triton_mla", disable_cuda_graph=True, page_size=page_size), prompts)
    graphed_engine = _engine(attention_backend="triton_mla", page_size=page_size)
    assert graphed_engine.model_runner.cuda_graph_runner is not None
    assert graphed_engine.model_runner.token_to_kv_pool.kv_buffer[0].shape[1:] == (1, 128 + 32)
    graphed = _generate(graphed_engine, prompts)
    assert eager == ref
    assert graphed == ref


def test_deterministic_graphs_match_eager_while_batch_grows_and_shrinks():
    """Batch-invariant split counts: graph replays padded to a bucket give the eager tokens."""
    prompts = _prompts(13, 7, hi=200)
    schedule = {0: prompts[:3], 6: prompts[3:8], 15: prompts[8:]}
    max_new = [48, 20, 48, 48, 12, 48, 25, 48, 10, 48, 15, 30, 48]
    kw = dict(attention_backend="triton_mla", enable_deterministic_inference=True, page_size=16)
    eager = _run_schedule(_engine(disable_cuda_graph=True, **kw), schedule, max_new)
    graphed = _run_schedule(_engine(**kw), schedule, max_new)
    ref = _run_schedule(_engine(attention_backend="torch_native", disable_cuda_graph=True, page_size=16), schedule,
                        max_new)
    assert graphed == eager
    assert eager == ref


def test_bf16_graphs_run_and_mostly_agree_with_float32():
    """bf16 (tensor-core MLA kernel path) runs end to end; its first greedy token agrees with
    float32 for most prompts (rounding may flip a near tie)."""
    prompts = _prompts(8, 3)
    bf16 = _generate(_engine(attention_backend="triton_mla", dtype="bfloat16", page_size=64), prompts, max_new=8)
    fp32 = _generate(_engine(attention_backend="triton_mla", page_size=64), prompts, max_new=8)
    assert all(len(o) == 8 and all(0 <= t < VOCAB for t in o) for o in bf16)
    assert sum(a[0] == b[0] for a, b in zip(bf16, fp32)) >= 6


def test_deepseek_v3_attention_shape_gluon_kernel_end_to_end(monkeypatch):
    """DeepSeek-V3's MLA dims (128 heads, 512 + 64) in bf16, page 64: on an sm_90 GPU the
    decode steps run the default (seesaw) Gluon stage 1 (counted); graphs replay the eager
    tokens (batch-invariant splits) and the first greedy tokens agree with torch_native."""
    from attnserve.attention.triton_ops import mla_decode_seesaw

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon MLA kernel targets sm_90")
    calls = []
    orig = mla_decode_seesaw.seesaw_descriptor  # built once per launch
    monkeypatch.setattr(mla_decode_seesaw, "seesaw_descriptor", lambda *a, **k: calls.append(1) or orig(*a, **k))
    prompts = _prompts(6, 11, hi=400)
    kw = dict(model="deepseek-v3-mla-tiny", dtype="bfloat16", page_size=64, max_total_tokens=8192,
              context_length=2048, enable_deterministic_inference=True)
    eager = _generate(_engine(attention_backend="triton_mla", disable_cuda_graph=True, **kw), prompts, max_new=12)
    assert calls, "the Gluon stage 1 did not run"
    graphed_engine = _engine(attention_backend="triton_mla", **kw)
    assert graphed_engine.model_runner.cuda_graph_runner is not None
    graphed = _generate(graphed_engine, prompts, max_new=12)
    ref = _generate(_engine(attention_backend="torch_native", disable_cuda_graph=True, **kw), prompts, max_new=12)
    assert graphed == eager
    assert sum(a[0] == b[0] for a, b in zip(eager, ref)) >= 5


@pytest.mark.parametrize("model,kind", [("deepseek-v2-lite-mla-tiny", "transposed_fp8"),
                                        ("deepseek-v3-mla-tiny", "seesaw_fp8")])
def test_fp8_latent_cache_end_to_end(monkeypatch, model, kind):
    """An fp8 e4m3 latent cache at DeepSeek's MLA dims (512 + 64), bf16, page 64, CUDA
    graphs, the default (non-deterministic) split policy: at 16 heads (DeepSeek-V2-Lite)
    decode runs the transposed fp8 kernel with two programs' worth of splits per SM, at 128
    heads (V3) the fp8 seesaw kernel (the launched kinds are recorded); the first greedy
    tokens agree with torch_native over the same fp8 cache for most prompts."""
    from attnserve.attention.triton_ops import mla_decode

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the fp8 Gluon MLA kernels target sm_90")
    kinds = []
    orig = mla_decode._launch_stage1
    monkeypatch.setattr(mla_decode, "_launch_stage1", lambda k, *a, **kw: kinds.append(k) or orig(k, *a, **kw))
    prompts = _prompts(6, 13, hi=400)
    kw = dict(model=model, dtype="bfloat16", page_size=64, max_total_tokens=8192, context_length=2048,
              kv_cache_dtype="fp8_e4m3")
    engine = _engine(attention_backend="triton_mla", **kw)
    assert engine.model_runner.cuda_graph_runner is not None
    assert engine.model_runner.token_to_kv_pool.kv_buffer[0].dtype == torch.float8_e4m3fn
    out = _generate(engine, prompts, max_new=12)
    assert kind in kinds, kinds
    ref = _generate(_engine(attention_backend="torch_native", disable_cuda_graph=True, **kw), prompts, max_new=12)
    assert all(len(o) == 12 for o in out)
    assert sum(a[0] == b[0] for a, b in zip(out, ref)) >= 5


def _step_logits(model, mc, device, backend_name, page_size=16):
    """Chunked prefill of two requests, then three batched decode steps, on ``device``;
    returns every step's float32 logits (on the CPU)."""
    from attnserve.attention.backend_config import AttentionBackendConfig
    from attnserve.attention.torch_native import TorchNativeAttnBackend
    from attnserve.attention.triton_mla_backend import TritonMLAAttnBackend

    r2t = ReqToTokenPool(4, 512, device)
    alloc = TokenToKVPoolAllocator(2048, page_size)
    pool = MLATokenToKVPool(alloc.size, page_size, torch.float32, mc.kv_lora_rank, mc.qk_rope_head_dim,
                            mc.num_hidden_layers, device)
    config = AttentionBackendConfig.from_pools(r2t, pool, mc.num_attention_heads)
    backend = TritonMLAAttnBackend(config) if backend_name == "triton" else TorchNativeAttnBackend(config)
    rows, lens, outs = r2t.alloc(2), {}, []
    prompts = _prompts(2, 99, lo=150, hi=260)
    steps = [(ForwardMode.EXTEND, [(rows[0], prompts[0][:100]), (rows[1], prompts[1][:37])]),
             (ForwardMode.EXTEND, [(rows[0], prompts[0][100:]), (rows[1], prompts[1][37:])])]
    steps += [(ForwardMode.DECODE, [(rows[0], [5 + i]), (rows[1], [9 + i])]) for i in range(3)]
    for mode, reqs in steps:
        rs = [r for r, _ in reqs]
        prefix = [lens.get(r, 0) for r in rs]
        ext = [len(ids) for _, ids in reqs]
        seq = [p + e for p, e in zip(prefix, ext)]
        last = [int(r2t.req_to_token[r, p - 1]) if p else 0 for r, p in zip(rs, prefix)]
        loc = alloc.alloc_extend(prefix, seq, last)
        start = 0
        for r, p, e in zip(rs, prefix, ext):
            r2t.write(r, p, loc[start : start + e])
            start += e
        fb = ForwardBatch.init_new(mode, [t for _, ids in reqs for t in ids], rs, prefix, ext, loc.to(device), r2t,
                                   pool, backend, device)
        backend.init_forward_metadata(fb)
        outs.append(model.compute_logits(model(fb.input_ids, fb.positions, fb)).cpu())
        lens.update(zip(rs, seq))
    return outs


def test_cuda_model_matches_cpu_reference():
    """The same weights on the CPU (PyTorch reference paths) and on the GPU (CUDA-only paths
    such as fused RoPE/norm kernels; torch_native and triton attention): logits of prefill
    chunks and decode steps agree. Guards what the backend-vs-backend tests cannot see."""
    from attnserve.model_loader.loader import load_model

    loaded = load_model("deepseek-v2-tiny", load_format="dummy", device="cpu", seed=5)
    ref = _step_logits(loaded.model, loaded.model_config, "cpu", "torch_native")
    gpu_model = copy.deepcopy(loaded.model).to("cuda")
    for backend in ("torch_native", "triton"):
        got = _step_logits(gpu_model, loaded.model_config, "cuda", backend)
        for a, b in zip(ref, got):
            assert a.shape == b.shape
            assert (a - b).abs().max().item() < 1e-4, backend


def test_128_head_mla_at_1024_running_requests_counts_its_workspace(caplog):
    """A 128-head MLA shape with --max-running-requests 1024 starts; the split workspace is
    sized for the largest batch that can run (not ``rows x 32 splits``: ~8.6 GB), counted
    before the KV pool and reported in the memory log; a batch of 1024 decodes."""
    import logging

    from attnserve.attention.triton_ops.mla_decode import mla_workspace_size

    with caplog.at_level(logging.INFO, logger="attnserve.engine.model_runner"):
        engine = _engine(model="deepseek-v3-mla-tiny", dtype="bfloat16", max_running_requests=1024,
                         max_total_tokens=None, context_length=64, cuda_graph_max_bs=64, chunked_prefill_size=4096)
    runner = engine.model_runner
    ws = runner.attn_backend.mla.workspace
    assert runner.attn_workspace_bytes == ws.numel() > 0
    assert ws.numel() < mla_workspace_size(0, 1025, 32, 128, 512) / 10
    assert any("attention workspace" in r.getMessage() and "1024 requests" in r.getMessage() for r in caplog.records)
    print("workspace MiB", ws.numel() / 2**20)
    outs = _generate(engine, _prompts(1024, 5, lo=3, hi=20), max_new=3)
    assert all(len(o) == 3 for o in outs)


@pytest.mark.parametrize("setting", ["0", "1"])
def test_expanded_prefix_switch_matches_torch_native(monkeypatch, setting):
    """Chunked prefill of long prompts (every chunk after the first extends over cached
    prefixes): the triton_mla backend with the prefixes absorbed (``0``) or expanded per head
    (``1``, `mla_expanded_prefix`) gives torch_native's greedy tokens, with CUDA graphs."""
    monkeypatch.setenv("ATTNSERVE_MLA_EXPANDED_PREFIX", setting)
    prompts = _prompts(7, 11, lo=130, hi=600)
    ref = _generate(_engine(attention_backend="torch_native", disable_cuda_graph=True), prompts)
    assert _generate(_engine(attention_backend="triton_mla"), prompts) == ref
