"""The chat request of OpenAI's API spec (openai/openai-openapi, ``CreateChatCompletionRequest``
and its ``ChatCompletionRequest*Message`` / content-part schemas), trimmed to the fields that shape
``messages``, as an OpenAPI document schemathesis can draw requests from. Every role (system,
developer, user, assistant with tool calls and a null content, tool, the deprecated function),
string or content-part content (text, image_url, input_audio, file, refusal), empty strings."""

from __future__ import annotations


def _obj(required: list[str], **properties) -> dict:
    return {"type": "object", "required": required, "properties": properties}


def _enum(*values: str) -> dict:
    return {"type": "string", "enum": list(values)}


_STR = {"type": "string"}
_TEXT = _obj(["type", "text"], type=_enum("text"), text=_STR)
_IMAGE = _obj(["type", "image_url"], type=_enum("image_url"),
              image_url=_obj(["url"], url=_STR, detail=_enum("auto", "low", "high")))
_AUDIO = _obj(["type", "input_audio"], type=_enum("input_audio"),
              input_audio=_obj(["data", "format"], data=_STR, format=_enum("wav", "mp3")))
_FILE = _obj(["type", "file"], type=_enum("file"), file=_obj([], file_id=_STR, filename=_STR, file_data=_STR))
_REFUSAL = _obj(["type", "refusal"], type=_enum("refusal"), refusal=_STR)


def _content(*parts: dict, nullable: bool = False) -> dict:
    schema = {"oneOf": [_STR, {"type": "array", "minItems": 1, "maxItems": 3, "items": {"oneOf": list(parts)}}]}
    if nullable:
        schema["nullable"] = True
    return schema


_TOOL_CALL = _obj(["id", "type", "function"], id=_STR, type=_enum("function"),
                  function=_obj(["name", "arguments"], name=_STR, arguments=_STR))
MESSAGE = {"oneOf": [
    _obj(["role", "content"], role=_enum("system"), content=_content(_TEXT), name=_STR),
    _obj(["role", "content"], role=_enum("developer"), content=_content(_TEXT), name=_STR),
    _obj(["role", "content"], role=_enum("user"), content=_content(_TEXT, _IMAGE, _AUDIO, _FILE), name=_STR),
    _obj(["role"], role=_enum("assistant"), content=_content(_TEXT, _REFUSAL, nullable=True),
         refusal={"type": "string", "nullable": True}, name=_STR,
         tool_calls={"type": "array", "maxItems": 2, "items": _TOOL_CALL}),
    _obj(["role", "content", "tool_call_id"], role=_enum("tool"), content=_content(_TEXT), tool_call_id=_STR),
    _obj(["role", "content", "name"], role=_enum("function"), content={"type": "string", "nullable": True}, name=_STR),
]}

CHAT_SCHEMA = {
    "openapi": "3.0.3",
    "info": {"title": "OpenAI chat messages (trimmed)", "version": "1"},
    "paths": {"/v1/chat/completions": {"post": {
        "requestBody": {"required": True, "content": {"application/json": {"schema": _obj(
            ["model", "messages", "max_tokens"],  # required here only to keep each request short
            model=_enum("tiny-llama"),
            messages={"type": "array", "minItems": 1, "maxItems": 5, "items": MESSAGE},
            max_tokens={"type": "integer", "minimum": 0, "maximum": 4},
            stream={"type": "boolean"},
            logprobs={"type": "boolean"},
            top_logprobs={"type": "integer", "minimum": 0, "maximum": 20},
        )}}},
        "responses": {"200": {"description": "a chat completion"}},
    }}},
}
