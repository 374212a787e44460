"""Steady traffic through the real EPP, as a gateway sends it, and the leaders' routing labels
over time: what ``tests/e2e/test_routing_e2e.py`` needs to show a rollout behind a gateway.

:class:`EppTraffic` sends open-loop chat requests at ``rate`` per second: each is picked by the
EPP over its ext-proc stream (:class:`hack.gie.ext_proc.EppClient`), sent to the picked leader
and its response reported back, as Envoy does. :class:`RoutableTimeline` polls the leaders'
``shardline.dev/routable`` labels, so each pick can be compared with what the label said then.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import httpx

from hack.gie.ext_proc import EppClient, PickRefused
from shardline_operator import labels


@dataclass
class GatewaySample:
    """One request: when the EPP picked (``time.monotonic()``), the endpoint it picked
    (``"ip:port"``, "" when refused), the HTTP status (0: refused or a transport error), the
    revision the body names, the seconds from the pick request to the full answer, an error."""

    picked_at: float
    endpoint: str
    status: int
    revision: str | None
    seconds: float
    error: str = ""


@dataclass
class EppTraffic:
    """Open-loop requests through the EPP at ``target`` (``"host:port"``) for model ``model``;
    ``samples`` fill in as answers come. A context manager: traffic runs while inside."""

    target: str
    model: str
    rate: float = 4.0
    max_tokens: int = 4
    samples: list[GatewaySample] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def __enter__(self) -> EppTraffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(180)

    async def _one(self, client: EppClient, http: httpx.AsyncClient, i: int) -> None:
        body = {"model": self.model, "max_tokens": self.max_tokens, "temperature": 0,
                "messages": [{"role": "user", "content": f"Request {i}: say hello."}]}
        started = time.monotonic()
        try:
            pick = await client.pick("/v1/chat/completions", body)
        except PickRefused as exc:
            self.samples.append(GatewaySample(started, "", 0, None, time.monotonic() - started, str(exc)))
            return
        try:
            resp = await http.post(f"http://{pick.endpoint}/v1/chat/completions", json=body)
            await pick.finish(resp.status_code, resp.content, "application/json")
        except (httpx.HTTPError, OSError) as exc:
            self.samples.append(GatewaySample(started, pick.endpoint, 0, None, time.monotonic() - started,
                                              f"{exc.__class__.__name__}: {exc}"))
            return
        ok = resp.status_code == 200
        revision = (resp.json().get("metadata") or {}).get("revision") if ok else None
        self.samples.append(GatewaySample(started, pick.endpoint, resp.status_code, revision,
                                          time.monotonic() - started, "" if ok else resp.text[:300]))

    async def _run(self) -> None:
        client = EppClient(self.target)
        tasks: list[asyncio.Task] = []
        try:
            async with httpx.AsyncClient(timeout=120) as http:
                next_at, i = time.monotonic(), 0
                while not self._stop.is_set():
                    tasks.append(asyncio.create_task(self._one(client, http, i)))
                    i += 1
                    next_at += 1.0 / self.rate
                    await asyncio.sleep(max(0.0, next_at - time.monotonic()))
                await asyncio.gather(*tasks)
        finally:
            await client.close()


@dataclass
class RoutableTimeline:
    """Polls (every ``period`` seconds) the routable label of the leaders of deployment ``name``
    in ``namespace``; ``changes`` lists ``(time.monotonic(), "podIP:8000", label value)`` each
    time a leader's value changes (the first poll records every leader)."""

    client: object
    namespace: str
    name: str
    period: float = 0.05
    changes: list[tuple[float, str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._last: dict[str, str] = {}

    def __enter__(self) -> RoutableTimeline:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _poll(self) -> None:
        selector = f"{labels.LABEL_DEPLOYMENT}={self.name},apps.kubernetes.io/pod-index=0"
        while not self._stop.is_set():
            pods = self.client.get(f"/api/v1/namespaces/{self.namespace}/pods",  # type: ignore[attr-defined]
                                   params={"labelSelector": selector})["items"]
            now = time.monotonic()
            for pod in pods:
                ip = pod.get("status", {}).get("podIP")
                if not ip:
                    continue
                endpoint = f"{ip}:{labels.HTTP_PORT}"
                value = pod["metadata"].get("labels", {}).get(labels.LABEL_ROUTABLE, "")
                if self._last.get(endpoint) != value:
                    self._last[endpoint] = value
                    self.changes.append((now, endpoint, value))
            self._stop.wait(self.period)

    def out_for(self, endpoint: str, at: float) -> float:
        """How long ``endpoint`` had been labelled not routable at ``at`` (seconds; 0 while it
        was routable or before its first poll)."""
        since = 0.0
        for t, ep, value in self.changes:
            if t > at:
                break
            if ep == endpoint:
                since = t if value == "false" else 0.0
        return at - since if since else 0.0

    def windows(self, endpoint: str) -> list[tuple[float, float]]:
        """``(start, end)`` of each span ``endpoint`` was labelled not routable (end: inf when
        it still is)."""
        out, start = [], None
        for t, ep, value in self.changes:
            if ep != endpoint:
                continue
            if value == "false" and start is None:
                start = t
            elif value != "false" and start is not None:
                out.append((start, t))
                start = None
        if start is not None:
            out.append((start, float("inf")))
        return out
