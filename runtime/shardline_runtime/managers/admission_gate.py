"""AdmissionGate: when a new request may be sent to the schedulers (hold, pause, drain).

One small state machine in the HTTP process, owning its ``asyncio.Event``s:

- **serving** / **updating**: a weight update runs while the served :class:`WeightsState`'s
  phase is ``updating`` (``/update_weights_from_disk`` also marks it at once, before the
  schedulers report). New requests are *held* meanwhile, as SGLang's ``TokenizerManager`` does,
  so they run on the new weights; one held longer than ``--weight-update-hold-timeout`` gets a
  503 with ``Retry-After`` (:class:`WeightUpdateHoldTimeout`). A disk update with
  ``admit_seconds`` opens an **admission window** first (:meth:`AdmissionGate.open_window`):
  requests are admitted as when serving, while the new weights stage, until it closes.
  ``/ready`` is 503 while updating, unless the update was sent with ``keep_ready``.
- **paused** (``/pause_generation``): new requests wait until ``/continue_generation``.
- **draining** (SIGTERM): ``/ready`` is 503 but requests are still served; paused ones are
  released with a 503. **closing** (the drain ended): new requests are refused.
- **blocked**: the schedulers cannot generate (memory released, weights missing): 503.

The hold is bounded across the HTTP process and the scheduler queue together
(``update_hold.HELD_SECONDS`` and ``update_hold.first_chunk``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from shardline_runtime.managers.update_hold import ADMITTED_AT, HELD_SECONDS, first_chunk
from shardline_runtime.weights_state import WeightsPhase


class ServerNotReadyError(RuntimeError):
    """The server cannot take the request now (HTTP 503): loading, updating weights, draining.

    ``retry_after_seconds`` (or None) becomes the ``Retry-After`` header.
    """

    retry_after_seconds: int | None = None


class WeightUpdateHoldTimeout(ServerNotReadyError):
    """A request waited ``--weight-update-hold-timeout`` seconds for a weight update to end."""

    def __init__(self, message: str, retry_after_seconds: int):
        super().__init__(message)
        self.retry_after_seconds = retry_after_seconds


class AdmissionGate:
    """Admission of new requests (see the module docstring).

    Args:
        hold_timeout: seconds a request may be held by weight updates (0: refuse at once).
        metrics: a ``ServingMetrics`` (or None); each hold's wait is observed.
    """

    def __init__(self, hold_timeout: float = 60.0, metrics: Any = None):
        self.hold_timeout = hold_timeout
        self.metrics = metrics
        self.phase = WeightsPhase.SERVING
        self.paused: str | None = None  # pause_generation mode
        self.blocked: str | None = None  # why the schedulers cannot generate, or None
        self.draining = False
        self.closing = False
        self.held = 0  # requests waiting for a weight update to end or for generation to continue
        self.window_open = False  # an update's admission window: not held though it runs
        # the disk update running was sent with keep_ready: /ready stays 200 (requests that
        # still come are held as usual; the caller routed traffic away first)
        self.keep_ready = False
        self._serving = asyncio.Event()  # set unless a weight update runs
        self._serving.set()
        self._updating = asyncio.Event()  # the inverse of _serving (first_chunk waits on both)
        self._unpaused = asyncio.Event()
        self._unpaused.set()

    # ---------------------------------------------------------------- transitions

    def set_phase(self, phase: WeightsPhase) -> None:
        """The weights phase now; requests are held while ``phase.updating``."""
        self.phase = phase
        if phase.updating and not self.window_open:
            self._serving.clear()
            self._updating.set()
        else:
            self._serving.set()
            self._updating.clear()

    def open_window(self) -> None:
        """A disk update began with an admission window: new requests are admitted (on the
        weights serving now) until :meth:`close_window`, whatever phase is reported meanwhile."""
        self.window_open = True
        self.set_phase(self.phase)

    def close_window(self) -> None:
        """The admission window ends while the update runs: requests are held from now on, as
        for an update without a window (``loading`` until the schedulers report a phase)."""
        self.window_open = False
        self.set_phase(self.phase if self.phase.updating else WeightsPhase.LOADING)

    def set_paused(self, mode: str | None) -> None:
        """Generation paused in ``mode`` (None: running); new requests wait while paused."""
        self.paused = mode
        if mode is None or self.draining:
            self._unpaused.set()
        else:
            self._unpaused.clear()

    def start_draining(self) -> None:
        """Shutting down: requests held by ``/pause_generation`` get their 503 now."""
        self.draining = True
        self._unpaused.set()

    # ---------------------------------------------------------------- admission

    def check_ready(self) -> None:
        """Raises ServerNotReadyError once the server takes no new requests (its drain ended,
        or generation is blocked). Draining and weight updates do not refuse: :meth:`admit`
        holds the request instead."""
        if self.closing:
            raise ServerNotReadyError("the server is shutting down")
        if self.blocked:
            raise ServerNotReadyError(self.blocked)

    async def admit(self) -> None:
        """Return once the request may be sent: at once when serving; after the running weight
        update when one runs (the request is held, counted in :attr:`held`, its wait observed);
        then, while generation is paused, after ``/continue_generation``. The time held is kept
        in ``HELD_SECONDS`` for :meth:`first_output`, the moment it passed in ``ADMITTED_AT``.

        Raises:
            ServerNotReadyError: the server is shutting down, or generation is blocked.
            WeightUpdateHoldTimeout: the update outlasted ``hold_timeout`` seconds.
        """
        self.check_ready()
        HELD_SECONDS.set(0.0)
        if not self._serving.is_set():
            started = time.monotonic()
            self.held += 1
            try:
                await asyncio.wait_for(self._serving.wait(), self.hold_timeout)
            except asyncio.TimeoutError:
                raise self.hold_timeout_error() from None
            finally:
                self.held -= 1
                HELD_SECONDS.set(time.monotonic() - started)
                if self.metrics:
                    self.metrics.observe_hold(time.monotonic() - started)
            self.check_ready()
        if self.paused is not None:
            self.held += 1  # counted in /get_server_info's num_held_reqs, as an update's holds
            try:
                await self._unpaused.wait()
            finally:
                self.held -= 1
            if self.paused is not None and self.draining:
                raise ServerNotReadyError("the server is shutting down")
            self.check_ready()
        ADMITTED_AT.set(time.monotonic())

    async def first_output(self, queue: asyncio.Queue) -> Any:
        """The first item of a sent request's ``queue``; the time it waits while an update runs
        counts against what ``hold_timeout`` left after :meth:`admit`.

        Raises:
            WeightUpdateHoldTimeout: held past the bound with nothing in ``queue``.
        """
        try:
            return await first_chunk(
                queue, self._updating, self._serving, self.hold_timeout - HELD_SECONDS.get()
            )
        except asyncio.TimeoutError:
            raise self.hold_timeout_error() from None

    def hold_timeout_error(self) -> WeightUpdateHoldTimeout:
        """The 503 (with ``Retry-After``) for a request held past ``hold_timeout``."""
        return WeightUpdateHoldTimeout(
            f"the server is updating its weights (phase {self.phase.value}) and the request "
            f"waited {self.hold_timeout:g}s (--weight-update-hold-timeout); retry shortly",
            retry_after_seconds=max(1, min(30, round(self.hold_timeout / 4))),
        )
