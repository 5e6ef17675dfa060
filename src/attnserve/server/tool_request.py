"""Tools in a chat request: checking ``tools`` and ``tool_choice``, what the chat template
gets (``tools=``, assistant ``tool_calls``, ``tool`` messages), and the grammar of forced
calls.

**tool_choice** (OpenAI's values): ``"none"`` (the tools are not shown to the template and
the output is not parsed, as SGLang does), ``"auto"`` (the default with tools: the output
is parsed by ``--tool-call-parser``, if the server has one), ``"required"`` or
``{"type": "function", "function": {"name": ...}}`` (forced).

**Forced calls** are generated under a JSON Schema grammar (xgrammar, through the
``json_schema`` path of `attnserve.server.grammar_request`): a JSON array of
``{"name": <one of the tools>, "parameters": <that tool's parameters schema>}`` objects, at
least one (exactly one for a named function or ``parallel_tool_calls: false``), as SGLang
constrains them. Whatever the model, the output is then a well-formed call list whose
arguments follow the schemas; the server reads it with the bare-array parser
(`attnserve.server.parsers.mistral.JsonArrayMachine`), whatever ``--tool-call-parser`` is.

Sources (facts only): the OpenAI API reference (chat ``tools``, ``tool_choice``,
``parallel_tool_calls``, assistant ``tool_calls`` and ``tool`` messages); HF transformers'
chat-template docs (``apply_chat_template(tools=...)``, tool calls with ``arguments`` as a
dict); SGLang ``serving_chat.py`` / ``function_call/utils.py`` (the forced-call schema).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from attnserve.server.errors import APIError
from attnserve.server.request_fields import UNRECOGNIZED

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_FUNCTION_KEYS = ("name", "description", "parameters", "strict")


@dataclass(frozen=True)
class ToolRequest:
    """A request's checked tools.

    Attributes:
        tools: the tools as OpenAI sends them (``{"type": "function", "function": {...}}``).
        choice: ``"none"``, ``"auto"``, ``"required"`` or ``"function"`` (a named one).
        function: the named function (``choice == "function"``), else None.
        parallel: ``parallel_tool_calls`` (default true).
    """

    tools: List[Dict[str, Any]]
    choice: str
    function: Optional[str] = None
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "function")


def _bad(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param, code)


def _check_tool(i: int, tool: Any) -> str:
    """The function name of ``tools[i]``; 400 naming the field when it is malformed."""
    p = f"tools.{i}"
    if not isinstance(tool, dict):
        raise _bad(p, f"{p} must be an object {{\"type\": \"function\", \"function\": {{...}}}}")
    for key in tool:
        if key not in ("type", "function"):
            raise _bad(f"{p}.{key}", f"Unrecognized request argument supplied: {p}.{key}", UNRECOGNIZED)
    if tool.get("type") != "function":
        raise _bad(f"{p}.type", f"{p}.type must be 'function', got {tool.get('type')!r:.40}")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise _bad(f"{p}.function", f"Missing required parameter: '{p}.function' (an object with 'name')")
    for key in fn:
        if key not in _FUNCTION_KEYS:
            raise _bad(f"{p}.function.{key}", f"Unrecognized request argument supplied: {p}.function.{key}",
                       UNRECOGNIZED)
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise _bad(f"{p}.function.name", f"{p}.function.name must be 1 to 64 letters, digits, '_' or '-', "
                                         f"got {name!r:.70}")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise _bad(f"{p}.function.description", f"{p}.function.description must be a string")
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        raise _bad(f"{p}.function.strict", f"{p}.function.strict must be a boolean")
    if "parameters" in fn:
        _check_schema(f"{p}.function.parameters", fn["parameters"])
    return name


def _check_schema(param: str, schema: Any) -> None:
    """400 unless ``schema`` is a JSON Schema object (checked against its meta-schema)."""
    if not isinstance(schema, dict):
        raise _bad(param, f"{param} must be a JSON Schema object, got {type(schema).__name__}")
    try:
        import jsonschema
    except ImportError:  # the forced-call grammar still goes through xgrammar's own checks
        return
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.exceptions.SchemaError as e:
        where = "/".join(str(x) for x in e.absolute_path) or "the root"
        raise _bad(param, f"{param} is not a valid JSON Schema: {e.message} (at {where})") from None


def tool_request(body) -> Optional[ToolRequest]:
    """Check ``body.tools``, ``body.tool_choice`` and ``parallel_tool_calls``.

    Returns:
        None when the request has no tools and no forcing ``tool_choice``.

    Raises:
        APIError 400: a malformed tool (``param`` names it), parameters that are not a JSON
            Schema, a ``tool_choice`` that is not one of OpenAI's forms, names a function
            absent from ``tools``, or forces a call without tools.
    """
    tools = body.tools or []
    if not isinstance(tools, list):
        raise _bad("tools", "tools must be a list of {\"type\": \"function\", \"function\": {...}} objects")
    names = [_check_tool(i, t) for i, t in enumerate(tools)]
    if len(set(names)) != len(names):
        raise _bad("tools", "tools must have distinct function names")
    choice, function = _check_choice(body.tool_choice, names)
    parallel = (getattr(body, "model_extra", None) or {}).get("parallel_tool_calls")
    if not tools and choice in ("none", "auto"):
        return None
    return ToolRequest(list(tools), choice, function, parallel is not False)


def _check_choice(tc: Any, names: List[str]):
    if tc is None:
        return ("auto" if names else "none"), None
    if isinstance(tc, str):
        if tc not in ("none", "auto", "required"):
            raise _bad("tool_choice", f"tool_choice must be 'none', 'auto', 'required' or {{\"type\": \"function\", "
                                      f"\"function\": {{\"name\": ...}}}}, got {tc!r:.40}")
        if tc == "required" and not names:
            raise _bad("tool_choice", "tool_choice 'required' needs tools")
        return tc, None
    fn = tc.get("function") if isinstance(tc, dict) and tc.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise _bad("tool_choice", "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                                  "\"function\": {\"name\": ...}}")
    if name not in names:
        raise _bad("tool_choice", f"tool_choice names the function {name!r:.70}, which is not among the tools "
                                  f"({', '.join(names) or 'none given'})")
    return "function", name


def forced_call_schema(tr: ToolRequest) -> Dict[str, Any]:
    """The JSON Schema of a forced call's output: an array of ``{"name", "parameters"}``
    objects (see the module doc)."""
    items = []
    for tool in tr.tools:
        fn = tool["function"]
        if tr.choice == "function" and fn["name"] != tr.function:
            continue
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        items.append({"type": "object", "properties": {"name": {"const": fn["name"]}, "parameters": params},
                      "required": ["name", "parameters"]})
    schema: Dict[str, Any] = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items},
                              "minItems": 1}
    if tr.choice == "function" or not tr.parallel:
        schema["maxItems"] = 1
    return schema


def forced_call_grammar(body, tr: ToolRequest) -> Dict[str, Any]:
    """`SamplingParams` keyword arguments (``{"json_schema": text}``) for a forced call,
    parsed by xgrammar first. Runs in a worker thread.

    Raises:
        APIError 400: the request also asks for another grammar, or xgrammar cannot
            build the tools' schema (``param`` ``tools``).
    """
    from attnserve.server.grammar_request import has_grammar_fields

    if has_grammar_fields(body):
        raise _bad("tool_choice", "a forced tool call (tool_choice 'required' or a named function) cannot be "
                                  "combined with response_format, json_schema, regex or ebnf")
    from attnserve.engine.constrained import GrammarSpec, check_grammar_text, normalize_json_schema

    text = normalize_json_schema(forced_call_schema(tr))
    try:
        check_grammar_text(GrammarSpec("json_schema", text))
    except ValueError as e:
        raise _bad("tools", f"the tools' parameters cannot be turned into a grammar: {e}") from None
    return {"json_schema": text}


def _arguments_value(arguments: str) -> Any:
    """A call's ``arguments`` as HF chat templates expect them: the decoded JSON object
    when it is one (templates write it with ``tojson``), else the text unchanged."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


