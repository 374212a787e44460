"""Failures only a real kubelet shows, as the group's Failed status reports them (issue 21,
stage 4): a container killed at its cgroup memory limit (OOMKilled, no termination message of
its own), and a checkpoint the pod's user (uid 10001) cannot read, whose error must reach the
status through the termination-message file the kubelet mounts."""
from __future__ import annotations

import uuid

import pytest

from hack.scenario.models import MODELS_ROOT, write_tiny_model
from tests.node.deployments import Served, adapted, single_pod_example

pytestmark = [pytest.mark.node, pytest.mark.slow]

NS = f"node-fail-{uuid.uuid4().hex[:5]}"
FAIL_AT_ONCE = {"maxGroupRestarts": 0, "backoffSeconds": 1}


@pytest.fixture(scope="module")
def namespace(operator_on_node):
    operator_on_node.kubectl("create", "namespace", NS, check=False)
    yield NS
    operator_on_node.kubectl("delete", "namespace", NS, "--wait=false", check=False)


def failing(cluster, doc):
    doc["spec"]["restartPolicy"] = dict(FAIL_AT_ONCE)
    served = Served(cluster, doc)
    served.apply()
    return served


def test_oom_killed_group_fails_naming_the_memory_limit(operator_on_node, namespace):
    # 48Mi: importing torch needs more anonymous memory than that. (At 160Mi the kernel kept
    # reclaiming the mapped libraries' page cache: the pod crawled at its limit, never killed.)
    doc = adapted(single_pod_example(), namespace, name="oom",
                  requests={"cpu": "100m", "memory": "32Mi"})
    doc["spec"]["runtime"]["resources"]["limits"] = {"memory": "48Mi"}
    served = failing(operator_on_node, doc)
    try:
        assert "OOMKilled" in served.wait_failed()
    finally:
        served.delete()


def test_checkpoint_unreadable_by_the_pod_user_fails_naming_the_uid(operator_on_node, namespace):
    path = write_tiny_model(MODELS_ROOT / "tiny-llama" / "rev-root-only", seed=4)
    (path / "model.safetensors").chmod(0o600)  # as save_pretrained leaves it, owned by root
    doc = adapted(single_pod_example(), namespace, name="root-only")
    doc["spec"]["model"].update(path=str(path), revision="rev-root-only")
    served = failing(operator_on_node, doc)
    try:
        assert "runs as uid 10001" in served.wait_failed()
    finally:
        served.delete()
