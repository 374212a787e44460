"""Two groups (TP=1, one pod each) of the TP=2 example, for rollouts under traffic.

Shared by ``bench/rollout.py`` and ``tests/e2e/test_rollout_*.py``: the manifest, the patch, the
wait for every group on a revision, and each leader's ``/get_server_info``.
"""
from __future__ import annotations

import json

import httpx
import yaml

from hack.scenario.examples import tp2_example
from hack.scenario.operator_install import operator_logs
from hack.scenario.status_watch import StatusWatcher


def two_group_doc(namespace: str, name: str, model_path: str, revision: str,
                  startup_timeout: int | None = None, replicas: int = 2) -> dict:
    """The TP=2 example as ``replicas`` (default 2) groups of TP=1 serving ``model_path`` at
    ``revision``; ``startup_timeout`` (seconds) sets ``spec.runtime.startupTimeoutSeconds``."""
    _, doc = tp2_example()
    doc = json.loads(json.dumps(doc))
    doc["metadata"] = {"name": name, "namespace": namespace}
    doc["spec"].update(replicas=replicas, parallelism={"tensor": 1, "gpusPerPod": 1})
    doc["spec"]["model"].update(path=model_path, revision=revision)
    if startup_timeout is not None:
        doc["spec"]["runtime"]["startupTimeoutSeconds"] = startup_timeout
    return doc


def apply(cluster, doc: dict) -> StatusWatcher:
    """Create the namespace, start watching the deployment's status, apply ``doc``."""
    ns, name = doc["metadata"]["namespace"], doc["metadata"]["name"]
    cluster.kubectl("create", "namespace", ns, check=False)
    watch = StatusWatcher(cluster.client(), ns, name).start()
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
    return watch


def wait_ready(watch: StatusWatcher, revision: str, since: int, timeout: float):
    """The first status since mark ``since`` that is Ready, observed, with every group ready
    and serving ``revision``. Raises TimeoutError (with the history) past ``timeout`` seconds."""
    return watch.wait(lambda s: s.phase == "Ready" and s.served_revision == revision
                      and s.ready_replicas == s.replicas
                      and s.observed_generation == s.generation, timeout, f"Ready on {revision}", since)


def patch(cluster, namespace: str, name: str, spec: dict) -> None:
    """Merge-patch ``spec`` into the InferenceDeployment."""
    cluster.kubectl("patch", "infd", name, "-n", namespace, "--type", "merge", "-p", json.dumps({"spec": spec}))


def leader_server_infos(client, namespace: str, name: str) -> dict[str, dict]:
    """``{pod name: /get_server_info}`` of every group leader (pod index 0) with a pod IP."""
    pods = client.get(f"/api/v1/namespaces/{namespace}/pods",
                      params={"labelSelector": f"shardline.dev/deployment={name},apps.kubernetes.io/pod-index=0"})
    return {p["metadata"]["name"]: httpx.get(f"http://{p['status']['podIP']}:8000/get_server_info", timeout=30).json()
            for p in pods["items"] if p.get("status", {}).get("podIP")}


def diagnostics(cluster, watch: StatusWatcher) -> str:
    """The last 40 statuses seen and the tail of the operator's log, for assertion messages."""
    history = "\n".join(s.line() for s in watch.history[-40:])
    return f"{history}\n{operator_logs(cluster)[-4000:]}"
