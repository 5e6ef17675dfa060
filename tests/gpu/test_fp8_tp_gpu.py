"""FP8 weights under tensor parallelism on two GPUs: the fused quantisers, the folded
``o_proj`` / ``down_proj`` routes and the fused all-reduce together, inside CUDA graphs and
eagerly (issue 37: "this works under tensor parallelism")."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(torch.cuda.device_count() < 2 or torch.cuda.get_device_capability() < (9, 0),
                                 reason="needs 2 GPUs of sm 90 (FP8 tensor parallel)")]

SCRIPT = """
import json, sys
from attnserve import LLM, SamplingParams
from attnserve.models.layers.quantization import fp8_kernels
calls = {"norm": 0, "scale": 0}
real_norm, real_scale = fp8_kernels.fused_add_rmsnorm_quant_fp8, fp8_kernels.scale_rows_cols
fp8_kernels.fused_add_rmsnorm_quant_fp8 = lambda *a, **k: calls.__setitem__("norm", calls["norm"] + 1) or real_norm(*a, **k)
fp8_kernels.scale_rows_cols = lambda *a, **k: calls.__setitem__("scale", calls["scale"] + 1) or real_scale(*a, **k)
prompts = [[1 + i % 200, 2, 3 + i % 150, 4, 5 + i % 7] for i in range(80)]
sp = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
out = {}
for graphs_off in (False, True):
    llm = LLM(sys.argv[1], load_format="dummy", device="cuda", quantization="fp8", tp_size=2,
              disable_cuda_graph=graphs_off, max_running_requests=96)
    layer = llm.engine.model_runner.model.model.layers[0]
    marks = [layer.input_layernorm.fp8_output, layer.self_attn.o_proj.fp8_folded_max_m,
             layer.mlp.down_proj.fp8_folded_max_m]
    out["graphs_off" if graphs_off else "graphs"] = [o.token_ids for o in llm.generate(prompts, sp)]
    llm.engine.shutdown()
    del llm
print("RESULT=" + json.dumps({**out, "calls": calls, "marks": marks}), flush=True)
"""


@pytest.mark.parametrize("name", ["llama-tiny", "qwen3-tiny"])
def test_fp8_tp2_graphs_match_eager_with_fused_routes(name):
    """tp 2, FP8 weights, 80 requests (decode batches past the W8A16 rows): rank 0's layers
    are marked (fused norm quantiser, folded ``o_proj`` and ``down_proj``), those kernels run,
    and the greedy tokens under CUDA graphs equal the eager ones (8 each, all requests)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    r = subprocess.run([sys.executable, "-c", SCRIPT, name], capture_output=True, text=True, timeout=500, env=env)
    tail = (r.stdout + r.stderr)[-4000:]
    assert r.returncode == 0, tail
    m = re.search(r"RESULT=(.*)", r.stdout)
    assert m is not None, tail
    res = json.loads(m.group(1))
    assert res["marks"][0] is True and res["marks"][1] > 0 and res["marks"][2] > 0, res["marks"]
    assert res["calls"]["norm"] > 0 and res["calls"]["scale"] > 0, res["calls"]
    assert [len(t) for t in res["graphs"]] == [8] * 80
    assert res["graphs"] == res["graphs_off"]
