"""What a request asks its output to match, and the checks that need no tokenizer.

A request carries at most one grammar, in one of three `SamplingParams` fields (SGLang's
names): ``json_schema`` (a JSON Schema, as JSON text or a dict), ``regex`` or ``ebnf``
(xgrammar's EBNF dialect, GBNF-like, with a ``root`` rule). OpenAI's
``response_format={"type": "json_object"}`` is the schema `JSON_OBJECT_SCHEMA`, as in
SGLang's OpenAI adapter; ``{"type": "json_schema", ...}`` is its ``schema``.

`check_fields` (type and "at most one" checks, no xgrammar) runs inside
`SamplingParams.verify`; `check_grammar_text` parses the grammar with xgrammar without a
tokenizer (microseconds to milliseconds, no token-mask compilation) and, for a JSON
Schema, checks it against its meta-schema with ``jsonschema`` where that is installed.
Both raise ValueError naming the field and the problem, so the server answers 400 and the
offline API raises before anything is queued.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Optional

#: `SamplingParams` fields that hold a grammar; at most one may be set.
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf")
#: OpenAI's JSON mode (``response_format={"type": "json_object"}``): any JSON object.
JSON_OBJECT_SCHEMA = '{"type": "object"}'
#: JSON output formatting: one line, ``", "`` and ``": "`` separators and no free whitespace
#: (xgrammar ``any_whitespace=False``), so a model cannot spend its tokens on blank space;
#: properties not declared by the schema are never generated (xgrammar ``strict_mode``).
JSON_ANY_WHITESPACE = False
JSON_STRICT_MODE = True

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: " and may carry a
# "Check failed: (...) is false: " prefix; neither helps a client.
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\]\s+\S+:\d+:\s*")
_CHECK_PREFIX = re.compile(r"^Check failed: \(.*?\) is false:\s*")


@dataclass(frozen=True)
class GrammarSpec:
    """One request's grammar.

    Attributes:
        kind: ``"json_schema"``, ``"regex"`` or ``"ebnf"`` (the `SamplingParams` field).
        text: the grammar text (a JSON Schema as JSON text).
    """

    kind: str
    text: str

    @property
    def key(self) -> tuple:
        """The compile-cache key: the same kind and text compile to the same grammar."""
        return (self.kind, self.text)


def normalize_json_schema(value: Any) -> Any:
    """A dict schema as compact JSON text (key order kept: it is the order in which the
    properties are generated); a string or None unchanged."""
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))
    return value


def check_fields(params) -> None:
    """Type checks of the grammar fields of ``params`` (a `SamplingParams`).

    Raises:
        ValueError: a field that is not a non-empty string (``json_schema`` arrives here
            already as text), or more than one grammar field set.
    """
    set_fields = []
    for name in GRAMMAR_FIELDS:
        value = getattr(params, name, None)
        if value is None:
            continue
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{name} must be a non-empty string, got {value!r:.60}")
        set_fields.append(name)
    if len(set_fields) > 1:
        raise ValueError(f"a request takes at most one grammar (json_schema, regex or ebnf), got "
                         f"{' and '.join(set_fields)}")


def spec_of(params) -> Optional[GrammarSpec]:
    """The grammar of ``params`` (a checked `SamplingParams`), or None."""
    for name in GRAMMAR_FIELDS:
        value = getattr(params, name, None)
        if value is not None:
            return GrammarSpec(name, value)
    return None


def clean_error(e: BaseException) -> str:
    """xgrammar's error message without its C++ source location (first line only)."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    text = _CPP_PREFIX.sub("", text)
    return _CHECK_PREFIX.sub("", text)


def _check_json_schema(text: str) -> None:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"json_schema is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"json_schema must be a JSON object or boolean (a schema), got {type(schema).__name__}")
    try:
        import jsonschema
    except ImportError:  # xgrammar's own checks below still run
        return
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.exceptions.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "the root"
        raise ValueError(f"json_schema is not a valid JSON Schema: {e.message} (at {where})") from None


def check_grammar_text(spec: GrammarSpec) -> None:
    """Parse ``spec`` with xgrammar (no tokenizer, no token masks): the checks that make an
    invalid grammar a client error before it reaches the engine.

    Raises:
        ValueError: ``"invalid <kind>: <xgrammar's reason>"`` (a malformed regex, an EBNF
            with a syntax error or an undefined rule, a schema xgrammar cannot convert),
            or a JSON Schema that is not JSON or breaks its meta-schema.
            Also when xgrammar is not installed (the message says how to install it).
    """
    if spec.kind == "json_schema":
        _check_json_schema(spec.text)
    try:
        xgr = import_xgrammar()
    except ImportError as e:
        raise ValueError(str(e)) from None
    try:
        if spec.kind == "json_schema":
            xgr.Grammar.from_json_schema(spec.text, any_whitespace=JSON_ANY_WHITESPACE, strict_mode=JSON_STRICT_MODE)
        elif spec.kind == "regex":
            xgr.Grammar.from_regex(spec.text)
        elif spec.kind == "ebnf":
            xgr.Grammar.from_ebnf(spec.text)
        else:
            raise ValueError(f"unknown grammar kind {spec.kind!r}")
    except RuntimeError as e:
        raise ValueError(f"invalid {spec.kind}: {clean_error(e)}") from None


def import_xgrammar():
    """The ``xgrammar`` module (imported lazily: only constrained requests need it).

    Raises:
        ImportError: it is not installed.
    """
    try:
        import xgrammar
    except ImportError as e:
        raise ImportError("constrained decoding (json_schema, regex, ebnf, response_format) needs xgrammar: "
                          "pip install 'attnserve[grammar]'") from e
    return xgrammar
