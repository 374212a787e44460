"""render/: every child validates strictly against Kubernetes 1.37 and carries the design's wiring."""

from __future__ import annotations

import kubernetes_validate
import pytest

from shardline_operator import labels
from shardline_operator.render import render_children
from shardline_operator.runtime_args import ServedModel
from shardline_operator.spec import CudaGraphSpec

K8S_VERSION = "1.37.0"


def by_kind_name(children):
    return {(c["kind"], c["metadata"]["name"]): c for c in children}


@pytest.mark.parametrize("overrides", [
    {},
    {"replicas": 1, "parallelism": {"tensor": 1, "gpusPerPod": 1}},
    {"replicas": 3, "parallelism": {"tensor": 8, "gpusPerPod": 4}},
    {"replicas": 0},
    {"service": {"type": "NodePort", "port": 80},
     "scheduling": {"nodeSelector": {"gpu": "h100"}, "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                                                                       "effect": "NoSchedule"}],
                    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}},
                    "priorityClassName": "inference"}},
    {"runtime": {"image": "r:1", "env": [{"name": "HF_HOME", "value": "/tmp/hf"}], "args": ["--log-level", "debug"],
                 "maxTotalTokens": 4096, "cudaGraph": {"enabled": False}, "resources": {"requests": {"memory": "8Gi"}}}},
    {"auth": {"apiKeySecretRef": {"name": "llama-api-key", "key": "key"}},
     "networkPolicy": {"allowedNamespaces": ["apps", "gateway"]}},
    {"networkPolicy": {"enabled": False}},
])
def test_every_child_validates_strictly(make_spec, overrides):
    children = render_children(make_spec(overrides), operator_namespace="shardline-system")
    assert children
    for child in children:
        kubernetes_validate.validate(child, K8S_VERSION, strict=True)


def test_children_per_group(make_spec):
    spec = make_spec({"replicas": 2})
    kinds = sorted((c["kind"], c["metadata"]["name"]) for c in render_children(spec))
    assert kinds == [("NetworkPolicy", "llama-g0"), ("NetworkPolicy", "llama-g1"),
                     ("PodDisruptionBudget", "llama"), ("Service", "llama"), ("Service", "llama-g0-ranks"),
                     ("Service", "llama-g1-ranks"), ("StatefulSet", "llama-g0"), ("StatefulSet", "llama-g1")]


