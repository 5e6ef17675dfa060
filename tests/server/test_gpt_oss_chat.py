"""gpt-oss harmony output through the server (``--reasoning-parser gpt-oss
--tool-call-parser gpt-oss``): a scripted engine (no model; it writes a canned harmony
answer one token per step and stops through the engine's real stop checks and
detokenization) behind the real app, with a tiny word-level tokenizer holding the harmony
special tokens. Chat completions, streamed and not, carry ``reasoning_content``,
``content`` and ``tool_calls`` and never a harmony marker; the engine got
``skip_special_tokens=False`` and ``<|return|>`` / ``<|call|>`` as stop tokens. The
request's own ``skip_special_tokens`` (chat and completions). Also
``/v1/responses`` (a reasoning item, then the message), and the engine's and the HTTP
process's (multi-process server) detokenizers with markers kept or not."""

import json
import threading
from types import SimpleNamespace

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from attnserve.engine.detokenizer import check_stop, stable_text  # noqa: E402
from attnserve.engine.request import FinishReason, Req  # noqa: E402
from attnserve.engine.sampling_params import SamplingParams  # noqa: E402
from attnserve.server.parsers.gpt_oss import MARKERS  # noqa: E402

httpx = pytest.importorskip("httpx")

TEMPLATE = ("{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|start|>assistant{% endif %}")
PARIS = '{"location":"Paris"}'
ANSWER = ("<|channel|>analysis<|message|>We need to answer 2+2.<|end|><|start|>assistant"
          "<|channel|>final<|message|>The answer is 4.<|return|>")
CALL = ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
        f"to=functions.get_weather <|constrain|>json<|message|>{PARIS}<|call|>"
        "<|start|>functions.get_weather to=assistant")  # past <|call|>: must never be generated
PREAMBLE = ("<|channel|>commentary<|message|>Let me check.<|end|><|start|>assistant to=functions.get_weather"
            f"<|channel|>commentary json<|message|>{PARIS}<|call|>")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"location": {"type": "string"}}}}}]
ASK = [{"role": "user", "content": "What is 2+2 ?"}]


def _tokenizer():
    """A word-level tokenizer whose special tokens are the harmony markers (``<|return|>``
    is its EOS, as in o200k_harmony); the words are those of the scripts and the prompt."""
    import re

    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<unk>"}
    for text in (ANSWER, CALL, PREAMBLE, "system user assistant What is 2+2 ?"):
        words.update(re.sub(r"<\|[a-z]+\|>", " ", text).split())
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(sorted(words))}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(m, special=True) for m in MARKERS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|return|>",
                                   chat_template=TEMPLATE)


class _Pool:
    def __init__(self, size):
        self.size = size

    def available_size(self):
        return self.size

    def clear(self):
        pass


