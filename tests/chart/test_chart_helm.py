"""The chart with the real helm CLI: lint --strict, template, strict 1.37 schema validation, RBAC."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

CHART = Path(__file__).resolve().parents[2] / "charts" / "shardline"

VALUE_SETS = {
    "defaults": [],
    "namespaced-custom": ["--set", "watchNamespaces={models,staging}", "--set", "image.tag=0.1.0-rc1",
                          "--set", "serviceAccount.annotations.team=ml", "--set", "priorityClassName=system",
                          "--set", "nodeSelector.pool=cpu", "--set", "logLevel=debug"],
}


def render(helm, extra):
    out = helm("template", "shardline", str(CHART), "--namespace", "shardline-system", "--include-crds", *extra).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def test_lint_strict(helm):
    helm("lint", "--strict", str(CHART))
    helm("lint", "--strict", str(CHART), *VALUE_SETS["namespaced-custom"])


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_every_template_validates_strictly(helm, name):
    docs = render(helm, VALUE_SETS[name])
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["ClusterRole", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "Deployment",
                     "ServiceAccount"]
    for doc in docs:
        kubernetes_validate.validate(doc, "1.37.0", strict=True)


def test_operator_pod_is_locked_down(helm):
    (deployment,) = [d for d in render(helm, []) if d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    (container,) = pod["containers"]
    assert container["image"] == "localhost/shardline-operator:0.1.0"  # appVersion, pinned
    assert container["command"] == ["shardline-operator"]
    assert container["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                             "capabilities": {"drop": ["ALL"]}}
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert "--liveness-endpoint=http://$(POD_IP):8080/healthz" in container["args"]


def test_watch_namespaces_become_args(helm):
    (deployment,) = [d for d in render(helm, VALUE_SETS["namespaced-custom"]) if d["kind"] == "Deployment"]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=models" in args and "--namespace=staging" in args


def _cluster_role(helm, name: str) -> dict:
    (role,) = [d for d in render(helm, []) if d["kind"] == "ClusterRole" and d["metadata"]["name"] == name]
    return role


def test_staging_pods_may_only_read_and_patch_pods(helm):
    role = _cluster_role(helm, "shardline-staging")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "patch"]}]


def test_operator_is_told_the_staging_cluster_role(helm):
    (deployment,) = [d for d in render(helm, []) if d["kind"] == "Deployment"]
    env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["SHARDLINE_STAGING_CLUSTER_ROLE"] == "shardline-staging"


def test_rbac_is_least_privilege(helm):
    role = _cluster_role(helm, "shardline")
    granted = {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                assert "*" not in rule["verbs"] and resource != "*" and group != "*"
                granted[(group, resource)] = set(rule["verbs"])
    assert granted[("", "pods")] == {"get", "list", "watch", "patch", "delete"}
    assert "create" not in granted[("", "pods")]
    assert granted[("shardline.dev", "inferencedeployments")] == {"get", "list", "watch", "patch"}
    assert granted[("shardline.dev", "inferencedeployments/status")] == {"get", "patch"}
    # Secrets: the admin token is created once and read, the API key read; never listed or changed.
    assert granted[("", "secrets")] == {"get", "create"}
    assert granted[("networking.k8s.io", "networkpolicies")] == {"get", "list", "watch", "create", "patch", "delete"}


@pytest.mark.parametrize("extra,expected", [([], "shardline-system"),
                                            (["--set", "networkPolicy.operatorNamespace=ops"], "ops")])
def test_operator_knows_the_namespace_runtime_policies_admit(helm, extra, expected):
    (deployment,) = [d for d in render(helm, extra) if d["kind"] == "Deployment"]
    env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["SHARDLINE_OPERATOR_NAMESPACE"] == expected
