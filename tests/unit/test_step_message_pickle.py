"""`StepMessage` round-trips through pickle (how rank 0 broadcasts a step) with every host
tensor's dtype, shape and values, and its ``req_to_token`` writes."""

import pickle

import torch

from attnserve.engine.step_inputs import host_step_layout
from attnserve.engine.tp.step_sync import StepMessage
from attnserve.forward_batch import ForwardMode


def _message(seed: int) -> StepMessage:
    g = torch.Generator().manual_seed(seed)
    bs = int(torch.randint(1, 9, (1,), generator=g))
    prefix = torch.randint(0, 50, (bs,), generator=g).tolist()
    extend = torch.randint(1, 20, (bs,), generator=g).tolist()
    host = host_step_layout(list(range(bs)), prefix, extend)
    n = sum(extend)
    loc = torch.randint(1, 1000, (n,), generator=g)
    host.update(input_ids=torch.randint(-1, 30000, (n,), generator=g), out_cache_loc=loc,
                out_cache_loc_i32=loc.to(torch.int32), emit_index=torch.arange(bs))
    writes = [(3, 7, torch.randint(0, 99, (5,), generator=g, dtype=torch.int32))]
    return StepMessage(ForwardMode.EXTEND, host, prefix, extend, bool(seed % 2), bs, writes)


def test_step_message_round_trips_through_pickle():
    for seed in range(5):
        msg = _message(seed)
        got = pickle.loads(pickle.dumps(msg))
        assert got.host.keys() == msg.host.keys()
        for k, v in msg.host.items():
            assert isinstance(got.host[k], torch.Tensor), k
            assert got.host[k].dtype == v.dtype and torch.equal(got.host[k], v), k
        assert (got.forward_mode, got.prefix_lens, got.extend_lens, got.has_future, got.num_emit) == \
            (msg.forward_mode, msg.prefix_lens, msg.extend_lens, msg.has_future, msg.num_emit)
        [(row, start, slots)] = got.r2t_writes
        assert (row, start) == (3, 7) and slots.dtype == torch.int32 and torch.equal(slots, msg.r2t_writes[0][2])
        # the sender's message is untouched (still tensors), and the copy is writable
        assert all(isinstance(v, torch.Tensor) for v in msg.host.values())
        got.host["positions"].add_(1)


def test_local_sampling_round_trips_and_samples_like_rank0():
    """`LocalSampling` travels with the step (pickle protocol 4 over gloo, 5 with out-of-band
    buffers through the shared-memory queue) and samples exactly what
    `SamplingBatchInfo.from_params` + `sample` give on one GPU."""
    from attnserve.engine.sampler import SamplingBatchInfo, host_sampling_tensors, sample
    from attnserve.engine.sampling_params import SamplingParams
    from attnserve.engine.tp.step_sync import LocalSampling

    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=5),
              SamplingParams(temperature=1.2, top_p=0.7, min_p=0.02), SamplingParams(temperature=0.5)]
    seeds, positions = [11, 12, 13, 2**40 + 5], [0, 3, 9, 1]
    logits = torch.randn(4, 97, generator=torch.Generator().manual_seed(0))
    want = sample(logits, SamplingBatchInfo.from_params(params, seeds, positions, "cpu"))
    for local in (LocalSampling(*host_sampling_tensors(params, seeds, positions)), LocalSampling()):
        msg = _message(0)
        msg.local_sampling = local
        buffers = []
        data5 = pickle.dumps(msg, protocol=5, buffer_callback=buffers.append)
        for got in (pickle.loads(pickle.dumps(msg, protocol=4)), pickle.loads(data5, buffers=buffers)):
            ls = got.local_sampling
            assert ls.flags == local.flags
            if local.floats is None:
                assert ls.floats is None and ls.ints is None
                assert torch.equal(ls.sample(logits), logits.argmax(-1))
            else:
                assert ls.floats.dtype == torch.float32 and torch.equal(ls.floats, local.floats)
                assert ls.ints.dtype == torch.int64 and torch.equal(ls.ints, local.ints)
                assert torch.equal(ls.sample(logits), want)
    assert not torch.equal(want, logits.argmax(-1))  # the sampled rows did not all fall on argmax
