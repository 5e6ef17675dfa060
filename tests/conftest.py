"""Shared pytest set-up: `cuda`-marked tests are skipped (and reported as skipped) without a GPU."""

import os

import pytest

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _HAS_CUDA = False

if not _HAS_CUDA:
    # Triton kernels run under the interpreter on CPU; must be set before triton is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
