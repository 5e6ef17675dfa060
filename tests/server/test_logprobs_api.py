"""Logprobs and logit controls through the real server with the ``openai`` client (issue 35):
OpenAI's response shapes (chat ``logprobs.content``, completions ``tokens`` /
``token_logprobs`` / ``top_logprobs`` / ``text_offset``, ``echo``), streamed chunks carrying
their tokens' logprobs, penalties / ``logit_bias`` / ``min_tokens`` taking effect, and bad
values refused with a 400 naming the field while the server keeps serving."""

import math

import pytest

openai = pytest.importorskip("openai")

MODEL = "smollm2-135m"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _check_top(top, chosen_lp, chosen_token=None):
    lps = [t.logprob for t in top]
    assert lps == sorted(lps, reverse=True)
    assert sum(math.exp(x) for x in lps) <= 1 + 1e-5
    assert top[0].logprob == pytest.approx(chosen_lp, abs=1e-6)  # greedy: the chosen token is the most likely
    if chosen_token is not None:
        assert top[0].token == chosen_token


def test_chat_logprobs_shape_and_stream(oai):
    kw = dict(model=MODEL, messages=QUESTION, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    r = oai.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    assert "".join(c.token for c in content) == r.choices[0].message.content
    for c in content:
        assert c.logprob <= 0 and bytes(c.bytes).decode("utf-8") == c.token
        assert len(c.top_logprobs) == 3
        _check_top(c.top_logprobs, c.logprob, c.token)
    chunks = list(oai.chat.completions.create(stream=True, **kw))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-4)
    with_text = [ch for ch in chunks if ch.choices and ch.choices[0].delta.content]
    assert len(with_text) > 3 and all(ch.choices[0].logprobs.content for ch in with_text)  # each chunk its own


def test_chat_without_logprobs_has_none(oai):
    r = oai.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2, temperature=0)
    assert r.choices[0].logprobs is None


def test_completion_logprobs_echo(oai, server):
    prompt = "The capital of France is"
    n_prompt = len(server.engine.tokenizer.encode(prompt))
    r = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=2, echo=True,
                               extra_body={"ignore_eos": True})
    choice = r.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n_prompt + 5
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first prompt token has no context
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert "".join(lp.tokens[n_prompt:]) == choice.text[len(prompt):]
    for tok, x, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert x <= 0 and top[tok] == pytest.approx(x) and len(top) <= 3
        assert sum(math.exp(v) for v in top.values()) <= 1 + 1e-5
    for x, top in zip(lp.token_logprobs[n_prompt:], lp.top_logprobs[n_prompt:]):
        assert x == pytest.approx(max(top.values()))  # greedy
    # the same request streamed: the prompt first, then one chunk per token, same values
    chunks = list(oai.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=2,
                                         echo=True, stream=True, extra_body={"ignore_eos": True}))
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.text_offset]
    assert tokens == lp.tokens and offsets == lp.text_offset
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    # logprobs=0: each position holds the chosen token alone
    r0 = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, logprobs=0)
    lp0 = r0.choices[0].logprobs
    assert all(list(top) == [tok] for tok, top in zip(lp0.tokens, lp0.top_logprobs))


def test_echo_without_logprobs(oai):
    r = oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=3, temperature=0, echo=True)
    assert r.choices[0].text.startswith("Once upon a time") and r.choices[0].logprobs is None


def _repeats(ids):
    return len(ids) - len(set(ids))


def test_penalties_bias_and_min_tokens_take_effect(oai, server):
    prompt = "one two one two one two one two one two one two"
    base = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, logprobs=0,
                                  extra_body={"ignore_eos": True})
    pen = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, logprobs=0,
                                 frequency_penalty=2.0, presence_penalty=0.5,
                                 extra_body={"ignore_eos": True, "repetition_penalty": 1.2})
    assert _repeats(pen.choices[0].logprobs.tokens) < _repeats(base.choices[0].logprobs.tokens)
    # logit_bias +100 on EOS ends the request at once; min_tokens holds it off for 3 tokens
    eos = server.engine.scheduler.eos_token_ids[0]
    bias = {str(eos): 100}
    r = oai.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=10, temperature=0, logit_bias=bias)
    assert r.usage.completion_tokens == 1 and r.choices[0].finish_reason == "stop"
    r = oai.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=10, temperature=0, logit_bias=bias,
                                    extra_body={"min_tokens": 3})
    assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "stop"
    # a strong bias on an ordinary token makes greedy decoding pick it every time
    tok = server.engine.tokenizer.encode(" banana")[0]
    r = oai.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0, logit_bias={str(tok): 100})
    assert r.choices[0].text == " banana" * 3


@pytest.mark.parametrize("kind,kw,param", [
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs
    ("chat", {"frequency_penalty": -2.5}, "frequency_penalty"),
    ("chat", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("chat", {"logit_bias": {"12": 101}}, "logit_bias.12"),
    ("cmpl", {"logprobs": 6}, "logprobs"),
    ("cmpl", {"logit_bias": {"1000000": 1}}, "logit_bias"),
    ("cmpl", {"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ("cmpl", {"extra_body": {"min_tokens": 9}}, "min_tokens"),  # more than max_tokens
], ids=["top-logprobs-21", "top-logprobs-alone", "frequency-range", "bias-key", "bias-value", "logprobs-6",
        "bias-vocab", "repetition-zero", "min-above-max"])
def test_bad_values_get_400_naming_the_field(oai, kind, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        if kind == "chat":
            oai.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, **kw)
        else:
            oai.completions.create(model=MODEL, prompt="Hi", max_tokens=4, **kw)
    assert e.value.body["param"] == param, e.value.body
    ok = oai.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason in ("stop", "length")
