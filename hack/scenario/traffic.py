"""Client traffic for rollouts: completions at a fixed rate, round-robin over the group leaders
that are Ready and not terminating (what EndpointSlices offer; client-side, since the local
cluster has no kube-proxy), a fresh connection per request. Used by tests/e2e and bench/rollout.py.
With ``routable_only`` it sends only to leaders labelled ``shardline.dev/routable: "true"`` too,
as a client of the deployment's Service does (its selector has the label; the operator takes a
leader out of routing before its update and back after it).

A request whose connection could not be made (refused, or timed out connecting: it never reached
a server) is sent again to another leader, as kube-proxy's clients and the OpenAI SDK retry
connection errors; anything after the connection was made is never resent: a disconnect, a
non-200 answer or a ``finish_reason: "abort"`` counts as failed.
"""
from __future__ import annotations

import threading
import time

import httpx

RATE = 4.0  # requests per second
CONNECT_ATTEMPTS = 3  # leaders tried for one request while connections are refused



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


def _finish_reason(response: httpx.Response) -> str | None:
    try:
        return response.json()["choices"][0].get("finish_reason")
    except (ValueError, KeyError, IndexError, TypeError):
        return None


class Traffic:
    """Open-loop client over the Ready, non-terminating leaders; counts what failed."""

    def __init__(self, client, namespace: str, name: str, model: str, rate: float = RATE,
                 timeout: float = 120.0, routable_only: bool = False):
        self.client, self.namespace, self.name, self.model, self.rate = client, namespace, name, model, rate
        self.timeout = timeout  # seconds per request
        self.selector = f"shardline.dev/deployment={name},apps.kubernetes.io/pod-index=0" + (
            ",shardline.dev/routable=true" if routable_only else "")
        self.leaders: list[str] = []
        self.sent = 0
        self.failures: list[str] = []
        self.reconnects = 0  # requests sent again to another leader after a refused connection
        self.records: list[tuple[float, str, float, bool]] = []  # (sent at, leader IP, seconds, ok)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._watch, daemon=True),
                         threading.Thread(target=self._send, daemon=True)]

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                pods = self.client.get(f"/api/v1/namespaces/{self.namespace}/pods",
                                       params={"labelSelector": self.selector})
            except Exception:  # noqa: BLE001 (an API hiccup: keep the last view, read again)
                time.sleep(0.5)
                continue
            self.leaders = ready_pod_ips(pods)
            time.sleep(0.1)

    def _one(self, ip: str) -> None:
        sent, ok = time.monotonic(), False
        for attempt in range(CONNECT_ATTEMPTS):
            try:
                r = httpx.post(f"http://{ip}:8000/v1/completions", timeout=self.timeout,
                               json={"model": self.model, "prompt": "Hello", "max_tokens": 4})
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # never reached a server
                others = [leader for leader in self.leaders if leader != ip]
                if attempt + 1 < CONNECT_ATTEMPTS and others:
                    self.reconnects += 1
                    ip = others[attempt % len(others)]
                    continue
                self.failures.append(f"{ip}: {exc.__class__.__name__}: {exc}")
            except httpx.HTTPError as exc:
                self.failures.append(f"{ip}: {exc.__class__.__name__} after {time.monotonic() - sent:.1f} s: {exc}")
            else:
                ok = r.status_code == 200 and _finish_reason(r) != "abort"
                if not ok:
                    self.failures.append(f"{ip}: HTTP {r.status_code} {r.text[:200]}")
            break
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

    def __enter__(self) -> Traffic:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        time.sleep(1.0)
        self._stop.set()
        for t in self._threads:
            t.join(10)
        time.sleep(2.0)  # let the last requests answer
