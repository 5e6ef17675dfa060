# Registers / spill bytes / shared memory of the extend kernel as the JIT compiles it for
# real launches (bf16, D 128, Hq 32 / Hkv 8, (128, 64, 8, 3)), with 64- and 128-key prefix
# tiles (session 14: the two-tile kernel's plain-prefill cost). GPU only.
import sys

import torch

sys.path.insert(0, "benchmarks")
from kernel_timings import extend_prefix  # noqa: E402

import attnserve.attention.triton_ops.extend_attention as m  # noqa: E402

for tile in (None, 128):
    extend_prefix(2, 1024, 256, config=m.ExtendConfig(128, 64, 8, 3, tile))
    torch.cuda.synchronize()
    for cache in m._extend_fwd_kernel.device_caches.values():
        for key, k in cache[0].items():
            k._init_handles()
            print("block_n_prefix", tile, "regs", k.n_regs, "spills", k.n_spills, "shared", k.metadata.shared,
                  flush=True)
    for cache in m._extend_fwd_kernel.device_caches.values():
        cache[0].clear()
