"""The GGUF config/tokenizer disk cache gives what transformers builds from the file itself."""

import os

import pytest

from attnserve.model_loader import gguf_meta_cache
from attnserve.model_loader.gguf import load_gguf_config
from attnserve.model_loader.tokenizer import get_tokenizer


def _plain(config):
    d = config.to_dict()
    for k in ("_name_or_path", "transformers_version"):
        d.pop(k, None)
    return d


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(gguf_meta_cache.CACHE_ENV, "1")
    return tmp_path


def test_cached_config_and_tokenizer_equal_the_parsed_ones(smollm2_source, cache_root):
    path = smollm2_source.gguf_path
    ref_cfg = load_gguf_config(path)  # parsed by transformers (an empty cache), then stored
    ref_tok = get_tokenizer(smollm2_source.model_path, smollm2_source.gguf_file)
    for kind in ("config", "tokenizer"):
        assert os.path.isdir(gguf_meta_cache.entry_dir(path, kind)), kind
    cfg = load_gguf_config(path)  # read back from the cache
    tok = get_tokenizer(smollm2_source.model_path, smollm2_source.gguf_file)
    assert cfg is not ref_cfg and tok is not ref_tok
    assert type(cfg) is type(ref_cfg) and _plain(cfg) == _plain(ref_cfg)
    assert type(tok) is type(ref_tok)
    texts = ["What is the capital of France?", "  héllo\n\twörld 123 😀 <|im_end|>", ""]
    for t in texts:
        assert tok.encode(t) == ref_tok.encode(t)
        assert tok.encode(t, add_special_tokens=False) == ref_tok.encode(t, add_special_tokens=False)
    ids = list(range(0, len(ref_tok), 97))
    assert tok.decode(ids) == ref_tok.decode(ids)
    assert (tok.eos_token_id, tok.bos_token_id, len(tok)) == (ref_tok.eos_token_id, ref_tok.bos_token_id,
                                                               len(ref_tok))
    msgs = [{"role": "user", "content": "hi"}]
    assert ref_tok.chat_template and tok.chat_template == ref_tok.chat_template
    assert (tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            == ref_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False))


def test_a_hit_does_not_build_and_a_changed_file_misses(tmp_path, cache_root):
    class Obj:
        def __init__(self, v):
            self.v = v

        def save_pretrained(self, d):
            with open(os.path.join(d, "v"), "w") as f:
                f.write(self.v)

    def load(d):
        with open(os.path.join(d, "v")) as f:
            return Obj(f.read())

    f = tmp_path / "m.gguf"
    f.write_bytes(b"x" * 10)
    builds = []

    def build():
        builds.append(1)
        return Obj(f"built {len(builds)}")

    assert gguf_meta_cache.cached(str(f), "config", build, load).v == "built 1"
    assert gguf_meta_cache.cached(str(f), "config", build, load).v == "built 1"  # read back, not built
    assert len(builds) == 1
    f.write_bytes(b"y" * 11)  # another size: another key
    assert gguf_meta_cache.cached(str(f), "config", build, load).v == "built 2"
    os.remove(os.path.join(gguf_meta_cache.entry_dir(str(f), "config"), "v"))  # a damaged entry is rebuilt
    assert gguf_meta_cache.cached(str(f), "config", build, load).v == "built 3"
