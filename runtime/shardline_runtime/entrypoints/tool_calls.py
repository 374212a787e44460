"""OpenAI ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` -> what the template, the
grammar and the reply parser get (:class:`ToolPlan`).

- ``tool_choice`` ``"none"``: no tool goes into the prompt and the reply is plain content
  (SGLang's behaviour; OpenAI's model then writes a message).
- ``"auto"`` (the default when ``tools`` is set): the tools go into the chat template
  (``apply_chat_template(tools=...)``), the reply is free and read by the family's parser.
- ``"required"`` or ``{"type": "function", "function": {"name": ...}}``: as ``auto``, and the
  reply is forced by a grammar (an xgrammar structural tag in the family's format) to be one or
  more calls of the allowed tools whose arguments fit each function's ``parameters`` schema;
  ``parallel_tool_calls: false`` allows exactly one call (vLLM forces with a JSON schema of its
  own format; forcing the family's own format lets one parser read both). A forced function's
  ``parameters`` using a JSON Schema keyword the grammar would not enforce is a 400 naming
  ``tools[i].function.parameters...`` (as ``response_format`` schemas are checked).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from shardline_runtime.constrained.grammar_spec import GrammarSpec
from shardline_runtime.constrained.xgrammar_backend import (
    bounded_strings_without_control_characters,
)
from shardline_runtime.entrypoints.structured_output import check_enforceable
from shardline_runtime.entrypoints.tool_parsers import ToolCallFormat
from shardline_runtime.managers.request_validation import RequestValidationError

# OpenAI's rule for function names
_FUNCTION_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
TOOL_CHOICE_MODES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolPlan:
    """What one chat request's tool fields mean for the server.

    Attributes:
        tools: the ``tools`` for the chat template (None: none go into the prompt).
        grammar: the forcing grammar of ``required`` / a named function (None: free reply).
        parse: read the reply for calls (``auto`` / ``required`` / named).
    """

    tools: list[dict[str, Any]] | None = None
    grammar: GrammarSpec | None = None
    parse: bool = False


def _bad(message: str, param: str) -> RequestValidationError:
    return RequestValidationError(f"{param}: {message}", param)


def checked_tools(tools: list[Any]) -> dict[str, dict[str, Any]]:
    """``tools`` checked, by function name: each ``{"type": "function", "function": {"name",
    "description"?, "parameters"?, "strict"?}}``.

    Raises:
        RequestValidationError: naming ``tools[i]`` and what is wrong.
    """
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        param = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise _bad('each tool must be {"type": "function", "function": {...}}', param)
        function = tool.get("function")
        if not isinstance(function, dict):
            raise _bad("function must be an object", f"{param}.function")
        name = function.get("name")
        if not isinstance(name, str) or not _FUNCTION_NAME.match(name):
            raise _bad(
                f"must be 1-64 of a-z, A-Z, 0-9, _ and -, got {name!r}", f"{param}.function.name"
            )
        if name in out:
            raise _bad(f"function {name!r} is defined twice", f"{param}.function.name")
        parameters = function.get("parameters", _EMPTY_PARAMETERS)
        if not isinstance(parameters, dict):
            raise _bad("must be a JSON Schema object", f"{param}.function.parameters")
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise _bad(f"must be a boolean, got {strict!r}", f"{param}.function.strict")
        out[name] = {**function, "parameters": parameters}
    return out


def _choice(tool_choice: Any, names: dict[str, Any]) -> str:
    """``none`` / ``auto`` / ``required`` or the named function's name."""
    if tool_choice is None:
        return "auto" if names else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICE_MODES:
            raise _bad(
                f"must be one of {list(TOOL_CHOICE_MODES)} or "
                f'{{"type": "function", "function": {{"name": ...}}}}, got {tool_choice!r}',
                "tool_choice",
            )
        if tool_choice == "required" and not names:
            raise _bad('"required" needs tools', "tool_choice")
        return tool_choice
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or name is None:
        raise _bad(
            f'a named function is {{"type": "function", "function": {{"name": ...}}}}, '
            f"got {tool_choice!r}",
            "tool_choice",
        )
    if name not in names:
        raise _bad(f"function {name!r} is not in tools {list(names)}", "tool_choice")
    return str(name)


def tool_plan(
    tools: list[Any] | None,
    tool_choice: Any,
    parallel_tool_calls: bool,
    fmt: ToolCallFormat | None,
) -> ToolPlan:
    """The plan of one request's tool fields (module docstring).

    Args:
        fmt: the server's tool-call format (None: this model has no parser; tools are a 400).

    Raises:
        RequestValidationError: a malformed field, a named function not in ``tools``, or tools
            for a model without a parser.
    """
    functions = checked_tools(tools or [])
    choice = _choice(tool_choice, functions)
    if choice == "none":
        return ToolPlan()
    if fmt is None:
        raise _bad(
            "this server has no tool-call parser for its model's architecture; start it with "
            "--tool-call-parser (llama3, hermes, mistral)",
            "tools",
        )
    if choice == "auto":
        return ToolPlan(tools=list(tools or []), parse=True)
    allowed = functions if choice == "required" else {choice: functions[choice]}
    for i, name in enumerate(functions):  # the forcing grammar enforces these schemas
        if name in allowed:
            where = f"tools[{i}].function.parameters"
            check_enforceable(allowed[name]["parameters"], where, where)
    tag = forcing_structural_tag(fmt, allowed, parallel_tool_calls)
    return ToolPlan(
        tools=list(tools or []),
        grammar=GrammarSpec("structural_tag", json.dumps(tag), param="tool_choice"),
        parse=True,
    )


def _arguments_schema(function: dict[str, Any]) -> dict[str, Any]:
    """The function's ``parameters``, made strict (no property beyond the schema's: OpenAI's
    strict mode) unless ``strict`` is false, with bounded strings free of control characters."""
    schema = bounded_strings_without_control_characters(function["parameters"])
    if function.get("strict") is not False:
        schema = _no_additional_properties(schema)
    return schema


def _no_additional_properties(schema: Any) -> Any:
    if isinstance(schema, list):  # plain loops: one frame per level (see bounded_strings_...)
        items = []
        for item in schema:
            items.append(_no_additional_properties(item))
        return items
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        out[key] = _no_additional_properties(value)
    if out.get("type") == "object" and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def forcing_structural_tag(
    fmt: ToolCallFormat, functions: dict[str, dict[str, Any]], parallel: bool
) -> dict[str, Any]:
    """xgrammar's structural tag for "one or more calls of ``functions`` in ``fmt``'s format"
    (exactly one when not ``parallel``): each call is ``{"name": NAME, KEY: ARGUMENTS}`` with
    ``ARGUMENTS`` fitting the function's schema, at most one whitespace in a row."""
    tags = [
        {
            "type": "tag",
            "begin": f'{fmt.call_open}{{"name": {json.dumps(name)}, "{fmt.arguments_key}": ',
            "content": {
                "type": "json_schema",
                "json_schema": _arguments_schema(function),
                "max_whitespace_cnt": 1,
            },
            "end": "}" + fmt.call_close,
        }
        for name, function in functions.items()
    ]
    calls = {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": fmt.separator,
        "at_least_one": True,
        "stop_after_first": not parallel,
    }
    elements: list[dict[str, Any]] = []
    if fmt.section_prefix():
        elements.append({"type": "const_string", "value": fmt.section_prefix()})
    elements.append(calls)
    if fmt.list_close:
        elements.append({"type": "const_string", "value": fmt.list_close})
    return {"type": "structural_tag", "format": {"type": "sequence", "elements": elements}}
