"""``--chat-template`` loading (a file or the template text, checked at start-up) and the
per-request option checks, without a model."""

import argparse

import pytest

from attnserve.model_loader.chat_template import ChatTemplateError, check_chat_options, load_chat_template
from attnserve.server_args import ServerArgs

TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"


def test_file_or_text(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(str(path)) == TEMPLATE
    assert load_chat_template(TEMPLATE) == TEMPLATE
    assert load_chat_template(None) is None and load_chat_template("") is None


def test_missing_file_and_broken_template_fail_at_start(tmp_path):
    with pytest.raises(ValueError, match="neither a readable file"):
        load_chat_template(str(tmp_path / "absent.jinja"))
    with pytest.raises(ValueError, match=r"does not compile \(line 1\)"):
        load_chat_template("{% for m in messages %}{{ m }")


def test_cli_flags():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(["--chat-template", "t.jinja", "--allowed-origins",
                                                       "http://a.example", "http://b.example"]))
    assert args.chat_template == "t.jinja" and args.allowed_origins == ["http://a.example", "http://b.example"]
    default = ServerArgs.from_cli_args(parser.parse_args([]))
    assert default.chat_template is None and default.allowed_origins is None


def test_option_checks():
    assert check_chat_options(None, False, None) is True
    assert check_chat_options(None, True, None) is False  # continuing: no header unless asked (and it cannot be)
    assert check_chat_options(False, False, {"enable_thinking": False}) is False
    with pytest.raises(ChatTemplateError, match="add_generation_prompt") as e:
        check_chat_options(True, True, None)
    assert e.value.param == "continue_final_message"
    with pytest.raises(ChatTemplateError) as e:
        check_chat_options(None, False, ["x"])
    assert e.value.param == "chat_template_kwargs"
