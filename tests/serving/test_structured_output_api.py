"""Structured output over HTTP on a random tiny model: ``response_format`` (json_schema,
json_object), ``regex`` / ``ebnf`` extras, ``/generate``'s ``sampling_params``, streaming,
``n > 1``, the 400s, and the openai SDK's ``chat.completions.parse`` with a Pydantic model."""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import jsonschema
import pytest

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "population": {"type": "integer", "minimum": 0, "maximum": 10000},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population", "capital"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Describe a city as JSON."}]


def _error(r: httpx.Response) -> dict:
    assert r.status_code == 400, r.text
    return r.json()["error"]


def test_chat_json_schema_every_choice_validates(server):
    r = server.post("/v1/chat/completions", {"messages": MESSAGES, "response_format": RESPONSE_FORMAT,
                                             "n": 3, "max_tokens": 120, "temperature": 1.0, "seed": 1})
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)


def test_streamed_json_schema_deltas_join_into_valid_json(server):
    body = {"messages": MESSAGES, "response_format": RESPONSE_FORMAT, "max_tokens": 120, "stream": True,
            "temperature": 1.0, "seed": 2}
    text = ""
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    text += choice["delta"].get("content") or ""
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_mode_answers_an_object(server):
    body = {"messages": MESSAGES, "response_format": {"type": "json_object"}, "max_tokens": 60,
            "temperature": 0.0}
    r = server.post("/v1/chat/completions", body)
    content = r.json()["choices"][0]["message"]["content"]
    if r.json()["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(content), dict)
    else:  # cut by max_tokens: still an object's prefix
        assert content.startswith("{")


def test_completions_regex_output_matches(server):
    body = {"prompt": "code:", "regex": r"[A-Z]{3}-[0-9]{2,4}", "max_tokens": 20, "n": 2, "temperature": 1.0}
    r = server.post("/v1/completions", body)
    for choice in r.json()["choices"]:
        assert re.fullmatch(r"[A-Z]{3}-[0-9]{2,4}", choice["text"]), choice


def test_generate_sampling_params_json_schema_and_ebnf(server):
    r = server.post("/generate", {"text": "hi", "sampling_params": {"json_schema": json.dumps(SCHEMA),
                                                                    "max_new_tokens": 120}})
    jsonschema.validate(json.loads(r.json()["text"]), SCHEMA)
    r = server.post("/generate", {"text": "hi", "sampling_params": {"ebnf": 'root ::= "yes" | "no"',
                                                                    "max_new_tokens": 8}})
    assert r.json()["text"] in ("yes", "no")


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"regex": "a["}, "regex"),
    ({"ebnf": "root ::= undefined_rule"}, "ebnf"),
    ({"response_format": {"type": "json_object"}, "regex": "a+"}, "regex"),
], ids=["schema-the-library-rejects", "no-schema", "unknown-type", "bad-regex", "bad-ebnf", "two-constraints"])
def test_rejected_constraints_are_400_naming_the_field(server, body, param):
    r = server.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, **body})
    assert _error(r)["param"] == param


def _schema_format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


@pytest.mark.parametrize(("schema", "where"), [
    ({"$ref": "http://example.com/s.json"}, "schema.$ref"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "if": {"required": ["a"]}, "then": {}}, "schema.if"),
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "schema.properties.a.not"),
    ({"type": "array", "items": {"type": "object", "dependentRequired": {"a": ["b"]}}}, "schema.items.dependentRequired"),
    ({"anyOf": [{"type": "integer"}, {"allOf": [{"type": "integer"}, {"minimum": 5}]}]}, "schema.anyOf.1.allOf"),
], ids=["remote-ref", "if-then", "not", "dependent-required", "all-of"])
def test_schema_keywords_the_backend_would_ignore_are_400_naming_them(server, schema, where):
    r = server.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4,
                                             "response_format": _schema_format(schema)})
    assert _error(r)["message"].startswith(f"response_format: {where}: "), r.text


def test_properties_named_like_keywords_are_served(server):
    schema = {"type": "object", "properties": {"not": {"type": "boolean"}, "if": {"enum": ["then"]}},
              "required": ["not", "if"], "additionalProperties": False}
    r = server.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 40,
                                             "response_format": _schema_format(schema)})
    assert r.status_code == 200, r.text


def _nested_objects(levels: int) -> str:
    """A schema ``levels`` objects deep, as text (``json.dumps`` itself recurses too deep)."""
    schema = '{"type": "integer"}'
    for _ in range(levels):
        schema = '{"type": "object", "properties": {"a": ' + schema + "}}"
    return schema


@pytest.mark.parametrize("levels", [300, 800])
def test_a_schema_nested_past_the_depth_limit_is_400_naming_the_field_and_limit(server, levels):
    body = ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "response_format": '
            '{"type": "json_schema", "json_schema": {"name": "x", "schema": ' + _nested_objects(levels) + "}}}")
    r = httpx.post(server.url + "/v1/chat/completions", content=body,
                   headers={"content-type": "application/json"}, timeout=120)
    error = _error(r)
    assert (error["param"], error["message"]) == (
        "response_format", "response_format: JSON nested more than 400 levels deep (arrays and objects); "
        "at most 400 levels are accepted")


def test_a_string_schema_nested_past_the_depth_limit_is_400_naming_sampling_params(server):
    r = server.post("/generate", {"text": "hi", "sampling_params": {"json_schema": _nested_objects(800),
                                                                    "max_new_tokens": 2}})
    assert _error(r)["param"] == "sampling_params.json_schema"


def test_a_schema_within_the_depth_limit_is_served(server):
    r = server.post("/generate", {"text": "hi", "sampling_params": {"json_schema": _nested_objects(20),
                                                                    "max_new_tokens": 2}})
    assert r.status_code == 200, r.text


@pytest.mark.slow
def test_health_answers_while_a_slow_schema_compiles(server):
    """A deeply nested schema takes seconds to compile; the compile runs off the event loop."""
    schema: dict = {"type": "integer"}
    for _ in range(390):
        schema = {"type": "array", "items": schema}
    body = {"messages": MESSAGES, "max_tokens": 2, "response_format": _schema_format(schema)}
    started = time.monotonic()
    thread = threading.Thread(target=server.post, args=("/v1/chat/completions", body))
    thread.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    assert server.get("/health").status_code == 200
    health_seconds = time.monotonic() - t0
    thread.join()
    assert time.monotonic() - started > 2, "the compile is slow enough for the test to mean something"
    assert health_seconds < 1.0


def test_generate_bad_regex_is_400_naming_sampling_params_regex(server):
    r = server.post("/generate", {"text": "hi", "sampling_params": {"regex": "(", "max_new_tokens": 4}})
    assert _error(r)["param"] == "sampling_params.regex"


def test_openai_sdk_parse_with_a_pydantic_model(server):
    from openai import OpenAI
    from pydantic import BaseModel, Field

    class City(BaseModel):
        city: str = Field(max_length=8)
        capital: bool

    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    completion = client.chat.completions.parse(model="tiny-llama", messages=MESSAGES, response_format=City,
                                               max_tokens=80, temperature=1.0, seed=3)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, City)
