"""Request shapes that OpenAI / vLLM / SGLang clients send and that attnserve once answered
wrongly: a JSON body without ``Content-Type`` (``requests.post(url, data=json.dumps(...))``),
a non-JSON ``Content-Type`` on the native routes, and OpenAI's prompt scoring
(``echo`` with ``max_tokens: 0``). Runs against the shared live server (`conftest.server`)."""

import json

import pytest

openai = pytest.importorskip("openai")

C, CHAT = "/v1/completions", "/v1/chat/completions"
MODEL = "smollm2-135m"
MSG = [{"role": "user", "content": "Hi"}]
PROMPT = "The capital of France is Paris"


@pytest.mark.parametrize("path,body", [
    (C, {"prompt": "Hi", "max_tokens": 1}),
    (CHAT, {"messages": MSG, "max_tokens": 1}),
    ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 1}}),
    ("/tokenize", {"prompt": "Hello world"}),
])
def test_json_body_without_content_type_is_read_as_json(server, auth, path, body):
    """No ``Content-Type`` header: the body is JSON all the same (it was a 400 "must be a JSON
    object" under FastAPI's strict content-type default)."""
    import httpx

    r = httpx.post(server.base_url + path, content=json.dumps(body).encode(), headers=auth, timeout=60)
    assert "content-type" not in r.request.headers
    assert r.status_code == 200, r.text
    if path == "/tokenize":
        assert r.json()["count"] == len(server.engine.tokenizer.encode("Hello world"))
    bad = httpx.post(server.base_url + path, content=b'{"prompt": ', headers=auth, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json", bad.text


@pytest.mark.parametrize("path", ["/generate", "/tokenize", "/detokenize"])
def test_native_routes_refuse_non_json_content_type(client, path):
    r = client.post(path, content=b'{"text": "Hi"}', headers={"Content-Type": "text/plain"})
    assert r.status_code == 415, r.text
    assert r.json()["error"]["code"] == "unsupported_media_type" and "text/plain" in r.json()["error"]["message"]


def _prompt_part(lp, n_prompt):
    return (lp.tokens[:n_prompt], lp.token_logprobs[:n_prompt], lp.text_offset[:n_prompt])


def test_echo_with_max_tokens_zero_scores_the_prompt(oai, server):
    """OpenAI's (and vLLM's) prompt scoring: the prompt and its logprobs, no completion."""
    n_prompt = len(server.engine.tokenizer.encode(PROMPT))
    one = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, echo=True, logprobs=1, temperature=0)
    r = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    c = r.choices[0]
    assert c.text == PROMPT and c.finish_reason == "length"
    assert len(c.logprobs.tokens) == n_prompt and c.logprobs.token_logprobs[0] is None
    assert _prompt_part(c.logprobs, n_prompt) == _prompt_part(one.choices[0].logprobs, n_prompt)
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == n_prompt == r.usage.total_tokens
    # streamed: one chunk with the prompt and its logprobs, then the finish chunk and the usage
    chunks = list(oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1,
                                         stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == PROMPT
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["length"]
    streamed = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens]
    assert streamed == c.logprobs.tokens
    assert chunks[-1].usage.completion_tokens == 0
    # without logprobs: the prompt alone; without echo, max_tokens 0 is refused
    assert oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True).choices[0].text == PROMPT
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)
    assert e.value.body["param"] == "max_tokens" and "echo" in e.value.body["message"]
    server.wait_idle(timeout=10)
