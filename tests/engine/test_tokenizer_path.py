"""``--tokenizer-path``: a tokenizer directory instead of the checkpoint's, which also gives a
dummy shape text prompts; one whose vocabulary the model cannot hold is refused at load."""

import pytest

from attnserve.engine.llm import LLM
from attnserve.engine.sampling_params import SamplingParams
from attnserve.server_args import ServerArgs


@pytest.fixture(scope="module")
def tokenizer_dir(llm, tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    llm.engine.tokenizer.save_pretrained(str(path))
    return str(path)


def test_dummy_shape_takes_a_tokenizer_directory(llm, tokenizer_dir):
    # Qwen3-0.6B's shape has no tokenizer of its own; bf16 halves its CPU memory
    with LLM("qwen3-0.6b", load_format="dummy", tokenizer_path=tokenizer_dir, max_total_tokens=512,
             context_length=256, dtype="bfloat16") as dummy:
        tok = dummy.engine.tokenizer
        assert tok is not None and tok.name_or_path == tokenizer_dir
        prompt = "The capital of France is"
        assert dummy.engine.tokenize(prompt) == llm.engine.tokenize(prompt)
        out = dummy.generate([prompt], SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True))[0]
        assert len(out.token_ids) == 3 and isinstance(out.text, str)


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tokenizer_dir):
    with pytest.raises(ValueError, match="vocabulary of 301"):
        LLM("qwen3-tiny", load_format="dummy", tokenizer_path=tokenizer_dir, max_total_tokens=256)


def test_cli_flags_reach_server_args():
    import argparse

    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    args = ServerArgs.from_cli_args(p.parse_args(["--tokenizer-path", "/tok", "--trust-remote-code"]))
    assert args.tokenizer_path == "/tok" and args.trust_remote_code is True
    assert ServerArgs().tokenizer_path is None and ServerArgs().trust_remote_code is False


def test_a_missing_or_empty_tokenizer_directory_says_so(tmp_path):
    from attnserve.model_loader.loader import load_model

    with pytest.raises(FileNotFoundError, match="'/nonexistent/tok' is not a directory"):
        load_model("qwen3-tiny", load_format="dummy", tokenizer_path="/nonexistent/tok")
    with pytest.raises(ValueError, match=r"--tokenizer-path .*: no tokenizer could be loaded from it \(.+\)"):
        load_model("qwen3-tiny", load_format="dummy", tokenizer_path=str(tmp_path))
