"""Shared fixtures of the GPU tests."""

import pytest
import torch


@pytest.fixture
def no_tf32():
    """IEEE float32 matmuls for the duration of a test (greedy comparisons in float32
    must not be decided by TF32 rounding)."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old
