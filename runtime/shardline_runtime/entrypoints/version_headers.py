"""The version headers: which weights answered a response, and which a request is pinned to.

``X-Shardline-Revision`` and ``X-Shardline-Weight-Version`` name the revision and
``weight_version`` of the weights (the same values as ``/get_server_info``'s ``weights`` block
and each response body's ``weight_version`` / ``revision`` metadata).

- On a request they pin it (``managers/version_pin.VersionPin``): an empty header is a 400.
- On a non-streamed generation they name the weights that produced its tokens; on a stream,
  what served when it was admitted (each event's body metadata names its own); on every other
  response (errors included) what serves now, added by :class:`VersionHeadersMiddleware`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from shardline_runtime.managers.request_validation import RequestValidationError
from shardline_runtime.managers.version_pin import VersionPin
from shardline_runtime.weights_state import WeightsState

REVISION_HEADER = "X-Shardline-Revision"
WEIGHT_VERSION_HEADER = "X-Shardline-Weight-Version"
_MAX_LENGTH = 256  # as the weight_version field of the update routes


def pin_from_headers(headers: Mapping[str, str]) -> VersionPin | None:
    """The request's :class:`VersionPin`, or None when it sends neither header.

    Raises:
        RequestValidationError: a header is empty or longer than 256 characters (400, naming it).
    """
    values: dict[str, str | None] = {}
    for name in (REVISION_HEADER, WEIGHT_VERSION_HEADER):
        value = headers.get(name)
        if value is not None and not 0 < len(value.strip()) <= _MAX_LENGTH:
            raise RequestValidationError(
                f"header {name} must name a version (1 to {_MAX_LENGTH} characters), got {value!r}",
                name,
            )
        values[name] = None if value is None else value.strip()
    if values[REVISION_HEADER] is None and values[WEIGHT_VERSION_HEADER] is None:
        return None
    return VersionPin(values[REVISION_HEADER], values[WEIGHT_VERSION_HEADER])


def version_headers(revision: str | None, weight_version: str | None) -> dict[str, str]:
    """The response headers naming ``revision`` / ``weight_version`` (a None one is left out)."""
    headers = {}
    if revision is not None:
        headers[REVISION_HEADER] = revision
    if weight_version is not None:
        headers[WEIGHT_VERSION_HEADER] = weight_version
    return headers


class VersionHeadersMiddleware:
    """Pure ASGI middleware: adds the version headers of ``weights()`` (the server's one
    ``WeightsState``, read when the response starts) to HTTP responses that do not carry them.

    Pure ASGI rather than Starlette's ``BaseHTTPMiddleware``, which wraps streamed bodies and
    the client-disconnect checks the routes rely on.
    """

    def __init__(self, app: Any, weights: Callable[[], WeightsState]):
        self.app = app
        self.weights = weights

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: dict) -> None:
            if message["type"] == "http.response.start":
                present = {k.lower() for k, _ in message.get("headers", [])}
                state = self.weights()
                extra = [
                    (name.lower().encode("latin-1"), value.encode("latin-1", "replace"))
                    for name, value in version_headers(state.revision, state.weight_version).items()
                    if name.lower().encode("latin-1") not in present
                ]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_headers)
