"""Event-driven reconcile and the operator's live metrics, against a real kube-apiserver
(marker ``cluster``).

The operator runs from the working tree with ``--resync-seconds 3600``: within these tests no
unprompted pass ever comes, so every status change seen here was triggered by an event on the
object's own pods or StatefulSets (or by a pass's own requeue). Pods land on a node played by
``FakeKubelet``; the StatefulSet, scheduler and garbage-collector controllers are real.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from fake_kubelet import NODE, TOLERATION, FakeKubelet, ensure_node

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

NAMESPACE = "events-it"
ROOT = Path(__file__).resolve().parents[2]


def wait_for(predicate, timeout: float, what: str, interval: float = 0.3):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_operator(kube_cluster, log: Path, attempts: int = 3) -> tuple[subprocess.Popen, int]:
    """Start the operator and wait until its ``/metrics`` answers; returns ``(process, port)``.

    The operator binds ``--metrics-port`` in ``cli.main`` before Kopf starts, so the endpoint
    exists before the first pass, and a port it cannot bind ends the process (exit 2, "cannot
    listen"): it never runs without metrics. The port is picked free here and released before the
    operator binds it, so on a busy machine another process can take it in between; then the
    operator is started again on another port instead of the test failing on a refused scrape.
    """
    for _ in range(attempts):
        port = free_port()
        process = subprocess.Popen(
            [sys.executable, "-m", "shardline_operator.cli", "--namespace", NAMESPACE, "--resync-seconds", "3600",
             "--metrics-port", str(port), "--liveness-endpoint", "http://127.0.0.1:0/healthz"],
            env=dict(kube_cluster.env, PYTHONPATH=str(ROOT / "operator")), stdout=log.open("w"),
            stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and process.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).status_code == 200:
                    return process, port
            except httpx.HTTPError:
                time.sleep(0.2)
        if process.poll() is None:
            process.kill()
            raise AssertionError(f"the operator's /metrics did not answer within 120 s:\n{log.read_text()[-3000:]}")
        if "cannot listen" not in log.read_text():
            raise AssertionError(f"the operator exited with {process.returncode}:\n{log.read_text()[-3000:]}")
    raise AssertionError(f"no free metrics port after {attempts} attempts")


@pytest.fixture(scope="module")
def env(kube_cluster, tmp_path_factory):
    kube_cluster.kubectl("apply", "-f", str(ROOT / "crds" / "inferencedeployment.yaml"))
    kube_cluster.kubectl("wait", "--for", "condition=established", "--timeout=60s",
                         "crd/inferencedeployments.shardline.dev")
    kube_cluster.kubectl("create", "namespace", NAMESPACE, check=False)
    client = kube_cluster.client()
    ensure_node(client)
    kubelet = FakeKubelet(client, NAMESPACE).start()
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    process, port = start_operator(kube_cluster, log)
    try:
        yield {"cluster": kube_cluster, "client": client, "kubelet": kubelet, "log": log,
               "metrics": f"http://127.0.0.1:{port}/metrics"}
    finally:
        kube_cluster.kubectl("delete", "infd", "--all", "-n", NAMESPACE, "--timeout=60s", check=False, timeout=90)
        try:
            wait_for(lambda: not client.get(f"/api/v1/namespaces/{NAMESPACE}/pods")["items"], 60, "pods gone")
        finally:
            kubelet.stop()
            process.terminate()
            process.wait(timeout=30)


def status(env, name):
    obj = env["client"].get(f"/apis/shardline.dev/v1alpha1/namespaces/{NAMESPACE}/inferencedeployments/{name}",
                            ok_missing=True)
    return (obj or {}).get("status") or {}


def gauges(env, name) -> dict[tuple[str, str], float]:
    """``{(sample name, group label): value}`` of the operator's samples for ``name``."""
    text = httpx.get(env["metrics"], timeout=10).text
    return {(s.name, s.labels.get("group", "")): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.labels.get("name") == name and s.labels.get("namespace") == NAMESPACE}


def test_pod_events_drive_status_and_metrics(env):
    name = "ev"
    ready = {"value": False}
    env["kubelet"].ready = lambda pod: ready["value"]
    doc = {"apiVersion": "shardline.dev/v1alpha1", "kind": "InferenceDeployment",
           "metadata": {"name": name, "namespace": NAMESPACE},
           "spec": {"replicas": 1,
                    "model": {"name": "tiny-llama", "path": "/var/lib/shardline/models/tiny-llama/rev-a",
                              "revision": "rev-a",
                              "volume": {"hostPath": {"path": "/var/lib/shardline/models"}}},
                    "parallelism": {"tensor": 2, "gpusPerPod": 1},
                    "runtime": {"image": "ghcr.io/shardline/shardline-runtime:0.1.0"},
                    "scheduling": {"nodeSelector": {"kubernetes.io/hostname": NODE}, "tolerations": [TOLERATION]},
                    "restartPolicy": {"maxGroupRestarts": 3, "backoffSeconds": 1}}}
    env["cluster"].kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
    log = env["log"].read_text
    # Pods created and started (pod events), not Ready yet.
    wait_for(lambda: status(env, name).get("phase") == "Initializing", 60, f"Initializing\n{log()}")
    ready["value"] = True  # only the pods' status events can carry this into the object's status
    wait_for(lambda: status(env, name).get("phase") == "Ready", 60, f"Ready\n{log()}")
    obj = env["client"].get(f"/apis/shardline.dev/v1alpha1/namespaces/{NAMESPACE}/inferencedeployments/{name}")
    assert "shardline.dev/finalizer" in obj["metadata"].get("finalizers", []), obj["metadata"]  # docs/operations.md
    sample = wait_for(lambda: gauges(env, name).get(("shardline_operator_restart_budget", "")) == 3 and gauges(env, name),
                      15, "restart budget gauge")
    assert sample[("shardline_operator_group_restarts", "0")] == 0
    assert sample[("shardline_operator_rollout_in_progress", "")] == 0
    assert sample[("shardline_operator_failed_groups", "")] == 0
    # A rank is deleted: the pod event triggers a whole-group restart, counted in status and metrics.
    env["cluster"].kubectl("delete", "pod", f"{name}-g0-1", "-n", NAMESPACE, "--wait=false")
    wait_for(lambda: (status(env, name).get("groups") or [{}])[0].get("restarts") == 1, 60, f"restart\n{log()}")
    wait_for(lambda: status(env, name).get("phase") == "Ready", 60, f"Ready again\n{log()}")
    # the gauges follow the status write (not the pass's end, which can be a return-to-routing
    # health check that times out: these pods run no server)
    # (60 s like the waits above: a CI run at high load once took longer than 15 s here)
    wait_for(lambda: gauges(env, name).get(("shardline_operator_group_restarts", "0")) == 1, 60, "restarts gauge")
    # Deletion drops the object's gauges.
    env["cluster"].kubectl("delete", "infd", name, "-n", NAMESPACE, "--timeout=60s", timeout=90)
    wait_for(lambda: not any(key[0] in ("shardline_operator_restart_budget", "shardline_operator_group_restarts")
                             for key in gauges(env, name)), 30, "gauges forgotten")
