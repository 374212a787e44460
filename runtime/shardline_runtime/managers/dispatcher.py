"""One table from message type to handler (after SGLang's ``TypeBasedDispatcher``).

The scheduler routes every message it receives (requests, aborts, flush, weight sync, LoRA,
expert control) through one :class:`TypeBasedDispatcher`; each part contributes the entries for
the messages it owns, so adding a message is one line where its handler lives.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

Handler = Callable[[Any], None]


class TypeBasedDispatcher:
    """Calls the handler registered for a message's type.

    Args:
        handlers: message type -> handler (called with the message). A subclass of a
            registered type uses its nearest registered base.

    Raises:
        ValueError: two parts registered the same type (see :meth:`merge`).
    """

    def __init__(self, handlers: Mapping[type, Handler]):
        self.handlers: dict[type, Handler] = dict(handlers)

    @classmethod
    def merge(cls, *tables: Mapping[type, Handler]) -> TypeBasedDispatcher:
        """One dispatcher over several parts' tables; a type may appear in one table only."""
        merged: dict[type, Handler] = {}
        for table in tables:
            for msg_type, handler in table.items():
                if msg_type in merged:
                    raise ValueError(f"two handlers for {msg_type.__name__}")
                merged[msg_type] = handler
        return cls(merged)

    def handles(self, msg: Any) -> bool:
        """True when some handler takes ``msg``."""
        return self._find(type(msg)) is not None

    def __call__(self, msg: Any) -> bool:
        """Run ``msg``'s handler; False (nothing run) when no handler takes its type."""
        handler = self._find(type(msg))
        if handler is None:
            return False
        handler(msg)
        return True

    def _find(self, msg_type: type) -> Handler | None:
        for base in msg_type.__mro__:
            handler = self.handlers.get(base)
            if handler is not None:
                return handler
        return None
