"""LoRA adapter load/unload between the HTTP process and the schedulers.

Messages (HTTP -> rank-0 scheduler, broadcast to every rank; replies from rank 0 only):
``LoadLoRAAdapterReqInput`` / ``UnloadLoRAAdapterReqInput`` -> ``LoRAAdapterReqOutput``.

Every rank's scheduler runs the same operations in the same order, so each rank's
``LoRAManager`` holds the same adapters in the same slots. A load runs at once (evicting an
unused adapter when the pool is full). An unload waits until no queued or running request
uses the adapter (the HTTP process stops admitting requests for it as soon as it sends the
unload), so requests already accepted finish on the adapter they asked for.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from shardline_runtime.lora.lora_config import LoRAAdapterError, LoRAPoolFullError
from shardline_runtime.managers.req import Req

logger = logging.getLogger(__name__)


@dataclass
class LoadLoRAAdapterReqInput:
    lora_name: str
    lora_path: str


@dataclass
class UnloadLoRAAdapterReqInput:
    lora_name: str


@dataclass
class LoRAAdapterReqOutput:
    """``status_code``: 200, 400 (bad adapter or name) or 503 (pool full of adapters in use).
    ``loaded``: ``{name: path}`` after the operation."""

    success: bool
    message: str
    status_code: int = 200
    param: str | None = None
    loaded: dict[str, str] = field(default_factory=dict)


class LoRAControl:
    """The scheduler's side of adapter load/unload (one per rank).

    Args:
        manager: the runner's ``LoRAManager`` (adapter slots).
        requests: every queued, chunked or running request (their adapters are in use).
        send: rank 0's sender of replies (a no-op on other ranks).
    """

    def __init__(
        self,
        manager: Any,
        requests: Callable[[], Iterable[Req]],
        send: Callable[[Any], None],
    ):
        self.manager = manager
        self.requests = requests
        self.send = send
        self.pending_unloads: list[UnloadLoRAAdapterReqInput] = []

    def handlers(self) -> dict[type, Callable[[Any], None]]:
        """This part's entries of the scheduler's message table."""
        return {LoadLoRAAdapterReqInput: self.handle, UnloadLoRAAdapterReqInput: self.handle}

    def names_in_use(self) -> set[str]:
        """Adapters of queued, chunked or running requests."""
        return {r.lora_name for r in self.requests() if r.lora_name is not None}

    def is_loaded(self, name: str) -> bool:
        """``name`` holds a slot and no unload of it is pending."""
        return name in self.manager.adapters and all(
            m.lora_name != name for m in self.pending_unloads
        )

    def loaded(self) -> dict[str, str]:
        return {a["name"]: a["path"] for a in self.manager.loaded()}

    def handle(self, msg: Any) -> None:
        if isinstance(msg, LoadLoRAAdapterReqInput):
            self.send(self.load(msg))
        else:
            self.pending_unloads.append(msg)
            self.poll()

    def load(self, msg: LoadLoRAAdapterReqInput) -> LoRAAdapterReqOutput:
        try:
            adapter = self.manager.load_adapter(msg.lora_name, msg.lora_path, self.names_in_use())
        except LoRAAdapterError as e:
            return LoRAAdapterReqOutput(False, str(e), 400, e.param, self.loaded())
        except LoRAPoolFullError as e:
            return LoRAAdapterReqOutput(False, str(e), 503, None, self.loaded())
        return LoRAAdapterReqOutput(
            True,
            f"loaded {adapter.name!r} (r={adapter.rank}) into slot {adapter.slot}",
            loaded=self.loaded(),
        )

    def poll(self) -> None:
        """Run the unloads whose adapter no request uses any more (each loop iteration)."""
        if not self.pending_unloads:
            return
        in_use = self.names_in_use()
        keep = []
        for msg in self.pending_unloads:
            if msg.lora_name in in_use:
                keep.append(msg)
                continue
            try:
                self.manager.unload_adapter(msg.lora_name)
                out = LoRAAdapterReqOutput(
                    True, f"unloaded {msg.lora_name!r}", loaded=self.loaded()
                )
            except LoRAAdapterError as e:
                out = LoRAAdapterReqOutput(False, str(e), 400, e.param, self.loaded())
            self.send(out)
        self.pending_unloads = keep
