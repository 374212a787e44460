"""Clients that route as a Service does (the local cluster with the node agent has no
kube-proxy): to the Ready pods the Service's selector matches, read from the API at every
request. One pins a revision (an RL loop's sampler), one goes through the deployment's client
Service. Used by tests/e2e/test_routing_e2e.py.

The pinned client follows the recipe of docs/operations.md ("Behind a gateway"): it sends to
the per-revision Service ``<name>-rev-<revision>`` with ``X-Shardline-Revision``; once that
Service lists no endpoint (or is gone), it asks the client Service with the same header, and a
server of another revision answers 503 naming the pinned one.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import httpx

from hack.localcluster.rest import ApiError
from hack.scenario.traffic import ready_pod_ips

REVISION_HEADER = "X-Shardline-Revision"


def ready_addresses(client, namespace: str, service: str) -> list[str]:
    """Addresses ``service`` routes to, sorted: the Ready, non-terminating pods its selector
    matches (the EndpointSlice controller's rule). Resolved here because the node agent gives
    pods loopback addresses, which EndpointSlices may not carry. [] when the Service is gone."""
    try:
        selector = client.get(f"/api/v1/namespaces/{namespace}/services/{service}")["spec"]["selector"]
    except ApiError as exc:
        if exc.status == 404:
            return []
        raise
    query = ",".join(f"{k}={v}" for k, v in sorted(selector.items()))
    pods = client.get(f"/api/v1/namespaces/{namespace}/pods", params={"labelSelector": query})
    return ready_pod_ips(pods)


@dataclass
class Sample:
    """One answer: the Service it went through, HTTP status, the revision the body and the
    header name (None when absent), the error message of a non-200, and the seconds it took."""

    service: str
    status: int
    body_revision: str | None
    header_revision: str | None
    message: str
    seconds: float


@dataclass
class ServiceClient:
    """Open-loop ``/generate`` requests at ``rate`` per second through ``service`` (with a
    ``pin``: through ``<name>-rev-<pin>``, falling back to ``fallback`` when it has no
    endpoint). ``samples`` and ``errors`` (transport failures) are filled as answers come."""

    client: object
    namespace: str
    service: str
    pin: str | None = None
    fallback: str | None = None
    rate: float = 3.0
    samples: list[Sample] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def __post_init__(self):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._send, daemon=True)

    def __enter__(self) -> ServiceClient:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)
        time.sleep(2)  # let the last answers land

    def _target(self) -> tuple[str, str] | None:
        for service in (self.service, self.fallback):
            if service is None:
                continue
            addresses = ready_addresses(self.client, self.namespace, service)
            if addresses:
                return service, addresses[int(time.monotonic() * 1000) % len(addresses)]
        return None

    def _one(self, service: str, ip: str) -> None:
        headers = {REVISION_HEADER: self.pin} if self.pin else {}
        body = {"text": "Hello", "sampling_params": {"max_new_tokens": 4}}
        started = time.monotonic()
        try:
            r = httpx.post(f"http://{ip}:8000/generate", json=body, headers=headers, timeout=120)
        except httpx.HTTPError as exc:
            self.errors.append(f"{service} {ip}: {exc.__class__.__name__}: {exc}")
            return
        ok = r.status_code == 200
        payload = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
        self.samples.append(Sample(
            service, r.status_code,
            (payload.get("meta_info") or {}).get("revision") if ok else None,
            r.headers.get(REVISION_HEADER),
            "" if ok else (payload.get("error") or {}).get("message", r.text[:200]),
            time.monotonic() - started))

    def _send(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            target = self._target()
            if target is not None:
                threading.Thread(target=self._one, args=target, daemon=True).start()
            next_at += 1.0 / self.rate
            self._stop.wait(max(0.0, next_at - time.monotonic()))
