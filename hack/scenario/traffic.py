"""Client traffic for rollouts: completions at a fixed rate, round-robin over the group leaders
that are Ready and not terminating (what EndpointSlices offer; client-side, since the local
cluster has no kube-proxy), a fresh connection per request. Used by tests/e2e and bench/rollout.py.
"""
from __future__ import annotations

import threading
import time

import httpx

RATE = 4.0  # requests per second



def ready_pod_ips(pods: dict | None) -> list[str]:
    """Sorted pod IPs of the Ready pods in a pod list (the API's ``PodList``), leaving out
    pods being deleted and pods without an IP yet."""
    ready = []
    for pod in (pods or {}).get("items", []):
        conditions = {c["type"]: c["status"] for c in pod.get("status", {}).get("conditions") or []}
        if conditions.get("Ready") == "True" and not pod["metadata"].get("deletionTimestamp") \
                and pod.get("status", {}).get("podIP"):
            ready.append(pod["status"]["podIP"])
    return sorted(ready)

class Traffic:
    """Open-loop client over the Ready, non-terminating leaders; counts what failed."""

    def __init__(self, client, namespace: str, name: str, model: str, rate: float = RATE,
                 timeout: float = 120.0):
        self.client, self.namespace, self.name, self.model, self.rate = client, namespace, name, model, rate
        self.timeout = timeout  # seconds per request
        self.leaders: list[str] = []
        self.sent = 0
        self.failures: list[str] = []
        self.records: list[tuple[float, str, float, bool]] = []  # (sent at, leader IP, seconds, ok)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._watch, daemon=True),
                         threading.Thread(target=self._send, daemon=True)]

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                pods = self.client.get(f"/api/v1/namespaces/{self.namespace}/pods",
                                       params={"labelSelector": f"shardline.dev/deployment={self.name},"
                                                                "apps.kubernetes.io/pod-index=0"})
            except httpx.HTTPError:  # an API server slow under load: keep the last list, ask again
                time.sleep(0.1)
                continue
            self.leaders = ready_pod_ips(pods)
            time.sleep(0.1)

    def _one(self, ip: str) -> None:
        sent, ok = time.monotonic(), False
        try:
            r = httpx.post(f"http://{ip}:8000/v1/completions", timeout=self.timeout,
                           json={"model": self.model, "prompt": "Hello", "max_tokens": 4})
            ok = r.status_code == 200
            if not ok:
                self.failures.append(f"{ip}: HTTP {r.status_code} {r.text[:200]}")
        except httpx.HTTPError as exc:
            self.failures.append(f"{ip}: {exc.__class__.__name__}: {exc}")
        self.records.append((sent, ip, time.monotonic() - sent, ok))

    def _send(self) -> None:
        turn, next_at = 0, time.monotonic()
        while not self._stop.is_set():
            leaders = self.leaders
            if leaders:
                threading.Thread(target=self._one, args=(leaders[turn % len(leaders)],), daemon=True).start()
                self.sent += 1
                turn += 1
            next_at += 1.0 / self.rate
            time.sleep(max(0.0, next_at - time.monotonic()))

    def __enter__(self) -> "Traffic":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        time.sleep(1.0)
        self._stop.set()
        for t in self._threads:
            t.join(10)
        time.sleep(2.0)  # let the last requests answer