def template_messages(body, chat_template: Optional[str]) -> List[Dict[str, Any]]:
    """The conversation as HF message dicts for ``apply_chat_template``: ``developer`` read
    as ``system``, ``name`` kept, an assistant's ``tool_calls`` (``arguments`` decoded), a
    ``tool`` message's ``tool_call_id``. A template that does not know ``tool_calls``
    (SmolLM2's) sees an assistant's calls as their JSON in the message's content instead,
    in the forced-call format, so the model still reads what it called."""
    knows_calls = "tool_calls" in (chat_template or "")
    out = []
    for m in body.messages:
        d: Dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.name is not None:
            d["name"] = m.name
        calls = getattr(m, "tool_calls", None)
        if calls:
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name,
                                             "arguments": _arguments_value(c.function.arguments)}} for c in calls]
            if not knows_calls:
                text = json.dumps([{"name": c.function.name, "parameters": _arguments_value(c.function.arguments)}
                                   for c in calls], ensure_ascii=False)
                d["content"] = (d["content"] + "\n" if d["content"] else "") + text
        if getattr(m, "tool_call_id", None) is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def template_tools(tr: Optional[ToolRequest]) -> Optional[List[Dict[str, Any]]]:
    """The ``tools=`` of ``apply_chat_template``: None without tools or with ``tool_choice``
    ``"none"``."""
    if tr is None or tr.choice == "none" or not tr.tools:
        return None
    return tr.tools
