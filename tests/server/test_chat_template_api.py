"""Chat-template control over HTTP (issue 36, "Templates"): a custom ``--chat-template``
file is used, ``continue_final_message`` continues the last assistant message without a new
turn header, ``chat_template_kwargs`` reach the template, template errors are 400s; and
CORS headers with ``--allowed-origins``.

The custom-template app shares the session server's engine and engine loop (no second
model load): it is driven in-process by Starlette's ``TestClient`` without its lifespan,
so it never stops that loop."""

import pytest

MARKER = "[CUSTOM-TEMPLATE]"
TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ raise_exception('this template takes no system message') }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n" + MARKER + "{% if shout %} SHOUT{% endif %} {{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ORIGIN = "http://app.example"
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "Name a colour."}]
PREFILL = USER + [{"role": "assistant", "content": "My favourite colour is"}]


@pytest.fixture(scope="module")
def custom(server, tmp_path_factory):
    """A second app over the shared engine loop: a template file and allowed origins."""
    from starlette.testclient import TestClient

    from attnserve.server.launch import create_app, wrap_app

    path = tmp_path_factory.mktemp("tpl") / "custom.jinja"
    path.write_text(TEMPLATE)
    app = create_app(server.engine, loop=server.loop, chat_template=str(path), allowed_origins=[ORIGIN])
    assert app.state.ctx.chat_template == TEMPLATE
    return TestClient(wrap_app(app))


def _tokens(c, **body):
    r = c.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def _text(server, ids):
    return server.engine.tokenizer.decode(ids, skip_special_tokens=False)


def test_custom_template_file_is_used(server, client, custom):
    ids = _tokens(custom, messages=USER)
    text = _text(server, ids)
    assert text == f"<|im_start|>user\n{MARKER} Name a colour.<|im_end|>\n<|im_start|>assistant\n"
    assert MARKER not in _text(server, _tokens(client, messages=USER))  # the other server: the model's template
    r = custom.post(CHAT, json={"messages": USER, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(ids)  # the chat route renders with it too


def test_chat_template_kwargs_reach_the_template(server, custom):
    loud = _text(server, _tokens(custom, messages=USER, chat_template_kwargs={"shout": True}))
    assert f"{MARKER} SHOUT Name a colour." in loud
    assert "SHOUT" not in _text(server, _tokens(custom, messages=USER, chat_template_kwargs={"shout": False}))


def test_continue_final_message_has_no_new_header(server, client):
    """Token ids: the open rendering is the closed one without its end-of-turn token and
    newline, ends with the assistant's own words, and opens no new turn."""
    tok = server.engine.tokenizer
    im_start, im_end = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>")
    cont = _tokens(client, messages=PREFILL, continue_final_message=True)
    closed = _tokens(client, messages=PREFILL, add_generation_prompt=False)
    assert closed == cont + [im_end] + tok.encode("\n")
    assert cont[-len(tok.encode("My favourite colour is")):] == tok.encode("My favourite colour is")
    last_turn = cont[len(cont) - 1 - cont[::-1].index(im_start):]  # from the last <|im_start|> on
    assert cont.count(im_start) == 3 and im_end not in last_turn  # system, user, the open assistant turn
    assert tok.decode(last_turn) == "<|im_start|>assistant\nMy favourite colour is"
    with_header = _tokens(client, messages=PREFILL)  # default: a new assistant turn after the closed one
    assert with_header == closed + tok.encode("<|im_start|>assistant\n") and with_header.count(im_start) == 4
    r = client.post(CHAT, json={"messages": PREFILL, "continue_final_message": True, "max_tokens": 3,
                                "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(cont)


@pytest.mark.parametrize("body,param,needle", [
    ({"messages": PREFILL, "continue_final_message": True, "add_generation_prompt": True}, "continue_final_message",
     "add_generation_prompt"),
    ({"messages": USER, "chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs.tokenize", "tokenize"),
    ({"messages": USER, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages", "messages"),
    ({"messages": USER, "chat_template_kwargs": [1]}, "chat_template_kwargs", "chat_template_kwargs"),
    ({"messages": USER, "add_generation_prompt": "yes"}, "add_generation_prompt", "add_generation_prompt"),
])
@pytest.mark.parametrize("path", [CHAT, "/tokenize"])
def test_bad_template_options_are_400(client, path, body, param, needle):
    r = client.post(path, json={**body, "max_tokens": 1} if path == CHAT else body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"] and param.split(".")[0] in err["message"], err


def test_template_that_fails_to_render_is_400_with_its_error(custom, server):
    msgs = [{"role": "system", "content": "Be brief."}, *USER]
    for path, extra in ((CHAT, {"max_tokens": 1}), ("/tokenize", {})):
        r = custom.post(path, json={"messages": msgs, **extra})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "messages" and "this template takes no system message" in err["message"], err
    assert custom.post(CHAT, json={"messages": USER, "max_tokens": 1}).status_code == 200  # still serving
    server.wait_idle()


def test_cors_headers_with_allowed_origins(custom):
    r = custom.get("/health", headers={"Origin": ORIGIN})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    pre = custom.options(CHAT, headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                                        "Access-Control-Request-Headers": "authorization,content-type"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert "authorization" in pre.headers["access-control-allow-headers"].lower()
    other = custom.get("/health", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in other.headers
