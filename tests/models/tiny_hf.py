"""Tiny random HF checkpoints for the model-family tests.

`hf_variant_getter` builds, once per name, an HF model from a ``(config class, architecture,
config kwargs)`` entry, lets the caller redraw weights that HF initialises to constants,
saves it with ``save_pretrained`` plus a word-level tokenizer, and returns
``(checkpoint dir, HF model in eval mode)``. Also the small helpers every family test uses.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import torch

from test_deepseek_v2 import _save_tokenizer


def hf_variant_getter(tmp_path_factory, variants: Dict[str, tuple], seed_base: int,
                      randomise: Callable[[torch.nn.Module, str], None], vocab: int):
    """name -> (checkpoint dir, HF model); ``randomise(model, name)`` runs under no_grad."""
    import transformers

    cache: Dict[str, Tuple[str, torch.nn.Module]] = {}

    def get(name):
        if name not in cache:
            cfg_name, arch, kw = variants[name]
            torch.manual_seed(seed_base + sorted(variants).index(name))
            cfg = getattr(transformers, cfg_name)(architectures=[arch], **kw)
            model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
            with torch.no_grad():
                randomise(model, name)
            path = tmp_path_factory.mktemp(name)
            model.save_pretrained(path)
            _save_tokenizer(path, vocab)
            cache[name] = (str(path), model)
        return cache[name]

    return get


def load_checkpoint(path, **kw):
    """Our loader on a test checkpoint (no tokenizer, no progress bar)."""
    from attnserve.model_loader.loader import load_model

    return load_model(path, load_tokenizer=False, progress=False, **kw)


def random_prompt(seed: int, n: int, vocab: int) -> List[int]:
    """``n`` token ids in ``[3, vocab)`` (past the special ids) from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def hf_logits(model, ids) -> torch.Tensor:
    """HF full-forward logits ``[len(ids), vocab]`` float32."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def assert_tp2_matches_tp1(path, prompts, max_new_tokens: int = 8) -> None:
    """Greedy tokens of the checkpoint at ``path`` at tp 2 on CPU ranks equal tp 1's (float32)."""
    from attnserve.engine.llm import LLM
    from attnserve.engine.sampling_params import SamplingParams

    kw = dict(model=path, device="cpu", dtype="float32", page_size=4, max_total_tokens=1024, max_running_requests=4)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    with LLM(**kw) as one:
        want = [o.token_ids for o in one.generate(prompts, params)]
    llm = LLM(tp_size=2, **kw)
    try:
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
    finally:
        llm.engine.shutdown()
