import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnserve.mem_cache.memory_pool import (
    MHATokenToKVPool,
    MLATokenToKVPool,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
)


class _Layer:
    """What a pool reads of a layer: its id and its FP8 KV scales."""

    def __init__(self, layer_id):
        self.layer_id = layer_id
        self.k_scale = self.v_scale = 1.0


def test_req_to_token_pool_alloc_free():
    pool = ReqToTokenPool(3, 16, "cpu")
    rows = pool.alloc(2)
    assert len(set(rows)) == 2 and pool.available_size() == 1
    assert pool.alloc(2) is None and pool.available_size() == 1  # nothing taken on failure
    pool.free(rows[0])
    with pytest.raises(ValueError):
        pool.free(rows[0])
    pool.write(rows[1], 3, torch.tensor([7, 8, 9]))
    assert pool.req_to_token[rows[1], 3:6].tolist() == [7, 8, 9]


@pytest.mark.parametrize("page_size", [1, 4])
def test_allocator_reserves_page_zero_and_reports_full(page_size):
    a = TokenToKVPoolAllocator(8 * page_size, page_size)
    slots = a.alloc(8 * page_size)
    assert slots is not None and slots.min().item() >= page_size  # page 0 never handed out
    assert len(set(slots.tolist())) == 8 * page_size
    assert a.alloc(1) is None
    a.free(slots)
    assert a.available_size() == 8 * page_size
    with pytest.raises(ValueError):
        a.free(slots)  # double free


def test_alloc_extend_continues_partial_pages():
    a = TokenToKVPoolAllocator(64, 4)
    first = a.alloc_extend([0], [6], [0])  # 6 tokens: one full page + half a page
    assert first.tolist()[:4] == list(range(first[0].item(), first[0].item() + 4))
    assert first[4].item() % 4 == 0 and first[5].item() == first[4].item() + 1
    more = a.alloc_extend([6], [9], [first[-1].item()])  # 2 fill the page, 1 opens a new one
    assert more[:2].tolist() == [first[-1].item() + 1, first[-1].item() + 2]
    assert more[2].item() % 4 == 0
    assert a.pages_needed(6, 9) == 1 and a.pages_needed(0, 8) == 2 and a.pages_needed(8, 8) == 0


@settings(max_examples=60, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 4, 16]),
    ops=st.lists(st.tuples(st.booleans(), st.integers(1, 40)), min_size=1, max_size=60),
)
def test_random_alloc_free_never_double_hands_out(page_size, ops):
    """Random request growth and frees: no slot owned twice; the pool ends full again."""
    a = TokenToKVPoolAllocator(256, page_size)
    owned = {}  # req -> list of slots
    next_id = 0
    for grow, n in ops:
        if grow or not owned:
            if owned and n % 2:
                rid = sorted(owned)[n % len(owned)]
                cur = owned[rid]
                got = a.alloc_extend([len(cur)], [len(cur) + n], [cur[-1]])
            else:
                rid, cur = next_id, []
                next_id += 1
                got = a.alloc_extend([0], [n], [0])
            if got is None:
                continue
            owned.setdefault(rid, []).extend(got.tolist())
        else:
            rid = sorted(owned)[n % len(owned)]
            a.free(torch.tensor(owned.pop(rid)))
        all_slots = [s for v in owned.values() for s in v]
        assert len(all_slots) == len(set(all_slots))
        assert all(s >= page_size for s in all_slots)
        pages_in_use = {s // page_size for s in all_slots}
        assert a.available_size() == a.size - len(pages_in_use) * page_size
    for v in owned.values():
        a.free(torch.tensor(v))
    assert a.available_size() == a.size


def test_mha_pool_set_and_paged_view():
    pool = MHATokenToKVPool(32, 4, torch.float32, head_num=2, head_dim=8, layer_num=2, device="cpu")
    assert pool.k_buffer[0].shape == (36, 2, 8)
    loc = torch.tensor([5, 6, 13])
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    pool.set_kv_buffer(_Layer(1), loc, k, v)
    assert torch.equal(pool.get_key_buffer(1)[loc], k) and torch.equal(pool.get_value_buffer(1)[loc], v)
    assert pool.get_key_buffer(0).abs().sum() == 0
    paged = pool.paged_view(pool.get_key_buffer(1))
    assert paged.shape == (9, 4, 2, 8) and paged.data_ptr() == pool.k_buffer[1].data_ptr()
    assert torch.equal(paged[3, 1], k[2])  # slot 13 = page 3, offset 1


def test_mla_pool_layout():
    pool = MLATokenToKVPool(16, 1, torch.float32, kv_lora_rank=8, qk_rope_head_dim=4, layer_num=1, device="cpu")
    loc = torch.tensor([2, 3])
    nope, rope = torch.randn(2, 1, 8), torch.randn(2, 1, 4)
    pool.set_mla_kv_buffer(_Layer(0), loc, nope, rope)
    assert torch.equal(pool.get_key_buffer(0)[loc], torch.cat([nope, rope], -1))
    assert torch.equal(pool.get_value_buffer(0)[loc], nope)
