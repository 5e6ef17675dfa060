"""A request's grammar: OpenAI's ``response_format`` and SGLang's ``json_schema`` /
``regex`` / ``ebnf`` fields -> the `SamplingParams` grammar fields, checked.

Accepted (both endpoints; SGLang accepts ``response_format`` on completions too):

* ``response_format``: ``{"type": "text"}`` (no grammar), ``{"type": "json_object"}``
  (any JSON object, OpenAI's JSON mode; SGLang's choice of the schema ``{"type":
  "object"}``), ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...},
  "description": ..., "strict": ...}}`` (OpenAI: ``name`` is required, a string of
  letters, digits, ``_`` and ``-`` of at most 64 characters; ``schema`` defaults to any
  JSON object). ``strict`` true or false constrains the output all the same: attnserve
  never samples outside the grammar. ``structural_tag`` is refused
  (``unsupported_parameter``).
* ``json_schema`` (JSON text, as SGLang takes it, or an object), ``regex``, ``ebnf``.

At most one grammar per request. Each grammar is parsed here
(`attnserve.engine.constrained.check_grammar_text`: xgrammar without a tokenizer, and the
JSON Schema meta-schema), so a malformed one is a 400 naming its field before the request
reaches the engine, streamed or not.

Sources (facts only): the OpenAI API reference (``response_format``); SGLang
``python/sglang/srt/entrypoints/openai/serving_chat.py`` (``json_object`` -> ``{"type":
"object"}``) and ``sampling_params.py`` (``json_schema``, ``regex``, ``ebnf``).
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Tuple

from attnserve.server.errors import APIError
from attnserve.server.request_fields import UNRECOGNIZED, UNSUPPORTED

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_JSON_SCHEMA_KEYS = ("name", "description", "schema", "strict")


def _bad(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param, code)


def _from_response_format(rf: Any) -> Optional[Tuple[str, str, Any]]:
    """``(param, SamplingParams field, value)`` of ``response_format``, or None for text."""
    if not isinstance(rf, dict):
        raise _bad("response_format", "response_format must be an object such as {\"type\": \"json_object\"}")
    kind = rf.get("type")
    allowed = {"type"} | ({"json_schema"} if kind == "json_schema" else set())
    for key in rf:
        if key not in allowed:
            raise _bad(f"response_format.{key}", f"Unrecognized request argument supplied: response_format.{key}",
                       UNRECOGNIZED)
    if kind == "text":
        return None
    if kind == "json_object":
        from attnserve.engine.constrained import JSON_OBJECT_SCHEMA

        return "response_format", "json_schema", JSON_OBJECT_SCHEMA
    if kind == "json_schema":
        return "response_format.json_schema", "json_schema", _openai_json_schema(rf.get("json_schema"))
    if kind == "structural_tag":
        raise _bad("response_format", "response_format of type 'structural_tag' is not supported by attnserve; "
                                      "use json_schema, regex or ebnf", UNSUPPORTED)
    raise _bad("response_format.type", f"response_format.type must be 'text', 'json_object' or 'json_schema', "
                                       f"got {kind!r:.40}")


def _openai_json_schema(js: Any) -> Any:
    param = "response_format.json_schema"
    if not isinstance(js, dict):
        raise _bad(param, f"Missing required parameter: '{param}' (an object with 'name' and 'schema')")
    for key in js:
        if key not in _JSON_SCHEMA_KEYS:
            raise _bad(f"{param}.{key}", f"Unrecognized request argument supplied: {param}.{key}", UNRECOGNIZED)
    name = js.get("name")
    if name is None:
        raise _bad(f"{param}.name", f"Missing required parameter: '{param}.name'")
    if not isinstance(name, str) or not _NAME.match(name):
        raise _bad(f"{param}.name", f"{param}.name must be 1 to 64 letters, digits, '_' or '-', got {name!r:.70}")
    if js.get("description") is not None and not isinstance(js["description"], str):
        raise _bad(f"{param}.description", f"{param}.description must be a string")
    if js.get("strict") is not None and not isinstance(js["strict"], bool):
        raise _bad(f"{param}.strict", f"{param}.strict must be a boolean")
    schema = js.get("schema", {"type": "object"})
    if not isinstance(schema, (dict, bool)):
        raise _bad(f"{param}.schema", f"{param}.schema must be a JSON Schema object")
    return schema


def has_grammar_fields(body) -> bool:
    """Whether ``body`` sets any grammar field (requests without one skip `request_grammar`
    and its worker-thread hop)."""
    return any(getattr(body, name, None) is not None for name in ("response_format", "json_schema", "regex", "ebnf"))


def request_grammar(body) -> Dict[str, Any]:
    """The `SamplingParams` keyword arguments of ``body``'s grammar (``{}`` without one),
    after parsing it. Runs in a worker thread (a large schema takes milliseconds).

    Raises:
        APIError 400: two grammars in one request; a malformed ``response_format``; a
            grammar that does not parse (``param`` names the field, code ``invalid_value``).
    """
    found: List[Tuple[str, str, Any]] = []
    if body.response_format is not None:
        got = _from_response_format(body.response_format)
        if got is not None:
            found.append(got)
    for name in ("json_schema", "regex", "ebnf"):
        value = getattr(body, name, None)
        if value is not None:
            found.append((name, name, value))
    if not found:
        return {}
    if len(found) > 1:
        names = " and ".join(p.split(".")[0] for p, _, _ in found)
        raise _bad(found[1][0].split(".")[0], f"a request takes at most one grammar (response_format json_object/"
                                               f"json_schema, json_schema, regex or ebnf); got {names}")
    from attnserve.engine.constrained import GrammarSpec, check_grammar_text, normalize_json_schema

    param, field, value = found[0]
    if field == "json_schema":
        value = normalize_json_schema(value)
        if isinstance(value, bool):
            value = "true" if value else "false"
    if not isinstance(value, str) or not value.strip():
        raise _bad(param, f"{param} must be a non-empty string")
    try:
        check_grammar_text(GrammarSpec(field, value))
    except ValueError as e:
        msg = str(e)
        if param != field:  # name the field the client used
            for head in (f"invalid {field}", field):
                if msg.startswith(head):
                    msg = head.replace(field, param) + msg[len(head):]
                    break
        raise _bad(param, msg) from None
    return {field: value}
