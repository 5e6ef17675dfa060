"""SGLang compatibility of the native routes against the shared real server (`conftest.server`):
``meta_info.finish_reason`` in SGLang's shapes (the matched stop token id or stop string,
the length, an abort), ``max_new_tokens: 0`` scoring a prompt (plain, streamed, in a batch),
and ``HEAD`` on the health routes."""

import pytest

from attnserve.server.engine_loop import StreamEvent
from attnserve.server.native_api import finish_reason_json

from native_route_helpers import GREEDY, PROMPT  # noqa: E402
from native_route_helpers import generate as _generate  # noqa: E402
from native_route_helpers import sse_events as _sse  # noqa: E402


@pytest.fixture(scope="module")
def greedy(server, auth):
    """The greedy 5-token answer (with its output ids) the stop tests cut short."""
    import httpx

    r = httpx.post(server.base_url + "/generate", headers=auth, timeout=120,
                   json={"text": PROMPT, "sampling_params": GREEDY, "return_logprob": True})
    assert r.status_code == 200, r.text
    return r.json()


def test_finish_reason_names_the_matched_stop_token(client, greedy):
    ids = greedy["output_ids"]
    tid = ids[2]
    out = _generate(client, text=PROMPT, sampling_params=dict(GREEDY, stop_token_ids=[tid]))
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": tid}
    assert meta["completion_tokens"] == ids.index(tid) + 1
    streamed = _sse(client.post("/generate", json={"text": PROMPT, "stream": True,
                                                   "sampling_params": dict(GREEDY, stop_token_ids=[tid])}).text)
    assert streamed[-1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": tid}
    assert streamed[-1]["text"] == out["text"]


def test_finish_reason_names_the_matched_stop_string(client, greedy):
    text = greedy["text"]
    stop = text.strip()[1:4]
    assert stop and stop in text
    out = _generate(client, text=PROMPT, sampling_params=dict(GREEDY, stop=["never-there", stop]))
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == text[: text.index(stop)]


def test_finish_reason_names_eos(server, client):
    eos = sorted(server.engine.scheduler.eos_token_ids)[0]
    out = _generate(client, text=PROMPT, sampling_params={"max_new_tokens": 4, "temperature": 0,
                                                          "logit_bias": {str(eos): 100}})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    assert out["meta_info"]["completion_tokens"] == 1 and out["text"] == ""


def test_finish_reason_shapes_of_length_and_abort():
    """SGLang's ``FINISH_LENGTH`` / ``FINISH_ABORT`` ``to_json`` keys; still running: None."""
    assert finish_reason_json(StreamEvent(completion_tokens=7, finish_reason="length")) == {"type": "length",
                                                                                            "length": 7}
    assert finish_reason_json(StreamEvent(completion_tokens=1, finish_reason="stop"), prompt_only=True) == {
        "type": "length", "length": 0}
    assert finish_reason_json(StreamEvent(finish_reason="abort")) == {
        "type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    assert finish_reason_json(StreamEvent(completion_tokens=2)) is None


def test_max_new_tokens_zero_scores_the_prompt(server, client):
    """SGLang's prompt scoring: no output, ``length`` 0, the prompt's logprobs as a request
    that generates returns them; streamed and in a batch too."""
    lp = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2}
    one = _generate(client, text=PROMPT, sampling_params={"max_new_tokens": 1, "temperature": 0}, **lp)
    out = _generate(client, text=PROMPT, sampling_params={"max_new_tokens": 0}, **lp)
    meta = out["meta_info"]
    assert out["text"] == "" and out["output_ids"] == []
    assert meta["completion_tokens"] == 0 and meta["finish_reason"] == {"type": "length", "length": 0}
    assert meta["output_token_logprobs"] == [] and meta["output_top_logprobs"] == []
    n_prompt = len(server.engine.tokenizer.encode(PROMPT))
    inputs = meta["input_token_logprobs"]
    assert meta["prompt_tokens"] == n_prompt == len(inputs) and inputs[0][0] is None
    assert [e[1] for e in inputs] == [e[1] for e in one["meta_info"]["input_token_logprobs"]]
    assert [e[0] for e in inputs[1:]] == pytest.approx([e[0] for e in one["meta_info"]["input_token_logprobs"][1:]],
                                                       abs=1e-4)
    assert len(meta["input_top_logprobs"]) == n_prompt and len(meta["input_top_logprobs"][1]) == 2
    plain = _generate(client, text=PROMPT, sampling_params={"max_new_tokens": 0})
    assert plain["text"] == "" and plain["meta_info"]["completion_tokens"] == 0 and "output_ids" not in plain
    streamed = _sse(client.post("/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 0},
                                                   "stream": True, **lp}).text)
    assert all(c["text"] == "" for c in streamed)
    assert streamed[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert streamed[-1]["meta_info"]["input_token_logprobs"] == inputs and streamed[-1]["output_ids"] == []
    batch = _generate(client, text=[PROMPT, PROMPT], sampling_params=[{"max_new_tokens": 0}, GREEDY])
    assert batch[0]["text"] == "" and batch[0]["meta_info"]["completion_tokens"] == 0
    assert batch[1]["meta_info"]["completion_tokens"] == 5 and batch[1]["text"]
    server.wait_idle()


@pytest.mark.parametrize("value", [-1, "0"])
def test_bad_max_new_tokens_is_still_a_400(client, value):
    r = client.post("/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": value}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "sampling_params.max_new_tokens"


@pytest.mark.parametrize("path", ["/health", "/health_generate"])
def test_head_on_health_routes(server, path):
    """Load balancers and k8s probes send HEAD: the GET status, no body, no API key."""
    import httpx

    get = httpx.get(server.base_url + path, timeout=60)
    head = httpx.head(server.base_url + path, timeout=60)
    assert get.status_code == head.status_code == 200, (get.text, head.text)
    assert head.content == b"" and get.content
    assert httpx.post(server.base_url + path, timeout=60).status_code == 405
