r"""JSON Schema -> xgrammar ``Grammar``, with two fixes for xgrammar 0.2.8's handling of
length-bounded strings (``minLength`` / ``maxLength``).

xgrammar turns ``{"type": "string", "maxLength": 12}`` into ``"\"" chars{0, 12} "\""`` with
``chars ::= [^\"\\\r\n]``. Two problems, measured against SmolLM2's 49,152-token
vocabulary on this project's 2-core CPU:

1. **Speed.** Inside such a string, filling one token mask takes 0.6 ms (``maxLength``
   4 or 16) to 3.6 ms (12), against 7 us in an unbounded string: a batch of 64 such rows
   would cost far more host time per step than a decode step's GPU time. The same bound
   written as a regex pattern (``^[\s\S]{0,12}$``, which xgrammar compiles to a JSON-string
   automaton) fills in 11-17 us for any bound up to 128; past that its fill jumps (23 ms at
   256) while the repetition's falls (29 us), so bounds up to `REGEX_MAX_LENGTH` are
   rewritten as patterns and larger ones are left to xgrammar.
2. **Validity.** The repetition's class admits the control characters U+0000-U+001F,
   which JSON forbids unescaped (a random model wrote ``"G\x17)<z"``, which ``json.loads``
   refuses). The pattern form excludes them; where the repetition stays, the class is
   narrowed to ``[^\0-\x1f\"\\\r\n]`` (the class of xgrammar's own unbounded strings) in
   the schema's EBNF, which is then compiled.

Either way a bounded string holds no escape sequences (no ``"``, ``\``, newline), as
xgrammar's own bounded strings; the output still validates against the client's schema.

Left as xgrammar has it (found with random weights, which emit any byte a mask allows; a
trained model does not write invalid UTF-8): its character classes accept UTF-16
surrogates encoded in UTF-8 (``ED A0..BF xx``) in every string, and its regex classes
also 3-byte overlong forms (``E0 80..9F xx``). Decoded, such bytes become U+FFFD, which
can push a bounded string past its ``maxLength``; the random-weight tests therefore bound
their strings with ASCII patterns.
The rewrite touches only ``{"type": "string"}`` subschemas with a length bound and no
``pattern``, ``format``, ``enum`` or ``const``; values of ``enum``, ``const``,
``default`` and ``examples`` are data and are left alone.
"""

from __future__ import annotations

import json
from typing import Any

from attnserve.engine.constrained.spec import JSON_ANY_WHITESPACE, JSON_STRICT_MODE, import_xgrammar

#: largest ``maxLength`` (and ``minLength``) written as a regex pattern (see the module doc)
REGEX_MAX_LENGTH = 128
#: keywords whose values are data, not subschemas
_DATA_KEYWORDS = ("enum", "const", "default", "examples")
#: keywords whose values map names to subschemas
_NAMED_SCHEMAS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
#: the character class of xgrammar's length-bounded strings, and the one used instead
_RAW_STRING_CHARS = '[^\\"\\\\\\r\\n]'
_JSON_STRING_CHARS = '[^\\0-\\x1f\\"\\\\\\r\\n]'


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def bounded_strings_as_patterns(node: Any) -> Any:
    """A copy of the schema ``node`` in which each length-bounded string subschema (bounds
    up to `REGEX_MAX_LENGTH`) carries a ``pattern`` of that length instead."""
    if isinstance(node, list):
        return [bounded_strings_as_patterns(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in _DATA_KEYWORDS:
            out[key] = value
        elif key in _NAMED_SCHEMAS and isinstance(value, dict):
            out[key] = {name: bounded_strings_as_patterns(s) for name, s in value.items()}
        else:
            out[key] = bounded_strings_as_patterns(value)
    lo, hi = out.get("minLength", 0), out.get("maxLength")
    if (out.get("type") == "string" and ("minLength" in out or "maxLength" in out)
            and not any(k in out for k in ("pattern", "format", "enum", "const"))
            and _is_count(lo) and lo <= REGEX_MAX_LENGTH
            and (hi is None or (_is_count(hi) and lo <= hi <= REGEX_MAX_LENGTH))):
        out.pop("minLength", None)
        out.pop("maxLength", None)
        out["pattern"] = "^[\\s\\S]{%d,%s}$" % (lo, "" if hi is None else hi)
    return out


def json_schema_grammar(schema: str):
    """The xgrammar ``Grammar`` of a JSON Schema (text), with the fixes of the module doc.

    Raises:
        RuntimeError: xgrammar cannot convert the schema.
        ValueError: the text is not JSON.
    """
    xgr = import_xgrammar()
    rewritten = json.dumps(bounded_strings_as_patterns(json.loads(schema)))
    grammar = xgr.Grammar.from_json_schema(rewritten, any_whitespace=JSON_ANY_WHITESPACE,
                                           strict_mode=JSON_STRICT_MODE)
    ebnf = str(grammar)
    if _RAW_STRING_CHARS not in ebnf:
        return grammar
    return xgr.Grammar.from_ebnf(ebnf.replace(_RAW_STRING_CHARS, _JSON_STRING_CHARS))
