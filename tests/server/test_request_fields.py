"""No silent drops (issue 33, item 9): every request field is honoured or refused with a
400 naming it. SGLang/vLLM extensions attnserve does not implement get
``unsupported_parameter``; fields no API defines get ``unrecognized_request_argument``;
neutral values, ``user``, ``metadata`` and ``store`` are accepted. Runs against the shared
live server (`conftest.server`) and, for the tables, without one."""

import pytest

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "Hi"}]
BASE = {C: {"prompt": "Hi", "max_tokens": 1}, CHAT: {"messages": MSG, "max_tokens": 1}}

# (field, a non-neutral value): SGLang/vLLM extensions of both endpoints that attnserve does
# not implement; each one was accepted with a 200 and ignored before.
DROPPED_BOTH = [
    ("length_penalty", 1.3), ("prompt_logprobs", 2), ("priority", 5), ("lora_path", "adapter-a"),
    ("return_hidden_states", True), ("stop_regex", "\\d+"), ("no_stop_trim", True),
    ("spaces_between_special_tokens", False),
    ("guided_json", {"type": "object"}), ("guided_regex", "[0-9]+"), ("guided_choice", ["yes", "no"]),
    ("guided_grammar", 'root ::= "a"'), ("structural_tag", '{"structures": []}'),
    ("session_params", {"id": "s1"}), ("rid", "my-request"), ("bootstrap_host", "10.0.0.1"),
    ("include_stop_str_in_output", True), ("custom_logit_processor", "x"), ("use_beam_search", True),
    ("bad_words", ["bad"]), ("allowed_token_ids", [1, 2]), ("request_id", "r1"),
]
# Extensions of /v1/chat/completions only.
DROPPED_CHAT = [
    ("separate_reasoning", True), ("chat_template", "{{ messages }}"),
    ("documents", [{"title": "t", "text": "x"}]), ("echo", True),
]
CASES = ([(C, f, v) for f, v in DROPPED_BOTH] + [(CHAT, f, v) for f, v in DROPPED_BOTH]
         + [(CHAT, f, v) for f, v in DROPPED_CHAT])


def _error(r, status=400):
    assert r.status_code == status, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error", err
    return err


@pytest.mark.parametrize("path,field,value", CASES, ids=[f"{'chat' if p == CHAT else 'cmpl'}-{f}" for p, f, _ in CASES])
def test_unimplemented_extension_is_refused(client, path, field, value):
    err = _error(client.post(path, json={**BASE[path], field: value}))
    assert err["code"] == "unsupported_parameter" and err["param"] == field, err
    assert field in err["message"] and "extension" in err["message"], err


@pytest.mark.parametrize("path", [C, CHAT])
def test_unknown_field_is_unrecognized(client, path):
    err = _error(client.post(path, json={**BASE[path], "frobnicate": {"x": [1, 2]}}))
    assert err == {"message": "Unrecognized request argument supplied: frobnicate", "type": "invalid_request_error",
                   "param": "frobnicate", "code": "unrecognized_request_argument"}


@pytest.mark.parametrize("path,body,param", [
    (C, {"continue_final_message": True}, "continue_final_message"),  # a chat-only extension
    (C, {"top_logprobs": 2}, "top_logprobs"),  # OpenAI defines it for chat only
    (C, {"store": False}, "store"),  # likewise
    (CHAT, {"suffix": "x"}, "suffix"),  # a completions-only field
    (C, {"stream_options": {"include_usage": True, "colour": 1}, "stream": True}, "stream_options.colour"),
    (CHAT, {"messages": [{"role": "user", "content": "Hi", "mood": "calm"}]}, "messages.0.mood"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi", "cache": 1}]}]},
     "messages.0.content.0.cache"),
], ids=["chat-only-on-cmpl", "top-logprobs-on-cmpl", "store-on-cmpl", "suffix-on-chat", "stream-options",
        "message", "content-part"])
def test_field_unknown_to_the_endpoint_is_unrecognized(client, path, body, param):
    err = _error(client.post(path, json={**BASE[path], **body}))
    assert err["code"] == "unrecognized_request_argument" and err["param"] == param, err
    assert err["message"] == f"Unrecognized request argument supplied: {param}"


@pytest.mark.parametrize("path,body,param", [
    (CHAT, {"reasoning_effort": "high"}, "reasoning_effort"),
    (CHAT, {"modalities": ["text", "audio"]}, "modalities"),
    (CHAT, {"response_format": {"type": "structural_tag"}}, "response_format"),
    (CHAT, {"stream_options": {"include_obfuscation": True}, "stream": True}, "stream_options.include_obfuscation"),
], ids=["reasoning-effort", "modalities", "chat-structural-tag", "obfuscation"])
def test_non_neutral_openai_value_is_unsupported(client, path, body, param):
    err = _error(client.post(path, json={**BASE[path], **body}))
    assert err["code"] == "unsupported_parameter" and err["param"] == param, err


