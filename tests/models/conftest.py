"""Shared fixtures of the model tests: SmolLM2 (ours and HF's) loaded once per session, and
a minimal step runner that drives a model through the paged KV cache like the engine does."""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import pytest
import torch

from attnserve.forward_batch import ForwardBatch, ForwardMode
from attnserve.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool, TokenToKVPoolAllocator

PROMPT = "What is the capital of France?"


class StepRunner:
    """Paged-KV bookkeeping for a handful of requests (a tiny stand-in for the scheduler)."""

    def __init__(self, model, model_config, page_size: int = 1, max_reqs: int = 4, max_ctx: int = 512, kv_size: int = 4096):
        from attnserve.attention.backend_config import AttentionBackendConfig
        from attnserve.attention.torch_native import TorchNativeAttnBackend

        self.model = model
        dtype = next(model.parameters()).dtype
        self.req_pool = ReqToTokenPool(max_reqs, max_ctx, "cpu")
        self.allocator = TokenToKVPoolAllocator(kv_size, page_size)
        self.kv_pool = MHATokenToKVPool(
            kv_size,
            page_size,
            dtype,
            model_config.num_key_value_heads,
            model_config.head_dim,
            model_config.num_hidden_layers,
            "cpu",
        )
        self.backend = TorchNativeAttnBackend(
            AttentionBackendConfig.from_pools(self.req_pool, self.kv_pool, model_config.num_attention_heads)
        )
        self.seq_lens: Dict[int, int] = {}

    def new_request(self) -> int:
        (row,) = self.req_pool.alloc(1)
        self.seq_lens[row] = 0
        return row

    def step(self, mode: ForwardMode, reqs: Sequence[Tuple[int, List[int]]]) -> torch.Tensor:
        """Run one step; ``reqs`` = (row, new token ids). Returns float32 logits ``[T, vocab]``."""
        rows = [r for r, _ in reqs]
        prefix = [self.seq_lens[r] for r in rows]
        extend = [len(ids) for _, ids in reqs]
        seq = [p + e for p, e in zip(prefix, extend)]
        last = [int(self.req_pool.req_to_token[r, p - 1]) if p else 0 for r, p in zip(rows, prefix)]
        out_loc = self.allocator.alloc_extend(prefix, seq, last)
        assert out_loc is not None
        start = 0
        for r, p, e in zip(rows, prefix, extend):
            self.req_pool.write(r, p, out_loc[start : start + e])
            start += e
        ids = [t for _, toks in reqs for t in toks]
        fb = ForwardBatch.init_new(
            mode, ids, rows, prefix, extend, out_loc, self.req_pool, self.kv_pool, self.backend, "cpu"
        )
        self.backend.init_forward_metadata(fb)
        hidden = self.model(fb.input_ids, fb.positions, fb)
        for r, s in zip(rows, seq):
            self.seq_lens[r] = s
        return self.model.compute_logits(hidden)


@pytest.fixture(scope="session")
def smollm2_source():
    from attnserve.model_loader.loader import resolve_model

    try:
        return resolve_model("smollm2-135m")
    except FileNotFoundError as e:  # pragma: no cover
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2_loaded(smollm2_source):
    """Our LlamaForCausalLM with the SmolLM2 GGUF weights (float32) and its tokenizer."""
    from attnserve.model_loader.loader import load_model

    return load_model(smollm2_source.gguf_path, dtype=torch.float32, progress=False)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_source):
    """HF transformers' model from the same GGUF, float32, eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        smollm2_source.model_path, gguf_file=smollm2_source.gguf_file, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def prompt_ids(smollm2_loaded) -> List[int]:
    from attnserve.model_loader.tokenizer import apply_chat_template

    return apply_chat_template(smollm2_loaded.tokenizer, PROMPT)


@pytest.fixture
def step_runner():
    """Factory: ``step_runner(model, model_config, page_size=1)`` -> `StepRunner`."""
    return StepRunner
