"""Shardline deployments on the real node: the examples, adapted only through their fields
(namespace, requests that fit this node), applied with kubectl and watched through the API."""
from __future__ import annotations

import copy
import json
import threading
import time

import yaml

from hack.localcluster import LocalCluster
from hack.scenario.examples import inference_deployments
from hack.scenario.node_client import chat_in_node  # noqa: F401 (the tests import it from here)
from hack.scenario.operator_install import operator_logs
from hack.scenario.status_watch import StatusWatcher

READY_TIMEOUT = 420
# The examples request 1 CPU and 2 GiB per pod, sized for a GPU node. This node has 2 CPUs for
# the operator and every runtime pod of a test, so requests shrink; limits are not set.
NODE_REQUESTS = {"cpu": "100m", "memory": "256Mi"}


def single_pod_example() -> dict:
    """The examples' plain TP=1 InferenceDeployment (one pod, no LoRA adapters)."""
    docs = [d for _, d in inference_deployments()
            if d["spec"]["parallelism"] == {"tensor": 1, "gpusPerPod": 1}
            and not d["spec"].get("loraAdapters")]
    assert docs, "examples/ has no TP=1 single-pod InferenceDeployment"
    return docs[0]


def adapted(doc: dict, namespace: str, name: str | None = None,
            requests: dict | None = None) -> dict:
    """A copy of example ``doc`` placed in ``namespace`` (renamed to ``name`` when given), with
    the runtime's resource requests set to ``requests`` (default :data:`NODE_REQUESTS`)."""
    out = copy.deepcopy(doc)
    out["metadata"] = {"name": name or doc["metadata"]["name"], "namespace": namespace}
    resources = out["spec"].setdefault("runtime", {}).setdefault("resources", {})
    resources["requests"] = dict(requests or NODE_REQUESTS)
    return out


class PodEnds:
    """Watch the pods of one deployment and keep, per pod UID, the last ``terminated`` state
    of its container before the pod went away, and when deletion was asked for."""

    def __init__(self, served: Served):
        self.served = served
        self.ends: dict[str, dict] = {}  # uid -> {"name", "deleted_at", "terminated"}
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        path = f"/api/v1/namespaces/{self.served.namespace}/pods"
        params = {"labelSelector": f"shardline.dev/deployment={self.served.name}"}
        client = self.served.cluster.client()
        while not self._stop.is_set():
            try:
                rv = client.get(path, params=params)["metadata"]["resourceVersion"]
                for ev in client.watch(path, rv, timeout_seconds=30, params=params):
                    if self._stop.is_set():
                        return
                    pod = ev.get("object", {})
                    meta = pod.get("metadata", {})
                    if "uid" not in meta:
                        continue
                    end = self.ends.setdefault(meta["uid"], {"name": meta["name"]})
                    if meta.get("deletionTimestamp") and "deleted_at" not in end:
                        end["deleted_at"] = time.monotonic()
                    for status in (pod.get("status") or {}).get("containerStatuses") or []:
                        done = (status.get("state") or {}).get("terminated")
                        if done and "terminated" not in end:
                            end["terminated"] = dict(done, seen_at=time.monotonic())
            except Exception:  # relist after a dropped watch
                time.sleep(0.5)

    def stop(self) -> None:
        self._stop.set()


class Served:
    """One InferenceDeployment on the node and its status watcher."""

    def __init__(self, cluster: LocalCluster, doc: dict):
        self.cluster, self.doc = cluster, doc
        self.namespace, self.name = doc["metadata"]["namespace"], doc["metadata"]["name"]
        self.client = cluster.client()
        self.watch = StatusWatcher(self.client, self.namespace, self.name).start()

    def kubectl(self, *args, **kw):
        return self.cluster.kubectl("-n", self.namespace, *args, **kw)

    def apply(self) -> None:
        self.kubectl("apply", "-f", "-", input=yaml.safe_dump(self.doc))

    def wait_ready(self, revision: str, since: int = 0, timeout: float = READY_TIMEOUT):
        try:
            return self.watch.wait(
                lambda s: s.phase == "Ready" and s.served_revision == revision
                and s.ready_replicas == s.replicas and s.observed_generation == s.generation,
                timeout, f"{self.name} Ready serving {revision}", since)
        except TimeoutError as e:
            raise AssertionError(f"{e}\n{self.diagnostics()}") from None

    def pod(self, index: int, group: int = 0) -> dict:
        return self.client.get(
            f"/api/v1/namespaces/{self.namespace}/pods/{self.name}-g{group}-{index}")

    def pod_uids(self) -> dict[str, str]:
        pods = json.loads(self.kubectl("get", "pods", "-l",
                                       f"shardline.dev/deployment={self.name}",
                                       "-o", "json").stdout)["items"]
        return {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods}

    def wait_pods_gone(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while self.pod_uids() and time.monotonic() < deadline:
            time.sleep(1)

    def diagnostics(self) -> str:
        phases = "\n".join(s.line() for s in self.watch.history[-30:])
        pods = self.kubectl("get", "pods", "-o", "wide", check=False).stdout
        events = self.kubectl("get", "events", "--sort-by=.lastTimestamp", check=False).stdout
        logs = "\n".join(
            f"== {p}\n" + self.kubectl("logs", p, "--tail=40", check=False).stdout
            for p in self.pod_uids())
        return (f"status history:\n{phases}\npods:\n{pods}\nevents:\n{events[-4000:]}\n{logs}\n"
                f"{operator_logs(self.cluster)}")

    def wait_failed(self, timeout: float = 300) -> str:
        """Wait for phase Failed; return group 0's status message."""
        try:
            self.watch.wait(lambda s: s.phase == "Failed", timeout, f"{self.name} Failed")
        except TimeoutError as e:
            raise AssertionError(f"{e}\n{self.diagnostics()}") from None
        obj = self.client.get(f"/apis/shardline.dev/v1alpha1/namespaces/{self.namespace}/"
                              f"inferencedeployments/{self.name}")
        return obj["status"]["groups"][0].get("message", "")

    def delete(self) -> None:
        self.watch.stop()
        self.kubectl("delete", "infd", self.name, "--wait=false", check=False)
