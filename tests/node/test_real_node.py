"""Pods under a real kubelet: runc containers with bridge IPs, cluster DNS, Service ClusterIPs."""
from __future__ import annotations

import ipaddress
import json
import subprocess
import time

import pytest

from hack.images.build import image_name
from hack.localcluster.node.config import POD_CIDR

pytestmark = pytest.mark.node

NS = "node-smoke"


def pod(name, command, labels=None):
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "labels": labels or {"app": name}},
            "spec": {"terminationGracePeriodSeconds": 2, "restartPolicy": "Never",
                     "securityContext": {"runAsNonRoot": True, "runAsUser": 10001,
                                         "seccompProfile": {"type": "RuntimeDefault"}},
                     "containers": [{"name": "main", "image": image_name("operator"),
                                     "imagePullPolicy": "Never", "command": command,
                                     "securityContext": {"allowPrivilegeEscalation": False,
                                                         "readOnlyRootFilesystem": True,
                                                         "capabilities": {"drop": ["ALL"]}}}]}}


def apply(cluster, *docs):
    cluster.kubectl("apply", "-f", "-", input="\n---\n".join(json.dumps(d) for d in docs))


def wait_running(cluster, name, timeout=180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = json.loads(cluster.kubectl("get", "pod", name, "-n", NS, "-o", "json").stdout)
        if got["status"].get("phase") in ("Running", "Succeeded", "Failed"):
            return got
        time.sleep(1)
    events = cluster.kubectl("get", "events", "-n", NS, check=False).stdout
    raise AssertionError(f"pod {name} not running after {timeout} s:\n{events}")


def wait_done(cluster, name, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = json.loads(cluster.kubectl("get", "pod", name, "-n", NS, "-o", "json").stdout)
        if got["status"].get("phase") in ("Succeeded", "Failed"):
            return got
        time.sleep(1)
    raise AssertionError(f"pod {name} did not finish in {timeout} s")


@pytest.fixture(scope="module")
def web(real_node_cluster):
    """A pod serving HTTP on 8080 and a ClusterIP Service in front of it."""
    cluster = real_node_cluster
    cluster.kubectl("create", "namespace", NS, check=False)
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": NS},
               "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]}}
    apply(cluster, pod("web", ["python3", "-m", "http.server", "8080", "--directory", "/etc"]),
          service)
    return wait_running(cluster, "web")


def test_pod_gets_an_ip_on_the_bridge(web):
    assert ipaddress.ip_address(web["status"]["podIP"]) in ipaddress.ip_network(POD_CIDR)


def test_crictl_shows_the_running_container(real_node_cluster, web):
    listed = json.loads(real_node_cluster.node.crictl("ps", "-o", "json"))["containers"]
    names = {(c["labels"].get("io.kubernetes.pod.name"), c["state"]) for c in listed}
    assert ("web", "CONTAINER_RUNNING") in names


def test_pod_ip_serves_http_inside_the_node_network(real_node_cluster, web):
    # Running is not listening: the server's Python may still be starting (seconds under load),
    # so the client retries for up to 60 s.
    url = f"http://{web['status']['podIP']}:8080/hostname"
    script = ("import time, urllib.request\n"
              "deadline = time.monotonic() + 60\n"
              "while True:\n"
              "    try:\n"
              f"        print(urllib.request.urlopen('{url}', timeout=5).status); break\n"
              "    except OSError:\n"
              "        if time.monotonic() > deadline: raise\n"
              "        time.sleep(1)\n")
    out = subprocess.run(real_node_cluster.node.exec_argv(["python3", "-c", script]),
                         capture_output=True, text=True, timeout=90)
    assert out.stdout.strip() == "200", out.stderr


def test_pod_reaches_a_service_by_dns_name_and_cluster_ip(real_node_cluster, web):
    script = ("import urllib.request;"
              "print(urllib.request.urlopen('http://web.node-smoke.svc.cluster.local/hostname',"
              " timeout=5).status)")
    apply(real_node_cluster, pod("client", ["python3", "-c", script]))
    done = wait_done(real_node_cluster, "client")
    logs = real_node_cluster.kubectl("logs", "client", "-n", NS, check=False).stdout
    assert done["status"]["phase"] == "Succeeded", logs
