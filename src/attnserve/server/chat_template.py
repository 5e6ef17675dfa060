"""Chat-template control of the HTTP requests: ``add_generation_prompt``,
``continue_final_message`` and ``chat_template_kwargs`` of ``/v1/chat/completions`` and
``/tokenize``, over the server's template (``--chat-template``, else the model's).

The rendering itself is `attnserve.model_loader.chat_template.render_chat` (shared with
the offline ``LLM.chat``); this module turns its errors into HTTP 400s naming the field.
Runs in a worker thread (tokenization).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from attnserve.server.errors import APIError


def _both_flags_message() -> str:
    return ("continue_final_message and add_generation_prompt cannot both be true: continuing the last message "
            "adds no new turn; send add_generation_prompt: false (or leave it out) with continue_final_message")


def effective_add_generation_prompt(body) -> Optional[bool]:
    """The request's ``add_generation_prompt``: what the client sent, or None (the
    default: true, unless it continues the final message). A client that sets both flags
    true gets 400 naming both, as vLLM's and SGLang's servers answer.

    Raises:
        APIError 400 (``param`` ``continue_final_message``; the message names both).
    """
    sent = "add_generation_prompt" in body.model_fields_set
    agp = body.add_generation_prompt if sent else None
    if body.continue_final_message and agp:
        raise APIError(400, _both_flags_message(), "continue_final_message", "invalid_value")
    return agp


def request_prompt_ids(ctx, body, messages: Sequence[Dict[str, Any]],
                       tools: Optional[List[Dict[str, Any]]] = None) -> List[int]:
    """Token ids of ``messages`` under the server's template and ``body``'s options
    (``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs``).

    Args:
        ctx: the `ServingContext` (``engine.tokenizer``, ``chat_template``).
        body: a request with the three option fields.
        messages: the conversation as template dicts (``role``, ``content`` ...).
        tools: tool definitions for the template, if any.

    Raises:
        APIError 400: conflicting options, reserved ``chat_template_kwargs`` keys, no
            template, or a template that fails to render (its error in the message).
    """
    return render_request(ctx, body, messages, tools).token_ids


def render_request(ctx, body, messages: Sequence[Dict[str, Any]], tools: Optional[List[Dict[str, Any]]] = None):
    """`request_prompt_ids`, returning the whole `ChatRender` (text and ids)."""
    from attnserve.model_loader.chat_template import ChatTemplateError, render_chat

    agp = effective_add_generation_prompt(body)
    try:
        return render_chat(ctx.engine.tokenizer, messages, chat_template=getattr(ctx, "chat_template", None),
                           add_generation_prompt=agp, continue_final_message=bool(body.continue_final_message),
                           chat_template_kwargs=body.chat_template_kwargs, tools=tools)
    except ChatTemplateError as e:
        raise APIError(400, str(e), e.param, "invalid_value") from e
