"""Tensor parallelism below the models: process-group handle (`group`) and head /
vocabulary partitions (`partition`). The rank processes are in `attnserve.engine.tp`."""
