"""Mixture-of-experts layers: routing (`routing`), the fused expert layer (`layer.FusedMoE`),
its PyTorch reference path (`native`) and the Triton grouped-GEMM path (`fused_moe_triton`,
with `align` and `tuned_configs`). Import the submodules directly."""
