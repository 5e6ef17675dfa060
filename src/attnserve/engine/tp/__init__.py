"""Tensor-parallel processes: start / watch / stop the ranks (`launch`), a non-zero rank's
loop (`worker`) and the per-step messages rank 0 sends (`step_sync`). The parallel layers and
partitions are in `attnserve.distributed`."""
