"""Tokenizers and chat templates via ``transformers.AutoTokenizer``."""

from __future__ import annotations

from typing import Any, List, Optional


def get_tokenizer(model_path: str, gguf_file: Optional[str] = None, trust_remote_code: bool = False) -> Any:
    """Load the tokenizer of an HF directory, or of a GGUF file inside ``model_path``.

    Args:
        model_path: directory (HF checkpoint, tokenizer-only directory, or the directory
            holding the GGUF).
        gguf_file: file name of the GGUF inside ``model_path`` (its embedded vocabulary
            and chat template are converted by transformers, needs ``gguf``, once per file:
            later loads read transformers' saved copy, `gguf_meta_cache`).
        trust_remote_code: transformers' ``trust_remote_code`` for a directory (``--trust-remote-code``).

    Raises:
        ValueError: transformers could not convert a GGUF file's vocabulary (e.g. its reader of
            gpt-oss files fails on the ``rope.scaling.*`` keys in 5.24); the message names the
            file, the cause and ``--tokenizer-path``.
    """
    from transformers import AutoTokenizer

    if gguf_file is not None:
        import os

        from attnserve.model_loader.gguf_meta_cache import cached

        try:
            return cached(os.path.join(model_path, gguf_file), "tokenizer",
                          lambda: AutoTokenizer.from_pretrained(model_path, gguf_file=gguf_file),
                          AutoTokenizer.from_pretrained)
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, NotImplementedError) as e:
            raise ValueError(
                f"transformers could not read the tokenizer of {gguf_file} ({type(e).__name__}: {e}); pass "
                f"--tokenizer-path with the model's HF tokenizer directory (tokenizer.json, tokenizer_config.json)"
            ) from e
    return AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)


def apply_chat_template(tokenizer: Any, prompt: str) -> List[int]:
    """Token ids of one user turn ``prompt`` in the tokenizer's chat template, followed by
    the assistant-turn header (``add_generation_prompt=True``).

    Raises:
        ValueError: when the tokenizer has no chat template.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; send raw prompts instead")
    out = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
    )
    if hasattr(out, "keys") and "input_ids" in out:  # transformers >= 5 returns a BatchEncoding
        out = out["input_ids"]
    return [int(t) for t in out]


def tokenize_prompt(tokenizer: Any, vocab_size: int, prompt, chat: bool = False) -> List[int]:
    """Token ids of ``prompt`` (a string, or already ids); ``chat`` applies the model's chat
    template as one user message (`apply_chat_template`).

    Raises:
        ValueError: an empty prompt, ids that are not ints in ``[0, vocab_size)``, or text
            without a tokenizer.
    """
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("the prompt is empty")
        if tokenizer is None:
            raise ValueError("this model has no tokenizer; pass token ids instead of text")
        if chat:
            return apply_chat_template(tokenizer, prompt)
        return tokenizer.encode(prompt)
    ids = list(prompt)
    if not ids:
        raise ValueError("the prompt is empty")
    if set(map(type, ids)) == {int}:  # the usual case, checked at C speed (bools have type bool)
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab_size})")
        return ids
    if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size for t in ids):
        raise ValueError(f"prompt token ids must be integers in [0, {vocab_size})")
    return ids
