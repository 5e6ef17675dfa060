"""What rank 0 sends the other tensor-parallel ranks each step, and the device half of a
step that every rank runs.

Rank 0's scheduler decides a step on the host (requests, token counts, KV slots) and
broadcasts it as a `StepMessage` (`TPGroup.broadcast_step`: the shared-memory step queue
when every rank shares rank 0's node, else the gloo CPU group). Every rank then runs
`execute_step` on its own pools: the same packed inputs, the same ``req_to_token`` writes
and the same forward (whose all-reduces and logit all-gather pair up across ranks). Each
rank scatters the step's sampled ids into its own future-token map, so decode inputs stay
on the device everywhere and overlap scheduling works as on one GPU. The ids get there in
one of two ways, chosen by rank 0 for each step (`StepMessage.local_sampling`):

* **local** (SGLang's way: every TP rank runs the sampler): the logits are all-gathered
  (`attnserve.models.layers.parallel.gather_logits`: a copy of every rank's vocabulary
  slice, so every rank holds the same bits), and greedy argmax and `sampler.sample` are
  pure functions of the logits and of host inputs rank 0 ships in the message (the rows'
  temperatures, top-k/p, min-p, seeds and output positions; the counter-based uniforms
  depend on (seed, position, token id) only). Every rank then samples the same ids with
  no collective. Taken when no sampling row needs state only rank 0 holds.
* **broadcast**: rank 0 samples and sends its ids with one device broadcast (~125 us a
  step on H100/H200 at tp 2). Taken for steps with a grammar-constrained row (the
  xgrammar matchers and masks live on rank 0) or a logit control (penalty counts,
  ``logit_bias`` and ``min_tokens`` state live on rank 0: `attnserve.engine.penalties`),
  and for every step when ``ATTNSERVE_TP_SAMPLE=broadcast`` (A/B timing).

Logprobs are computed on rank 0 alone, from the logits it also samples from.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from attnserve.engine.sampler import SamplingBatchInfo, argmax_last, host_sampling_tensors, sample
from attnserve.engine.step_inputs import StepInputPacker, StepTensors
from attnserve.forward_batch import ForwardBatch, ForwardMode

#: environment variable: how the other ranks get a step's sampled ids (``local`` where
#: every row allows it, the default; ``broadcast`` for every step, the old path)
TP_SAMPLE_ENV = "ATTNSERVE_TP_SAMPLE"
_TP_SAMPLE_MODES = ("local", "broadcast")


def tp_sample_mode() -> str:
    """``"local"`` or ``"broadcast"`` (`TP_SAMPLE_ENV`, default ``local``).

    Raises:
        ValueError: any other value.
    """
    value = os.environ.get(TP_SAMPLE_ENV, "").strip().lower() or "local"
    if value not in _TP_SAMPLE_MODES:
        raise ValueError(f"{TP_SAMPLE_ENV}={value!r}: expected one of {', '.join(_TP_SAMPLE_MODES)}")
    return value


@dataclass
class LocalSampling:
    """A step that every rank samples itself from its copy of the all-gathered logits.

    Attributes:
        floats / ints / flags: `sampler.host_sampling_tensors` of the sampling rows
            (float32 ``[3, n]``, int64 ``[4, n]`` on the CPU, three host flags); all None
            when every row is greedy (argmax).
    """

    floats: Optional[torch.Tensor] = None
    ints: Optional[torch.Tensor] = None
    flags: Optional[Tuple[bool, bool, bool]] = None

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """int64 ``[n]`` ids of ``logits`` ``[n, V]`` (the sampling rows), on its device."""
        if self.floats is None:
            return argmax_last(logits)
        return sample(logits, SamplingBatchInfo.from_host(self.floats, self.ints, self.flags, logits.device))

    # the two tensors travel out of band with pickle protocol 5 (the shared-memory step
    # queue), as numpy arrays below it (gloo), like `StepMessage`'s host tensors
    def __reduce_ex__(self, protocol):
        if protocol >= 5:
            from attnserve.engine.tp.step_codec import tensor_to_raw as enc
        else:
            enc = _to_numpy
        return _restore_local_sampling, (enc(self.floats), enc(self.ints), self.flags)


def _restore_local_sampling(floats, ints, flags) -> LocalSampling:
    from attnserve.engine.tp.step_codec import tensor_from_raw

    return LocalSampling(_from_numpy(tensor_from_raw(floats)), _from_numpy(tensor_from_raw(ints)), flags)


@dataclass
class StepMessage:
    """One step, as rank 0 scheduled it.

    Attributes:
        forward_mode: EXTEND / DECODE / MIXED.
        host: the host tensors of every `StepTensors` field (``input_ids`` -1 where the
            token is read from the future-token map).
        prefix_lens / extend_lens: per request.
        has_future: some input ids come from the future-token map.
        num_emit: requests that sample a token (0: no ids broadcast after the forward).
        r2t_writes: ``(row, start, slots)`` single-request ``req_to_token`` writes rank 0
            made since the previous step (prefix-cache matches), applied first.
        prompt_plan: the prompt positions whose logprobs are wanted
            (`attnserve.engine.logprobs.PromptLogprobPlan`), or None.
        local_sampling: every rank samples the step itself (`LocalSampling`); None: the
            ids come from rank 0 with one device broadcast (when ``num_emit`` > 0).
    """

    forward_mode: ForwardMode
    host: dict
    prefix_lens: List[int]
    extend_lens: List[int]
    has_future: bool
    num_emit: int
    r2t_writes: List[Tuple[int, int, torch.Tensor]] = field(default_factory=list)
    prompt_plan: Optional[object] = None
    local_sampling: Optional[LocalSampling] = None

    # Pickled once a step by rank 0 and unpickled by every other rank. A torch tensor
    # pickles through torch's storage serializer (~0.5 ms for the step's 11 small tensors
    # each way on a 2-core CPU); the same values as numpy arrays take ~40 us to pickle and
    # ~30 us to restore, so host tensors travel as numpy and come back as tensors.
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["host"] = {k: _to_numpy(v) for k, v in self.host.items()}
        state["r2t_writes"] = [(row, start, _to_numpy(slots)) for row, start, slots in self.r2t_writes]
        return state

    def __setstate__(self, state: dict) -> None:
        state["host"] = {k: _from_numpy(v) for k, v in state["host"].items()}
        state["r2t_writes"] = [(row, start, _from_numpy(slots)) for row, start, slots in state["r2t_writes"]]
        self.__dict__.update(state)

    # Protocol 5 (the shared-memory step queue, `attnserve.distributed.shm_broadcast`):
    # the host tensors travel as one flat out-of-band buffer per dtype (`step_codec`),
    # copied into shared memory rather than pickled, and come back as views of the
    # receiver's copy of the frame. Protocols < 5 (gloo's ``broadcast_object_list``) keep
    # the numpy state above.
    def __reduce_ex__(self, protocol):
        if protocol < 5:
            return super().__reduce_ex__(protocol)
        from attnserve.engine.tp.step_codec import pack_tensors, packable, tensor_to_raw

        state = dict(self.__dict__)
        if packable(self.host):
            state["host"] = pack_tensors(self.host)
        if self.r2t_writes:
            state["r2t_writes"] = [(row, start, tensor_to_raw(slots)) for row, start, slots in self.r2t_writes]
        return _restore_step_message, (state,)


def _to_numpy(x):
    return x.numpy() if isinstance(x, torch.Tensor) and x.device.type == "cpu" and not x.requires_grad else x


def _from_numpy(x):
    import numpy as np

    return torch.from_numpy(x) if isinstance(x, np.ndarray) else x


def _restore_step_message(state: dict) -> "StepMessage":
    from attnserve.engine.tp.step_codec import PackedTensors, tensor_from_raw, unpack_tensors

    if isinstance(state["host"], PackedTensors):
        state["host"] = unpack_tensors(state["host"])
    if state["r2t_writes"]:
        state["r2t_writes"] = [(row, start, tensor_from_raw(slots)) for row, start, slots in state["r2t_writes"]]
    msg = StepMessage.__new__(StepMessage)
    msg.__dict__.update(state)
    return msg


#: the message that stops the other ranks' loops
SHUTDOWN = "shutdown"


def execute_step(runner, packer: StepInputPacker, token_map: torch.Tensor,
                 msg: StepMessage) -> Tuple[torch.Tensor, StepTensors]:
    """Copy the step's inputs to the device, write ``req_to_token``, run the forward.

    Args:
        runner: the rank's `ModelRunner`.
        packer: the rank's `StepInputPacker`.
        token_map: int64 ``[req_to_token rows]`` last sampled id of each row.
        msg: the step.

    Returns:
        ``(logits, dev)``: float32 ``[bs, vocab]`` logits of each request's last token and
        the step's device tensors.
    """
    host = msg.host
    r2t = runner.req_to_token_pool
    dev = packer.pack(host)
    r2t.write_device(host["token_rows"], host["positions"], host["out_cache_loc_i32"], dev.token_rows,
                     dev.positions, dev.out_cache_loc_i32)
    input_ids = dev.input_ids
    if msg.has_future:
        if msg.forward_mode.is_decode():
            input_ids = token_map[dev.req_pool_indices]
        else:
            input_ids = torch.where(input_ids >= 0, input_ids, token_map[dev.token_rows])
    fb = ForwardBatch(
        forward_mode=msg.forward_mode, batch_size=len(msg.extend_lens), input_ids=input_ids,
        positions=dev.positions, req_pool_indices=dev.req_pool_indices, seq_lens=dev.seq_lens,
        out_cache_loc=dev.out_cache_loc, seq_lens_cpu=host["seq_lens"],
        seq_lens_sum=sum(msg.prefix_lens) + sum(msg.extend_lens),
        extend_prefix_lens=dev.extend_prefix_lens, extend_seq_lens=dev.extend_seq_lens,
        extend_prefix_lens_cpu=list(msg.prefix_lens), extend_seq_lens_cpu=list(msg.extend_lens),
        extend_start_loc=dev.extend_start_loc, req_to_token_pool=r2t,
        token_to_kv_pool=runner.token_to_kv_pool, attn_backend=runner.attn_backend,
    )
    return runner.forward(fb, prompt_plan=msg.prompt_plan), dev


def emit_rows(dev: StepTensors, num_emit: int) -> torch.Tensor:
    """``req_to_token`` rows of the requests that sample (all of them, or ``emit_index``'s)."""
    return dev.req_pool_indices if num_emit == dev.req_pool_indices.numel() else dev.req_pool_indices[dev.emit_index]


class StepSender:
    """Rank 0's side: broadcast each step, then (unless every rank samples it) its sampled ids.

    Args:
        tp: rank 0's `TPGroup` (size > 1).
        req_to_token_pool: rank 0's pool; its single-request writes are logged
            (``write_log``) and travel with the next step.

    Attributes:
        sample_local: `tp_sample_mode` is ``local`` (read once, here).
        local_steps / ids_broadcasts: steps every rank sampled itself / whose ids rank 0
            broadcast.
    """

    def __init__(self, tp, req_to_token_pool):
        self.tp = tp
        self.r2t = req_to_token_pool
        self.r2t.write_log = []
        self.sample_local = tp_sample_mode() == "local"
        self.local_steps = 0
        self.ids_broadcasts = 0

    def local_sampling(self, reqs, positions) -> Optional[LocalSampling]:
        """How every rank samples a step whose sampling rows are ``reqs`` (`Req`, in order;
        ``positions``: their output tokens before this step), or None when rank 0 must
        broadcast the ids: local sampling is off, or some row is grammar-constrained or has
        a logit control (state that only rank 0 holds)."""
        if not self.sample_local or not reqs:
            return None
        if any(r.grammar is not None or r.control_slot is not None for r in reqs):
            return None
        self.local_steps += 1
        params = [r.sampling_params for r in reqs]
        if all(p.is_greedy for p in params):
            return LocalSampling()
        return LocalSampling(*host_sampling_tensors(params, [r.seed for r in reqs], positions))

    def send_step(self, msg: StepMessage) -> None:
        msg.r2t_writes, self.r2t.write_log = self.r2t.write_log, []
        self.tp.broadcast_step(msg)

    def send_ids(self, next_ids: torch.Tensor) -> None:
        self.ids_broadcasts += 1
        self.tp.broadcast(next_ids.contiguous())

    def shutdown(self) -> None:
        self.tp.broadcast_step(SHUTDOWN)


def follow_steps(runner, tp) -> int:
    """A non-zero rank's loop: receive each step from rank 0 and run it, until SHUTDOWN.

    Returns:
        the number of steps run.
    """
    device = torch.device(runner.device)
    packer = StepInputPacker(device)
    r2t = runner.req_to_token_pool
    token_map = torch.zeros(r2t.size, dtype=torch.int64, device=device)
    steps = 0
    while True:
        msg = tp.broadcast_step(None)
        if isinstance(msg, str) and msg == SHUTDOWN:
            return steps
        for row, start, slots in msg.r2t_writes:
            r2t.write(row, start, slots)
        host = msg.host  # the host mirror (on the CPU the table itself), as rank 0 wrote it
        r2t.write_host(host["token_rows"], host["positions"], host["out_cache_loc_i32"])
        logits, dev = execute_step(runner, packer, token_map, msg)
        if msg.num_emit:
            if msg.local_sampling is not None:  # as rank 0 does (`StepSampling._enqueue_sampling`)
                if msg.num_emit != len(msg.extend_lens):
                    logits = logits[dev.emit_index]
                ids = msg.local_sampling.sample(logits)
            else:
                ids = tp.broadcast(torch.empty(msg.num_emit, dtype=torch.int64, device=device))
            token_map[emit_rows(dev, msg.num_emit)] = ids
        steps += 1
