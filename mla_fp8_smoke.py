# scratch (not committed): compile info + one quick check of the fp8 seesaw kernel
import json, os, sys, time
import torch
sys.path.insert(0, "tests/kernels")
from test_mla_fp8 import make_fp8_case, run_fp8, check
from attnserve.attention.triton_ops.mla_decode import mla_stage1_kernel
from attnserve.attention.triton_ops import mla_decode_seesaw as S
res = {}
for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
    t0 = time.time()
    case = make_fp8_case([0, 1, 130, 1000], 128, 64, torch.bfloat16, fp8, 0.05, amp=2.0, seed=1)
    print("kind", mla_stage1_kernel(case["q_nope"], case["q_pe"], case["kv"], 64), flush=True)
    o, lse = run_fp8(case, 64, 2, 2, 0.05)
    torch.cuda.synchronize()
    print(str(fp8), "ran", time.time() - t0, flush=True)
    try:
        check(case, o, lse, torch.bfloat16); res[str(fp8)] = "ok"
    except AssertionError as e:
        res[str(fp8)] = f"FAIL {e}"
    print(res, flush=True)
try:
    caches = S._mla_decode_stage1_seesaw.device_caches
    for dev, entry in caches.items():
        for key, k in entry[0].items():
            info = dict(n_regs=getattr(k, "n_regs", None), n_spills=getattr(k, "n_spills", None),
                        shared=getattr(k.metadata, "shared", None))
            print("compiled", info, flush=True)
            res.setdefault("compiled", []).append(info)
except Exception as e:
    print("no cache info", e)
os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "smoke.json"), "w"), indent=1)