NEUTRAL = {
    C: {"logprobs": 0, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "echo": False,
        "best_of": 1, "suffix": None, "response_format": {"type": "text"}, "add_special_tokens": True,
        "repetition_penalty": 1.0, "min_tokens": 0, "priority": 0, "regex": None, "lora_path": None,
        "skip_special_tokens": True, "no_stop_trim": False, "user": "u1"},
    CHAT: {"logprobs": False, "top_logprobs": 0, "presence_penalty": 0.0, "tool_choice": "none", "tools": [],
           "response_format": {"type": "text"}, "parallel_tool_calls": True, "service_tier": "auto",
           "reasoning_effort": None, "repetition_penalty": 1, "min_tokens": 0, "priority": None,
           "json_schema": None, "continue_final_message": False, "add_generation_prompt": True,
           "chat_template_kwargs": {}, "separate_reasoning": False, "spaces_between_special_tokens": True,
           "stream_options": {"include_usage": True, "include_obfuscation": False}, "stream": True},
}


@pytest.mark.parametrize("path", [C, CHAT])
def test_neutral_values_are_accepted(client, path):
    r = client.post(path, json={**BASE[path], **NEUTRAL[path]})
    assert r.status_code == 200, r.text
    if path == CHAT:  # streamed, with the usage chunk asked for
        assert r.text.rstrip().endswith("data: [DONE]") and '"usage"' in r.text and '"error"' not in r.text
    else:
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_user_metadata_and_store_are_accepted(client):
    for extra in ({"user": "user-1234"}, {"store": True}, {"store": False},
                  {"store": True, "metadata": {"team": "search", "run": "7"}}, {"metadata": {}},
                  {"safety_identifier": "hash-1", "prompt_cache_key": "k"}):
        r = client.post(CHAT, json={**BASE[CHAT], **extra})
        assert r.status_code == 200, (extra, r.text)
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    r = client.post(C, json={**BASE[C], "user": "user-1234"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("metadata", [{"n": 1}, {f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513},
                                      "tags", {"k": None}],
                         ids=["int-value", "17-pairs", "long-key", "long-value", "not-an-object", "null-value"])
def test_bad_metadata_is_refused(client, metadata):
    err = _error(client.post(CHAT, json={**BASE[CHAT], "metadata": metadata}))
    assert err["code"] == "invalid_value" and err["param"].split(".")[0] == "metadata", err


def test_bad_store_and_user_types_are_refused(client):
    assert _error(client.post(CHAT, json={**BASE[CHAT], "store": "yes"}))["param"] == "store"
    assert _error(client.post(C, json={**BASE[C], "user": 7}))["param"] == "user"


def test_honoured_extensions_still_work(client):
    """``top_k``, ``min_p``, ``stop_token_ids`` and ``ignore_eos`` reach the engine: greedy
    via ``top_k=1`` equals ``temperature=0``, and ``ignore_eos`` yields every token asked for."""
    body = {"prompt": "The capital of France is", "max_tokens": 6}
    greedy = client.post(C, json={**body, "temperature": 0}).json()["choices"][0]["text"]
    r = client.post(C, json={**body, "temperature": 1.0, "top_k": 1, "min_p": 0.05, "stop_token_ids": [0],
                             "ignore_eos": True, "seed": 3})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == greedy and r.json()["usage"]["completion_tokens"] == 6


def test_message_name_reaches_the_chat_template(server, client, monkeypatch):
    tok = server.engine.tokenizer
    seen = []
    original = tok.apply_chat_template

    def recording(messages, *a, **kw):
        seen.append(messages)
        return original(messages, *a, **kw)

    monkeypatch.setattr(tok, "apply_chat_template", recording)
    r = client.post(CHAT, json={"messages": [{"role": "user", "content": "Hi", "name": "alice"}], "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert seen and seen[-1][0].get("name") == "alice"


# ---- the tables, without a server --------------------------------------------------------------
def test_tables_do_not_shadow_declared_or_honoured_fields():
    """A table entry that a model declares would never be consulted (declared fields are
    not extras), and one that `SamplingParams` honours must not be refused."""
    import dataclasses

    from attnserve.engine.sampling_params import SamplingParams
    from attnserve.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, StreamOptions

    honoured = {f.name for f in dataclasses.fields(SamplingParams)} | {"max_tokens", "max_completion_tokens", "n"}
    # the server serves prompt logprobs as completions' echo + logprobs; vLLM's own
    # `prompt_logprobs` field (and its response shape) stays refused unless null
    honoured -= {"prompt_logprobs"}
    for model in (CompletionRequest, ChatCompletionRequest, ChatMessage, StreamOptions):
        table = set(model.known_extras)
        assert not table & set(model.model_fields), (model.__name__, table & set(model.model_fields))
        assert not table & honoured, (model.__name__, table & honoured)


def test_is_neutral_matches_json_types():
    from attnserve.server.request_fields import is_neutral

    assert is_neutral(1, (None, 1.0)) and is_neutral(0.0, (None, 0)) and is_neutral(None, (None,))
    assert not is_neutral(True, (None, 1.0)) and not is_neutral(False, (None, 0)) and not is_neutral(0, (None, False))
    assert not is_neutral("1.0", (None, 1.0)) and not is_neutral([], (None,)) and is_neutral([], (None, []))
    assert is_neutral({"type": "text"}, (None, {"type": "text"})) and not is_neutral({"type": "json_object"},
                                                                                    (None, {"type": "text"}))
