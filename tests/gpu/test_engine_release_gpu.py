"""Engines built and shut down in sequence on one GPU give their memory back (issue 33,
item 8: on an H100 the fifth engine of a process once failed with "not enough GPU memory
for the KV cache").

Five engines of the Llama-3-8B shape (dummy bf16 weights, CUDA graphs and overlap on, the
KV pool sized from free memory: default flags but a 2,048-token context, which only shrinks
``req_to_token``) are built, serve a batch, and are shut down in turn. After each shutdown
`torch.cuda.memory_allocated` is back within 64 MiB of its value before the first engine,
and each engine's KV pool, sized from what `torch.cuda.mem_get_info` reports free, is as
large as the first one's (to 1 %): nothing of an earlier engine, live or cached by the
allocator, is left to shrink it.
"""

import gc
import time

import pytest
import torch

from attnserve.engine.llm import LLM
from attnserve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.cuda

SHAPE = dict(model="llama-3-8b", load_format="dummy", device="cuda", dtype="bfloat16", context_length=2048)
ROUNDS = 5
SLACK_BYTES = 64 * 2**20
WEIGHT_BYTES = 14 * 2**30  # 8.0e9 bf16 parameters are 14.96 GiB


def test_five_8b_engines_in_sequence_give_their_memory_back():
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    sp = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [[(31 * i + 7 * j) % 128000 + 1 for j in range(64 + 40 * i)] for i in range(8)]
    pools, rows = [], []
    for i in range(ROUNDS):
        t0 = time.perf_counter()
        llm = LLM(**SHAPE)
        t1 = time.perf_counter()
        assert llm.engine.model_runner.cuda_graph_runner is not None and llm.engine.scheduler.overlap
        pools.append(llm.engine.max_total_tokens)
        outs = llm.generate(prompts, sp)
        assert [len(o.token_ids) for o in outs] == [16] * len(prompts)
        held = torch.cuda.memory_allocated() - base
        assert held > WEIGHT_BYTES
        t2 = time.perf_counter()
        llm.shutdown()
        t3 = time.perf_counter()
        left = torch.cuda.memory_allocated() - base
        rows.append(f"engine {i}: build {t1 - t0:.1f} s, shutdown {t3 - t2:.2f} s, pool {pools[-1]} tokens, "
                    f"held {held / 2**30:.2f} GiB, left {left / 2**20:.1f} MiB, "
                    f"free {torch.cuda.mem_get_info()[0] / 2**30:.2f} GiB")
        print(rows[-1], flush=True)
        assert left <= SLACK_BYTES, rows[-1]
        del llm, outs
    assert min(pools) >= 0.99 * pools[0], pools
