"""Typed readers of one spec field (pure): each checks the type, range or allowed values and
raises :class:`~.spec_types.SpecError` naming the field path and what is allowed."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, overload

from .spec_types import SpecError


def field_value(
    obj: Mapping[str, Any],
    key: str,
    path: str,
    kind: type | tuple[type, ...],
    default: Any = None,
    required: bool = False,
) -> Any:
    value = obj.get(key, default)
    if value is None:
        if required:
            raise SpecError(f"{path}.{key} is required")
        return default
    # bool is an int subclass: never accept True where a number is meant.
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
        raise SpecError(
            f"{path}.{key} must be of type {_type_names(kind)}, got {type(value).__name__} {value!r}"
        )
    return value


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _type_names(kind: type | tuple[type, ...]) -> str:
    names = {
        int: "integer",
        float: "number",
        str: "string",
        bool: "boolean",
        dict: "object",
        list: "array",
    }
    return " or ".join(names.get(k, k.__name__) for k in _as_tuple(kind))


@overload
def int_in(
    obj: Mapping[str, Any],
    key: str,
    path: str,
    default: int,
    low: int,
    high: int,
    required: bool = False,
) -> int: ...
@overload
def int_in(
    obj: Mapping[str, Any],
    key: str,
    path: str,
    default: None,
    low: int,
    high: int,
    required: bool = False,
) -> int | None: ...
def int_in(
    obj: Mapping[str, Any],
    key: str,
    path: str,
    default: int | None,
    low: int,
    high: int,
    required: bool = False,
) -> int | None:
    value = field_value(obj, key, path, int, default, required)
    if value is not None and not low <= value <= high:
        raise SpecError(f"{path}.{key} must be in [{low}, {high}], got {value}")
    return value


def one_of(
    obj: Mapping[str, Any], key: str, path: str, default: str, allowed: tuple[str, ...]
) -> str:
    value = field_value(obj, key, path, str, default)
    if value not in allowed:
        raise SpecError(f"{path}.{key} must be one of {', '.join(allowed)}; got {value!r}")
    return value
