"""Compact pickling of the messages sent every step (``BatchTokenOut`` and what it holds).

A frozen slots dataclass pickles through ``dataclasses``' ``__getstate__`` / ``__setstate__``,
which list the fields (``dataclasses.fields``) and set each through ``object.__setattr__`` on
every message, in Python. The scheduler pickles one ``BatchTokenOut`` per step and the HTTP
process unpickles it, so at batch 1 that was a visible part of the host time of a step.
:func:`compact_pickle` gives such a class a ``__reduce__`` that sends its field values as one
tuple (read by one ``operator.attrgetter`` call) and rebuilds the object from it. The pickled
form stays a plain pickle (ZMQ's ``send_pyobj`` / ``recv_pyobj``); the rebuilt object equals the
original.
"""

from __future__ import annotations

import operator
from dataclasses import fields
from typing import Any

_FIELDS: dict[type, tuple[str, ...]] = {}


def compact_pickle(*classes: type) -> None:
    """Give each dataclass of ``classes`` the compact ``__reduce__`` (module docstring)."""
    for cls in classes:
        names = tuple(f.name for f in fields(cls))
        _FIELDS[cls] = names
        get = operator.attrgetter(*names)
        if len(names) == 1:
            cls.__reduce__ = _single_reducer(cls, get)  # type: ignore[method-assign]
        else:
            cls.__reduce__ = _reducer(cls, get)  # type: ignore[method-assign]


def _reducer(cls: type, get: Any) -> Any:
    def __reduce__(self: Any) -> tuple[Any, ...]:
        return _rebuild, (cls, get(self))

    return __reduce__


def _single_reducer(cls: type, get: Any) -> Any:
    def __reduce__(self: Any) -> tuple[Any, ...]:
        return _rebuild, (cls, (get(self),))

    return __reduce__


def _rebuild(cls: type, values: tuple[Any, ...]) -> Any:
    """The instance of ``cls`` with field values ``values`` (in field order), as unpickled."""
    names = _FIELDS.get(cls)
    if names is None:  # an unpickling process that has not imported the class's module yet
        names = _FIELDS[cls] = tuple(f.name for f in fields(cls))
    obj: Any = object.__new__(cls)
    for name, value in zip(names, values):
        object.__setattr__(obj, name, value)
    return obj
