"""JSON request bodies checked before FastAPI validates them, so text the tokenizer cannot take is
a 400 naming where it is, never a 500 deep in the tokenizer.

- Bytes that are not UTF-8: 400 with the offset of the first bad byte (RFC 8259 section 8.1:
  JSON exchanged between systems is UTF-8).
- A lone UTF-16 surrogate written as an escape (``"\\ud800"``): Python's JSON parser accepts it,
  but it is no Unicode scalar value and a Rust tokenizer raises on it. 400 naming the field's
  path (``messages.0.content``) and the code point.
- Nesting deeper than ``json_depth.MAX_JSON_DEPTH`` levels: 400 naming the top-level field and
  the limit (checked before parsing; Python's parser would raise ``RecursionError``).
- A body sent with another ``Content-Type`` (``curl -d`` sends
  ``application/x-www-form-urlencoded``): 400 naming the header and the type expected.

Routes opt in through :class:`CheckedJSONRoute` (``app.router.route_class``).
"""

from __future__ import annotations

import email.message
import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from shardline_runtime.entrypoints.json_depth import check_depth
from shardline_runtime.managers.request_validation import RequestValidationError


def _is_json(content_type: str | None) -> bool:
    if not content_type:
        return True  # FastAPI parses a body without the header as JSON
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


def _lone_surrogate(value: Any, path: tuple[str, ...] = ()) -> tuple[tuple[str, ...], str] | None:
    """(path, character) of the first string (key or value) holding a lone surrogate, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return path, value[exc.start]
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            name = key.encode("utf-8", "backslashreplace").decode("utf-8")
            found = _lone_surrogate(key, (*path, name)) or _lone_surrogate(item, (*path, name))
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _lone_surrogate(item, (*path, str(i)))
            if found is not None:
                return found
    return None


def parse_json_body(body: bytes) -> Any:
    """The parsed body.

    Raises:
        RequestValidationError: bytes that are not UTF-8, a string holding a lone surrogate, or
            nesting deeper than ``MAX_JSON_DEPTH`` (``param``: the top-level field).
        json.JSONDecodeError: not JSON (FastAPI reports it).
    """
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestValidationError(
            f"request body is not valid UTF-8: byte {exc.start} is {body[exc.start]:#04x}"
        ) from None
    check_depth(text)
    parsed = json.loads(text)
    found = _lone_surrogate(parsed)
    if found is not None:
        path, char = found
        where = ".".join(path) or "request body"
        raise RequestValidationError(
            f"{where}: contains a lone UTF-16 surrogate (U+{ord(char):04X}); strings must be "
            "valid Unicode (escape a character outside the BMP as a surrogate pair)",
            path[0] if path else None,
        )
    return parsed


class _CheckedRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_checked_json"):
            self._checked_json = parse_json_body(await self.body())
        return self._checked_json


class CheckedJSONRoute(APIRoute):
    """An ``APIRoute`` whose JSON body goes through :func:`parse_json_body` first (its errors
    are raised outside FastAPI's body parsing, so the app's 400 handler names the field)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        if self.body_field is None:
            return handler

        async def checked(request: Request) -> Response:
            req = _CheckedRequest(request.scope, request.receive)
            body = await req.body()
            if body:
                content_type = req.headers.get("content-type")
                if not _is_json(content_type):
                    raise RequestValidationError(
                        f"Content-Type must be application/json, got {content_type!r} "
                        "(with curl, add -H 'Content-Type: application/json')"
                    )
                try:
                    await req.json()
                except json.JSONDecodeError:
                    pass  # FastAPI parses it again and reports where
            return await handler(req)

        return checked
