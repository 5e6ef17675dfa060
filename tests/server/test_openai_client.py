"""The official ``openai`` client against the real server: completions, chat, streaming,
models, usage, stop strings, seeds."""

import pytest

openai = pytest.importorskip("openai")

MODEL = "smollm2-135m"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_models_list(oai, server):
    models = oai.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert oai.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("gpt-4")


def test_chat_answers_paris(oai):
    r = oai.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.model == MODEL
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content.startswith("The capital of France is Paris")
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 10 and 1 <= r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_and_token_id_prompt(oai, server):
    r = oai.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert r.object == "text_completion"
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
    assert "Paris" in r.choices[0].text
    ids = server.engine.tokenizer.encode("The capital of France is")
    r2 = oai.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert r2.choices[0].text == r.choices[0].text and r2.usage.prompt_tokens == len(ids)


def test_batch_of_prompts_answers_each_in_order(oai, server):
    prompts = ["The capital of France is", "The capital of Italy is", "One, two, three,"]
    singles = [oai.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0) for p in prompts]
    r = oai.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [s.choices[0].text for s in singles]
    assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert r.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles) == 18
    # token-id batches with n choices: prompt p's choices at p * n .. p * n + n - 1, echo per prompt
    ids = [server.engine.tokenizer.encode(p) for p in prompts[:2]]
    r2 = oai.completions.create(model=MODEL, prompt=ids, max_tokens=3, n=2, temperature=0, echo=True)
    assert [c.index for c in r2.choices] == [0, 1, 2, 3]
    for i, c in enumerate(r2.choices):
        assert c.text.startswith(prompts[i // 2]), (i, c.text)
        assert c.text[len(prompts[i // 2]):] == singles[i // 2].choices[0].text[:len(c.text) - len(prompts[i // 2])]
    assert r2.usage.prompt_tokens == sum(len(x) for x in ids) and r2.usage.completion_tokens == 12
    # streamed: every chunk names its choice; each choice's text and one finish_reason per choice
    chunks = list(oai.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, stream=True,
                                         stream_options={"include_usage": True}))
    texts, finals = ["", "", ""], [[], [], []]
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finals[c.index].append(c.finish_reason)
    assert texts == [c.text for c in r.choices]
    assert finals == [[c.finish_reason] for c in r.choices]
    assert chunks[-1].usage.completion_tokens == 18


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_stream_equals_non_stream(oai, kind):
    kw = dict(model=MODEL, max_tokens=16, temperature=0)
    if kind == "chat":
        full = oai.chat.completions.create(messages=QUESTION, **kw)
        chunks = list(oai.chat.completions.create(messages=QUESTION, stream=True,
                                                  stream_options={"include_usage": True}, **kw))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        expected = full.choices[0].message.content
        assert chunks[0].choices[0].delta.role == "assistant"
    else:
        full = oai.completions.create(prompt="Once upon a time", **kw)
        chunks = list(oai.completions.create(prompt="Once upon a time", stream=True,
                                             stream_options={"include_usage": True}, **kw))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        expected = full.choices[0].text
    assert len(chunks) > 3  # really streamed, token by token
    assert text == expected
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_stop_string_streamed_and_not(oai):
    kw = dict(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0, stop=["Paris"])
    full = oai.chat.completions.create(**kw)
    assert full.choices[0].finish_reason == "stop" and "Paris" not in full.choices[0].message.content
    text = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(stream=True, **kw)
                   if c.choices)
    assert text == full.choices[0].message.content


def test_seeded_sampling_is_reproducible(oai):
    kw = dict(model=MODEL, prompt="My favourite animal is", max_tokens=10, temperature=1.0, top_p=0.9,
              seed=1234, extra_body={"top_k": 50, "ignore_eos": True})
    a = oai.completions.create(**kw).choices[0].text
    b = oai.completions.create(**kw).choices[0].text
    assert a == b and oai.completions.create(**kw).usage.completion_tokens == 10


def test_multi_turn_chat_uses_template(oai, server):
    messages = [{"role": "system", "content": "You answer in one word."},
                {"role": "user", "content": "Capital of Italy?"},
                {"role": "assistant", "content": "Rome."},
                {"role": "user", "content": [{"type": "text", "text": "And of Spain?"}]}]
    r = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    tok = server.engine.tokenizer
    expected = tok.apply_chat_template(
        [{**m, "content": m["content"] if isinstance(m["content"], str) else m["content"][0]["text"]}
         for m in messages], add_generation_prompt=True, tokenize=True)
    if hasattr(expected, "keys"):
        expected = expected["input_ids"]
    assert r.usage.prompt_tokens == len(expected)
    assert r.choices[0].message.content
