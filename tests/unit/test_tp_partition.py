"""Tensor-parallel partitions and layers in one process: every rank's slice of every
parameter is the matching part of the tp-1 tensor, and the ranks' partial outputs sum to the
tp-1 layer's output (collectives replaced by a manual sum)."""

import pytest
import torch

from attnserve.distributed.group import TPGroup
from attnserve.distributed.partition import check_tp_size, kv_head_range, q_head_range, vocab_range
from attnserve.model_loader.loader import load_model
from attnserve.models.layers.parallel import ColumnParallelLinear, load_param
from numeric_bounds import assert_within, dot_product_bound, forward_bound


class NoCommGroup(TPGroup):
    """A rank of a group whose all-reduce is left to the test (returns the partial sum)."""

    def all_reduce(self, x):
        return x


def test_head_ranges_split_and_replicate():
    assert [q_head_range(32, 4, r).start for r in range(4)] == [0, 8, 16, 24]
    assert [(kv_head_range(8, 4, r).start, kv_head_range(8, 4, r).count) for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    # fewer KV heads than ranks: each head on size / heads consecutive ranks
    rngs = [kv_head_range(2, 8, r) for r in range(8)]
    assert [r.start for r in rngs] == [0, 0, 0, 0, 1, 1, 1, 1] and all(r.count == 1 and r.replicas == 4 for r in rngs)
    # the query heads of a rank always map to its KV head (GQA groups of 16 q heads)
    for r in range(8):
        q = q_head_range(32, 8, r)
        assert {h // 16 for h in range(q.start, q.start + q.count)} == {rngs[r].start}


@pytest.mark.parametrize("heads,kv,tp,what", [(9, 3, 2, "attention heads"), (8, 6, 4, "KV heads"),
                                               (12, 3, 2, "KV heads")])
def test_tp_size_errors(heads, kv, tp, what):
    with pytest.raises(ValueError, match=what):
        check_tp_size(heads, kv, tp)


def test_vocab_range_pads_the_last_rank():
    assert [vocab_range(301, 2, r) for r in range(2)] == [(0, 151, 151), (151, 151, 150)]
    assert vocab_range(256, 1, 0) == (0, 256, 256)


def test_load_param_parts_and_errors():
    from attnserve.distributed.partition import HeadRange

    torch.manual_seed(0)
    full_q, full_k = torch.randn(8, 4), torch.randn(4, 4)  # 4 q heads and 2 kv heads of dim 2
    for rank in range(2):
        lin = ColumnParallelLinear(4, [(q_head_range(4, 2, rank), 2), (kv_head_range(2, 2, rank), 2)])
        load_param(lin.weight, full_q, "q", part=0)
        load_param(lin.weight, full_k, "k", part=1)
        assert torch.equal(lin.weight[:4], full_q[4 * rank: 4 * rank + 4])
        assert torch.equal(lin.weight[4:], full_k[2 * rank: 2 * rank + 2])
        with pytest.raises(ValueError, match="shape"):
            load_param(lin.weight, torch.randn(6, 4), "q", part=0)
        with pytest.raises(ValueError, match="no part 2"):
            load_param(lin.weight, full_k, "x", part=2)
    lin = ColumnParallelLinear(4, [(HeadRange(0, 3, 3), 2)])
    load_param(lin.weight, torch.arange(24.0).view(6, 4), "w")
    assert torch.equal(lin.weight, torch.arange(24.0).view(6, 4))


def _models(name, tp_size):
    kw = dict(load_format="dummy", load_tokenizer=False)
    full = load_model(name, **kw).model
    ranks = [load_model(name, tp=NoCommGroup(rank=r, size=tp_size), **kw).model for r in range(tp_size)]
    return full, ranks


def _check_slices(full, ranks):
    fp = dict(full.named_parameters())
    for m in ranks:
        for name, p in m.named_parameters():
            spec = getattr(p, "tp_shard", None)
            f = fp[name]
            if spec is None:
                assert torch.equal(p, f), name
                continue
            assert spec.full_size == f.shape[spec.dim], name
            for pc in spec.pieces:
                assert torch.equal(p.narrow(spec.dim, pc.local_offset, pc.length),
                                   f.narrow(spec.dim, pc.part_offset + pc.src_offset, pc.length)), name


@pytest.mark.parametrize("name,tp_size", [("llama-tiny", 2), ("llama-tiny", 4), ("qwen3-tiny", 2),
                                          ("deepseek-v2-tiny", 4), ("smollm2-135m", 3)])
def test_dummy_slices_match_tp1(name, tp_size):
    full, ranks = _models(name, tp_size)
    _check_slices(full, ranks)


@pytest.mark.parametrize("name,tp_size", [("llama-tiny", 2), ("qwen3-tiny", 2), ("deepseek-v2-tiny", 4)])
def test_partial_outputs_sum_to_tp1(name, tp_size):
    full, ranks = _models(name, tp_size)
    torch.manual_seed(1)
    hidden = full.config.hidden_size
    x = torch.randn(5, hidden)
    layer = lambda m: m.model.layers[0]  # noqa: E731
    got = sum(layer(m).mlp(x) for m in ranks)
    want = layer(full).mlp(x)
    # gate/up then down: the ranks sum the down projection's terms in another order (and
    # their GEMM shapes may pick other kernels); float32 rounding of two chained GEMMs,
    # N = hidden + intermediate terms, relative to the largest output (tests/numeric_bounds.py)
    mlp_terms = hidden + layer(full).mlp.down_proj.in_features
    assert_within(got, want, forward_bound(want, mlp_terms), f"{name} tp{tp_size} mlp")
    # row-parallel output projection: each rank's input columns; the sum over ranks is one
    # more order of the same dot products, within Higham's bound of each element
    attn = layer(full).self_attn
    cols = attn.o_proj.in_features
    a = torch.randn(5, cols)
    per = cols // tp_size
    got = sum(layer(m).self_attn.o_proj(a[:, r * per:(r + 1) * per]) for r, m in enumerate(ranks))
    assert_within(got, attn.o_proj(a), dot_product_bound(a, attn.o_proj.weight, attn.o_proj.bias),
                  f"{name} tp{tp_size} o_proj")
    ids = torch.tensor([0, 3, full.config.vocab_size // 2, full.config.vocab_size - 1])
    torch.testing.assert_close(sum(m.model.embed_tokens(ids) for m in ranks), full.model.embed_tokens(ids))
