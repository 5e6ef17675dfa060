"""Constrained decoding through the server with the official ``openai`` client on the
real SmolLM2 (the shared `conftest.server`): 32 JSON-schema completions (OpenAI
``response_format`` and SGLang's ``json_schema``; nested objects, bounded arrays, enums,
numbers, optional fields, ``anyOf``) that must all parse and validate, regex and EBNF
(``extra_body``), JSON mode, a streamed one, ``n=2``, and unconstrained requests in the
same batch whose output must equal their output alone. Bad grammars get a 400 naming the
field while that batch is being served."""

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

MODEL = "smollm2-135m"
S, I = {"type": "string"}, {"type": "integer"}


def _obj(required=None, **props):
    return {"type": "object", "properties": props, "required": list(props) if required is None else required}


SCHEMAS = {
    "person": _obj(name={**S, "maxLength": 16}, age={**I, "minimum": 0, "maximum": 120}),
    "nested": _obj(city=_obj(name={**S, "maxLength": 16}, country={**S, "maxLength": 16})),
    "array": _obj(colors={"type": "array", "items": {"enum": ["red", "green", "blue", "yellow"]}, "minItems": 2,
                          "maxItems": 3}),
    "enum": _obj(answer={"enum": ["yes", "no", "maybe"]}),
    "numbers": _obj(temperature={"type": "number", "minimum": -50, "maximum": 60},
                    count={**I, "minimum": 0, "maximum": 100}),
    "optional": _obj(["title", "year"], title={**S, "maxLength": 20}, year={**I, "minimum": 1900, "maximum": 2030},
                     subtitle={**S, "maxLength": 10}),
    "anyof": _obj(value={"anyOf": [{**I, "minimum": 0, "maximum": 1000}, {**S, "maxLength": 8}, {"type": "null"}]}),
    "objects": _obj(items={"type": "array", "items": _obj(name={**S, "maxLength": 8}, qty={**I, "minimum": 1,
                                                                                           "maximum": 9}),
                           "minItems": 1, "maxItems": 2}),
    "bool": _obj(is_capital={"type": "boolean"}, continent={"enum": ["Africa", "Asia", "Europe", "America"]}),
    "deep": _obj(book=_obj(author=_obj(first={**S, "maxLength": 10}, last={**S, "maxLength": 10}),
                           pages={**I, "minimum": 1, "maximum": 2000})),
}
PROMPTS = ["Describe Paris in JSON.", "Give an example for a shopping list in JSON.",
           "Answer in JSON: is the sky blue?"]
REGEX = r"(yes|no), because [a-z ]{1,20}\."
EBNF = 'root ::= "The answer is " answer "."\nanswer ::= "Paris" | "London" | "Rome"'
FREE = [("chat", "What is the capital of France?"), ("completion", "The quick brown fox")]


def _chat(q):
    return [{"role": "user", "content": q}]


@pytest.fixture(scope="module")
def oai(server, api_key):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=api_key, max_retries=0, timeout=300)


def _free(oai, kind, text):
    if kind == "chat":
        r = oai.chat.completions.create(model=MODEL, messages=_chat(text), max_tokens=12, temperature=0)
        return r.choices[0].message.content
    return oai.completions.create(model=MODEL, prompt=text, max_tokens=12, temperature=0).choices[0].text


@pytest.fixture(scope="module")
def batch(oai, server):
    """Every request of the module at once (one mixed batch in the engine); while it runs,
    bad grammars are sent and must be refused with a 400. Returns the results by name."""
    with ThreadPoolExecutor(len(FREE)) as pool:  # together: multi-row GEMMs, as in the big batch
        free_alone = list(pool.map(lambda kt: _free(oai, *kt), FREE))
    misses0 = _compile_misses(server)
    errors0 = server.state()["step_errors"]  # the shared server may carry other modules' injected faults
    jobs = {}
    for i, (name, schema) in enumerate(SCHEMAS.items()):
        for j, prompt in enumerate(PROMPTS):
            if j == 2:  # SGLang's own field, schema as JSON text
                kw = dict(extra_body={"json_schema": json.dumps(schema)})
            else:
                kw = dict(response_format={"type": "json_schema", "json_schema": {
                    "name": name, "schema": schema, "strict": bool(j)}})
            jobs[f"schema:{name}:{j}"] = (lambda kw=kw, prompt=prompt: oai.chat.completions.create(
                model=MODEL, messages=_chat(prompt), max_tokens=96, temperature=0, **kw))
    jobs["n2"] = lambda: oai.chat.completions.create(
        model=MODEL, messages=_chat(PROMPTS[0]), max_tokens=96, temperature=0.8, seed=3, n=2,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMAS["person"]}})
    jobs["stream"] = lambda: "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(
        model=MODEL, messages=_chat(PROMPTS[1]), max_tokens=96, temperature=0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "array", "schema": SCHEMAS["array"]}})
        if c.choices)
    jobs["json_object"] = lambda: oai.chat.completions.create(
        model=MODEL, messages=_chat("Give me a JSON object with one key."), max_tokens=96, temperature=0,
        response_format={"type": "json_object"})
    jobs["regex"] = lambda: oai.completions.create(model=MODEL, prompt="Is water wet? Answer:", max_tokens=32,
                                                   temperature=0, extra_body={"regex": REGEX})
    jobs["ebnf"] = lambda: oai.chat.completions.create(model=MODEL, messages=_chat("What is the capital of Italy?"),
                                                       max_tokens=16, temperature=0, extra_body={"ebnf": EBNF})
    for i, (kind, text) in enumerate(FREE):
        jobs[f"free:{i}"] = lambda kind=kind, text=text: _free(oai, kind, text)
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        deadline = time.monotonic() + 120
        while server.state()["running"] < 10 and time.monotonic() < deadline:
            time.sleep(0.05)  # the bad grammars go in while the batch is being served
        seen_running = server.state()["running"]
        refusals = _bad_requests(oai)
        results = {name: f.result() for name, f in futures.items()}
    return dict(results=results, free_alone=free_alone, refusals=refusals, seen_running=seen_running,
                step_errors_before=errors0,
                misses=_compile_misses(server) - misses0)


