import pytest
import torch

from attention_harness import backend_config, make_batch, naive_reference
from attnserve.attention.registry import available_backends, create_attention_backend
from attnserve.attention.torch_native import TorchNativeAttnBackend
from attnserve.forward_batch import ForwardMode, VerifyInput


def _run(case, backend):
    case.fb.attn_backend = backend
    backend.init_forward_metadata(case.fb)
    out = case.layer(case.q.reshape(case.q.shape[0], -1), case.k.reshape(case.k.shape[0], -1),
                     case.v.reshape(case.v.shape[0], -1), case.fb)
    return out.view(case.q.shape[0], case.layer.tp_q_head_num, case.layer.v_head_dim)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("window,logit_cap", [(-1, 0.0), (5, 0.0), (-1, 3.0), (3, 10.0)])
def test_extend_with_prefix_matches_float64(hq, hkv, page_size, window, logit_cap):
    seed = hash((hq, hkv, page_size, window, logit_cap)) % 1000
    case = make_batch(ForwardMode.EXTEND, [0, 7, 3, 20], [5, 1, 9, 4], hq, hkv, 16, page_size,
                      window=window, logit_cap=logit_cap, seed=seed)
    out = _run(case, TorchNativeAttnBackend(backend_config(case)))
    ref = naive_reference(case)
    assert torch.allclose(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("window", [-1, 6])
def test_decode_matches_float64(page_size, window):
    case = make_batch(ForwardMode.DECODE, [0, 12, 33, 5], [1, 1, 1, 1], 6, 2, 8, page_size, window=window,
                      seed=page_size + window, sm_scale=0.3)
    out = _run(case, TorchNativeAttnBackend(backend_config(case)))
    assert torch.allclose(out.double(), naive_reference(case), atol=1e-5, rtol=1e-5)


def test_mixed_batch_and_writes_kv():
    case = make_batch(ForwardMode.MIXED, [0, 9, 4], [6, 1, 1], 4, 2, 8, 4, seed=3)
    out = _run(case, TorchNativeAttnBackend(backend_config(case)))
    assert torch.allclose(out.double(), naive_reference(case), atol=1e-5, rtol=1e-5)
    # the new tokens' K/V landed in their out_cache_loc slots
    k_buf = case.pool.get_key_buffer(0)
    assert torch.equal(k_buf[case.fb.out_cache_loc], case.k)


def test_float16_and_custom_mask():
    case = make_batch(ForwardMode.TARGET_VERIFY, [5, 2], [3, 4], 4, 4, 8, 1, dtype=torch.float16, seed=11)
    g = torch.Generator().manual_seed(0)
    masks, flat = [], []
    for p, e in zip(case.prefix_lens, case.extend_lens):
        m = torch.rand(e, p + e, generator=g) < 0.6
        m[:, 0] = True
        masks.append(m)
        flat.append(m.flatten())

    case.fb.spec_info = VerifyInput(torch.cat(flat), torch.tensor([0, masks[0].numel()]), case.fb.positions,
                                    [m.shape[0] for m in masks])
    out = _run(case, TorchNativeAttnBackend(backend_config(case)))
    ref = naive_reference(case, custom_masks=masks)
    assert (out.double() - ref).abs().max() < 2e-3


def test_registry_rejects_unknown_backend():
    assert "torch_native" in available_backends()
    with pytest.raises(ValueError, match="valid backends: .*torch_native"):
        create_attention_backend("flashattn9000", None)


@pytest.mark.parametrize("window", [-1, 4])
def test_decode_never_reads_invisible_slots(window):
    """Poison every KV slot no query may see (outside windows, padding, free slots)."""
    case = make_batch(ForwardMode.DECODE, [3, 17, 9], [1, 1, 1], 4, 2, 8, 4, window=window, seed=21)
    ref = None
    backend = TorchNativeAttnBackend(backend_config(case))
    # write the new tokens' K/V first, then compute the reference from the clean pool
    case.pool.set_kv_buffer(case.layer, case.fb.out_cache_loc, case.k, case.v)
    ref = naive_reference(case)
    visible = set()
    for row, p in zip(case.rows, case.prefix_lens):
        lo = 0 if window < 0 else max(0, p - window)
        visible |= set(case.req_to_token[row, lo:p + 1].tolist())
    for buf in (case.pool.get_key_buffer(0), case.pool.get_value_buffer(0)):
        hidden = torch.tensor(sorted(set(range(buf.shape[0])) - visible))
        buf[hidden] = float("nan")
    case.fb.attn_backend = backend
    backend.init_forward_metadata(case.fb)
    out = backend.forward_decode(case.q.reshape(3, -1), None, None, case.layer, case.fb, save_kv_cache=False)
    out = out.view(3, 4, 8)
    assert not torch.isnan(out).any()
    assert torch.allclose(out.double(), ref, atol=1e-5)
