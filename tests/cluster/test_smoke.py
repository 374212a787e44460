"""The local cluster and its node agent, end to end with plain workloads (no Shardline):
a StatefulSet of tiny HTTP servers becomes Ready, its pod DNS names resolve to the pod IPs,
GPU capacity is enforced by the real scheduler, crashes restart with the termination message
reported, and deleted pods are finished."""
from __future__ import annotations

import json
import socket
import sys
import time
import uuid

import httpx
import pytest
import yaml

from hack.localcluster import kubectl_binary
from tests.kube_fixtures import agent_nodes_only

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def wait_for(what: str, check, timeout: float = 60.0, interval: float = 0.5):
    """Poll ``check()`` until it returns a truthy value; fail naming ``what`` on timeout."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


def get_json(kube, *args):
    return json.loads(kube.kubectl("get", *args, "-o", "json").stdout)


@pytest.fixture
def namespace(kube_cluster):
    name = f"smoke-{uuid.uuid4().hex[:6]}"
    kube_cluster.kubectl("create", "namespace", name)
    with agent_nodes_only(kube_cluster):
        yield name
    kube_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def http_statefulset(ns: str, replicas: int = 2) -> str:
    server = {"name": "web", "image": "python:3", "command": [sys.executable],
              "args": ["-m", "http.server", "8080", "--bind", "$(POD_IP)"],
              "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                      {"name": "POD_INDEX", "valueFrom": {"fieldRef": {
                          "fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}}],
              "ports": [{"name": "http", "containerPort": 8080}],
              "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 2}}
    docs = [
        {"apiVersion": "v1", "kind": "Service",
         "metadata": {"name": "web", "namespace": ns},
         "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                  "selector": {"app": "web"}, "ports": [{"port": 8080}]}},
        {"apiVersion": "apps/v1", "kind": "StatefulSet",
         "metadata": {"name": "web", "namespace": ns},
         "spec": {"serviceName": "web", "replicas": replicas,
                  "podManagementPolicy": "Parallel",
                  "selector": {"matchLabels": {"app": "web"}},
                  "template": {"metadata": {"labels": {"app": "web"}},
                               "spec": {"terminationGracePeriodSeconds": 5,
                                        "containers": [server]}}}},
    ]
    return yaml.safe_dump_all(docs)


def test_statefulset_ready_dns_and_delete(kube_cluster, namespace):
    kube = kube_cluster
    kube.kubectl("apply", "-f", "-", input=http_statefulset(namespace))
    kube.kubectl("rollout", "status", f"statefulset/web", "-n", namespace, "--timeout=90s",
                 timeout=120)
    pods = get_json(kube, "pods", "-n", namespace)["items"]
    assert len(pods) == 2
    ips = set()
    for pod in pods:
        ip = pod["status"]["podIP"]
        ips.add(ip)
        assert ip.startswith("127.") and ip != "127.0.0.1"
        ready = {c["type"]: c["status"] for c in pod["status"]["conditions"]}
        assert ready["Ready"] == "True" and pod["status"]["phase"] == "Running"
        name = pod["metadata"]["name"]
        for fqdn in (f"{name}.web.{namespace}.svc", f"{name}.web.{namespace}.svc.cluster.local"):
            assert socket.gethostbyname(fqdn) == ip
        assert httpx.get(f"http://{ip}:8080/", timeout=5).status_code == 200
    assert len(ips) == 2

    kube.kubectl("delete", "statefulset", "web", "-n", namespace, "--wait=false")
    wait_for("pods finished and removed",
             lambda: not get_json(kube, "pods", "-n", namespace)["items"], timeout=60)
    for ip in ips:
        with pytest.raises(OSError):
            socket.create_connection((ip, 8080), timeout=2).close()
    with pytest.raises(OSError):
        socket.gethostbyname(f"web-0.web.{namespace}.svc")


def test_gpu_capacity_enforced_by_scheduler(kube_cluster, namespace):
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "too-big", "namespace": namespace},
           "spec": {"containers": [{"name": "c", "image": "x", "command": ["sleep", "60"],
                                    "resources": {"limits": {"nvidia.com/gpu": "9"}}}]}}
    kube_cluster.kubectl("apply", "-f", "-", input=json.dumps(pod))

    def unschedulable():
        conds = get_json(kube_cluster, "pod", "too-big", "-n", namespace)["status"].get(
            "conditions", [])
        return [c for c in conds if c["type"] == "PodScheduled" and c["status"] == "False"
                and "Insufficient nvidia.com/gpu" in c.get("message", "")]

    wait_for("Insufficient nvidia.com/gpu", unschedulable, timeout=30)


def test_crash_restarts_with_termination_message(kube_cluster, namespace):
    script = ("import os; open(os.environ['SHARDLINE_TERMINATION_LOG'], 'w')"
              ".write('fatal: checkpoint missing shard 2'); raise SystemExit(3)")
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "crash", "namespace": namespace},
           "spec": {"restartPolicy": "Always",
                    "containers": [{"name": "c", "image": "x", "command": [sys.executable, "-c",
                                                                            script]}]}}
    kube_cluster.kubectl("apply", "-f", "-", input=json.dumps(pod))

    def restarted():
        st = get_json(kube_cluster, "pod", "crash", "-n", namespace)["status"]
        cs = (st.get("containerStatuses") or [{}])[0]
        return cs if cs.get("restartCount", 0) >= 2 and cs.get("lastState", {}).get(
            "terminated") else None

    cs = wait_for("two restarts", restarted, timeout=60)
    term = cs["lastState"]["terminated"]
    assert term["exitCode"] == 3
    assert term["message"] == "fatal: checkpoint missing shard 2"
    kube_cluster.kubectl("delete", "pod", "crash", "-n", namespace, "--timeout=30s")


def test_pod_gets_its_service_account_identity(kube_cluster, namespace):
    """The agent mounts a TokenRequest token of the pod's ServiceAccount where kubelet would
    (``/var/run/secrets/kubernetes.io/serviceaccount``) and sets ``KUBERNETES_SERVICE_*``, with
    no KUBECONFIG, so clients take their in-cluster branch and talk to the API server as that
    account (the operator pod gets the chart's RBAC). Without mount namespaces the agent falls
    back to a KUBECONFIG."""
    from hack.node_agent import service_account

    mounted = service_account.mount_namespaces_work()[0]
    kube_cluster.kubectl("create", "serviceaccount", "robot", "-n", namespace)
    script = ("import os, subprocess; who = subprocess.run([os.environ['KUBECTL'], 'auth', "
              "'whoami', '-o', 'jsonpath={.status.userInfo.username}'], capture_output=True, "
              "text=True); open(os.environ['SHARDLINE_TERMINATION_LOG'], 'w').write("
              "(who.stdout or who.stderr) + f\" kubeconfig={'KUBECONFIG' in os.environ}\" "
              "+ f\" token={os.path.exists('/var/run/secrets/kubernetes.io/serviceaccount/token')}\")")
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "whoami", "namespace": namespace},
           "spec": {"serviceAccountName": "robot", "restartPolicy": "Never",
                    "containers": [{"name": "c", "image": "x", "command": [sys.executable, "-c",
                                                                            script],
                                    "env": [{"name": "KUBECTL", "value": kubectl_binary()}]}]}}
    kube_cluster.kubectl("apply", "-f", "-", input=json.dumps(pod))

    def finished():
        st = get_json(kube_cluster, "pod", "whoami", "-n", namespace)["status"]
        return st if st.get("phase") in ("Succeeded", "Failed") else None

    st = wait_for("the whoami pod to finish", finished, timeout=60)
    term = st["containerStatuses"][0]["state"]["terminated"]
    assert st["phase"] == "Succeeded"
    assert term["message"] == (f"system:serviceaccount:{namespace}:robot"
                               f" kubeconfig={not mounted} token={mounted}")
    assert not service_account.MOUNT_PATH.joinpath("token").exists()  # mounted for the pod only