def _compile_misses(server):
    cache = server.engine.scheduler.grammar.cache
    return 0 if cache is None else cache.stats.misses


BAD = [
    ("invalid-schema", dict(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "array", "minItems": -2}}}}}),
     "response_format.json_schema", "not a valid JSON Schema"),
    ("unknown-type", dict(extra_body={"json_schema": '{"type": "frobnicate"}'}), "json_schema", "frobnicate"),
    ("schema-not-json", dict(extra_body={"json_schema": "{oops"}), "json_schema", "not valid JSON"),
    ("malformed-regex", dict(extra_body={"regex": "(a|b"}), "regex", "invalid regex"),
    ("malformed-ebnf", dict(extra_body={"ebnf": 'root ::= "a" missing'}), "ebnf", 'Rule "missing" is not defined'),
    ("two-grammars", dict(response_format={"type": "json_object"}, extra_body={"regex": "a+"}), "regex",
     "at most one grammar"),
    ("schema-without-name", dict(response_format={"type": "json_schema", "json_schema": {"schema": {}}}),
     "response_format.json_schema.name", "Missing required parameter"),
    ("bad-format-type", dict(response_format={"type": "yaml"}), "response_format.type", "'yaml'"),
    ("structural-tag", dict(response_format={"type": "structural_tag"}), "response_format", "not supported"),
]


def _bad_requests(oai):
    out = {}
    for name, kw, param, message in BAD:
        try:
            oai.chat.completions.create(model=MODEL, messages=_chat("hi"), max_tokens=4, **kw)
            out[name] = None
        except openai.BadRequestError as e:
            out[name] = (e.status_code, e.body)
    return out


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_outputs_validate(batch, name):
    for j in range(len(PROMPTS)):
        r = batch["results"][f"schema:{name}:{j}"]
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (name, j, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])


def test_n_stream_json_object_regex_ebnf(batch):
    res = batch["results"]
    assert len(res["n2"].choices) == 2
    for c in res["n2"].choices:
        jsonschema.validate(json.loads(c.message.content), SCHEMAS["person"])
    jsonschema.validate(json.loads(res["stream"]), SCHEMAS["array"])
    assert isinstance(json.loads(res["json_object"].choices[0].message.content), dict)
    assert re.fullmatch(REGEX, res["regex"].choices[0].text), res["regex"].choices[0].text
    assert res["regex"].choices[0].finish_reason == "stop"
    assert re.fullmatch(r"The answer is (Paris|London|Rome)\.", res["ebnf"].choices[0].message.content)


def test_unconstrained_rows_of_the_mixed_batch_are_untouched(batch):
    assert [batch["results"][f"free:{i}"] for i in range(len(FREE))] == batch["free_alone"]


def test_each_distinct_grammar_compiled_once(batch):
    # 10 schemas (each sent three ways, the JSON-text form spelled differently from the
    # response_format dicts), n=2 and the streamed one reuse them; json_object, regex, ebnf
    assert batch["misses"] <= 2 * len(SCHEMAS) + 3


@pytest.mark.parametrize("name,kw,param,message", BAD, ids=[b[0] for b in BAD])
def test_bad_grammar_is_400_while_serving(batch, name, kw, param, message):
    assert batch["seen_running"] >= 10  # sent while the mixed batch ran
    got = batch["refusals"][name]
    assert got is not None, f"{name} was accepted"
    status, body = got
    assert status == 400 and body["param"] == param and message in body["message"], body
    assert body["code"] in ("invalid_value", "unsupported_parameter", "unrecognized_request_argument")


def test_server_is_idle_afterwards(batch, server):
    st = server.wait_idle()
    assert st["step_errors"] == batch["step_errors_before"]
