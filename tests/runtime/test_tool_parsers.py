"""Tool-call formats, the forcing grammar and the reasoning split, without a server: every
family's grammar (xgrammar on the tiny tokenizer, random logits) writes calls its parser reads,
and a stream's deltas join into exactly the non-streamed message."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from shardline_runtime.constrained.grammar_spec import GrammarSpec
from shardline_runtime.constrained.xgrammar_backend import (
    GrammarBackend,
    allow_all_bitmask,
    apply_token_bitmask,
)
from shardline_runtime.entrypoints.chat_output import ChatOutput, ChatParsers
from shardline_runtime.entrypoints.reasoning_parser import split_reasoning
from shardline_runtime.entrypoints.tool_calls import tool_plan
from shardline_runtime.entrypoints.tool_parsers import HERMES, LLAMA3, MISTRAL, scan_reply
from shardline_runtime.managers.request_validation import RequestValidationError

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

REPLIES = {
    "hermes": (HERMES, 'Sure. <tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n'
                       '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'),
    "mistral": (MISTRAL, '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}, '
                         '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}]'),
    "llama3": (LLAMA3, '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}; '
                       '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}'),
}


@pytest.mark.parametrize("family", sorted(REPLIES))
def test_each_family_reads_both_calls_of_its_format(family):
    fmt, text = REPLIES[family]
    calls = scan_reply(fmt, text, final=True).calls
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Oslo", "days": 2})]


def test_content_before_hermes_calls_is_kept():
    assert scan_reply(HERMES, REPLIES["hermes"][1], final=True).content == "Sure. "


@pytest.mark.parametrize("text", ["The weather is fine.", "<tool_call>\nnot json\n</tool_call>",
                                  'hello {"name": "f", "parameters": {}}'])
def test_a_reply_without_readable_calls_is_all_content(text):
    fmt = LLAMA3 if text.startswith("hello") else HERMES
    scanned = scan_reply(fmt, text, final=True)
    assert (scanned.content, scanned.calls) == (text, [])


@pytest.mark.parametrize("family", sorted(REPLIES))
def test_streamed_deltas_join_into_the_final_message(family):
    fmt, text = REPLIES[family]
    stream = ChatOutput(None, fmt)
    content, calls = "", {}
    for k in range(0, len(text), 3):
        delta = stream.delta(text[k:k + 3], final=k + 3 >= len(text))
        content += delta.get("content", "")
        for entry in delta.get("tool_calls", []):
            call = calls.setdefault(entry["index"], {"name": None, "arguments": "", "id": None})
            if "id" in entry:
                assert call["id"] is None  # id and name come once, first
                call.update(id=entry["id"], name=entry["function"]["name"])
            call["arguments"] += entry["function"].get("arguments", "")
    message, _ = ChatOutput(None, fmt).message(text)
    joined = [{"name": c["name"], "arguments": c["arguments"]} for _, c in sorted(calls.items())]
    assert joined == [c["function"] for c in message["tool_calls"]]
    assert content == (message["content"] or "")


def _force(backend: GrammarBackend, spec: GrammarSpec, seed: int, steps: int = 2000) -> str:
    """Sample random logits under the grammar until it terminates (a random tiny model)."""
    grammar = backend.matcher(spec)
    generator = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for _ in range(steps):
        mask = allow_all_bitmask(1, 512)
        grammar.fill_bitmask(mask, 0)
        logits = apply_token_bitmask(torch.randn(1, 512, generator=generator), mask)
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        assert grammar.accept(token)
        if grammar.is_terminated():
            return backend.tokenizer.decode(out)
        out.append(token)
    raise AssertionError(f"grammar did not finish in {steps} tokens: {backend.tokenizer.decode(out)!r}")


@pytest.fixture(scope="module")
def backend(tiny_checkpoint):
    return GrammarBackend.from_tokenizer_path(str(tiny_checkpoint("llama", 0)), vocab_size=512, stop_token_ids=[2])


@pytest.mark.parametrize("family", sorted(REPLIES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_tool_choice_forces_calls_that_fit_their_schemas(backend, family, seed):
    fmt = REPLIES[family][0]
    plan = tool_plan(TOOLS, "required", True, fmt)
    calls = scan_reply(fmt, _force(backend, plan.grammar, seed), final=True).calls
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


@pytest.mark.parametrize("family", sorted(REPLIES))
def test_a_named_function_without_parallel_calls_is_called_exactly_once(backend, family):
    fmt = REPLIES[family][0]
    plan = tool_plan(TOOLS, {"type": "function", "function": {"name": "get_time"}}, False, fmt)
    calls = scan_reply(fmt, _force(backend, plan.grammar, 5), final=True).calls
    assert [c.name for c in calls] == ["get_time"]


@pytest.mark.parametrize(("tools", "choice", "param"), [
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    (None, "required", "tool_choice"),
    (TOOLS, "sometimes", "tool_choice"),
    ([{"type": "retrieval"}], "auto", "tools[0]"),
    ([{"type": "function", "function": {"name": "bad name!"}}], "auto", "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], "auto", "tools[0].function.parameters"),
], ids=["unknown-name", "required-without-tools", "unknown-mode", "not-a-function", "bad-name", "bad-parameters"])
def test_malformed_tool_fields_are_400_naming_the_field(tools, choice, param):
    with pytest.raises(RequestValidationError) as err:
        tool_plan(tools, choice, True, HERMES)
    assert err.value.param == param


def test_tool_choice_none_puts_no_tool_in_the_prompt():
    assert tool_plan(TOOLS, "none", True, HERMES).tools is None


def test_tools_for_a_model_without_a_parser_are_400_naming_tools():
    with pytest.raises(RequestValidationError) as err:
        tool_plan(TOOLS, "auto", True, None)
    assert err.value.param == "tools"


def test_auto_parser_follows_the_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    assert ChatParsers.resolve("auto", None, str(tmp_path)).tool_format is HERMES


@pytest.mark.parametrize(("parser", "text", "expected"), [
    ("qwen3", "<think>\nplan\n</think>\n\nanswer", ("\nplan\n", "\n\nanswer")),
    ("qwen3", "answer without thinking", ("", "answer without thinking")),
    ("qwen3", "<think>cut by max_tokens", ("cut by max_tokens", "")),
    ("deepseek-r1", "plan</think>answer", ("plan", "answer")),
    ("deepseek-r1", "<think>plan</think>answer", ("plan", "answer")),
    ("deepseek-r1", "still thinking", ("still thinking", "")),
])
def test_reasoning_split(parser, text, expected):
    split = split_reasoning(parser, text, final=True)
    assert (split.reasoning, split.content) == expected


@pytest.mark.parametrize("parser", ["qwen3", "deepseek-r1"])
def test_streamed_reasoning_joins_into_the_final_split(parser):
    text = "<think>\nweigh the options</think>\n\nthe answer"
    stream = ChatOutput(parser, None)
    reasoning, content = "", ""
    for k in range(0, len(text), 2):
        delta = stream.delta(text[k:k + 2], final=k + 2 >= len(text))
        reasoning += delta.get("reasoning_content", "")
        content += delta.get("content", "")
    message, _ = ChatOutput(parser, None).message(text)
    assert (reasoning, content) == (message["reasoning_content"], message["content"])
