"""Tensor parallelism: process groups (`group`), head / vocabulary partitions
(`partition`), rank processes (`launch`, `worker`) and the per-step messages rank 0 sends
to the other ranks (`step_sync`)."""
