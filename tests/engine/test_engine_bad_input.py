"""Bad input gets a precise error and leaves the engine serving."""

import subprocess
import sys

import pytest

from attnserve.engine.sampling_params import SamplingParams
from attnserve.server_args import ServerArgs


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"stop": [""]}, "stop"),
        ({"seed": 2**64}, "seed must fit in a signed 64-bit integer"),
        ({"seed": 2**63 - 2, "n": 2}, "seed must fit"),  # sample 1's seed + 1 would overflow
    ],
)
def test_invalid_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_prompts_leave_engine_untouched(llm):
    alloc = llm.engine.model_runner.token_to_kv_pool_allocator
    free_before = alloc.available_size()
    sp = SamplingParams(max_new_tokens=4, temperature=0.0)
    with pytest.raises(ValueError, match="prompt list is empty"):
        llm.generate([], sp)
    with pytest.raises(ValueError, match="empty"):
        llm.generate(["fine", ""], sp)
    too_long = [1] * llm.engine.context_len
    with pytest.raises(ValueError, match="context length"):
        llm.generate(["fine prompt", too_long], sp)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[1, 2, -5]], sp)
    assert not llm.engine.has_work() and alloc.available_size() == free_before
    assert llm.generate(["Hello"], sp, chat=True)[0].finish_reason in ("stop", "length")


def test_sampling_params_as_dicts(llm):
    """SGLang's offline form: a dict of `SamplingParams` fields (or a list of them, one per
    prompt) gives what the dataclass gives; a key that is no field, a list of the wrong
    length or another type is a ValueError naming it, and nothing is enqueued."""
    prompts = ["The capital of France is", "One, two,"]
    want = llm.generate(prompts, SamplingParams(max_new_tokens=5, temperature=0.0))
    got = llm.generate(prompts, {"max_new_tokens": 5, "temperature": 0.0})
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    per_prompt = llm.generate(prompts, [{"max_new_tokens": 2, "temperature": 0.0},
                                        SamplingParams(max_new_tokens=5, temperature=0.0)])
    assert per_prompt[0].token_ids == want[0].token_ids[:2] and per_prompt[1].token_ids == want[1].token_ids
    sglang_names = llm.generate(prompts[:1], {"max_new_tokens": 5, "temperature": 0.0, "min_new_tokens": 5,
                                              "sampling_seed": 3})
    assert len(sglang_names[0].token_ids) == 5
    with pytest.raises(ValueError, match="'max_tokens'"):
        llm.generate(prompts, {"max_tokens": 5})
    with pytest.raises(ValueError, match="2 prompts but 1 sampling params"):
        llm.generate(prompts, [{"max_new_tokens": 5}])
    with pytest.raises(ValueError, match="got str"):
        llm.generate(prompts, "greedy")
    with pytest.raises(ValueError, match="temperature"):
        llm.generate(prompts, {"temperature": -1.0})
    assert not llm.engine.has_work()


def test_n_samples_per_prompt(llm):
    """``n``: that many outputs per prompt, in a row (SGLang's order); greedy samples agree,
    seeded ones differ from each other but repeat across calls; the engine alone refuses n > 1."""
    prompts = ["The capital of France is", "One, two,"]
    greedy = llm.generate(prompts, SamplingParams(max_new_tokens=4, temperature=0.0, n=3))
    assert len(greedy) == 6
    assert [o.token_ids for o in greedy[:3]] == [greedy[0].token_ids] * 3
    assert [o.token_ids for o in greedy[3:]] == [greedy[3].token_ids] * 3 and greedy[0].token_ids != greedy[3].token_ids
    sp = {"max_new_tokens": 12, "temperature": 1.0, "seed": 7, "n": 4, "ignore_eos": True}
    first = [o.token_ids for o in llm.generate(prompts[:1], sp)]
    again = [o.token_ids for o in llm.generate(prompts[:1], sp)]
    assert first == again and len(set(map(tuple, first))) > 1
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="one sample per request"):
        llm.engine.check_prompt([1, 2, 3], SamplingParams(n=2))
    assert not llm.engine.has_work()


def test_server_args_reject_bad_flags():
    with pytest.raises(ValueError, match="page-size"):
        ServerArgs(page_size=0).check()
    with pytest.raises(ValueError, match="contradicts"):
        ServerArgs(disable_cuda_graph=True, cuda_graph_max_bs=8).check()


def test_context_length_longer_than_the_models_is_refused(monkeypatch):
    """llama-tiny's RoPE tables end at 512 positions: a longer --context-length used to start
    and then fail every long request with an IndexError (HTTP 500)."""
    from attnserve.engine.engine import Engine

    args = dict(model="llama-tiny", load_format="dummy", device="cpu", max_total_tokens=2048)
    with pytest.raises(ValueError, match=r"--context-length 513 is longer than the context of 'llama-tiny' \(512 tokens"):
        Engine(ServerArgs(context_length=513, **args))
    engine = Engine(ServerArgs(context_length=512, **args))  # the model's own length is fine
    try:
        assert engine.context_len == 512
    finally:
        engine.shutdown()
    monkeypatch.setenv("ATTNSERVE_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "1")  # SGLang's override: only a warning
    engine = Engine(ServerArgs(context_length=600, **args))
    try:
        assert engine.context_len == 600
    finally:
        engine.shutdown()


def test_stop_strings_need_a_tokenizer():
    """A dummy shape has no tokenizer, so a stop string could never match: refused, not ignored."""
    from attnserve.engine.engine import Engine

    engine = Engine(ServerArgs(model="llama-tiny", load_format="dummy", device="cpu", max_total_tokens=1024))
    try:
        with pytest.raises(ValueError, match="stop strings need a tokenizer.*use stop_token_ids"):
            engine.check_prompt([1, 2, 3], SamplingParams(stop=["a"]))
        engine.check_prompt([1, 2, 3], SamplingParams(stop_token_ids=[5]))  # ids are fine
    finally:
        engine.shutdown()


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "attnserve", "generate", *args], capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--attention-backend", "nope", "hi"], "valid backends"),
        (["--model", "/does/not/exist.gguf", "hi"], "exist"),
        (["--max-new-tokens", "0", "hi"], "max_new_tokens"),
        (["--temperature", "-1", "hi"], "temperature"),
        ([], "no prompts"),
    ],
)
def test_cli_errors_are_one_line_exit_2(args, needle):
    r = _cli(*args)
    assert r.returncode == 2, r.stderr
    err = r.stderr.strip().splitlines()
    assert err and err[-1].startswith("attnserve: error:") and needle in err[-1]


def test_cli_generates(tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("What is the capital of France?\n")
    r = _cli("--prompts-file", str(f), "--max-new-tokens", "12", "--page-size", "4")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout and "requests=1" in r.stdout and "tokens/s=" in r.stdout
