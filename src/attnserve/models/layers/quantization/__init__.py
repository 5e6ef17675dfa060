"""FP8 weight quantisation of the dense linears (issue 37).

One concern a file:

* `config` -- `QuantizationConfig` from ``--quantization fp8`` or an HF ``quantization_config``;
* `fp8_utils` -- e4m3 quantise / dequantise in PyTorch (the reference);
* `fp8_kernels` / `fp8_kernels_triton` -- activation quantisation and the scaled FP8 GEMM;
* `fp8_linear` -- the linear methods (per-channel / per-tensor W8A8, block-scaled, reference);
* `loading` -- weight loaders (quantise on load; scales sharded under tensor parallelism);
* `context` / `apply` -- build a model with deferred linear weights and quantise it by name;
* `export` -- write a model as an FP8 checkpoint (HF fp8 block / per-tensor, compressed-tensors).

This package file imports only `config` and `context` (cheap); the rest load on use.
"""

from attnserve.models.layers.quantization.config import (  # noqa: F401
    QUANTIZATION_METHODS,
    QuantizationConfig,
    check_quantization_device,
    parse_hf_quantization_config,
    resolve_quantization,
)
from attnserve.models.layers.quantization.context import deferring_linear_weights, quantized_construction  # noqa: F401
