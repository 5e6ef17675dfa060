"""Shared engines for the end-to-end tests (the GGUF is dequantised once per configuration).

At most `MAX_CACHED_ENGINES` engines stay alive (least recently used ones are dropped), and
unless a test sets it the KV pool holds 8,192 tokens instead of the CPU default of 32,768:
a SmolLM2 engine is then ~0.9 GB instead of ~2 GB, so the suite fits a 24 GB machine.
"""

import gc
from collections import OrderedDict

import pytest

from attnserve.engine.llm import LLM

MAX_CACHED_ENGINES = 3
TEST_MAX_TOTAL_TOKENS = 8192


@pytest.fixture(scope="session")
def llm_factory():
    cache = OrderedDict()

    def get(**kwargs):
        kwargs.setdefault("max_total_tokens", TEST_MAX_TOTAL_TOKENS)
        key = tuple(sorted(kwargs.items()))
        if key in cache:
            cache.move_to_end(key)
            return cache[key]
        while len(cache) >= MAX_CACHED_ENGINES:
            cache.popitem(last=False)
            gc.collect()
        cache[key] = LLM(**kwargs)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def llm(llm_factory):
    return llm_factory()
