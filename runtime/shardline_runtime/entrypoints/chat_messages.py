"""Chat ``messages`` (and ``tools``) -> the prompt's token ids, through the tokenizer's chat
template.

Messages reach the template as transformers documents them: text content joined from its
parts; an assistant message's ``tool_calls`` with ``function.arguments`` as an object (OpenAI
sends a JSON string; tool-use templates read a mapping, and vLLM converts the same way); a
``tool`` message's ``tool_call_id`` and ``name`` kept.
"""

from __future__ import annotations

import json
from typing import Any

from shardline_runtime.entrypoints.protocol import ChatCompletionRequest, ChatMessage
from shardline_runtime.entrypoints.refused_fields import template_kwargs
from shardline_runtime.managers.request_validation import RequestValidationError
from shardline_runtime.managers.tokenizer_manager import TokenizerManager


def _text_content(i: int, content: Any) -> str:
    if not isinstance(content, list):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise RequestValidationError(
                f"messages[{i}].content: only text parts are supported", f"messages[{i}].content"
            )
        parts.append(part["text"])
    return "".join(parts)


def _template_tool_calls(i: int, tool_calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for j, call in enumerate(tool_calls):
        param = f"messages[{i}].tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestValidationError(
                f'{param}: a tool call is {{"id", "type": "function", "function": {{"name", '
                f'"arguments"}}}}',
                param,
            )
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except ValueError as exc:
                raise RequestValidationError(
                    f"{param}.function.arguments: not valid JSON: {exc}",
                    f"{param}.function.arguments",
                ) from None
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


def template_message(i: int, m: ChatMessage) -> dict[str, Any]:
    """Message ``i`` as the chat template reads it (module docstring).

    Raises:
        RequestValidationError: non-text content parts, or a malformed tool call.
    """
    message: dict[str, Any] = {"role": m.role, "content": _text_content(i, m.content)}
    if m.name is not None:
        message["name"] = m.name
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        message["tool_calls"] = _template_tool_calls(i, m.tool_calls)
    return message


def _check_template_reads_tools(tm: TokenizerManager, tools: list[dict[str, Any]]) -> None:
    """A template that never mentions ``tools`` would drop them silently: a 400 instead."""
    try:
        source = tm.tokenizer.get_chat_template(None, tools)
    except (ValueError, TypeError):
        source = getattr(tm.tokenizer, "chat_template", "") or ""
    if "tools" not in str(source):
        raise RequestValidationError(
            "tools: this model's chat template does not render tools (it never reads 'tools'); "
            "serve a tokenizer whose template does, or leave tools out",
            "tools",
        )


def chat_prompt_ids(
    req: ChatCompletionRequest, tm: TokenizerManager, tools: list[dict[str, Any]] | None = None
) -> list[int]:
    """Apply the tokenizer's chat template to ``messages`` (and ``tools``: the tool definitions
    the template writes into the prompt, None for none) and tokenize the text.

    The template usually writes BOS itself, so special tokens are not added unless the request
    says ``add_special_tokens: true`` (vLLM's default and override). A template that raises (many
    do on purpose, e.g. when roles do not alternate) is the client's error: a 400 on ``messages``
    carrying the template's message.

    Raises:
        RequestValidationError: non-text content parts, a malformed tool call, no chat template,
            a template that does not read ``tools`` when tools are given, the template raised,
            or the prompt is empty or too long.
    """
    messages = [template_message(i, m) for i, m in enumerate(req.messages)]
    if getattr(tm.tokenizer, "chat_template", None) is None:
        raise RequestValidationError(
            "this model's tokenizer has no chat template; use /v1/completions", "messages"
        )
    if tools:
        _check_template_reads_tools(tm, tools)
    add_generation_prompt = req.add_generation_prompt
    if req.continue_final_message:  # as vLLM: both explicitly true is a 400; unset means off
        if add_generation_prompt and "add_generation_prompt" in req.model_fields_set:
            raise RequestValidationError(
                "continue_final_message: cannot be true together with add_generation_prompt "
                "true (one continues the final message, the other opens a new one); send "
                "add_generation_prompt false",
                "continue_final_message",
            )
        add_generation_prompt = False
    extra_kwargs = template_kwargs(req.chat_template_kwargs)
    if tools:
        extra_kwargs["tools"] = tools
    try:
        text = tm.tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=req.continue_final_message,
            **extra_kwargs,
        )
    except Exception as exc:  # whatever a template raises on these messages is a bad request
        raise RequestValidationError(
            f"messages: the chat template rejected them: {exc}", "messages"
        ) from None
    if not isinstance(text, str):
        raise RequestValidationError("messages: the chat template did not produce text", "messages")
    tm.validator.check_text_length(text, "messages")
    ids, _ = tm.validator.encode_text(text, req.add_special_tokens)
    if not ids:
        raise RequestValidationError("messages produce an empty prompt", "messages")
    return ids
