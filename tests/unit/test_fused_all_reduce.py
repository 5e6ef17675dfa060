"""Fused all-reduce + residual add + RMSNorm: the kernel's arithmetic and flags under the
Triton interpreter, and which layers `link_allreduce_fusion` hands to the norms.

The interpreter runs one simulated rank at a time, so the peers' halves and flags are
staged first (as the peers' own launches would leave them); every rank's launch then does
its own copy-in and flag writes again and must give the reference result. The interpreter
converts float32 to bfloat16 by truncation (the GPU rounds to nearest), so the bfloat16
reference rounds the same way; the kernel's GPU numbers are checked against the unfused
path on two or more GPUs (tests/gpu/test_custom_all_reduce_gpu.py).
"""

import os

import pytest
import torch

from attnserve.distributed import fused_all_reduce as far
from attnserve.distributed.fused_all_reduce import FusedRegion, fused_all_reduce_add_rmsnorm, fused_unsupported_reason

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


def _as_interpreter(x32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 -> ``dtype`` as the Triton interpreter converts (bfloat16: truncation)."""
    if dtype == torch.bfloat16:
        return (x32.view(torch.int32) & -65536).view(torch.float32).to(dtype)
    return x32.to(dtype)


def _staged(world, region, xs, epoch, rows):
    bufs = [torch.zeros(region.end, dtype=torch.uint8) for _ in range(world)]
    for q, b in enumerate(bufs):
        start = region.data_offset + (epoch % 2) * region.half_bytes
        nbytes = xs[q].numel() * xs[q].element_size()
        b[start:start + nbytes].view(xs[q].dtype).copy_(xs[q].view(-1))
        b[region.flags_offset:region.end].view(torch.int64).fill_(epoch)  # every peer has signalled
    return bufs


@pytest.mark.parametrize("world,dtype,rows,hidden,offset,programs", [
    (3, torch.float32, 5, 48, 0.0, 128),  # three ranks: the order of the float32 adds shows
    (2, torch.bfloat16, 3, 64, 1.0, 128),  # Gemma's (1 + w)
    (4, torch.bfloat16, 5, 32, 0.0, 2),  # rows strided over 2 programs
])
def test_kernel_matches_all_reduce_then_fused_add_rmsnorm(monkeypatch, world, dtype, rows, hidden, offset, programs):
    from attnserve.models.layers.fused_kernels import fused_add_rmsnorm

    monkeypatch.setattr(far, "MAX_PROGRAMS", programs)
    region = FusedRegion.after(1000, rows * hidden * dtype.itemsize, world)
    assert region.data_offset % 256 == 0 and region.flags_offset >= region.data_offset + 2 * region.half_bytes
    gen = torch.Generator().manual_seed(world)
    w = torch.randn(hidden, generator=gen).to(dtype)
    counters = [torch.zeros(2, dtype=torch.int64) for _ in range(world)]
    for epoch in (1, 2):  # both halves
        xs = [(torch.randn(rows, hidden, generator=gen) * 4).to(dtype) for _ in range(world)]
        residual = torch.randn(rows, hidden, generator=gen).to(dtype)
        acc = xs[0]
        for q in range(1, world):  # rank order, one rounding per add (PyTorch's one-shot kernel)
            acc = _as_interpreter(acc.float() + xs[q].float(), dtype)
        want_res = residual.clone()
        want = fused_add_rmsnorm(acc, want_res, w, 1e-5, offset)
        bufs = _staged(world, region, xs, epoch, rows)
        ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
        for rank in range(world):
            res = residual.clone()
            x = xs[rank].clone()
            out = fused_all_reduce_add_rmsnorm(x, res, w, 1e-5, offset, ptrs, counters[rank], rank, region)
            assert torch.equal(out, want) and torch.equal(res, want_res)
            assert torch.equal(x, xs[rank])  # the partial sums are read, not written
            assert counters[rank].tolist() == [epoch, 0]  # the next call takes the other half
        flags = torch.stack([b[region.flags_offset:region.end].view(torch.int64) for b in bufs])
        assert bool((flags == epoch).all())


def test_kernel_writes_own_half_and_flags(monkeypatch):
    """Rank 1 of 2 copies its rows into half ``epoch % 2`` of its own buffer and writes
    ``epoch`` into slot ``(program, 1)`` of every rank's flags (rank 0's staged beforehand)."""
    world, rows, hidden = 2, 3, 16
    region = FusedRegion.after(64, rows * hidden * 4, world)
    bufs = [torch.zeros(region.end, dtype=torch.uint8) for _ in range(world)]
    flags = [b[region.flags_offset:region.end].view(torch.int64).view(far.MAX_PROGRAMS, world) for b in bufs]
    flags[1][:, 0] = 1  # rank 0 has signalled call 1
    x = torch.arange(rows * hidden, dtype=torch.float32).view(rows, hidden)
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    fused_all_reduce_add_rmsnorm(x, torch.zeros_like(x), torch.ones(hidden), 1e-6, 0.0, ptrs,
                                 torch.zeros(2, dtype=torch.int64), 1, region)
    half1 = bufs[1][region.data_offset + region.half_bytes:][:x.numel() * 4].view(torch.float32)
    assert torch.equal(half1, x.view(-1))
    assert bool((bufs[1][region.data_offset:region.data_offset + region.half_bytes] == 0).all())
    assert flags[0][:rows, 1].tolist() == [1] * rows and flags[1][:rows, 1].tolist() == [1] * rows
    assert int(flags[0][rows:].sum()) == 0  # programs that did not run wrote nothing


def test_unsupported_inputs_and_warps_match_the_norm_kernel():
    from attnserve.models.layers.fused_kernels import _norm_warps

    region = FusedRegion.after(0, 1024, 2)
    x = torch.zeros(4, 64)
    w = torch.ones(64)
    assert fused_unsupported_reason(x, x.clone(), w, region) is None
    assert "dtypes" in fused_unsupported_reason(x.half(), x.half(), w, region)
    assert "contiguous" in fused_unsupported_reason(torch.zeros(64, 4).t(), x, w, region)
    assert "bytes" in fused_unsupported_reason(torch.zeros(8, 64), torch.zeros(8, 64), w, region)
    assert "shapes" in fused_unsupported_reason(x, torch.zeros(4, 32), w, region)
    with pytest.raises(ValueError, match="fused_all_reduce_add_rmsnorm"):
        fused_all_reduce_add_rmsnorm(x.half(), x.half(), w, 1e-6, 0.0, torch.zeros(2, dtype=torch.int64),
                                     torch.zeros(2, dtype=torch.int64), 0, region)
    for block in (16, 512, 1024, 4096, 8192, 32768):
        assert far.norm_warps(block) == _norm_warps(block)


def _tiny_llama(tp, bias=False, layers=3):
    from types import SimpleNamespace

    from attnserve.models.llama import LlamaForCausalLM

    cfg = SimpleNamespace(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5,
                          max_position_embeddings=64, rope_theta=10000.0, rope_scaling=None, attention_bias=bias,
                          mlp_bias=False, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg, torch.float32, tp).model


def test_link_moves_both_sums_of_every_llama_layer_into_the_norms():
    from attnserve.distributed.group import TPGroup

    model = _tiny_llama(TPGroup(rank=1, size=2))
    assert model.fused_allreduces == 6
    for i, layer in enumerate(model.layers):
        assert not layer.self_attn.o_proj.reduce_results and not layer.mlp.down_proj.reduce_results
        assert layer.attn_output_partial and layer.mlp_output_partial
        assert layer.input_partial == (i > 0)  # layer 0's input is the (summed) embedding
    off = _tiny_llama(TPGroup(rank=1, size=2, allreduce_fusion=False))
    assert off.fused_allreduces == 0 and off.layers[0].self_attn.o_proj.reduce_results
    biased = _tiny_llama(TPGroup(rank=0, size=2), bias=True)  # o_proj's bias follows the sum: kept apart
    assert biased.fused_allreduces == 3 and biased.layers[0].self_attn.o_proj.reduce_results
    assert _tiny_llama(TPGroup.single()).fused_allreduces == 0


def test_group_fallback_sums_then_norms():
    """No custom all-reduce (one rank): the fallback is ``all_reduce`` then ``add_rmsnorm``."""
    from attnserve.distributed.group import TPGroup
    from attnserve.models.layers.norm import RMSNorm

    gen = torch.Generator().manual_seed(3)
    x, res, w = torch.randn(3, 16, generator=gen), torch.randn(3, 16, generator=gen), torch.randn(16, generator=gen)
    seen = []

    def add_rmsnorm(summed, residual):
        seen.append(summed)
        return summed * 2, residual

    out, r = TPGroup.single().fused_all_reduce_add_rmsnorm(x, res, w, 1e-6, 0.0, add_rmsnorm=add_rmsnorm)
    assert torch.equal(out, x * 2) and r is res and len(seen) == 1
    want_res = res + x
    norm = RMSNorm(16, 1e-6, dtype=torch.float32)
    norm.weight.data.copy_(w)
    out, r = TPGroup.single().fused_all_reduce_add_rmsnorm(x, res.clone(), w, 1e-6, 0.0, add_rmsnorm=norm.forward)
    assert torch.equal(r, want_res)
    torch.testing.assert_close(out, want_res * torch.rsqrt(want_res.pow(2).mean(-1, keepdim=True) + 1e-6) * w)


def test_custom_all_reduce_takes_only_one_shot_messages(monkeypatch):
    """`CustomAllReduce.fused_all_reduce_add_rmsnorm` launches only for what the one-shot
    path would take (every rank decides alike from shapes), else None: the caller falls back."""
    from attnserve.distributed.custom_all_reduce import FUSED, CustomAllReduce, CustomAllReduceConfig
    from attnserve.distributed.fused_all_reduce import FusedAllReduce

    cfg = CustomAllReduceConfig(one_shot_max_bytes=1024, two_shot_max_bytes=4096)
    region = FusedRegion.after(cfg.buffer_bytes, cfg.one_shot_max_bytes, 2)
    launched = []
    monkeypatch.setattr(far, "fused_all_reduce_add_rmsnorm", lambda x, *a, **k: launched.append(x.shape) or x * 0)
    custom = CustomAllReduce(rank=0, world_size=2, group_name="g", config=cfg, buffer=torch.empty(0),
                             scratch=torch.empty(0))
    x, w = torch.zeros(4, 64), torch.ones(64)
    assert custom.fused_all_reduce_add_rmsnorm(x, x.clone(), w, 1e-6) is None  # no fusion state
    custom.fusion = FusedAllReduce(region, torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64))
    assert custom.fused_all_reduce_add_rmsnorm(x, x.clone(), w, 1e-6) is not None  # 1024 bytes: one-shot
    big = torch.zeros(8, 64)  # 2048 bytes: two-shot
    assert custom.fused_all_reduce_add_rmsnorm(big, big.clone(), w, 1e-6) is None
    half = torch.zeros(4, 64, dtype=torch.float16)  # one-shot has no float16 kernel
    assert custom.fused_all_reduce_add_rmsnorm(half, half.clone(), w, 1e-6) is None
    assert launched == [(4, 64)] and custom.calls[FUSED] == 1


def test_peer_addresses_from_views_or_shifted_bases():
    from types import SimpleNamespace

    from attnserve.distributed.custom_all_reduce import _peer_addresses

    buf = torch.zeros(64, dtype=torch.uint8)
    own = buf.data_ptr()
    views = [torch.zeros(64, dtype=torch.uint8) for _ in range(2)]
    views[1] = buf  # rank 1 is us
    good = SimpleNamespace(get_buffer=lambda r, sizes, dtype, off: views[r], buffer_ptrs=[0, 0])
    assert _peer_addresses(good, buf, 1, 2) == [views[0].data_ptr(), own]

    def refuse(*args):
        raise RuntimeError("no get_buffer here")

    # our tensor sits 256 bytes into its allocation: so do the peers'
    bases = SimpleNamespace(get_buffer=refuse, buffer_ptrs=[1 << 20, own - 256])
    assert _peer_addresses(bases, buf, 1, 2) == [(1 << 20) + 256, own]
