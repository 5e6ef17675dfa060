"""Chat templates: load ``--chat-template`` and render conversations through
``transformers``' ``apply_chat_template`` with per-request control.

Shared by the offline `attnserve.engine.llm.LLM.chat` and the HTTP server
(`attnserve.server.chat_template`), so both render a conversation to the same token ids.

* `load_chat_template`: the flag's value is a Jinja file path or the template itself
  (a value with Jinja or line-break characters is a template; anything else must name a
  readable file). The template is compiled once here, so a broken one fails at start-up.
* `render_chat`: text and token ids of a conversation. ``add_generation_prompt`` appends
  the assistant turn's header; ``continue_final_message`` leaves the last message open
  (no end-of-turn token, no new header) so generation continues it (prefill); the two
  are mutually exclusive. ``chat_template_kwargs`` become template variables (e.g.
  ``enable_thinking``); names ``apply_chat_template`` itself takes are refused.

Sources (facts only): the ``transformers`` chat-templating guide and
``PreTrainedTokenizerBase.apply_chat_template`` (rendered text tokenized without special
tokens; ``continue_final_message`` cuts the rendering after the last message's content);
vLLM's and SGLang's OpenAI servers (``add_generation_prompt``, ``continue_final_message``,
``chat_template_kwargs`` request fields; both flags true is an error).
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

#: Characters that mark a ``--chat-template`` value as a template rather than a path.
_TEMPLATE_CHARS = ("{", "}", "\n")


class ChatTemplateError(ValueError):
    """A conversation or its options cannot be rendered.

    Attributes:
        param: the request field at fault (``"messages"``, ``"continue_final_message"``,
            ``"chat_template_kwargs"`` ...), for an HTTP 400's ``param``.
    """

    def __init__(self, message: str, param: str = "messages"):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ChatRender:
    """A rendered conversation: the prompt ``text`` and its ``token_ids`` (tokenized
    without extra special tokens, as ``apply_chat_template`` does)."""

    text: str
    token_ids: List[int] = field(default_factory=list)


def load_chat_template(value: Optional[str]) -> Optional[str]:
    """The Jinja source named by ``--chat-template``, compiled once to check it.

    Args:
        value: a path to a Jinja file, or the template text itself; None for the model's
            own template.

    Returns:
        the template text, or None when ``value`` is None or empty.

    Raises:
        ValueError: a value that looks like a path but names no readable file, or a
            template that does not compile (the Jinja error, with its line).
    """
    if not value:
        return None
    if any(c in value for c in _TEMPLATE_CHARS):
        text = value
    else:
        path = os.path.expanduser(value)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ValueError(f"--chat-template {value!r} is neither a readable file ({e.strerror}) nor a Jinja "
                             "template (a template contains '{' or a line break)") from None
    _compile(text, value)
    return text


def _compile(text: str, origin: str) -> None:
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # older transformers: plain Jinja, which is what it wraps
        import jinja2

        def _compile_jinja_template(t):
            return jinja2.Environment().from_string(t)
    try:
        _compile_jinja_template(text)
    except Exception as e:  # jinja2.TemplateSyntaxError and friends
        where = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
        raise ValueError(f"--chat-template {origin[:80]!r} does not compile{where}: {e}") from None


def reserved_template_kwargs(tokenizer: Any) -> frozenset:
    """Names ``chat_template_kwargs`` may not use: ``apply_chat_template``'s own parameters
    and ``messages`` (the template's conversation variable)."""
    try:
        params = inspect.signature(tokenizer.apply_chat_template).parameters
    except (TypeError, ValueError):
        params = {}
    own = {n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return frozenset(own | {"messages", "conversation", "tools", "documents", "chat_template",
                            "add_generation_prompt", "continue_final_message", "tokenize"})


def check_chat_options(add_generation_prompt: Optional[bool], continue_final_message: Optional[bool],
                       chat_template_kwargs: Optional[Dict[str, Any]], tokenizer: Any = None) -> bool:
    """Check the per-request template options; returns the effective
    ``add_generation_prompt`` (False when continuing the final message and the caller did
    not set it; True by default otherwise).

    Raises:
        ChatTemplateError: both flags true (``param`` names both), a kwargs value that is
            not a dict, or a kwargs key that ``apply_chat_template`` reserves.
    """
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be true: "
                                "continuing the last message adds no new turn", "continue_final_message")
    if chat_template_kwargs is not None:
        if not isinstance(chat_template_kwargs, dict):
            raise ChatTemplateError("chat_template_kwargs must be an object of template variables",
                                    "chat_template_kwargs")
        reserved = reserved_template_kwargs(tokenizer) if tokenizer is not None else frozenset()
        bad = sorted(k for k in chat_template_kwargs if k in reserved or not isinstance(k, str))
        if bad:
            raise ChatTemplateError(f"chat_template_kwargs may not set {', '.join(map(repr, bad))}: set the request "
                                    "field of that name instead (or leave it out)", f"chat_template_kwargs.{bad[0]}")
    if continue_final_message:
        return False
    return True if add_generation_prompt is None else bool(add_generation_prompt)


def render_chat(tokenizer: Any, messages: Sequence[Dict[str, Any]], *, chat_template: Optional[str] = None,
                add_generation_prompt: Optional[bool] = True, continue_final_message: bool = False,
                chat_template_kwargs: Optional[Dict[str, Any]] = None,
                tools: Optional[List[Dict[str, Any]]] = None) -> ChatRender:
    """Render ``messages`` (dicts with ``role`` and ``content`` ...) with the chat template.

    Args:
        tokenizer: an HF tokenizer.
        chat_template: Jinja source overriding the tokenizer's template (`load_chat_template`).
        add_generation_prompt: append the assistant header (None: the default, True,
            unless ``continue_final_message``).
        continue_final_message: leave the last message open, for generation to continue.
        chat_template_kwargs: extra template variables.
        tools: OpenAI-style tool definitions, passed to the template's ``tools``.

    Returns:
        `ChatRender` (text, token ids).

    Raises:
        ChatTemplateError: no template at all (no tokenizer template and none given),
            conflicting options (`check_chat_options`), an empty conversation, or a
            template that fails to render (the template's own message).
    """
    if tokenizer is None:
        raise ChatTemplateError("this model has no tokenizer, so it has no chat template; send token ids")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("this model has no chat template; start the server with --chat-template or send a "
                                "plain prompt")
    if not messages:
        raise ChatTemplateError("messages must hold at least one message")
    agp = check_chat_options(add_generation_prompt, continue_final_message, chat_template_kwargs, tokenizer)
    kwargs = dict(chat_template_kwargs or {})
    try:
        text = tokenizer.apply_chat_template(list(messages), tools=tools or None, chat_template=chat_template,
                                             add_generation_prompt=agp,
                                             continue_final_message=bool(continue_final_message), tokenize=False,
                                             **kwargs)
    except Exception as e:  # jinja2 errors, the template's raise_exception, transformers' own checks
        raise ChatTemplateError(f"the messages do not fit the chat template: {type(e).__name__}: {e}") from e
    if not isinstance(text, str):
        raise ChatTemplateError(f"the chat template rendered {type(text).__name__}, not text")
    out = tokenizer(text, add_special_tokens=False)
    ids = out["input_ids"] if hasattr(out, "keys") else out
    return ChatRender(text, [int(t) for t in ids])