class ScriptedEngine:
    """The engine as the server loop sees it: each request writes the ids of ``script``
    one per step; `check_stop` (EOS: ``<|return|>`` only) ends it and decodes its text."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.scheduler = self
        self.model_runner = SimpleNamespace(token_to_kv_pool_allocator=_Pool(1000), req_to_token_pool=_Pool(8),
                                            token_to_kv_pool=SimpleNamespace(dtype="float32", mem_bytes=lambda: 0))
        self.server_args = SimpleNamespace(model="gpt-oss-scripted", tool_call_parser="gpt-oss",
                                           reasoning_parser="gpt-oss", chat_template=None, allowed_origins=None)
        self.info = {"versions": {"attnserve": "test"}}
        self.context_len = self.max_request_tokens = 4096
        self.vocab_size = len(tokenizer)
        self.eos = [tokenizer.convert_tokens_to_ids("<|return|>")]
        self.running, self.waiting, self.requests = [], [], {}
        self.script, self.params = "", []

    def tokenize(self, prompt, chat=False):
        return prompt if isinstance(prompt, list) else self.tokenizer.encode(prompt, add_special_tokens=False)

    def add_request(self, prompt_ids, sp, rid=None):
        req = Req(rid=rid, prompt_ids=list(prompt_ids), sampling_params=sp, max_total_len=4096)
        req.script = self.tokenizer.encode(self.script, add_special_tokens=False)
        self.params.append(sp)
        self.requests[rid] = req
        self.waiting.append(req)
        return req

    def abort_request(self, rid):
        req = self.requests.get(rid)
        if req is None or req.finished:
            return False
        req.finish_reason = FinishReason.ABORT
        for lst in (self.waiting, self.running):
            if req in lst:
                lst.remove(req)
        return True

    def forget(self, rid):
        req = self.requests.get(rid)
        if req is not None and req.finished:
            del self.requests[rid]

    def has_work(self):
        return bool(self.waiting or self.running)

    def step(self):
        self.running += self.waiting
        self.waiting = []
        for r in self.running:
            r.output_ids.append(r.script[len(r.output_ids)])
            check_stop(r, self.tokenizer, self.eos, self.context_len)
        done = [r for r in self.running if r.finished]
        self.running = [r for r in self.running if not r.finished]
        return list(self.running) + done


@pytest.fixture(scope="module")
def scripted():
    from attnserve.server.launch import ServerThread, create_app

    engine = ScriptedEngine(_tokenizer())
    thread = ServerThread(create_app(engine)).start()
    with httpx.Client(base_url=thread.base_url, timeout=60) as client:
        yield engine, client
    thread.stop()


_LOCK = threading.Lock()


def _chat(scripted, script, stream, **extra):
    """``(message or reassembled delta, finish_reason, SamplingParams the engine got, chunks)``."""
    engine, client = scripted
    with _LOCK:
        engine.script = script
        body = {"messages": ASK, "max_tokens": 64, "stream": stream, **extra}
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        sp = engine.params[-1]
    if not stream:
        choice = r.json()["choices"][0]
        return choice["message"], choice["finish_reason"], sp, [r.text]
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    msg = {"reasoning_content": "", "content": "", "tool_calls": {}}
    reasons = []
    for ch in chunks:
        for c in ch["choices"]:
            reasons.append(c["finish_reason"])
            d = c["delta"]
            msg["reasoning_content"] += d.get("reasoning_content") or ""
            msg["content"] += d.get("content") or ""
            for tc in d.get("tool_calls") or ():
                if tc.get("id"):
                    msg["tool_calls"][tc["index"]] = {"id": tc["id"], "type": tc["type"], "function": {
                        "name": tc["function"]["name"], "arguments": ""}}
                msg["tool_calls"][tc["index"]]["function"]["arguments"] += tc["function"]["arguments"]
    msg["tool_calls"] = [msg["tool_calls"][i] for i in sorted(msg["tool_calls"])]
    return msg, [x for x in reasons if x][-1], sp, [r.text]


def _no_markers(raw):
    for text in raw:
        assert not any(m in text for m in MARKERS), text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_reasoning_and_content(scripted, stream):
    msg, reason, sp, raw = _chat(scripted, ANSWER, stream)
    assert msg["reasoning_content"] == "We need to answer 2+2."
    assert msg["content"] == "The answer is 4."
    assert not msg.get("tool_calls") and reason == "stop"
    assert sp.skip_special_tokens is False  # the engine decoded with the markers kept ...
    _no_markers(raw)  # ... and the client received none


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_call(scripted, stream):
    msg, reason, sp, raw = _chat(scripted, CALL, stream, tools=TOOLS)
    assert reason == "tool_calls"
    assert msg["reasoning_content"] == "Need weather."
    assert msg["content"] == ("" if stream else None)
    [call] = msg["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": PARIS}
    tok = scripted[0].tokenizer
    assert {tok.convert_tokens_to_ids("<|return|>"), tok.convert_tokens_to_ids("<|call|>")} <= set(sp.stop_token_ids)
    _no_markers(raw)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_preamble_then_call_in_the_header_form(scripted, stream):
    msg, reason, _, raw = _chat(scripted, PREAMBLE, stream, tools=TOOLS)
    assert reason == "tool_calls" and not msg.get("reasoning_content")
    assert msg["content"] == "Let me check."
    assert [c["function"] for c in msg["tool_calls"]] == [{"name": "get_weather", "arguments": PARIS}]
    _no_markers(raw)


def test_without_tools_the_call_is_content_and_stop_reason_is_clean(scripted):
    """No tools: no call is made of the output (its body is content); the internal stop
    tokens are not reported as the client's ``stop_reason``."""
    engine, client = scripted
    with _LOCK:
        engine.script = CALL
        r = client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 64})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice.get("stop_reason") is None
    assert choice["message"]["content"] == PARIS and choice["message"]["reasoning_content"] == "Need weather."
    _no_markers([r.text])


