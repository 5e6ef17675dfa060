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


LOCAL_SAMPLING_SCRIPT = """
import json
from attnserve import LLM, SamplingParams
prompts = [[1, 2, 3], list(range(10, 40)), [7] * 9, list(range(100, 117))]
params = [SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True),
          SamplingParams(temperature=0.8, seed=1, max_new_tokens=16, ignore_eos=True),
          SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=2, max_new_tokens=16, ignore_eos=True),
          SamplingParams(temperature=0.7, min_p=0.05, seed=3, max_new_tokens=16, ignore_eos=True)]
kw = dict(load_format="dummy", device="cuda", dtype="float32", max_total_tokens=4096, max_running_requests=8)
ref = LLM("llama-tiny", **kw)
want = [o.token_ids for o in ref.generate(prompts, params)]
ref.engine.shutdown()
del ref
llm = LLM("llama-tiny", tp_size=2, **kw)
assert llm.engine.model_runner.cuda_graph_runner is not None, "CUDA graphs were not captured"
assert llm.engine.scheduler.overlap, "overlap scheduling is off"
sender = llm.engine.scheduler.tp_sender
assert sender.sample_local, "ATTNSERVE_TP_SAMPLE is not local by default"
got = {}
for mode in ("local", "broadcast"):
    sender.sample_local = mode == "local"
    llm.engine.scheduler.flush_prefix_cache()
    before = (sender.local_steps, sender.ids_broadcasts)
    got[mode] = [o.token_ids for o in llm.generate(prompts, params)]
    got[mode + "_steps"] = [sender.local_steps - before[0], sender.ids_broadcasts - before[1]]
llm.engine.shutdown()
print("RESULT=" + json.dumps({"tp1": want, **got}), flush=True)
"""


def test_tp2_local_sampling_in_graphs_and_overlap_matches_broadcast_and_tp1():
    """Every rank samples each step itself (`step_sync.LocalSampling`), with CUDA graphs and
    overlap scheduling, float32: greedy and seeded temperature / top-k / top-p / min-p
    tokens equal those of rank 0's id broadcast and of tp 1. A rank whose ids differed
    would feed other input ids to its next forward and change rank 0's tokens too."""
    import json

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    env.pop("ATTNSERVE_TP_SAMPLE", None)
    r = subprocess.run([sys.executable, "-c", LOCAL_SAMPLING_SCRIPT], capture_output=True, text=True, timeout=500,
                       env=env)
    tail = (r.stdout + r.stderr)[-4000:]
    assert r.returncode == 0, tail
    m = re.search(r"RESULT=(.*)", r.stdout)
    assert m is not None, tail
    res = json.loads(m.group(1))
    assert res["local_steps"][0] >= 16 and res["local_steps"][1] == 0, res
    assert res["broadcast_steps"][0] == 0 and res["broadcast_steps"][1] >= 16, res
    assert res["local"] == res["broadcast"], res
    assert res["local"] == res["tp1"], res


OVERLAP_SCRIPT = """
import json, os
from attnserve import LLM, SamplingParams
from attnserve.models.layers import tp_prefill_overlap as tpo
calls = []
real = tpo.overlapped_layer_forward
tpo.overlapped_layer_forward = lambda *a, **k: calls.append(1) or real(*a, **k)
prompts = [list(range(10, 90)), [7] * 41, list(range(150, 183))]
sp = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
kw = dict(load_format="dummy", device="cuda", dtype="float32", max_total_tokens=4096, max_running_requests=8)
ref = LLM("llama-tiny", **kw)
want = [o.token_ids for o in ref.generate(prompts, sp)]
ref.engine.shutdown()
del ref
# halves of >= 16 rows of llama-tiny's 64 float32 values: every prefill here, no decode step
os.environ[tpo.TP_OVERLAP_MIN_HALF_ENV] = str(16 * 64 * 4 / 2**20)
os.environ[tpo.TP_OVERLAP_ENV] = "1"
out = {}
for tp in sorted({2, int(os.environ["WORLD"])}):
    calls.clear()
    llm = LLM("llama-tiny", tp_size=tp, **kw)
    out[str(tp)] = [[o.token_ids for o in llm.generate(prompts, sp)], len(calls)]
    llm.engine.shutdown()
    del llm
print("RESULT=" + json.dumps({"tp1": want, **out}), flush=True)
"""


def test_tp_prefill_overlap_matches_tp1():
    """`tp_prefill_overlap` forced on for every prefill (a 16-row threshold), float32, at
    tp 2 and tp = all GPUs (4 where lent): greedy tokens equal tp 1's, with CUDA graphs
    captured for decode (which keeps one all-reduce: small batches), and rank 0 took the
    token-halves path (a layer call per prefill layer at least)."""
    import json

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
               WORLD=str(min(torch.cuda.device_count(), 4)))
    r = subprocess.run([sys.executable, "-c", OVERLAP_SCRIPT], capture_output=True, text=True, timeout=500, env=env)
    tail = (r.stdout + r.stderr)[-4000:]
    assert r.returncode == 0, tail
    m = re.search(r"RESULT=(.*)", r.stdout)
    assert m is not None, tail
    res = json.loads(m.group(1))
    for tp, (tokens, calls) in ((k, v) for k, v in res.items() if k != "tp1"):
        assert tokens == res["tp1"], (tp, res)
        assert calls >= 2, (tp, calls)
    print(f"OVERLAP tp sizes {sorted(k for k in res if k != 'tp1')}: tokens equal tp 1, calls "
          f"{[v[1] for k, v in res.items() if k != 'tp1']}")
