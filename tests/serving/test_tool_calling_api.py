"""Tool calling and reasoning over HTTP on a random tiny model with a Hermes-style template:
forced calls (``required``, a named function) are valid calls whose arguments fit their schemas,
streamed ``tool_calls`` deltas join into the non-streamed calls, tool round trips render, and
``--reasoning-parser deepseek-r1`` moves the reply into ``reasoning_content``."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from serving_server import POOL, start_server

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,6}$"}, "days": {"type": "integer", "minimum": 1,
                                                                         "maximum": 7}},
    "required": ["city", "days"],
}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Oslo?"}]


def _chat(server, **body) -> dict:
    r = server.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 160, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _stream(server, **body) -> list[dict]:
    body = {"messages": MESSAGES, "max_tokens": 160, "stream": True, **body}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"]


def test_required_tool_choice_answers_calls_whose_arguments_fit(tools_server):
    body = _chat(tools_server, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, n=2,
                 temperature=1.0, seed=4)
    calls = [c for choice in body["choices"] for c in choice["message"]["tool_calls"]]
    for call in calls:
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])


def test_forced_calls_finish_with_tool_calls(tools_server):
    body = _chat(tools_server, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                 temperature=1.0, seed=5)
    assert body["choices"][0]["finish_reason"] == "tool_calls"


def test_named_function_without_parallel_calls_is_called_once(tools_server):
    choice = {"type": "function", "function": {"name": "get_time"}}
    body = _chat(tools_server, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False, temperature=1.0)
    calls = body["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_time"]


def test_streamed_tool_call_deltas_join_into_the_non_streamed_calls(tools_server):
    request = {"tools": TOOLS, "tool_choice": "required", "max_tokens": 60, "temperature": 1.0, "seed": 6}
    whole = _chat(tools_server, **request)["choices"][0]["message"]["tool_calls"]
    calls: dict[int, dict] = {}
    for event in _stream(tools_server, **request):
        for choice in event["choices"]:
            for entry in choice["delta"].get("tool_calls") or []:
                call = calls.setdefault(entry["index"], {"name": "", "arguments": ""})
                call["name"] += entry["function"].get("name", "")
                call["arguments"] += entry["function"].get("arguments", "")
    assert [calls[i] for i in sorted(calls)] == [c["function"] for c in whole]


def test_a_calls_first_delta_names_it_with_an_id(tools_server):
    events = _stream(tools_server, tools=TOOLS, tool_choice="required", max_tokens=60, temperature=1.0, seed=7)
    first = next(e["choices"][0]["delta"]["tool_calls"][0] for e in events
                 if e["choices"] and e["choices"][0]["delta"].get("tool_calls"))
    assert (first["index"], first["type"], first["id"].startswith("call_"), first["function"]["name"] in SCHEMAS) \
        == (0, "function", True, True)


def test_a_forced_call_with_response_format_is_a_call(tools_server):
    body = _chat(tools_server, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=1.0,
                 seed=9, response_format={"type": "json_object"})
    assert body["choices"][0]["message"]["tool_calls"]


def test_a_tool_round_trip_renders_and_answers(tools_server):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    r = tools_server.post("/v1/chat/completions", {"messages": messages, "tools": TOOLS, "max_tokens": 4})
    assert r.status_code == 200, r.text


def test_tool_call_arguments_that_are_not_json_are_400_naming_them(tools_server):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{zone"}}
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]}]
    r = tools_server.post("/v1/chat/completions", {"messages": messages, "max_tokens": 4})
    assert r.json()["error"]["param"] == "messages[1].tool_calls[0].function.arguments"


def test_auto_tool_choice_with_a_reply_that_calls_nothing_is_content(tools_server):
    message = _chat(tools_server, tools=TOOLS, max_tokens=8, temperature=0.0)["choices"][0]["message"]
    assert (isinstance(message["content"], str), "tool_calls" in message) == (True, False)


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "regex": "[a-z]+"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "x", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0]"),
], ids=["unknown-function", "two-constraints", "schema-the-library-rejects", "not-a-function"])
def test_bad_tool_requests_are_400_naming_the_field(tools_server, body, param):
    r = tools_server.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, **body})
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_forced_parameters_with_an_unenforced_keyword_are_400_naming_the_path(tools_server, tool_choice):
    """The forcing grammar would ignore ``not``: refused as ``response_format`` schemas are."""
    time_tool = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "not": {"enum": ["PST"]}}}}}}
    body = {"messages": MESSAGES, "max_tokens": 4, "tools": [TOOLS[0], time_tool], "tool_choice": tool_choice}
    error = tools_server.post("/v1/chat/completions", body).json()["error"]
    assert error["message"].startswith("tools[1].function.parameters.properties.zone.not: "), error


def test_auto_tool_choice_serves_parameters_the_grammar_would_not_enforce(tools_server):
    """Nothing is forced under ``auto``: the schema only goes into the prompt."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}
    r = tools_server.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, "tools": [tool]})
    assert r.status_code == 200, r.text


def test_tools_on_a_template_that_ignores_them_are_400_naming_tools(server):
    r = server.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, "tools": TOOLS})
    assert r.json()["error"]["param"] == "tools"


@pytest.fixture(scope="module")
def reasoning_server(tools_checkpoint, checkpoint_dir):
    """The tools checkpoint read as a DeepSeek-R1 reply: it starts inside thinking."""
    srv = start_server(tools_checkpoint, checkpoint_dir, "--max-total-tokens", str(POOL),
                       "--tool-call-parser", "hermes", "--reasoning-parser", "deepseek-r1")
    yield srv
    srv.stop()


def test_a_reply_without_think_end_is_all_reasoning(tools_server, reasoning_server):
    plain = _chat(tools_server, max_tokens=12, temperature=0.0)["choices"][0]["message"]["content"]
    message = _chat(reasoning_server, max_tokens=12, temperature=0.0)["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (plain, "")


def test_streamed_reasoning_deltas_join_into_reasoning_content(reasoning_server):
    whole = _chat(reasoning_server, max_tokens=12, temperature=0.0)["choices"][0]["message"]
    events = _stream(reasoning_server, max_tokens=12, temperature=0.0)
    joined = "".join(c["delta"].get("reasoning_content") or "" for e in events for c in e["choices"])
    assert joined == whole["reasoning_content"]


def test_a_forced_call_is_not_read_as_reasoning(reasoning_server):
    body = _chat(reasoning_server, tools=TOOLS, tool_choice="required", max_tokens=60, temperature=1.0, seed=8)
    assert body["choices"][0]["message"]["tool_calls"]
