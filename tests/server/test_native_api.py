"""The native routes against the shared real server (`conftest.server`): /tokenize and
/detokenize, SGLang's /generate (text, input_ids, batch, stream, logprobs), /health_generate,
/get_model_info, /flush_cache, the sglang: metric names, and bad input (400, the server keeps serving)."""

import asyncio
import json

import pytest

from prometheus_client.parser import text_string_to_metric_families

from native_route_helpers import GREEDY, PROMPT  # noqa: E402
from native_route_helpers import generate as _generate  # noqa: E402
from native_route_helpers import sse_events as _sse  # noqa: E402


@pytest.fixture(scope="module")
def completion(server, auth):
    """The greedy /v1/completions answer /generate must reproduce."""
    import httpx

    r = httpx.post(server.base_url + "/v1/completions", headers=auth, timeout=120, json={
        "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "logprobs": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_tokenize_detokenize_round_trip(server, client):
    text = "Hello, world! ünïcödé 123 <|im_start|>"
    r = client.post("/tokenize", json={"prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["tokens"] == server.engine.tokenizer.encode(text)
    assert out["count"] == len(out["tokens"]) > 5 and out["max_model_len"] == server.engine.context_len
    assert len(out["token_strs"]) == out["count"]
    back = client.post("/detokenize", json={"tokens": out["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}, back.text


def test_tokenize_messages_uses_the_chat_template(server, client):
    msgs = [{"role": "user", "content": "Hi there"}]
    out = client.post("/tokenize", json={"messages": msgs}).json()
    want = server.engine.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    assert out["tokens"] == list(want["input_ids"] if hasattr(want, "keys") else want)
    without = client.post("/tokenize", json={"messages": msgs, "add_generation_prompt": False}).json()
    header = server.engine.tokenizer.encode("<|im_start|>assistant\n")
    assert out["tokens"] == without["tokens"] + header  # the assistant header is all the flag adds


def test_generate_text_matches_completions(client, completion):
    out = _generate(client, text=PROMPT, sampling_params=GREEDY)
    assert out["text"] == completion["text"] and out["text"]
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["completion_tokens"] == 5 and meta["prompt_tokens"] > 3 and meta["e2e_latency"] > 0
    assert meta["id"].startswith("generate-") and "output_token_logprobs" not in meta


def test_generate_input_ids_and_batch(server, client, completion):
    ids = server.engine.tokenizer.encode(PROMPT)
    out = _generate(client, input_ids=ids, sampling_params=GREEDY)
    assert out["text"] == completion["text"] and out["meta_info"]["prompt_tokens"] == len(ids)
    other = "One, two, three,"
    batch = _generate(client, text=[PROMPT, other], sampling_params=[GREEDY, dict(GREEDY, max_new_tokens=3)],
                      rid=["a", "b"])
    assert isinstance(batch, list) and len(batch) == 2
    assert batch[0]["text"] == completion["text"] and batch[0]["meta_info"]["id"] == "a"
    assert batch[1]["meta_info"]["completion_tokens"] == 3 and batch[1]["meta_info"]["id"] == "b"
    alone = _generate(client, text=other, sampling_params=dict(GREEDY, max_new_tokens=3))
    assert batch[1]["text"] == alone["text"]
    ids_batch = _generate(client, input_ids=[ids, ids[:-1]], sampling_params=GREEDY)
    assert ids_batch[0]["text"] == completion["text"] and ids_batch[1]["meta_info"]["prompt_tokens"] == len(ids) - 1


def test_generate_stream(client, completion):
    r = client.post("/generate", json={"text": PROMPT, "sampling_params": GREEDY, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = _sse(r.text)
    assert len(chunks) >= 2
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # cumulative, as SGLang streams
    assert texts[-1] == completion["text"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    batch = _sse(client.post("/generate", json={"text": [PROMPT, PROMPT], "sampling_params": GREEDY,
                                                "stream": True}).text)
    finals = {c["index"]: c["text"] for c in batch if c["meta_info"]["finish_reason"]}
    assert finals == {0: completion["text"], 1: completion["text"]}


def test_generate_return_logprob(server, client, completion):
    out = _generate(client, text=PROMPT, sampling_params=GREEDY, return_logprob=True, top_logprobs_num=3,
                    return_text_in_logprobs=True, logprob_start_len=0)
    meta, tok = out["meta_info"], server.engine.tokenizer
    lps, tops = meta["output_token_logprobs"], meta["output_top_logprobs"]
    assert len(lps) == len(tops) == 5 and [e[1] for e in lps] == out["output_ids"]
    assert tok.decode(out["output_ids"]) == out["text"] == completion["text"]
    for (lp, tid, text), top in zip(lps, tops):
        assert lp <= 0 and text == tok.decode([tid]) and len(top) == 3
        assert top[0][1] == tid and top[0][0] == pytest.approx(lp, abs=1e-5)  # greedy: the chosen is the best
    assert [e[0] for e in lps] == pytest.approx(completion["logprobs"]["token_logprobs"], abs=1e-3)
    inputs = meta["input_token_logprobs"]
    assert len(inputs) == meta["prompt_tokens"] and inputs[0][0] is None and all(e[0] <= 0 for e in inputs[1:])
    assert [e[1] for e in inputs] == tok.encode(PROMPT)
    plain = _generate(client, text=PROMPT, sampling_params=GREEDY, return_logprob=True)
    assert plain["meta_info"]["output_top_logprobs"] == [[] for _ in range(5)]
    assert plain["meta_info"]["output_token_logprobs"][0][2] is None  # no text unless asked
    streamed = _sse(client.post("/generate", json={"text": PROMPT, "sampling_params": GREEDY, "stream": True,
                                                   "return_logprob": True}).text)
    assert streamed[-1]["output_ids"] == out["output_ids"]


def test_generate_n_samples(server, client):
    """SGLang's parallel sampling: prompt i's n samples are answers i*n .. i*n+n-1 of a list
    (one prompt too), indexed; greedy samples agree, seeded ones are seed + j and repeat."""
    greedy = _generate(client, text=PROMPT, sampling_params=dict(GREEDY, n=2))
    assert isinstance(greedy, list) and [g["index"] for g in greedy] == [0, 1]
    assert greedy[0]["text"] == greedy[1]["text"] == _generate(client, text=PROMPT, sampling_params=GREEDY)["text"]
    assert len({g["meta_info"]["id"] for g in greedy}) == 2
    hot = {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 7, "ignore_eos": True}
    batch = _generate(client, text=[PROMPT, "Once upon a time"], rid=["a", "b"], sampling_params=dict(hot, n=3))
    assert [b["index"] for b in batch] == list(range(6))
    assert [b["meta_info"]["id"] for b in batch] == ["a-0", "a-1", "a-2", "b-0", "b-1", "b-2"]
    alone = _generate(client, text="Once upon a time", sampling_params=dict(hot, sampling_seed=8))
    assert batch[4]["text"] == alone["text"]  # prompt 1, sample 1: seed 7 + 1
    assert len({b["text"] for b in batch[:3]}) > 1
    streamed = _sse(client.post("/generate", json={"text": PROMPT, "stream": True,
                                                   "sampling_params": dict(GREEDY, n=2)}).text)
    last = {c["index"]: c for c in streamed}
    assert sorted(last) == [0, 1] and last[0]["text"] == last[1]["text"] == greedy[0]["text"]
    server.wait_idle()


@pytest.mark.parametrize("body,param,code", [
    ({"text": PROMPT, "sampling_params": {"max_new_tokens": 2, "beam_width": 4}}, "sampling_params.beam_width",
     "unrecognized_request_argument"),
    ({"text": PROMPT, "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature", "invalid_value"),
    ({"text": PROMPT, "sampling_params": {"top_p": 0}}, "sampling_params.top_p", "invalid_value"),
    ({"text": PROMPT, "sampling_params": {"n": 17}}, "sampling_params.n", "invalid_value"),
    ({"text": [PROMPT, PROMPT], "sampling_params": [{"n": 2}, {"n": 3}]}, "sampling_params.1.n", "invalid_value"),
    ({"text": PROMPT, "sampling_params": {"regex": "("}}, "sampling_params.regex", "invalid_value"),
    ({"text": ""}, "text", "invalid_value"),
    ({"input_ids": []}, "input_ids", "invalid_value"),
    ({"text": ["ok", ""]}, "text.1", "invalid_value"),
    ({}, "input_ids", "invalid_value"),
    ({"text": PROMPT, "input_ids": [1, 2]}, "text", "invalid_value"),
    ({"text": [PROMPT, PROMPT], "sampling_params": [{}]}, "sampling_params", "invalid_value"),
    ({"input_ids": [10 ** 9]}, "input_ids", "invalid_value"),
    ({"text": PROMPT, "image_data": "x.png"}, "image_data", "unsupported_parameter"),
    ({"text": PROMPT, "colour": 1}, "colour", "unrecognized_request_argument"),
    ({"text": PROMPT, "return_logprob": True, "logprob_start_len": 3}, "logprob_start_len", "unsupported_parameter"),
    ({"text": PROMPT, "sampling_params": {"max_new_tokens": 10 ** 6}}, "sampling_params.max_new_tokens",
     "context_length_exceeded"),
], ids=["unknown-param", "type", "range", "n", "n-differs", "bad-regex", "empty-text", "empty-ids", "empty-in-batch", "none",
        "both", "batch-length", "id-range", "image", "unknown-field", "logprob-start", "too-long"])
def test_generate_bad_input_is_400(server, client, body, param, code):
    r = client.post("/generate", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == code, err


def test_bad_input_leaves_the_server_serving(server, client, completion):
    for body in ({"text": PROMPT, "sampling_params": {"frobnicate": 1}}, {"text": ""}):
        assert client.post("/generate", json=body).status_code == 400
    for body in ({"tokens": [-1]}, {"tokens": "abc"}):
        assert client.post("/detokenize", json=body).status_code == 400
    for body in ({}, {"prompt": "a", "messages": [{"role": "user", "content": "b"}]},
                 {"prompt": "a", "continue_final_message": True}):
        assert client.post("/tokenize", json=body).status_code == 400
    assert _generate(client, text=PROMPT, sampling_params=GREEDY)["text"] == completion["text"]
    server.wait_idle()


def test_health_generate_runs_a_token(server):
    import httpx

    r = httpx.get(server.base_url + "/health_generate", timeout=60)  # open, like /health: no API key
    assert r.status_code == 200 and r.json()["completion_tokens"] == 1, r.text


def test_health_generate_503_when_the_engine_is_dead_or_stuck(server):
    """A loop that is not running answers 503 at once; a loop that never returns the
    token answers 503 after the timeout, and the request is aborted."""
    from attnserve.server.engine_loop import EngineLoop
    from attnserve.server.native_api import health_generate
    from attnserve.server.openai_api import ServingContext

    class StuckLoop:
        draining = False
        aborted = []

        def is_alive(self):
            return True

        def submit(self, cmd):
            pass  # never answered

        def abort(self, rid):
            self.aborted.append(rid)

    dead = ServingContext(loop=EngineLoop(server.engine), engine=server.engine, model_name="m")
    stuck = ServingContext(loop=StuckLoop(), engine=server.engine, model_name="m", health_generate_timeout_s=0.2)
    r_dead = asyncio.run(health_generate(dead))
    r_stuck = asyncio.run(health_generate(stuck))
    assert r_dead.status_code == 503 and json.loads(r_dead.body)["error"]["code"] == "engine_dead"
    assert r_stuck.status_code == 503 and json.loads(r_stuck.body)["error"]["code"] == "engine_unresponsive"
    assert len(StuckLoop.aborted) == 1 and StuckLoop.aborted[0].startswith("health-")


def test_get_model_info(server, client):
    info = client.get("/get_model_info").json()
    assert info["model_path"] == server.engine.server_args.model and info["is_generation"] is True
    assert info["tokenizer_path"] == server.engine.tokenizer.name_or_path
    assert info["architectures"] == ["LlamaForCausalLM"] and info["max_model_len"] == server.engine.context_len


def _metric_values(text):
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, s.value)
    return out


def test_sglang_metric_names(server, client):
    before = _metric_values(client.get("/metrics").text)
    _generate(client, text=PROMPT, sampling_params=dict(GREEDY, max_new_tokens=4))
    server.wait_idle()
    text = client.get("/metrics").text
    after = _metric_values(text)
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:gen_throughput", "sglang:token_usage",
                 "sglang:cache_hit_rate", "sglang:num_used_tokens", "sglang:time_to_first_token_seconds_count",
                 "sglang:e2e_request_latency_seconds_count", "sglang:inter_token_latency_seconds_count",
                 "sglang:num_requests_total", "sglang:cached_tokens_total"):
        assert name in after, name
    for ours, theirs in (("attnserve_generation_tokens_total", "sglang:generation_tokens_total"),
                         ("attnserve_prompt_tokens_total", "sglang:prompt_tokens_total"),
                         ("attnserve_time_to_first_token_seconds_count", "sglang:time_to_first_token_seconds_count")):
        assert after[theirs] == after[ours] and after[theirs] > before.get(theirs, 0), theirs
    assert after["sglang:generation_tokens_total"] - before["sglang:generation_tokens_total"] == 4
    assert after["sglang:num_running_reqs"] == 0 and after["sglang:token_usage"] == 0
    assert "# TYPE sglang:num_running_reqs gauge" in text


def test_no_cors_headers_without_allowed_origins(server, client):
    r = client.get("/v1/models", headers={"Origin": "http://example.test"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    pre = client.options("/generate", headers={"Origin": "http://example.test",
                                               "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in pre.headers


def test_flush_cache_when_idle_and_refused_while_busy(server, client):
    """``/flush_cache`` (GET or POST) empties the prefix cache of an idle server; while a
    request runs it answers 400 ``requests_in_flight`` and the cache is kept."""
    import time

    def cached():
        return client.get("/debug/state").json()["kv_slots_cached"]

    def wait_for(pred):
        deadline = time.monotonic() + 30
        while not pred():
            assert time.monotonic() < deadline
            time.sleep(0.05)

    assert client.post("/generate", json={"text": PROMPT * 8, "sampling_params": GREEDY}).status_code == 200
    wait_for(lambda: cached() > 0)
    assert client.post("/flush_cache").status_code == 200
    wait_for(lambda: cached() == 0)
    assert client.post("/generate", json={"text": PROMPT * 8, "sampling_params": GREEDY}).status_code == 200
    wait_for(lambda: cached() > 0)
    body = {"prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as long_stream:  # keeps a request running
        assert long_stream.status_code == 200
        next(ln for ln in long_stream.iter_lines() if ln.startswith("data: "))
        wait_for(lambda: client.get("/debug/state").json()["running"] > 0)
        r = client.get("/flush_cache")
        assert r.status_code == 400 and r.json()["error"]["code"] == "requests_in_flight", r.text
    wait_for(lambda: client.get("/debug/state").json()["running"] == 0)  # leaving the stream aborted it
    assert cached() > 0
    assert client.get("/flush_cache").status_code == 200
    wait_for(lambda: cached() == 0)


def test_server_info_and_version(server, client):
    import attnserve

    info = client.get("/server_info").json()
    assert info == client.get("/get_server_info").json() | {"internal_states": info["internal_states"]}
    assert info["version"] == attnserve.__version__ and info["page_size"] == server.engine.server_args.page_size
    assert info["model"] == server.engine.server_args.model and info["context_length"] == server.engine.context_len
    assert info["max_total_num_tokens"] == server.engine.max_total_tokens
    assert len(info["internal_states"]) == 1 and "running" in info["internal_states"][0]
    assert client.get("/version").json() == {"version": attnserve.__version__}
