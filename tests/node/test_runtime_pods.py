"""Shardline's own pods under the real kubelet (issue 21, stage 3): the operator as the chart's
Deployment from the operator image, and an InferenceDeployment whose pods run the runtime image
as runc containers with bridge IPs."""
from __future__ import annotations

import ipaddress
import json
import uuid

import pytest

from hack.images.build import image_name
from hack.localcluster.node.config import POD_CIDR
from tests.node.deployments import Served, adapted, single_pod_example

pytestmark = [pytest.mark.node, pytest.mark.slow]

NS = f"node-single-{uuid.uuid4().hex[:5]}"


@pytest.fixture(scope="module")
def single(operator_on_node):
    operator_on_node.kubectl("create", "namespace", NS, check=False)
    served = Served(operator_on_node, adapted(single_pod_example(), NS))
    served.apply()
    yield served
    served.delete()
    operator_on_node.kubectl("delete", "namespace", NS, "--wait=false", check=False)


def test_operator_runs_from_the_operator_image(operator_on_node):
    pods = json.loads(operator_on_node.kubectl(
        "get", "pods", "-n", "shardline-system", "-l", "app.kubernetes.io/component=operator",
        "-o", "json").stdout)["items"]
    statuses = [s for p in pods for s in p["status"]["containerStatuses"]]
    assert [(s["image"], s["ready"]) for s in statuses] == [(image_name("operator"), True)]


def test_operator_container_is_a_containerd_container(operator_on_node):
    pods = json.loads(operator_on_node.kubectl(
        "get", "pods", "-n", "shardline-system", "-o", "json").stdout)["items"]
    ids = [s["containerID"] for p in pods for s in p["status"]["containerStatuses"]]
    assert all(i.startswith("containerd://") for i in ids), ids


def test_single_pod_group_becomes_ready(single):
    snap = single.wait_ready(single.doc["spec"]["model"]["revision"])
    assert snap.ready_replicas == 1


def test_runtime_pod_runs_the_runtime_image(single):
    single.wait_ready(single.doc["spec"]["model"]["revision"])
    status = single.pod(0)["status"]["containerStatuses"][0]
    assert status["image"] == image_name("runtime")


def test_runtime_pod_ip_is_on_the_bridge(single):
    single.wait_ready(single.doc["spec"]["model"]["revision"])
    wide = single.kubectl("get", "pods", "-o", "wide").stdout.splitlines()
    ip = single.pod(0)["status"]["podIP"]
    assert ipaddress.ip_address(ip) in ipaddress.ip_network(POD_CIDR)
    assert any(ip in line.split() for line in wide[1:]), wide


def test_crictl_shows_the_runtime_container(operator_on_node, single):
    single.wait_ready(single.doc["spec"]["model"]["revision"])
    listed = json.loads(operator_on_node.node.crictl("ps", "-o", "json"))["containers"]
    running = {(c["labels"].get("io.kubernetes.pod.name"), c["labels"].get(
        "io.kubernetes.container.name"), c["state"]) for c in listed}
    assert (f"{single.name}-g0-0", "runtime", "CONTAINER_RUNNING") in running
