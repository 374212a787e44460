"""OpenAI-style error objects, for plain responses and for streams that fail after their headers.

The error object is OpenAI's ``{"error": {"message", "type", "param", "code"}}``; ``"object":
"error"`` is added as vLLM and SGLang do. Once a stream's ``200`` and headers are out, a failure
can no longer change the status: it is sent as one ``data:`` event carrying the same error
object, then ``data: [DONE]`` (what vLLM's and SGLang's OpenAI servers send), so a client sees why
the stream ended instead of an incomplete chunked read.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse

from shardline_runtime.managers.admission_gate import ServerNotReadyError
from shardline_runtime.managers.request_validation import RequestValidationError

logger = logging.getLogger(__name__)

_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 503: "service_unavailable"}


def error_body(
    status: int, message: str, param: str | None = None, err_type: str | None = None
) -> dict:
    """The error object for HTTP ``status`` (int); ``err_type`` defaults by status class."""
    if err_type is None:
        err_type = _ERROR_TYPES.get(
            status, "invalid_request_error" if status < 500 else "server_error"
        )
    return {
        "error": {"message": message, "type": err_type, "param": param, "code": status},
        "object": "error",
    }


def error_response(
    status: int, message: str, param: str | None = None, err_type: str | None = None
) -> JSONResponse:
    """An OpenAI-style error response with HTTP ``status``."""
    return JSONResponse(error_body(status, message, param, err_type), status_code=status)


def exception_body(exc: BaseException) -> dict:
    """The error object for an exception raised while serving: 400 for ``RequestValidationError``
    (with its ``param``), 503 for ``ServerNotReadyError``, else 500 naming the exception type."""
    if isinstance(exc, RequestValidationError):
        return error_body(400, str(exc), exc.param)
    if isinstance(exc, ServerNotReadyError):
        return error_body(503, str(exc))
    return error_body(500, f"internal error: {type(exc).__name__}: {exc}")


async def guard_stream(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Pass ``events`` (SSE lines) through; if they raise, end with an error event and
    ``data: [DONE]`` instead of cutting the connection. Cancellation (client gone) still
    propagates, so the request is aborted as before."""
    try:
        async for line in events:
            yield line
    except Exception as exc:  # noqa: BLE001 - every failure after the headers becomes an event
        if not isinstance(exc, (RequestValidationError, ServerNotReadyError)):
            logger.exception("stream failed after its headers were sent")
        yield f"data: {json.dumps(exception_body(exc), ensure_ascii=False)}\n\n"
        yield "data: [DONE]\n\n"
