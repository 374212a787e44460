"""The HTTP process's SIGTERM drain: go unready, keep serving while clients still arrive and
requests run, then exit.

Kubernetes removes a deleted pod from its Service's endpoints while the pod's ``preStop`` sleep
runs, but kube-proxy, gateways and clients that read EndpointSlices or poll ``/ready`` learn it
with a lag that grows with the API server's latency; a pod that stops accepting at SIGTERM
refuses whoever has not learned yet (the reason for Kubernetes' documented pre-stop delay, and
for Envoy's drain time). So after SIGTERM:

1. ``/ready`` answers 503 at once, and a disk weight update still staging is aborted (the pod
   goes away; requests it holds run on the weights that serve);
2. **accepting**: the listener stays open and new requests are served as before while requests
   are in flight or clients still arrive, i.e. until nothing is in flight and no serving request
   (``/v1/*``, ``/generate``; :func:`~shardline_runtime.entrypoints.auth.access_class`
   ``serving``) has arrived for :data:`QUIET_SECONDS`, counted from SIGTERM at the earliest:
   routing has moved away (a client that polls ``/ready`` gets that long to see the 503 even when
   nothing ran before the signal). Probes and info reads (``/health``, ``/ready``,
   ``/get_server_info``, ``/metrics``) never hold it open;
3. the server exits: the listener closes (a later client gets *connection refused*, which it may
   retry on another replica: the request never reached this one). At ``--drain-timeout`` seconds
   after SIGTERM whatever still runs is ended with ``finish_reason: "abort"`` and new requests
   are refused with 503 first, so the pod exits inside its ``terminationGracePeriodSeconds``
   (the operator renders preStop + drain timeout + margin).
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

from shardline_runtime.entrypoints.auth import access_class

QUIET_SECONDS = 2.0  # no serving request for this long after SIGTERM: routing has moved away

Scope = dict[str, Any]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]


class DrainStep(enum.Enum):
    """What the drain does next (:func:`drain_step`)."""

    ACCEPT = "accept"  # keep serving and accepting: requests run or clients still arrive
    DONE = "done"  # nothing runs and routing has moved away: exit
    TIMEOUT = "timeout"  # --drain-timeout reached: abort what runs, then exit


def drain_step(now: float, quiet_since: float, in_flight: int, deadline: float) -> DrainStep:
    """The next drain step (times in seconds on one monotonic clock).

    Args:
        now: the time now.
        quiet_since: the later of SIGTERM and the last serving request's arrival.
        in_flight: requests that reached the server and are not answered yet.
        deadline: SIGTERM + ``--drain-timeout``.
    """
    if now >= deadline:
        return DrainStep.TIMEOUT
    if in_flight == 0 and now - quiet_since >= QUIET_SECONDS:
        return DrainStep.DONE
    return DrainStep.ACCEPT


class RequestTracker:
    """ASGI wrapper counting the HTTP requests in progress and when the last serving one arrived.

    ``in_progress``: requests from their arrival until the app returned (a streamed response
    until its last chunk), probes and info reads (``open`` / ``info`` access classes) left out;
    ``last_arrival``: ``clock()`` at the last ``serving`` request (``-inf`` before the first).
    """

    def __init__(self, app: ASGIApp, clock: Callable[[], float] = time.monotonic):
        self.app = app
        self.clock = clock
        self.in_progress = 0
        self.last_arrival = -math.inf

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        kind = access_class(scope.get("path", "/"))
        if kind in ("open", "info"):
            await self.app(scope, receive, send)
            return
        if kind == "serving":
            self.last_arrival = self.clock()
        self.in_progress += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_progress -= 1
