"""Request fields that constrain the output -> one :class:`GrammarSpec` (or None: free text).

- OpenAI ``response_format``: ``{"type": "text"}`` (free), ``{"type": "json_object"}`` (any JSON
  object), ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"?}}``. ``strict``
  true or absent: no property or item beyond the schema's (OpenAI's strict mode; vLLM's and
  SGLang's only behaviour); false: JSON Schema's own default, where an object without
  ``"additionalProperties": false`` may carry more properties.
- ``regex`` and ``ebnf`` as extra body fields (as SGLang accepts them; vLLM reads the same from
  ``structured_outputs``), and in ``/generate``'s ``sampling_params`` SGLang's ``json_schema``,
  ``regex`` and ``ebnf``.

At most one constraint per request; two are a 400 naming the second. The spec is compiled here
(``RequestValidator.check_grammar``), so a schema the library rejects is a 400 naming the field.
"""

from __future__ import annotations

import json
from typing import Any

from shardline_runtime.constrained.grammar_spec import GrammarSpec
from shardline_runtime.entrypoints.json_depth import check_depth
from shardline_runtime.managers.request_validation import RequestValidationError

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


def _schema_text(schema: Any, param: str) -> str:
    if isinstance(schema, str):
        check_depth(schema, param)
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise RequestValidationError(f"{param}: not valid JSON: {exc}", param) from None
    if not isinstance(schema, (dict, bool)):
        raise RequestValidationError(f"{param}: a JSON Schema must be an object", param)
    check_enforceable(schema, "schema", param)
    return json.dumps(schema)


def check_enforceable(schema: Any, where: str, param: str) -> None:
    """Refuse a schema using a keyword the grammar backend would not enforce.

    Args:
        schema: the parsed JSON Schema.
        where: its path in messages (``schema``, ``tools[0].function.parameters``).
        param: the request field named by the 400.

    Raises:
        RequestValidationError: ``"{param}: {path of the keyword}: {why}"`` (the path alone
            when it starts with ``param``).
    """
    found = _unenforced_keyword(schema, where)
    if found is not None:
        path, why = found
        prefix = "" if path.startswith(param) else f"{param}: "
        raise RequestValidationError(f"{prefix}{path}: {why}", param)


# JSON Schema keywords the grammar library (xgrammar 0.2) accepts but does not enforce: a schema
# using them would be a 200 whose output may break it, so they are refused (vLLM refuses the
# same ones for xgrammar, ``has_xgrammar_unsupported_json_features``).
UNENFORCED_KEYWORDS = ("if", "then", "else", "not", "dependentRequired", "dependentSchemas")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "contains", "propertyNames", "additionalItems")


def _unenforced_keyword(schema: Any, where: str) -> tuple[str, str] | None:
    """(path, why) of the first keyword in ``schema`` (or a subschema) that would not be
    enforced, or None. Walks subschemas only (property names and ``enum`` values are data)."""
    if not isinstance(schema, dict):
        return None
    for key in UNENFORCED_KEYWORDS:
        if key in schema:
            return f"{where}.{key}", (
                f"the JSON Schema keyword {key!r} is not enforced by the grammar backend; "
                f"unsupported keywords: {list(UNENFORCED_KEYWORDS)}"
            )
    ref = schema.get("$ref")
    if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
        return f"{where}.$ref", f"only local references ('#' or '#/...') are served, got {ref!r}"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return f"{where}.allOf", "allOf with more than one subschema is not enforced; merge them"
    children: list[tuple[str, Any]] = []
    for key in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            children += [(f"{where}.{key}.{name}", sub) for name, sub in schema[key].items()]
    for key in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            children += [(f"{where}.{key}.{i}", sub) for i, sub in enumerate(schema[key])]
    for key in _SUBSCHEMAS:
        sub = schema.get(key)
        subs = enumerate(sub) if isinstance(sub, list) else [(None, sub)]
        children += [(f"{where}.{key}" + ("" if i is None else f".{i}"), s) for i, s in subs]
    for path, sub in children:
        found = _unenforced_keyword(sub, path)
        if found is not None:
            return found
    return None


def response_format_spec(response_format: dict[str, Any] | None) -> GrammarSpec | None:
    """The spec of an OpenAI ``response_format`` (None for absent or ``text``).

    Raises:
        RequestValidationError: an unknown ``type``, or ``json_schema`` without a schema.
    """
    if response_format is None:
        return None
    kind = response_format.get("type", "text")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise RequestValidationError(
            f"response_format.type must be one of {list(RESPONSE_FORMAT_TYPES)}, got {kind!r}",
            "response_format",
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", param="response_format")
    body = response_format.get("json_schema")
    if not isinstance(body, dict) or "schema" not in body:
        raise RequestValidationError(
            'response_format: type "json_schema" needs {"json_schema": {"name": ..., '
            '"schema": {...}}}',
            "response_format",
        )
    strict = body.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise RequestValidationError(
            f"response_format.json_schema.strict must be a boolean, got {strict!r}",
            "response_format",
        )
    source = _schema_text(body["schema"], "response_format")
    return GrammarSpec("json_schema", source, strict=strict is not False, param="response_format")


def request_grammar(req: Any) -> GrammarSpec | None:
    """The one constraint of an OpenAI request (chat or completions), or None.

    Raises:
        RequestValidationError: a malformed field, or more than one constraint.
    """
    specs: list[GrammarSpec] = []
    rf = response_format_spec(getattr(req, "response_format", None))
    if rf is not None:
        specs.append(rf)
    for kind in ("regex", "ebnf"):
        value = getattr(req, kind, None)
        if value is not None:
            specs.append(GrammarSpec(kind, _text((kind, value)), param=kind))
    return _one(specs)


def sampling_params_grammar(values: dict[str, Any]) -> GrammarSpec | None:
    """Pop SGLang's ``json_schema`` / ``regex`` / ``ebnf`` from ``/generate``'s
    ``sampling_params`` (in place) and return the one constraint, or None.

    Raises:
        RequestValidationError: a malformed value, or more than one constraint.
    """
    specs: list[GrammarSpec] = []
    for key in ("json_schema", "regex", "ebnf"):
        value = values.pop(key, None)
        if value is None:
            continue
        param = f"sampling_params.{key}"
        if key == "json_schema":
            specs.append(GrammarSpec("json_schema", _schema_text(value, param), param=param))
        else:
            specs.append(GrammarSpec(key, _text((param, value)), param=param))
    return _one(specs)


def _text(item: tuple[str, Any]) -> str:
    name, value = item
    if not isinstance(value, str) or not value:
        raise RequestValidationError(f"{name} must be a non-empty string", name)
    return value


def _one(specs: list[GrammarSpec]) -> GrammarSpec | None:
    if len(specs) > 1:
        raise RequestValidationError(
            f"{specs[1].param}: only one output constraint per request; "
            f"{specs[0].param} is set too",
            specs[1].param,
        )
    return specs[0] if specs else None
