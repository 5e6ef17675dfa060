"""`attnserve serve`'s start-up checks that run before the model loads: the listening socket
(a port in use, a host that does not resolve, ``--port 0``), an empty ``--served-model-name``;
and an empty ``--api-key``, which means no key (as in SGLang)."""

import argparse

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from attnserve.server.launch import ServerThread, bind_socket, create_app, launch_server  # noqa: E402


def test_bind_socket_errors_name_the_flag():
    taken = bind_socket("127.0.0.1", 0)
    try:
        port = taken.getsockname()[1]
        assert port > 0  # --port 0: the port is known before uvicorn starts
        taken.listen(1)
        with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{port}: .*pick another --port"):
            bind_socket("127.0.0.1", port)
    finally:
        taken.close()
    with pytest.raises(ValueError, match="--host 'no-such-host.invalid' does not resolve"):
        bind_socket("no-such-host.invalid", 0)


def test_empty_served_model_name_is_refused_before_the_model_loads():
    from attnserve.server_args import ServerArgs

    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--api-key", default=None)
    p.add_argument("--served-model-name", default=None)
    ServerArgs.add_cli_args(p)
    args = p.parse_args(["--model", "/no/such/model.gguf", "--served-model-name", " "])
    with pytest.raises(ValueError, match="--served-model-name must not be empty"):
        launch_server(args)  # the bad model path would fail later, at load


def test_empty_api_key_means_no_key():
    from attnserve.engine.engine import Engine
    from attnserve.server_args import ServerArgs

    engine = Engine(ServerArgs(model="qwen3-tiny", load_format="dummy"))
    thread = ServerThread(create_app(engine, api_key="")).start()
    try:
        r = httpx.post(thread.base_url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 2
    finally:
        thread.stop()
        engine.shutdown()