def test_statefulset_wiring(make_spec):
    spec = make_spec({"parallelism": {"tensor": 8, "gpusPerPod": 4}})
    sts = by_kind_name(render_children(spec))[("StatefulSet", "llama-g1")]
    body = sts["spec"]
    assert body["replicas"] == 2
    assert body["podManagementPolicy"] == "Parallel"
    assert body["updateStrategy"] == {"type": "OnDelete"}
    assert body["serviceName"] == "llama-g1-ranks"
    assert body["selector"]["matchLabels"] == {labels.LABEL_DEPLOYMENT: "llama", labels.LABEL_GROUP: "1"}
    template_labels = body["template"]["metadata"]["labels"]
    assert template_labels[labels.LABEL_REVISION] == "rev-a"
    assert all(template_labels[k] == v for k, v in body["selector"]["matchLabels"].items())
    container = body["template"]["spec"]["containers"][0]
    assert container["command"] == ["shardline-runtime", "serve"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert container["resources"]["limits"]["cpu"] == "2"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    # back in the Service (and counted updated) within a second of an in-place update's end
    assert container["readinessProbe"]["periodSeconds"] == 1
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    # Drain on deletion (issue 9): a pre-stop delay inside the grace period, then the runtime drains.
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert 0 < pre_stop < body["template"]["spec"]["terminationGracePeriodSeconds"]
    startup = container["startupProbe"]
    assert startup["httpGet"]["path"] == "/health"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1800
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["POD_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']"
    args = container["args"]
    assert args[args.index("--node-rank") + 1] == "$(POD_INDEX)"
    assert args[args.index("--host") + 1] == "$(POD_IP)"
    assert args[args.index("--dist-init-addr") + 1] == "llama-g1-0.llama-g1-ranks.default.svc:29501"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 8000, "dist": 29501}  # one rendezvous port per group
    assert args[args.index("--tp-size") + 1] == "8" and args[args.index("--nnodes") + 1] == "2"
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["model"]["mountPath"] == "/var/lib/shardline/models" and mounts["model"]["readOnly"]
    volumes = {v["name"]: v for v in body["template"]["spec"]["volumes"]}
    assert volumes["model"]["hostPath"]["path"] == "/var/lib/shardline/models"


def test_rank_service_publishes_not_ready_addresses(make_spec):
    svc = by_kind_name(render_children(make_spec()))[("Service", "llama-g0-ranks")]
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"] == {labels.LABEL_DEPLOYMENT: "llama", labels.LABEL_GROUP: "0"}


def test_client_service_selects_group_leaders(make_spec):
    svc = by_kind_name(render_children(make_spec({"service": {"port": 80}})))[("Service", "llama")]
    assert svc["spec"]["selector"] == {labels.LABEL_DEPLOYMENT: "llama", labels.LABEL_POD_INDEX: "0",
                                       labels.LABEL_ROUTABLE: "true"}
    assert svc["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]


def test_pdb_allows_one_group(make_spec):
    pdb = by_kind_name(render_children(make_spec({"parallelism": {"tensor": 4, "gpusPerPod": 2}})))[
        ("PodDisruptionBudget", "llama")]
    assert pdb["spec"]["maxUnavailable"] == 2


def test_owner_references_and_labels(make_spec):
    for child in render_children(make_spec()):
        meta = child["metadata"]
        assert meta["namespace"] == "default"
        (owner,) = meta["ownerReferences"]
        assert owner == {"apiVersion": "shardline.dev/v1alpha1", "kind": "InferenceDeployment", "name": "llama",
                         "uid": "0000-uid", "controller": True, "blockOwnerDeletion": True}
        for key in (labels.LABEL_NAME, labels.LABEL_INSTANCE, labels.LABEL_PART_OF, labels.LABEL_MANAGED_BY,
                    labels.LABEL_DEPLOYMENT):
            assert key in meta["labels"]


def test_served_model_overrides_one_group(make_spec):
    spec = make_spec()
    old = ServedModel("/var/lib/shardline/models/tiny-llama/rev-0", "rev-0", CudaGraphSpec(False, 8))
    children = by_kind_name(render_children(spec, {1: old}))
    g0 = children[("StatefulSet", "llama-g0")]["spec"]["template"]["spec"]["containers"][0]["args"]
    g1_sts = children[("StatefulSet", "llama-g1")]
    g1 = g1_sts["spec"]["template"]["spec"]["containers"][0]["args"]
    assert g0[g0.index("--model-path") + 1].endswith("rev-a") and "--cuda-graph-max-bs" in g0
    assert g1[g1.index("--model-path") + 1].endswith("rev-0") and "--disable-cuda-graph" in g1
    assert g1_sts["metadata"]["annotations"][labels.ANNOTATION_MODEL_REVISION] == "rev-0"
    assert g1_sts["metadata"]["annotations"][labels.ANNOTATION_CUDA_GRAPH] == "enabled=false,maxBatchSize=8"


def test_rendering_is_deterministic(make_spec):
    assert render_children(make_spec()) == render_children(make_spec())


def _grace_and_pre_stop(spec):
    body = next(c for c in render_children(spec, operator_namespace="shardline-system")
                if c["kind"] == "StatefulSet")["spec"]["template"]["spec"]
    return body["terminationGracePeriodSeconds"], \
        body["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"]


@pytest.mark.parametrize("args, drain", [([], 30), (["--drain-timeout", "300"], 300),
                                         (["--drain-timeout=120"], 120)])
def test_termination_grace_covers_pre_stop_and_the_runtime_drain(make_spec, args, drain):
    # The kubelet counts the grace period from the preStop hook and SIGKILLs at its end: a
    # fixed 60 s killed a runtime told to drain for 300 s mid-request (issue 21).
    grace, pre_stop = _grace_and_pre_stop(make_spec({"runtime": {"image": "r:1", "args": args}}))
    assert grace >= pre_stop + drain + 3  # uvicorn closes at drain + 3 s


def test_default_termination_grace_stays_sixty_seconds(make_spec):
    assert _grace_and_pre_stop(make_spec())[0] == 60
