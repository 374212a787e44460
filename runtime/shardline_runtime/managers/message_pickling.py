"""Compact pickling of the messages sent every step (``BatchTokenOut`` and what it holds).

A frozen slots dataclass pickles through ``dataclasses``' ``__getstate__`` / ``__setstate__``,
which list the fields (``dataclasses.fields``) and set each through ``object.__setattr__`` on
every message, in Python. The scheduler pickles one ``BatchTokenOut`` per step and the HTTP
process unpickles it, so at batch 1 that was a visible part of the host time of a step.
:func:`compact_pickle` gives such a class a ``__reduce__`` that sends its field values as one
tuple (read by one ``operator.attrgetter`` call) and rebuilds the object from it. The pickled
form stays a plain pickle (ZMQ's ``send_pyobj`` / ``recv_pyobj``); the rebuilt object equals the
original.

:func:`compact_step_pickle` goes further for the per-step ``BatchTokenOut``: a request's
``TokenOut`` that carries only ids and usage (a running request without logprobs, the common
case) travels as a tuple of five plain values, so the whole message pickles with one
``__reduce__`` call and one global (the rebuild function) instead of three of each per request
(``pickle`` looks every global up by module and name on both sides). Other ``TokenOut`` (a
finish, logprobs, an embedding) travel as they are.
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


# The fields :func:`_rebuild_step` sets by hand: a field added to one of these classes would be
# left unset on the compact path, so :func:`compact_step_pickle` refuses any other set.
STEP_FIELDS: dict[str, frozenset[str]] = {
    "batch": frozenset({"outs"}),
    "out": frozenset({"rid", "ids", "usage", "logprobs", "prompt_logprobs", "finish", "embedding"}),
    "usage": frozenset({"prompt_tokens", "completion_tokens", "cached_tokens"}),
}


def check_step_fields(cls: type, expected: frozenset[str]) -> None:
    """Raise ``TypeError`` naming the missing and extra fields when the dataclass ``cls``'s
    fields are not exactly ``expected``."""
    actual = {f.name for f in fields(cls)}
    if actual != expected:
        raise TypeError(
            f"compact_step_pickle rebuilds {cls.__name__} with the fields {sorted(expected)}; "
            f"missing {sorted(expected - actual)}, extra {sorted(actual - expected)}: update "
            "message_pickling._rebuild_step, the wire tuple and STEP_FIELDS together"
        )


def compact_step_pickle(batch_cls: type, out_cls: type, usage_cls: type) -> None:
    """Give ``batch_cls`` (``BatchTokenOut``: one field ``outs``, a list of ``out_cls``
    ``TokenOut``) the per-step reduce of the module docstring; ``usage_cls`` is ``Usage``.

    Raises:
        TypeError: a class's fields are not :data:`STEP_FIELDS`' (checked once, at import of
            ``io_struct``), naming the missing and extra ones.
    """
    for cls, key in ((batch_cls, "batch"), (out_cls, "out"), (usage_cls, "usage")):
        check_step_fields(cls, STEP_FIELDS[key])
    _STEP_CLASSES[:] = [batch_cls, out_cls, usage_cls]

    def __reduce__(self: Any) -> tuple[Any, ...]:
        wire = []
        for out in self.outs:
            if (
                out.finish is None
                and not out.logprobs
                and out.prompt_logprobs is None
                and out.embedding is None
            ):
                u = out.usage
                wire.append(
                    (out.rid, out.ids, u.prompt_tokens, u.completion_tokens, u.cached_tokens)
                )
            else:
                wire.append(out)
        return _rebuild_step, (wire,)

    batch_cls.__reduce__ = __reduce__  # type: ignore[method-assign,assignment]


_STEP_CLASSES: list[type] = []


def _rebuild_step(wire: list[Any]) -> Any:
    """The ``BatchTokenOut`` of a :func:`compact_step_pickle` wire list, as unpickled."""
    if not _STEP_CLASSES:  # an unpickling process that has not imported io_struct yet
        import shardline_runtime.managers.io_struct  # noqa: F401  (registers the classes)
    batch_cls, out_cls, usage_cls = _STEP_CLASSES
    new, set_ = object.__new__, object.__setattr__
    outs = []
    for item in wire:
        if type(item) is tuple:
            rid, ids, prompt, completion, cached = item
            usage: Any = new(usage_cls)
            set_(usage, "prompt_tokens", prompt)
            set_(usage, "completion_tokens", completion)
            set_(usage, "cached_tokens", cached)
            item = new(out_cls)
            for name, value in (
                ("rid", rid),
                ("ids", ids),
                ("usage", usage),
                ("logprobs", []),
                ("prompt_logprobs", None),
                ("finish", None),
                ("embedding", None),
            ):
                set_(item, name, value)
        outs.append(item)
    batch: Any = new(batch_cls)
    set_(batch, "outs", outs)
    return batch
