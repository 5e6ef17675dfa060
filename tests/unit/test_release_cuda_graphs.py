"""`ModelRunner.release_cuda_graphs` / `CudaGraphRunner.release`: the tensor-parallel
shutdown step that destroys captured graphs before the NCCL groups (logic only, with fake
graphs and events; the GPU run is tests/gpu/test_tp_gpu.py)."""

import torch

from attnserve.engine.cuda_graph_runner import CudaGraphRunner
from attnserve.engine.model_runner import ModelRunner
from attnserve.forward_batch import ForwardBatch, ForwardMode


class FakeGraph:
    def __init__(self):
        self.resets = 0

    def reset(self):
        self.resets += 1


class FakeEvent:
    """``query()`` answers from ``answers`` (then keeps the last answer)."""

    def __init__(self, answers):
        self.answers = list(answers)
        self.recorded = False

    def record(self):
        self.recorded = True

    def query(self):
        assert self.recorded, "query before record"
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


def _runner_with_graphs(n=3):
    graphs = CudaGraphRunner.__new__(CudaGraphRunner)
    graphs.graphs = {bs: FakeGraph() for bs in (1, 2, 4)[:n]}
    graphs.outputs = {bs: torch.zeros(bs, 8) for bs in graphs.graphs}
    graphs.max_bs = max(graphs.graphs)
    runner = ModelRunner.__new__(ModelRunner)
    runner.cuda_graph_runner = graphs
    return runner, graphs


def test_release_waits_for_the_device_then_resets_every_graph(monkeypatch):
    runner, graphs = _runner_with_graphs()
    fakes = dict(graphs.graphs)
    events = []
    monkeypatch.setattr(torch.cuda, "Event", lambda: events.append(FakeEvent([False, False, True])) or events[-1])
    assert runner.release_cuda_graphs(drain_timeout_s=5.0) is True
    assert len(events) == 1 and events[0].answers == [True]  # polled until the device drained
    assert [g.resets for g in fakes.values()] == [1, 1, 1]
    assert graphs.graphs == {} and graphs.outputs == {}
    assert runner.cuda_graph_runner is None
    assert runner.release_cuda_graphs() is True  # idempotent: nothing left to release


def test_graphs_are_kept_when_the_device_does_not_drain(monkeypatch):
    runner, graphs = _runner_with_graphs()
    fakes = dict(graphs.graphs)
    monkeypatch.setattr(torch.cuda, "Event", lambda: FakeEvent([False]))
    assert runner.release_cuda_graphs(drain_timeout_s=0.05) is False
    assert [g.resets for g in fakes.values()] == [0, 0, 0]
    assert runner.cuda_graph_runner is graphs and len(graphs.graphs) == 3


def test_a_released_graph_runner_no_longer_runs_decode():
    _, graphs = _runner_with_graphs()
    fb = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=2, input_ids=torch.zeros(2, dtype=torch.int64),
                      positions=torch.zeros(2, dtype=torch.int64), req_pool_indices=torch.zeros(2, dtype=torch.int64),
                      seq_lens=torch.ones(2, dtype=torch.int32), out_cache_loc=torch.zeros(2, dtype=torch.int64))
    assert graphs.can_run(fb)
    graphs.release()
    assert not graphs.can_run(fb)
