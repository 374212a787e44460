"""OpenAI request fields that would change the output but are not served: each is a 400 naming
it, never silently dropped (the rule of field case G14). Fields that change nothing the model
writes (``user``, ``store``, ``metadata``, ``service_tier``, ``prediction``: predicted outputs
only speed OpenAI's decoding up, the answer is the same) are accepted and ignored.
"""

from __future__ import annotations

from typing import Any

from shardline_runtime.managers.request_validation import RequestValidationError

# field -> why it is refused (the 400's message)
REFUSED_CHAT_FIELDS: dict[str, str] = {
    "functions": "the legacy function-calling fields are not served (their reply, "
    "message.function_call, is not written); send tools instead",
    "function_call": "the legacy function-calling fields are not served (their reply, "
    "message.function_call, is not written); send tool_choice instead",
    "reasoning_effort": "this server has no reasoning-effort control; for models whose chat "
    'template reads a flag, send chat_template_kwargs (e.g. {"enable_thinking": false})',
    "audio": "audio output is not served (text only)",
    "web_search_options": "web search is not served",
    "verbosity": "verbosity control is not served",
}

# chat_template_kwargs keys the server sets itself (each has its own request field)
RESERVED_TEMPLATE_KWARGS = (
    "messages",
    "conversation",
    "tools",
    "documents",
    "tokenize",
    "return_dict",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template",
)


def check_refused_chat_fields(body: dict[str, Any]) -> None:
    """400 for the first refused field ``body`` sets (``body``: the request's fields as sent,
    extras included), and for ``modalities`` other than ``["text"]``.

    Raises:
        RequestValidationError: naming the field and why.
    """
    for name, why in REFUSED_CHAT_FIELDS.items():
        if body.get(name) is not None:
            raise RequestValidationError(f"{name}: {why}", name)
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise RequestValidationError(
            f'modalities: only ["text"] is served, got {modalities!r}', "modalities"
        )


def template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """``chat_template_kwargs`` for ``apply_chat_template`` (e.g. ``enable_thinking``).

    Raises:
        RequestValidationError: a key the server sets itself (it has its own request field).
    """
    kwargs = dict(kwargs or {})
    clash = [k for k in kwargs if k in RESERVED_TEMPLATE_KWARGS]
    if clash:
        raise RequestValidationError(
            f"chat_template_kwargs: {clash[0]!r} is set by the server (use its own request "
            f"field); reserved keys: {list(RESERVED_TEMPLATE_KWARGS)}",
            "chat_template_kwargs",
        )
    return kwargs
