"""Pod Security admission of the real kube-apiserver 1.37 admits the pods Shardline renders in a
namespace labelled ``pod-security.kubernetes.io/enforce=restricted``.

The StatefulSet controller creates the runtime pods (creation is admission); a nodeSelector
that matches no node keeps them Pending, so nothing runs. Negative controls show the label is
enforced. The node agent does not apply ``securityContext`` (it runs processes as its own
user, see docs/local-cluster.md); admission is the API server's and is what is tested here.
"""
from __future__ import annotations

import copy
import json
import time
import uuid

import pytest
import yaml

from hack.scenario.operator_install import CHART
from shardline_operator.render import build_admin_secret, render_children
from shardline_operator.spec import parse_spec

pytestmark = [pytest.mark.cluster]

SPEC = {
    "replicas": 1,
    # No volume: hostPath is outside restricted (and baseline); the checkpoint comes with the image.
    "model": {"name": "tiny", "path": "/models/tiny/rev-a", "revision": "rev-a"},
    "parallelism": {"tensor": 2, "gpusPerPod": 1},
    "runtime": {"image": "ghcr.io/shardline/shardline-runtime:0.1.0"},
    "auth": {"apiKeySecretRef": {"name": "tiny-api-key"}},
    "scheduling": {"nodeSelector": {"shardline.dev/test-no-such-node": "true"}},
}


@pytest.fixture
def restricted(kube_cluster):
    name = f"pss-{uuid.uuid4().hex[:6]}"
    kube_cluster.kubectl("create", "namespace", name)
    kube_cluster.kubectl("label", "namespace", name, "pod-security.kubernetes.io/enforce=restricted",
                         "pod-security.kubernetes.io/enforce-version=latest")
    yield name
    kube_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def children(namespace: str) -> list[dict]:
    spec = parse_spec("tiny", namespace, "00000000-0000-0000-0000-000000000000", copy.deepcopy(SPEC))
    objects = [build_admin_secret(spec, "token"), *render_children(spec, operator_namespace="shardline-system")]
    for obj in objects:
        # No InferenceDeployment exists here: the garbage collector would delete orphans.
        obj["metadata"].pop("ownerReferences", None)
    return objects


def as_pod(template: dict, namespace: str, name: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace},
            "spec": copy.deepcopy(template["spec"])}


def statefulset(objects: list[dict]) -> dict:
    return next(o for o in objects if o["kind"] == "StatefulSet")


def dry_run(kube, pod: dict):
    return kube.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(pod), check=False)


def test_runtime_pods_are_created_under_restricted(kube_cluster, restricted):
    objects = children(restricted)
    kube_cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}))
    deadline = time.monotonic() + 60
    pods: list[str] = []
    while time.monotonic() < deadline and len(pods) < 2:
        pods = kube_cluster.kubectl("get", "pods", "-n", restricted, "-o", "name").stdout.split()
        time.sleep(0.5)
    events = kube_cluster.kubectl("get", "events", "-n", restricted, "-o", "json").stdout
    refused = [e["message"] for e in json.loads(events)["items"] if e.get("reason") == "FailedCreate"]
    assert sorted(pods) == ["pod/tiny-g0-0", "pod/tiny-g0-1"], f"pods not created; FailedCreate: {refused}"


def test_the_label_is_enforced(kube_cluster, restricted):
    template = statefulset(children(restricted))["spec"]["template"]
    admitted = dry_run(kube_cluster, as_pod(template, restricted, "control"))
    assert admitted.returncode == 0, admitted.stderr
    host_path = as_pod(template, restricted, "hostpath")
    host_path["spec"]["volumes"].append({"name": "m", "hostPath": {"path": "/var/lib/shardline/models"}})
    refused = dry_run(kube_cluster, host_path)
    assert refused.returncode != 0 and "violates PodSecurity" in refused.stderr and "hostPath" in refused.stderr
    as_root = as_pod(template, restricted, "root")
    del as_root["spec"]["securityContext"]["runAsNonRoot"]
    for container in as_root["spec"]["containers"]:  # the containers repeat it (defence in depth)
        container.get("securityContext", {}).pop("runAsNonRoot", None)
    refused = dry_run(kube_cluster, as_root)
    assert refused.returncode != 0 and "runAsNonRoot" in refused.stderr, refused.stderr


def test_operator_pod_is_admitted_under_restricted(kube_cluster, restricted):
    rendered = kube_cluster.helm("template", "shardline", str(CHART), "--namespace", restricted).stdout
    deployment = next(d for d in yaml.safe_load_all(rendered) if d and d.get("kind") == "Deployment")
    result = dry_run(kube_cluster, as_pod(deployment["spec"]["template"], restricted, "operator"))
    assert result.returncode == 0, result.stderr
