"""Attention-backend choice: a table of rules for the default, checks for explicit flags.

The default is the first row of `DEFAULT_BACKEND_TABLE` that matches the device kind, its
compute capability, the model's attention architecture (MHA vs MLA), the speculative
top-k (tree drafts need custom-mask support) and the page size; its reason is logged at
start-up. The rows follow the shape of SGLang's ``_get_default_attn_backend`` (hardware
first, then MHA vs MLA, then speculative top-k and page size), restricted to the backends
this project ships:

========  ========  ======  ==========  ==========  ==============
device    min cc    arch    spec top-k  page size   backend
========  ========  ======  ==========  ==========  ==============
cpu       -         any     any         any         torch_native
cuda      7.0       mla     any         any         triton_mla
cuda      7.0       mha     any         any         triton
========  ========  ======  ==========  ==========  ==============

A CUDA device below compute capability 7.0 matches no row (Triton needs Volta or newer):
a clear error. ``--attention-backend`` serves every phase, ``--prefill-attention-backend``
/ ``--decode-attention-backend`` override one phase each; an explicit backend that cannot
run the device or the model is a clear error naming what can.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from attnserve.attention.backend_config import AttentionBackendConfig
from attnserve.attention.base import AttentionBackend
from attnserve.attention.hybrid import HybridAttnBackend
from attnserve.attention.registry import backends_for_arch, create_attention_backend, get_attention_backend_class

logger = logging.getLogger(__name__)

#: Triton's oldest supported NVIDIA architecture (Volta).
TRITON_MIN_CC = (7, 0)


@dataclass(frozen=True)
class DeviceCaps:
    """What the selection needs to know of a device (faked in tests).

    Attributes:
        kind: ``"cpu"`` or ``"cuda"``.
        compute_capability: ``(major, minor)`` of a CUDA device, ``(0, 0)`` on CPU.
        name: device name for the log.
    """

    kind: str
    compute_capability: Tuple[int, int] = (0, 0)
    name: str = ""

    @classmethod
    def detect(cls, device) -> "DeviceCaps":
        device = torch.device(device)
        if device.type != "cuda":
            return cls(device.type, (0, 0), device.type)
        return cls("cuda", tuple(torch.cuda.get_device_capability(device)), torch.cuda.get_device_name(device))


@dataclass(frozen=True)
class SelectionRule:
    """One row of the default table; a field of None matches anything."""

    backend: str
    reason: str
    device_kind: str
    archs: Tuple[str, ...] = ("mha", "mla")
    min_cc: Tuple[int, int] = (0, 0)
    max_spec_topk: Optional[int] = None
    page_sizes: Optional[Tuple[int, ...]] = None

    def matches(self, caps: DeviceCaps, arch: str, spec_topk: int, page_size: int) -> bool:
        return (
            caps.kind == self.device_kind
            and arch in self.archs
            and tuple(caps.compute_capability) >= self.min_cc
            and (self.max_spec_topk is None or spec_topk <= self.max_spec_topk)
            and (self.page_sizes is None or page_size in self.page_sizes)
        )


DEFAULT_BACKEND_TABLE: Tuple[SelectionRule, ...] = (
    SelectionRule("torch_native", "CPU: torch_native is the only backend that runs without a GPU", "cpu"),
    SelectionRule("triton_mla", "CUDA, MLA model: paged MLA decode kernels over the latent cache, latent extend, "
                  "CUDA graphs", "cuda", ("mla",), TRITON_MIN_CC),
    SelectionRule("triton", "CUDA, MHA model: paged split-K decode and extend kernels (any page size, windows, "
                  "tree masks), CUDA graphs", "cuda", ("mha",), TRITON_MIN_CC),
)


@dataclass
class BackendChoice:
    prefill: str
    decode: str
    reason: str


def default_backend_name(caps: DeviceCaps, attention_arch: str = "mha", spec_topk: int = 1, page_size: int = 1,
                         table: Tuple[SelectionRule, ...] = DEFAULT_BACKEND_TABLE) -> Tuple[str, str]:
    """(name, reason) of the first matching row of ``table``.

    Raises:
        ValueError: no row matches (e.g. a GPU older than compute capability 7.0).
    """
    for rule in table:
        if rule.matches(caps, attention_arch, spec_topk, page_size):
            return rule.backend, rule.reason
    cc = ".".join(map(str, caps.compute_capability))
    raise ValueError(
        f"no attention backend runs a {attention_arch.upper()} model on {caps.kind} {caps.name} (compute capability "
        f"{cc}); the Triton backends need compute capability >= {TRITON_MIN_CC[0]}.{TRITON_MIN_CC[1]}: use --device cpu"
    )


def check_backend(name: str, caps: DeviceCaps, attention_arch: str) -> None:
    """Raise ValueError when backend ``name`` is unknown or cannot run this device or model."""
    cls = get_attention_backend_class(name)  # ValueError for unknown names
    if attention_arch not in cls.supported_archs:
        raise ValueError(
            f"attention backend '{name}' does not run {attention_arch.upper()} models; for this model use one of: "
            f"{', '.join(backends_for_arch(attention_arch))}"
        )
    if caps.kind not in cls.supported_devices:
        raise ValueError(f"attention backend '{name}' needs a CUDA GPU; on CPU use --attention-backend torch_native")
    if caps.kind == "cuda" and name != "torch_native" and tuple(caps.compute_capability) < TRITON_MIN_CC:
        raise ValueError(f"attention backend '{name}' needs compute capability >= 7.0, this GPU has "
                         f"{'.'.join(map(str, caps.compute_capability))}; use --attention-backend torch_native")


def choose_backends(server_args, caps: DeviceCaps, attention_arch: str = "mha", spec_topk: int = 1) -> BackendChoice:
    """Resolve the flags into one backend name per phase.

    Raises:
        ValueError: an unknown backend name (lists the valid ones), a backend that cannot
            run the device or the model, or a device no backend runs.
    """
    if server_args.attention_backend:
        base, reason = server_args.attention_backend, "--attention-backend"
    else:
        base, reason = default_backend_name(caps, attention_arch, spec_topk, server_args.page_size)
    prefill = server_args.prefill_attention_backend or base
    decode = server_args.decode_attention_backend or base
    for name in dict.fromkeys((prefill, decode)):
        check_backend(name, caps, attention_arch)
    if server_args.prefill_attention_backend or server_args.decode_attention_backend:
        reason += " with per-phase overrides"
    return BackendChoice(prefill, decode, reason)


def create_backends(config: AttentionBackendConfig, choice: BackendChoice,
                    speculative_attention_mode: str = "prefill") -> AttentionBackend:
    """Construct the backend(s) from ``config``; a `HybridAttnBackend` when the phases differ."""
    if choice.prefill == choice.decode:
        backend = create_attention_backend(choice.prefill, config)
    else:
        backend = HybridAttnBackend(
            create_attention_backend(choice.prefill, config),
            create_attention_backend(choice.decode, config),
            speculative_attention_mode,
        )
    logger.info("attention: prefill=%s decode=%s (%s)", choice.prefill, choice.decode, choice.reason)
    return backend


def backend_workspace_bytes(config: AttentionBackendConfig, choice: BackendChoice) -> int:
    """Bytes the chosen backends allocate at construction (counted before the KV pool)."""
    return sum(get_attention_backend_class(n).workspace_bytes(config) for n in dict.fromkeys((choice.prefill,
                                                                                             choice.decode)))
