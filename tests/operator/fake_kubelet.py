"""A kubelet stand-in for one node with no node agent, driven through the pods/status API.

The operator's cluster tests bind their pods to such a node so they decide what the pods do
(Ready or not, crash with a termination message) without running real runtime processes;
the scheduler, StatefulSet, EndpointSlice and garbage-collector controllers stay real.
"""

from __future__ import annotations

import datetime
import threading
import time
from typing import Callable

from hack.localcluster.nodes import node_manifest, node_status
from hack.localcluster.rest import ApiError, RestClient

NODE = "operator-test-node"
TAINT = {"key": "shardline.dev/fake-kubelet", "value": "true", "effect": "NoSchedule"}
TOLERATION = {"key": TAINT["key"], "operator": "Equal", "value": "true", "effect": "NoSchedule"}


def ensure_node(client: RestClient, name: str = NODE, gpus: int = 16) -> None:
    """A Ready, schedulable node with GPUs that no node agent serves, tainted so only pods
    tolerating ``TAINT`` (the operator tests' own) land on it."""
    try:
        client.post("/api/v1/nodes", node_manifest(name))
    except ApiError as exc:
        if exc.status != 409:
            raise
    client.merge_patch(f"/api/v1/nodes/{name}", {"spec": {"taints": [TAINT], "unschedulable": None}})
    client.merge_patch(f"/api/v1/nodes/{name}/status", {"status": node_status(gpus)})


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class FakeKubelet:
    """Polls pods bound to ``NODE`` in ``namespace``: starts them (podIP, Running), sets Ready
    per ``ready(pod)``, crashes them per ``crash(pod) -> message | None`` and finishes their
    deletion as kubelet would (grace 0 with a UID precondition) once ``finish_deletion(pod)``
    says so (a pod kept terminating plays one whose runtime still drains)."""

    def __init__(self, client: RestClient, namespace: str):
        self.client, self.namespace = client, namespace
        self.ready: Callable[[dict], bool] = lambda pod: True
        self.crash: Callable[[dict], str | None] = lambda pod: None
        self.finish_deletion: Callable[[dict], bool] = lambda pod: True
        self._stop = threading.Event()
        self._ips: dict[str, str] = {}
        self._thread = threading.Thread(target=self._loop, daemon=True, name="fake-kubelet")
        self.errors: list[str] = []

    def start(self) -> "FakeKubelet":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync()
            except (ApiError, OSError) as exc:  # transient (e.g. a pod deleted meanwhile)
                self.errors.append(str(exc))
            time.sleep(0.3)

    def _ip(self, uid: str) -> str:
        """A pod IP outside loopback (EndpointSlices reject 127.0.0.0/8); nothing ever binds it."""
        if uid not in self._ips:
            n = len(self._ips) + 2
            self._ips[uid] = f"10.244.{n // 250}.{n % 250 + 2}"
        return self._ips[uid]

    def sync(self) -> None:
        pods = self.client.get(f"/api/v1/namespaces/{self.namespace}/pods")["items"]
        for pod in pods:
            meta, spec = pod["metadata"], pod["spec"]
            if spec.get("nodeName") != NODE:
                continue
            path = f"/api/v1/namespaces/{self.namespace}/pods/{meta['name']}"
            if meta.get("deletionTimestamp"):
                if not self.finish_deletion(pod):
                    continue
                self.client.delete(path, {"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}},
                                   ok_missing=True)
                continue
            crashed = self.crash(pod)
            ready = self.ready(pod) and crashed is None
            status = self._status(pod, ready, crashed)
            if self._differs(pod.get("status") or {}, status):
                self.client.merge_patch(f"{path}/status", {"status": status})

    def _status(self, pod: dict, ready: bool, crashed: str | None) -> dict:
        old = pod.get("status") or {}
        started = old.get("startTime") or _now()
        container = {"name": pod["spec"]["containers"][0]["name"], "image": pod["spec"]["containers"][0]["image"],
                     "imageID": "", "containerID": "local://0", "ready": ready, "started": crashed is None,
                     "restartCount": 0, "state": {"running": {"startedAt": started}}}
        if crashed is not None:
            container.update(restartCount=1, state={"waiting": {"reason": "CrashLoopBackOff"}},
                             lastState={"terminated": {"exitCode": 1, "reason": "Error", "message": crashed,
                                                       "startedAt": started, "finishedAt": _now()}})
        flag = "True" if ready else "False"
        ip = self._ip(pod["metadata"]["uid"])
        return {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}], "hostIP": "127.0.0.1", "startTime": started,
                "conditions": [{"type": "PodScheduled", "status": "True"}, {"type": "Initialized", "status": "True"},
                               {"type": "ContainersReady", "status": flag}, {"type": "Ready", "status": flag}],
                "containerStatuses": [container]}

    @staticmethod
    def _differs(old: dict, new: dict) -> bool:
        def key(status):
            containers = status.get("containerStatuses") or [{}]
            conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
            return (status.get("podIP"), conditions.get("Ready"), containers[0].get("restartCount"))
        return key(old) != key(new)