@pytest.mark.parametrize("skip", [True, False])
def test_request_skip_special_tokens(scripted, skip):
    """The request's ``skip_special_tokens``: on the chat route the gpt-oss parsers remove
    the markers either way; ``/v1/completions`` and ``/generate`` (no parsers) return the
    raw harmony text when it is false."""
    msg, _, sp, raw = _chat(scripted, ANSWER, False, skip_special_tokens=skip)
    assert sp.skip_special_tokens is False and msg["content"] == "The answer is 4."
    _no_markers(raw)
    engine, client = scripted
    with _LOCK:
        engine.script = ANSWER
        r = client.post("/v1/completions", json={"prompt": "What is 2+2 ?", "max_tokens": 64,
                                                 "skip_special_tokens": skip})
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    assert ("<|channel|>" in text) is not skip and engine.params[-1].skip_special_tokens is skip
    assert text.endswith("The answer is 4.")  # <|return|> is the EOS: not in the text
    with _LOCK:  # SGLang's native route takes it in sampling_params
        r = client.post("/generate", json={"text": "What is 2+2 ?", "sampling_params": {
            "max_new_tokens": 64, "skip_special_tokens": skip}})
    assert r.status_code == 200, r.text
    assert r.json()["text"] == text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_responses_api_reads_harmony(scripted, stream):
    engine, client = scripted
    with _LOCK:
        engine.script = ANSWER
        r = client.post("/v1/responses", json={"input": "What is 2+2 ?", "max_output_tokens": 64, "stream": stream})
    assert r.status_code == 200, r.text
    _no_markers([r.text])
    if stream:
        deltas = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
        text = "".join(d["delta"] for d in deltas if d["type"] == "response.output_text.delta")
        thinking = "".join(d["delta"] for d in deltas if d["type"] == "response.reasoning_text.delta")
        assert (thinking, text) == ("We need to answer 2+2.", "The answer is 4.")
    else:
        kinds = [item["type"] for item in r.json()["output"]]
        assert kinds == ["reasoning", "message"]
        assert r.json()["output"][1]["content"][0]["text"] == "The answer is 4."


def test_detokenizers_keep_markers_only_when_asked():
    """The engine's text (`check_stop` / `stable_text`) and the HTTP process's
    `IncrementalDetokenizer` follow the request's ``skip_special_tokens``."""
    from attnserve.server.detokenize import IncrementalDetokenizer

    tok = _tokenizer()
    ids = tok.encode(ANSWER, add_special_tokens=False)
    for skip in (True, False):
        want = tok.decode(ids[:-1], skip_special_tokens=skip)
        assert ("<|channel|>" in want) is not skip
        detok = IncrementalDetokenizer(tok, (), skip_special_tokens=skip)
        detok.add(ids[:-1])
        assert detok.text == want
        detok = IncrementalDetokenizer(tok, (), skip_special_tokens=skip)
        for t in ids[:-1]:  # token by token (this word-level tokenizer has no decoder: spaces differ)
            detok.add([t])
        assert (detok.text.count("<|") == want.count("<|") == 6) is not skip
        req = Req(rid="r", prompt_ids=[0], sampling_params=SamplingParams(skip_special_tokens=skip), max_total_len=999)
        for t in ids:
            req.output_ids.append(t)
            check_stop(req, tok, [tok.eos_token_id], 999)
            assert want.startswith(stable_text(req, tok))
        assert req.finish_reason == FinishReason.STOP and req.text == want  # <|return|> itself dropped
    with pytest.raises(ValueError, match="skip_special_tokens"):
        SamplingParams(skip_special_tokens="no")
