"""How deep a JSON text nests, found without parsing it (so without recursion).

Python's JSON parser, and every recursive walk over the parsed value (the schema checks, the
grammar rewrites), fail with ``RecursionError`` near 1,000 levels of nesting. A request nested
deeper than :data:`MAX_JSON_DEPTH` is refused before it is parsed, with a 400 naming the
top-level field and the limit, so no deep value ever reaches a recursive function.
"""

from __future__ import annotations

import re

from shardline_runtime.managers.request_validation import RequestValidationError

# Levels of arrays and objects a request body (or a JSON Schema given as a string) may nest.
# Every recursive walk of a request value takes at most one Python frame per level, so 400
# levels stay well inside the interpreter's default limit of 1,000 frames.
MAX_JSON_DEPTH = 400

# A string (with the ':' of an object key after it) or one bracket; text between is skipped.
_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"(\s*:)?|[\[\]{}]')


def too_deep(text: str, limit: int = MAX_JSON_DEPTH) -> tuple[str | None, int] | None:
    """``(top-level key or None, depth)`` of the first place ``text`` nests deeper than
    ``limit`` (the depth counted there is ``limit + 1``), or None. ``text`` need not be valid
    JSON (the parser reports syntax errors itself); strings are skipped whole."""
    depth = 0
    top_key: str | None = None
    for match in _TOKENS.finditer(text):
        token = match.group(0)
        if token[0] == '"':
            if depth == 1 and match.group(1) is not None:
                top_key = token[1 : match.start(1) - match.start(0) - 1]
            continue
        if token in "[{":
            depth += 1
            if depth > limit:
                return top_key, depth
        else:
            depth -= 1
    return None


def check_depth(text: str, where: str | None = None) -> None:
    """Refuse ``text`` nested deeper than :data:`MAX_JSON_DEPTH`.

    Args:
        text: the JSON text (a request body, or a schema sent as a string).
        where: the field ``text`` came from (None: a request body, whose top-level key is named).

    Raises:
        RequestValidationError: naming the field and the limit.
    """
    found = too_deep(text)
    if found is None:
        return
    key, _ = found
    param = where if where is not None else key
    name = param if param is not None else "request body"
    raise RequestValidationError(
        f"{name}: JSON nested more than {MAX_JSON_DEPTH} levels deep (arrays and objects); "
        f"at most {MAX_JSON_DEPTH} levels are accepted",
        param,
    )
