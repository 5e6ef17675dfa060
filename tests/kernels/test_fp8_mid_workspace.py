"""The FP8 mid GEMM's persistent split-K workspace (`split_k_workspace`, issue 37).

The kernel's last program per column block zeroes the workspace slice it read and resets
its counter, so one buffer serves consecutive calls. Under the Triton interpreter (CPU;
programs run one after another, so the atomics add in a fixed order) a run of calls of
different shapes through one `SplitKWorkspace` must give the bits of the same calls on
fresh zeroed buffers, and leave the buffer all zero after each call.
"""

from __future__ import annotations

import pytest
import torch

from attnserve.models.layers.mid_gemm import MidGemmConfig
from attnserve.models.layers.quantization.fp8_kernels import quantize_activation
from attnserve.models.layers.quantization.fp8_mid_gemm import fp8_mid_linear
from attnserve.models.layers.quantization.fp8_utils import quantize_per_row, quantize_per_tensor
from attnserve.models.layers.split_k_workspace import MIN_NUMEL, SplitKWorkspace

# (mode, m, n weight rows, k, per_tensor, bias, activation, config): split-K 2 and 3, a gated
# weight whose last column block is partial (N = 40 gate columns, block_n 32), two row
# pieces (33 = 32 + 16), a split-K-free call in between, and the first shape again
SEQUENCE = [
    ("w8a8", 33, 64, 160, False, True, None, MidGemmConfig(block_n=32, block_k=32, split_k=3)),
    ("w8a8", 17, 80, 96, False, False, "silu", MidGemmConfig(block_n=32, block_k=32, split_k=2)),
    ("w8a16", 20, 48, 128, True, False, None, MidGemmConfig(block_n=32, block_k=64, split_k=1)),
    ("w8a16", 33, 80, 96, False, True, "gelu_tanh", MidGemmConfig(block_n=32, block_k=32, split_k=3)),
    ("w8a8", 33, 64, 160, False, True, None, MidGemmConfig(block_n=32, block_k=32, split_k=3)),
]


def _operands(gen, mode, m, n, k, per_tensor, bias, device):
    w = torch.randn(n, k, generator=gen) * 0.05
    wq, ws = quantize_per_tensor(w) if per_tensor else quantize_per_row(w)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None
    kw = {}
    if mode == "w8a8":
        x, s = quantize_activation(x)
        kw = dict(x_scale=s.to(device), out_dtype=torch.bfloat16)
    return x.to(device), wq.to(device), ws.reshape(-1).to(device), (b.to(device) if b is not None else None), kw


def test_reused_workspace_gives_fresh_buffer_bits(gen, device):
    workspace = SplitKWorkspace()
    calls = [(case, _operands(gen, *case[:6], device)) for case in SEQUENCE]
    for (mode, m, n, k, _, _, act, cfg), (x, wq, ws, b, kw) in calls:
        fresh = fp8_mid_linear(x, wq, ws, b, act, config=cfg, **kw)
        for rep in range(2):  # the same call twice on the shared buffer
            y = fp8_mid_linear(x, wq, ws, b, act, config=cfg, workspace=workspace, **kw)
            assert torch.equal(y, fresh), f"{mode} m={m} n={n} k={k} {cfg} call {rep}"
        held = workspace.buffers(device)
        if cfg.split_k > 1:
            assert len(held) == 1 and held[0].numel() >= m * n
            assert held[0].numel() == MIN_NUMEL  # every need here is below the smallest class
        assert all(int(torch.count_nonzero(buf)) == 0 for buf in held), f"buffer left dirty after {mode} {cfg}"
    assert len(workspace.buffers(device)) == 1  # one buffer served every split-K call


def test_workspace_size_classes():
    """The smallest held buffer that fits; a new power-of-two class past it; all kept."""
    ws = SplitKWorkspace()
    a = ws.get(10, "cpu")
    assert a.numel() == MIN_NUMEL and a.dtype == torch.float32 and int(torch.count_nonzero(a)) == 0
    assert ws.get(MIN_NUMEL, "cpu") is a
    b = ws.get(MIN_NUMEL + 1, "cpu")
    assert b.numel() == 2 * MIN_NUMEL and b is not a
    assert ws.get(5, "cpu") is a and ws.get(MIN_NUMEL + 7, "cpu") is b
    assert [t.numel() for t in ws.buffers("cpu")] == [MIN_NUMEL, 2 * MIN_NUMEL]
    assert SplitKWorkspace().get(3, "cpu") is not a  # another owner, another buffer
    with pytest.raises(ValueError, match="numel"):
        ws.get(0, "cpu")


def test_model_linears_share_one_workspace(device):
    """`quantize_model_linears` gives every `Fp8LinearMethod` of a model the same workspace."""
    from torch import nn

    from attnserve.models.layers.linear import Linear
    from attnserve.models.layers.quantization import QuantizationConfig, quantized_construction
    from attnserve.models.layers.quantization.apply import quantize_model_linears

    cfg = QuantizationConfig("channel")
    with quantized_construction(cfg):
        model = nn.Sequential(Linear(32, 64, dtype=torch.bfloat16), Linear(64, 32, dtype=torch.bfloat16))
    assert quantize_model_linears(model, cfg, device, torch.bfloat16) == 2
    a, b = (mod.quant_method for mod in model)
    assert isinstance(a.workspace, SplitKWorkspace) and a.workspace is b.workspace
