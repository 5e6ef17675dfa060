"""Captured verify graphs share one logits buffer (`SharedGraphOutput`, `VerifyGraphRunner`):
logic on the CPU with fake CUDA graphs (the capture body runs once, eagerly; a replay only
counts). The GPU run with real graphs is tests/gpu/test_speculative_gpu.py."""

import contextlib
import gc
import weakref
from types import SimpleNamespace

import pytest
import torch

from attnserve.engine.graph_output import SharedGraphOutput
from attnserve.engine.speculative import verify_graph as vg

VOCAB = 11


class FakeGraph:
    def __init__(self):
        self.replays = 0

    def replay(self):
        self.replays += 1


class FakeStream:
    def wait_stream(self, other):
        pass


class FakeBackend:
    replay_hook_is_capturable = False

    def __init__(self):
        self.replayed = []

    def get_cuda_graph_seq_len_fill_value(self):
        return 1

    def init_forward_metadata_capture_cuda_graph(self, *a):
        pass

    def init_forward_metadata_replay_cuda_graph(self, bs, *a):
        self.replayed.append(bs)


class FakeModel:
    """Logits ``[rows, VOCAB]`` filled with ``rows`` (a new tensor per call, tracked)."""

    def __init__(self, ignore_out=False):
        self.made = []  # (rows, weakref)
        self.handed = []  # per call: None, or (rows, rows of the ``out`` it was handed)
        self.ignore_out = ignore_out

    def __call__(self, input_ids, positions, fb):
        return input_ids.float()[:, None]

    def compute_logits(self, hidden, out=None):
        rows = hidden.shape[0]
        self.handed.append(None if out is None else (rows, out.shape[0]))
        if out is not None and not self.ignore_out:
            return out.fill_(float(rows))  # written in place, as the LM head's GEMM does
        out = torch.full((rows, VOCAB), float(rows))
        self.made.append((rows, weakref.ref(out)))
        return out


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a, **k: (0, 0))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: FakeStream())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda g, pool=None, stream=None: contextlib.nullcontext())
    monkeypatch.setattr(vg, "capture_stream", lambda: FakeStream())


def _runner(ignore_out=False):
    return SimpleNamespace(device="cpu", attn_backend=FakeBackend(), model=FakeModel(ignore_out),
                           req_to_token_pool=None, token_to_kv_pool=None)


@pytest.mark.parametrize("ignore_out", [False, True], ids=["written-in-place", "copied"])
def test_every_verify_graph_returns_a_view_of_one_buffer(fake_cuda, ignore_out):
    n, sizes = 3, [1, 2, 4, 8]
    runner = _runner(ignore_out)
    g = vg.VerifyGraphRunner(runner, n, sizes)
    big = g.outputs[8]
    assert big.shape == (8 * n, VOCAB) and g.logits_buffer_bytes == 8 * n * VOCAB * 4
    for bs in sizes:
        out = g.outputs[bs]
        assert out.shape == (bs * n, VOCAB) and out.data_ptr() == big.data_ptr()
    # captured largest first, each smaller graph wrote (or copied) its logits into the leading rows
    expect = torch.cat([torch.full((k * n, VOCAB), float(v * n)) for k, v in ((1, 1), (1, 2), (2, 4), (4, 8))])
    assert torch.equal(big, expect)
    # the captures (every third call: two warm-ups first) of the smaller graphs were handed
    # the buffer's leading rows; the largest, captured first, had no buffer yet
    captured = runner.model.handed[2::3]
    assert captured == [None] + [(bs * n, bs * n) for bs in (4, 2, 1)]
    gc.collect()
    alive = sorted(rows for rows, ref in runner.model.made if ref() is not None)
    assert alive == [8 * n]  # the buffer; warm-up outputs and the smaller graphs' own logits are gone


def test_replay_returns_the_buffer_rows_of_the_padded_size(fake_cuda):
    n = 2
    runner = _runner()
    g = vg.VerifyGraphRunner(runner, n, [1, 2, 4])
    raw, t = 3, 3 * n
    packed = torch.cat([torch.tensor([5, 6, 7]), torch.tensor([10, 11, 12]), torch.arange(t) + 100,
                        torch.arange(t) + 200, torch.arange(t) + 300, torch.ones(t * n, dtype=torch.int64)])
    out = g.replay(packed, raw)
    assert [gr.replays for gr in (g.graphs[1], g.graphs[2], g.graphs[4])] == [0, 0, 1]  # padded to 4
    assert out.shape == (t, VOCAB) and out.data_ptr() == g.outputs[4].data_ptr()
    assert runner.attn_backend.replayed == [4]
    assert g.req_pool_indices.tolist() == [5, 6, 7, 0] and g.prefix_lens.tolist() == [10, 11, 12, 1]
    assert g.input_ids[t:].tolist() == [0] * n and g.out_cache_loc[:t].tolist() == list(range(300, 300 + t))
    assert g.replay(packed[: 1 + 1 + n + n + n + n * n], 1).data_ptr() == out.data_ptr()  # bs 1: same memory


def test_shared_output_binds_largest_first():
    shared = SharedGraphOutput()
    assert shared.nbytes == 0 and shared.target(1) is None
    first = torch.zeros(6, 4)
    assert shared.bind(first) is first and shared.nbytes == 6 * 4 * 4
    view = shared.bind(torch.full((2, 4), 3.0))
    assert view.data_ptr() == first.data_ptr() and view.shape == (2, 4)
    assert first[:2].eq(3.0).all() and first[2:].eq(0.0).all()
    target = shared.target(5)
    assert target.data_ptr() == first.data_ptr() and target.shape == (5, 4) and shared.target(7) is None
    target.fill_(9.0)
    assert shared.bind(target) is target  # written in place: returned as it is, no copy
    assert first[:5].eq(9.0).all() and first[5:].eq(0.0).all()
    for bad in (torch.zeros(7, 4), torch.zeros(2, 5), torch.zeros(2, 4, dtype=torch.float64), torch.zeros(8)):
        with pytest.raises(ValueError, match="largest graph first"):
            shared.bind(bad)
