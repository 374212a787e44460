"""API keys: who may call which endpoint of the HTTP server (an ASGI middleware).

Every request path falls in one access class:

- ``open``: ``/health``, ``/ready``, ``/metrics`` (probes and scraping), never guarded;
- ``serving``: the inference endpoints, guarded by the API key (``--api-key``);
- ``info``: read-only model and server information (``/v1/models``, ``/v1/models/{model}``,
  ``/get_model_info``, ``/get_server_info`` and its SGLang alias ``/server_info``), open to the
  API key *and* the admin key (the operator reads ``/get_server_info`` with its admin token);
- ``admin``: everything else. A path is a control endpoint unless it is listed above, so an
  endpoint added later (weight sync, memory release, adapters, ...) is guarded by default.

Keys are sent as ``Authorization: Bearer <key>`` (what the OpenAI client sends for
``api_key``). A key setting may hold several keys separated by commas (``old,new``), each of
which is accepted: that is how a key is rotated without refusing anyone (add the new key, move
the clients, remove the old one). Which key a class takes:

====================  ====================  ================================================
access class          key configured        accepted
====================  ====================  ================================================
serving               API key               the API key only (an admin key that differs is
                                            refused: a leaked client key and the operator's
                                            token stay separate powers)
info                  API key               the API key or the admin key
admin                 admin key             the admin key only
admin                 API key, no admin     the API key (one key guards everything, as
                                            SGLang's ``--api-key`` does)
any                   neither               open (with a warning at start)
====================  ====================  ================================================

A refusal is HTTP 401 with an OpenAI error object; the message is the same whether the key was
missing, wrong, or a valid key of the other class, so it never tells which keys exist. The
SHA-256 digests of the sent token and of every accepted key are compared with
:func:`hmac.compare_digest`, without an early exit: the time taken tells neither a key's
content nor its length.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

logger = logging.getLogger(__name__)

ACCESS_CLASSES = ("open", "serving", "info", "admin")
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
SERVING_PATHS = frozenset(
    {"/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/generate", "/health_generate"}
)
INFO_PATHS = frozenset({"/v1/models", "/get_model_info", "/get_server_info", "/server_info"})
INFO_PREFIXES = ("/v1/models/",)  # GET /v1/models/{model}: OpenAI's model retrieve
UNAUTHORIZED_MESSAGE = "missing or invalid API key: send the key as 'Authorization: Bearer <key>'"

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def access_class(path: str) -> str:
    """``open``, ``serving``, ``info`` or ``admin`` for a request path (trailing ``/`` ignored)."""
    path = path.rstrip("/") or "/"
    if path in OPEN_PATHS:
        return "open"
    if path in SERVING_PATHS:
        return "serving"
    if path in INFO_PATHS or path.startswith(INFO_PREFIXES):
        return "info"
    return "admin"


def split_keys(setting: str | None) -> tuple[str, ...]:
    """The keys of a ``--api-key`` / ``--admin-api-key`` value: comma-separated, blanks dropped."""
    return tuple(key.strip() for key in (setting or "").split(",") if key.strip())


def accepted_keys(
    access: str, api_key: str | None, admin_key: str | None
) -> tuple[str, ...] | None:
    """The keys that open ``access``, or None when it is open (see the module table)."""
    api, admin = split_keys(api_key), split_keys(admin_key)
    if access == "open":
        return None
    if access == "serving":
        return api or None
    if access == "info":
        return (api + admin) if api else None
    return admin or api or None


def bearer_token(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The token of the first ``Authorization: Bearer <token>`` header, or None."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" and token.strip() else None
    return None


def _digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def key_matches(token: bytes | None, key_digests: tuple[bytes, ...]) -> bool:
    """True when ``token`` is one of the keys whose SHA-256 digests are ``key_digests``; every
    digest is compared in constant time."""
    sent = _digest(token or b"")
    matched = False
    for digest in key_digests:
        matched |= hmac.compare_digest(sent, digest)
    return matched and token is not None


class APIKeyMiddleware:
    """ASGI middleware enforcing the access table above on HTTP requests.

    Args:
        app: the wrapped ASGI application (the whole server, so no route escapes it).
        api_key: key of the serving endpoints, or None.
        admin_key: key of the control endpoints, or None.
    """

    def __init__(self, app: ASGIApp, api_key: str | None, admin_key: str | None) -> None:
        self.app = app
        self._digests: dict[str, tuple[bytes, ...] | None] = {}
        for access in ACCESS_CLASSES:
            keys = accepted_keys(access, api_key, admin_key)
            self._digests[access] = (
                None if keys is None else tuple(_digest(k.encode()) for k in keys)
            )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            digests = self._digests[access_class(scope.get("path", ""))]
            if digests is not None and not key_matches(
                bearer_token(scope.get("headers") or []), digests
            ):
                await _unauthorized(send)
                return
        await self.app(scope, receive, send)


async def _unauthorized(send: Send) -> None:
    body = json.dumps(
        {
            "error": {
                "message": UNAUTHORIZED_MESSAGE,
                "type": "invalid_request_error",
                "param": None,
                "code": "invalid_api_key",
            },
            "object": "error",
        }
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 401,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"www-authenticate", b"Bearer"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def guard(app: ASGIApp, api_key: str | None, admin_key: str | None, port: int) -> ASGIApp:
    """``app`` behind :class:`APIKeyMiddleware`; logs a warning for each key not configured."""
    if not api_key:
        logger.warning(
            "no --api-key (or SHARDLINE_API_KEY): the serving endpoints on port %d are open to "
            "anyone who can reach it",
            port,
        )
    if not admin_key and not api_key:
        logger.warning(
            "no --admin-api-key (or SHARDLINE_ADMIN_API_KEY): the control endpoints on port %d "
            "(weight updates, cache flush, aborts, ...) are open to anyone who can reach it",
            port,
        )
    return APIKeyMiddleware(app, api_key, admin_key)
