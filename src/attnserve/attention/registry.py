"""Attention-backend registry: ``@register_attention_backend("name")`` and the factory.

The registry is a plain dict filled at import time of each backend module (importing a
backend module never imports its optional kernel library; construction does).
"""

from __future__ import annotations

import importlib
from typing import Callable, Dict, Type

from attnserve.attention.backend_config import AttentionBackendConfig
from attnserve.attention.base import AttentionBackend

#: name -> backend class. Filled by `register_attention_backend` when backend modules load.
ATTENTION_BACKENDS: Dict[str, Type[AttentionBackend]] = {}

# Modules that define backends; imported on first lookup so that the registry is complete.
_BACKEND_MODULES = (
    "attnserve.attention.torch_native",
    "attnserve.attention.triton_backend",
    "attnserve.attention.triton_mla_backend",
)


def register_attention_backend(name: str) -> Callable[[Type[AttentionBackend]], Type[AttentionBackend]]:
    """Class decorator: register ``cls`` under ``name`` (names must be unique)."""

    def deco(cls: Type[AttentionBackend]) -> Type[AttentionBackend]:
        if name in ATTENTION_BACKENDS and ATTENTION_BACKENDS[name] is not cls:
            raise ValueError(f"attention backend '{name}' registered twice")
        cls.name = name
        ATTENTION_BACKENDS[name] = cls
        return cls

    return deco


def _load_backend_modules() -> None:
    for mod in _BACKEND_MODULES:
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:  # a backend module not written yet / optional
            if not e.name or not e.name.startswith("attnserve"):
                raise


def available_backends() -> list:
    _load_backend_modules()
    return sorted(ATTENTION_BACKENDS)


def get_attention_backend_class(name: str) -> Type[AttentionBackend]:
    """Look a backend class up by name.

    Raises:
        ValueError: for an unknown name; the message lists the valid ones.
    """
    names = available_backends()
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend '{name}'; valid backends: {', '.join(names)}")
    return ATTENTION_BACKENDS[name]


def create_attention_backend(name: str, config: AttentionBackendConfig) -> AttentionBackend:
    """Construct backend ``name`` from ``config`` (which must carry the pools).

    Raises:
        ValueError: unknown name, or a model the backend cannot run (e.g. an MLA model on
            an MHA-only backend).
    """
    cls = get_attention_backend_class(name)
    if config.attention_arch not in cls.supported_archs:
        raise ValueError(
            f"attention backend '{name}' runs {'/'.join(a.upper() for a in cls.supported_archs)} models, not "
            f"{config.attention_arch.upper()}; backends for {config.attention_arch.upper()}: "
            f"{', '.join(backends_for_arch(config.attention_arch))}"
        )
    return cls(config)


def backends_for_arch(attention_arch: str) -> list:
    """Registered backend names that run ``attention_arch`` ("mha" or "mla")."""
    names = available_backends()
    return [n for n in names if attention_arch in ATTENTION_BACKENDS[n].supported_archs]
