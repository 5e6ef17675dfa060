"""Shared pieces of the constrained-decoding tests: a tiny byte-level BPE tokenizer (any
text can be encoded, as with GPT-2-style vocabularies) and a tiny Llama checkpoint
directory (config + tokenizer; the engine fills it with random weights), whose logits
are wider than the tokenizer (a padded LM head)."""

from __future__ import annotations

import json
import os

#: tokenizer vocabulary (3 special tokens, 256 byte tokens, merges) and the model's wider one
TOKENIZER_VOCAB = 300
MODEL_VOCAB = 320

_CORPUS = [
    '{"name": "Ada", "age": 36, "tags": ["math", "code"], "ok": true}',
    '{"id": 12, "items": [1, 2, 3], "kind": "red", "nested": {"x": 1.5, "y": null}}',
    "yes no maybe 123-456 abc def the quick brown fox",
] * 4


def tiny_bpe_tokenizer():
    """A `PreTrainedTokenizerFast`: byte-level BPE of `TOKENIZER_VOCAB` tokens, ``<unk>``
    0, ``<s>`` 1, ``</s>`` 2 (EOS)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def tiny_model_dir(path: str) -> str:
    """Write a 2-layer Llama config (vocabulary `MODEL_VOCAB`, EOS 2) and the tiny tokenizer
    to ``path``; load it with ``load_format="dummy"``."""
    os.makedirs(path, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": MODEL_VOCAB, "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 512,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    tiny_bpe_tokenizer().save_pretrained(path)
    return path
