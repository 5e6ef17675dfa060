"""Tensor parallelism on two GPUs (NCCL, CUDA graphs): a clean, prompt shutdown.

On two H100s (session 16, torch 2.11, NCCL 2.28) a tp 2 engine with captured decode
graphs took the full 10 s teardown timeout and its process then aborted at exit
("terminate called without an active exception", exit code 134): NCCL's communicator
abort waits until every graph that captured one of its collectives is destroyed. The
engine now releases its graphs first (`ModelRunner.release_cuda_graphs`). The engine runs
in a child process so that its exit code and stderr are what is checked. Its step messages
go through the shared-memory step queue, which leaves no /dev/shm segment behind.
"""

import os
import re
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (tensor parallel)")]

SCRIPT = """
import time
from attnserve import LLM, SamplingParams
llm = LLM("llama-tiny", load_format="dummy", device="cuda", tp_size=2, max_total_tokens=4096,
          max_running_requests=8)
assert llm.engine.model_runner.cuda_graph_runner is not None, "CUDA graphs were not captured"
assert llm.engine.tp_runtime.tp.step_queue is not None, "step messages do not use the shared-memory queue"
sp = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
outs = llm.generate([[1, 2, 3], list(range(10, 40))], sp)
assert [len(o.token_ids) for o in outs] == [8, 8]
t = time.monotonic()
llm.engine.shutdown()
print(f"SHUTDOWN_S={time.monotonic() - t:.3f}", flush=True)
import os
assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"attnserve-stepq-{os.getpid()}-")], "segment left"
"""


def test_tp2_with_cuda_graphs_exits_cleanly():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=400, env=env)
    tail = (r.stdout + r.stderr)[-4000:]
    assert r.returncode == 0, tail
    assert "teardown did not finish" not in r.stderr, tail
    assert "terminate called" not in r.stderr, tail
    m = re.search(r"SHUTDOWN_S=([0-9.]+)", r.stdout)
    assert m is not None, tail
    assert float(m.group(1)) < 5.0, tail
