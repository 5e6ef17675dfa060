"""Custom all-reduce: which path a message takes, and the fallback to NCCL / gloo.

The kernels themselves need two GPUs (tests/gpu/test_custom_all_reduce_gpu.py); here the
pure selection, the availability checks and, on two gloo ranks, that a CPU group gets no
custom all-reduce, that the ranks agree when one of them cannot run it, and that
`TPGroup.all_reduce` still sums.
"""

import multiprocessing as mp

import pytest
import torch

from attnserve.distributed.custom_all_reduce import (FUSED, NCCL, ONE_SHOT, TWO_SHOT, TWO_SHOT_MAX_ENV,
                                                     CustomAllReduceConfig, config_from_env, default_config,
                                                     local_unavailable_reason, peer_access_reason, select_algorithm)
from attnserve.engine.tp.launch import free_port

CFG = CustomAllReduceConfig(one_shot_max_bytes=4096, two_shot_max_bytes=65536)
BF16, F32 = torch.bfloat16, torch.float32


@pytest.mark.parametrize("numel,dtype,contiguous,offset,world,want", [
    (1, BF16, True, 0, 2, ONE_SHOT),          # 2 bytes, padded to 16
    (3, F32, True, 4, 2, ONE_SHOT),           # one-shot takes any offset (padded through scratch)
    (2048, BF16, True, 0, 2, ONE_SHOT),       # exactly the one-shot limit
    (2056, BF16, True, 0, 2, TWO_SHOT),       # 16 bytes over it
    (16384, F32, True, 0, 4, TWO_SHOT),       # exactly the two-shot limit
    (16388, F32, True, 0, 2, NCCL),           # over it
    (2056, BF16, True, 0, 3, NCCL),           # two-shot is built for 2, 4, 8 ranks only
    (2056, BF16, True, 8, 2, NCCL),           # two-shot output must be 16-byte aligned
    (2057, BF16, True, 0, 2, NCCL),           # ... and its size a multiple of 16 bytes
    (8, torch.float16, True, 0, 2, NCCL),     # no float16 kernel
    (8, BF16, False, 0, 2, NCCL),             # not dense
    (0, BF16, True, 0, 2, NCCL),
    (8, BF16, True, 0, 1, NCCL),
])
def test_select_algorithm(numel, dtype, contiguous, offset, world, want):
    assert select_algorithm(numel, dtype, contiguous, offset, world, CFG) == want


def test_config_checks_and_buffer_size():
    with pytest.raises(ValueError, match=">= 0"):
        CustomAllReduceConfig(-1, 10)
    assert CustomAllReduceConfig(100, 30).buffer_bytes == 112  # the one-shot limit, padded to 16 bytes
    for world in (2, 4, 8):
        c = default_config(world)
        assert 0 < c.one_shot_max_bytes <= c.two_shot_max_bytes <= c.buffer_bytes
    assert default_config(8).one_shot_max_bytes <= default_config(2).one_shot_max_bytes


def test_two_shot_ceiling_from_env(monkeypatch):
    monkeypatch.delenv(TWO_SHOT_MAX_ENV, raising=False)
    assert config_from_env(4) == default_config(4)
    monkeypatch.setenv(TWO_SHOT_MAX_ENV, "64")
    c = config_from_env(4)
    assert (c.one_shot_max_bytes, c.two_shot_max_bytes) == (default_config(4).one_shot_max_bytes, 64 << 20)
    assert c.buffer_bytes == 64 << 20  # the symmetric buffer grows with the ceiling
    monkeypatch.setenv(TWO_SHOT_MAX_ENV, "0.001")  # rounded down to the kernels' 16-byte vectors
    assert config_from_env(2).two_shot_max_bytes == 1040
    for bad in ("0", "-3", "lots"):
        monkeypatch.setenv(TWO_SHOT_MAX_ENV, bad)
        with pytest.raises(ValueError, match=TWO_SHOT_MAX_ENV):
            config_from_env(2)


def test_local_reasons():
    assert "not CUDA" in local_unavailable_reason(torch.device("cpu"), 2, "gloo")
    assert local_unavailable_reason(torch.device("cuda", 0), 1, "nccl") == "one rank"
    assert "gloo" in local_unavailable_reason(torch.device("cuda", 0), 2, "gloo")
    assert "2 hosts" in peer_access_reason([("a", 0), ("b", 0)], 0)
    assert peer_access_reason([("a", 0)], 0) is None  # no peer to check


