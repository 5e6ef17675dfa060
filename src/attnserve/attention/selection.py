"""Default attention-backend choice by device, model type and installed libraries.

Rules (first match wins), each with the reason logged at start-up:

* an explicit ``--attention-backend`` serves every phase; ``--prefill-attention-backend`` /
  ``--decode-attention-backend`` override one phase each;
* CPU -> ``torch_native`` (the only backend that runs there);
* CUDA -> ``triton`` (paged split-K decode and extend kernels; supports MHA and MLA, sliding
  windows, logit caps and CUDA graphs).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from attnserve.attention.base import AttentionBackend
from attnserve.attention.hybrid import HybridAttnBackend
from attnserve.attention.registry import create_attention_backend, get_attention_backend_class

logger = logging.getLogger(__name__)


@dataclass
class BackendChoice:
    prefill: str
    decode: str
    reason: str


def default_backend_name(device: str, attention_arch: str = "mha") -> tuple:
    """(name, reason) of the default backend for ``device`` and model type."""
    if device == "cpu":
        return "torch_native", "CPU device: torch_native is the only backend that runs on CPU"
    return "triton", f"CUDA device, {attention_arch.upper()} model: triton paged kernels (capturable in CUDA graphs)"


def choose_backends(server_args, device: str, attention_arch: str = "mha") -> BackendChoice:
    """Resolve the flags into one backend name per phase.

    Raises:
        ValueError: an unknown backend name (lists the valid ones) or a GPU-only backend
            requested on CPU.
    """
    base, reason = default_backend_name(device, attention_arch)
    if server_args.attention_backend:
        base, reason = server_args.attention_backend, "--attention-backend"
    prefill = server_args.prefill_attention_backend or base
    decode = server_args.decode_attention_backend or base
    for name in {prefill, decode}:
        get_attention_backend_class(name)  # ValueError for unknown names
        if device == "cpu" and name != "torch_native":
            raise ValueError(f"attention backend '{name}' needs a CUDA GPU; on CPU use --attention-backend torch_native")
    if server_args.prefill_attention_backend or server_args.decode_attention_backend:
        reason += " with per-phase overrides"
    return BackendChoice(prefill, decode, reason)


def create_backends(model_runner, choice: BackendChoice) -> AttentionBackend:
    """Construct the backend(s); a `HybridAttnBackend` when the phases differ."""
    if choice.prefill == choice.decode:
        backend = create_attention_backend(choice.prefill, model_runner)
    else:
        backend = HybridAttnBackend(
            create_attention_backend(choice.prefill, model_runner),
            create_attention_backend(choice.decode, model_runner),
            model_runner.server_args.speculative_attention_mode,
        )
    logger.info("attention: prefill=%s decode=%s (%s)", choice.prefill, choice.decode, choice.reason)
    return backend
