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