def _rank(rank, port, queue):
    import torch.distributed as dist

    from attnserve.distributed.custom_all_reduce import agree, init_custom_all_reduce
    from attnserve.distributed.group import TPGroup

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=rank)
    cpu = dist.new_group([0, 1], backend="gloo")
    tp = TPGroup(rank=rank, size=2, device_group=dist.group.WORLD, cpu_group=cpu)
    tp.init_custom_all_reduce(torch.device("cpu"))
    x = torch.arange(5, dtype=torch.float32) * (rank + 1)
    summed = tp.all_reduce(x).tolist()
    off = init_custom_all_reduce(rank, 2, dist.group.WORLD, cpu, torch.device("cpu"), disable=True)
    joint = agree("no peer access" if rank == 1 else None, cpu, rank)
    queue.put((rank, tp.custom_all_reduce, summed, off, joint))
    dist.destroy_process_group()


def test_gloo_ranks_fall_back_and_agree():
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict((r, rest) for r, *rest in (queue.get() for _ in procs))
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    for rank in (0, 1):
        custom, summed, off, joint = got[rank]
        assert custom is None and off is None
        assert summed == [0.0, 3.0, 6.0, 9.0, 12.0]
        assert joint == "rank 1: no peer access"  # both ranks see rank 1's verdict


class _FakeSymmOps:
    """Stands in for ``torch.ops.symm_mem`` on one process: the "peer" holds the same values,
    so every reduction doubles the symmetric buffer's contents. Checks the arguments the
    real kernels check (dense, offset-0 buffer views, sizes a multiple of 4 bytes)."""

    def __init__(self, buffer):
        self.buffer, self.seen = buffer, []

    def _check(self, sym):
        assert sym.data_ptr() == self.buffer.data_ptr() and sym.is_contiguous()
        assert (sym.numel() * sym.element_size()) % 4 == 0

    def one_shot_all_reduce_copy_out(self, sym, local, op, group, out):
        self._check(sym)
        assert op == "sum" and group == "g" and local.numel() == sym.numel()
        sym.copy_(local)
        out.copy_(sym * 2)
        self.seen.append("one_shot_copy")

    def one_shot_all_reduce_out(self, sym, op, group, out):
        self._check(sym)
        out.copy_(sym * 2)
        self.seen.append("one_shot")

    def two_shot_all_reduce_out(self, sym, op, group, out):
        self._check(sym)
        assert out.data_ptr() % 16 == 0
        out.copy_(sym * 2)
        self.seen.append("two_shot")


def test_custom_paths_pad_and_write_in_place(monkeypatch):
    from attnserve.distributed.custom_all_reduce import CustomAllReduce

    cfg = CustomAllReduceConfig(one_shot_max_bytes=256, two_shot_max_bytes=1024)
    buf = torch.full((cfg.buffer_bytes,), 255, dtype=torch.uint8)  # stale bytes: must not leak into results
    ops = _FakeSymmOps(buf)
    monkeypatch.setattr(torch.ops, "symm_mem", ops, raising=False)
    custom = CustomAllReduce(rank=0, world_size=2, group_name="g", config=cfg, buffer=buf,
                             scratch=torch.empty(256, dtype=torch.uint8))
    base = torch.randn(400)
    for x, want in [(base[:8].clone(), "one_shot_copy"),  # 32 bytes, aligned
                    (base[:3].to(BF16), "one_shot"),  # 6 bytes: padded through scratch
                    (base[1:9], "one_shot"),  # offset 4 bytes
                    (base[:64].view(4, 16).clone(), "one_shot_copy"),
                    (base[:200].clone(), "two_shot"),
                    (base[:300].clone(), None)]:  # over the two-shot limit: NCCL
        before = x.clone()
        done = custom.all_reduce(x)
        assert done == (want is not None)
        if done:
            assert ops.seen[-1] == want
            assert torch.equal(x, before * 2)
        else:
            assert torch.equal(x, before)
    assert custom.calls == {ONE_SHOT: 4, TWO_SHOT: 1, NCCL: 1, FUSED: 0}
