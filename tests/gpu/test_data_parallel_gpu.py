"""Data parallelism on two GPUs (``dp_size=2``): replica i runs on GPU i, both serve, and a
killed replica leaves the other serving with nothing of it left behind. Runs in a child
process (the replicas are spawned; their GPU memory and exit are what is checked)."""

import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (data parallel)")]

SCRIPT = """
import os, signal, time
import torch
from attnserve.engine.sampling_params import SamplingParams
from attnserve.server.data_parallel_llm import DataParallelLLM

free0 = [torch.cuda.mem_get_info(i)[0] for i in range(2)]
sp = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
with DataParallelLLM("llama-tiny", load_format="dummy", device="cuda", dp_size=2, max_total_tokens=4096,
                     max_running_requests=8) as llm:
    used = [free0[i] - torch.cuda.mem_get_info(i)[0] for i in range(2)]
    print(f"USED_MB={[u >> 20 for u in used]} DEVICES={llm.engine.info['replica_devices']}", flush=True)
    assert min(used) > 256 << 20, used  # each GPU holds one replica (its context, weights, KV pool)
    outs = llm.generate([[1, 2, 3]] * 4 + [list(range(10, 60))] * 4 + [[7, 8, 9, 10]] * 4, sp)
    assert [o.completion_tokens for o in outs] == [8] * 12
    assert sorted({o.dp_rank for o in outs}) == [0, 1], [o.dp_rank for o in outs]
    pids = [c.process.pid for c in llm.controller.clients]
    os.kill(pids[1], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while llm.controller.clients[1].is_alive():
        assert time.monotonic() < deadline, "replica 1's death was not noticed in 30 s"
        time.sleep(0.05)
    outs = llm.generate([[1, 2, 3]] * 4, sp)
    assert [o.dp_rank for o in outs] == [0] * 4 and [o.completion_tokens for o in outs] == [8] * 4
    assert llm.controller.dead_replicas() == [1]
for pid in pids:
    assert not os.path.exists(f"/proc/{pid}"), f"replica process {pid} is still there"
print("DP_OK", flush=True)
"""


def test_dp2_uses_both_gpus_and_survives_a_dead_replica():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=500, env=env)
    tail = (r.stdout + r.stderr)[-4000:]
    assert r.returncode == 0 and "DP_OK" in r.stdout, tail
