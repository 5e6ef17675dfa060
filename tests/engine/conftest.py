"""Shared engines for the end-to-end tests (the GGUF is dequantised once per page size)."""

import pytest

from attnserve.engine.llm import LLM


@pytest.fixture(scope="session")
def llm_factory():
    cache = {}

    def get(**kwargs):
        key = tuple(sorted(kwargs.items()))
        if key not in cache:
            cache[key] = LLM(**kwargs)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def llm(llm_factory):
    return llm_factory()
