"""The chart's monitoring objects with the real helm CLI: off by default, rendered behind the
``metrics.*`` flags, and the operator's ``--metrics-port`` wiring. Their schemas are checked
against the real prometheus-operator CRDs by tests/cluster/test_monitoring_crds.py."""

from __future__ import annotations

import json
from pathlib import Path

import kubernetes_validate
import yaml

CHART = Path(__file__).resolve().parents[2] / "charts" / "shardline"
ALL_ON = ["--set", "metrics.serviceMonitor.enabled=true", "--set", "metrics.prometheusRule.enabled=true",
          "--set", "metrics.dashboard.enabled=true"]


def render(helm, *extra):
    out = helm("template", "shardline", str(CHART), "--namespace", "shardline-system", *extra).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def operator_container(docs):
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    return deployment["spec"]["template"]["spec"]["containers"][0]


def test_monitoring_is_off_by_default_and_the_port_is_served(helm):
    docs = render(helm)
    assert not [d for d in docs if d["kind"] in ("ServiceMonitor", "PrometheusRule", "ConfigMap", "Service")]
    container = operator_container(docs)
    assert "--metrics-port=8081" in container["args"]
    assert {"name": "metrics", "containerPort": 8081, "protocol": "TCP"} in container["ports"]
    disabled = operator_container(render(helm, "--set", "metrics.port=0"))
    assert "--metrics-port=0" in disabled["args"]
    assert [p["name"] for p in disabled["ports"]] == ["health"]


def test_flags_render_servicemonitors_rule_and_dashboard(helm):
    helm("lint", "--strict", str(CHART), *ALL_ON)
    docs = render(helm, *ALL_ON, "--set", "metrics.serviceMonitor.labels.release=kube-prometheus-stack",
                  "--set", "watchNamespaces={models}")
    by_kind: dict[str, list] = {}
    for doc in docs:
        by_kind.setdefault(doc["kind"], []).append(doc)
    for doc in by_kind["Service"] + by_kind["ConfigMap"]:
        kubernetes_validate.validate(doc, "1.37.0", strict=True)
    monitors = {m["metadata"]["name"]: m for m in by_kind["ServiceMonitor"]}
    assert set(monitors) == {"shardline-operator", "shardline-runtime"}
    assert all(m["metadata"]["labels"]["release"] == "kube-prometheus-stack" for m in monitors.values())
    (service,) = by_kind["Service"]
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"
    assert monitors["shardline-operator"]["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
    runtime = monitors["shardline-runtime"]["spec"]
    # Leaders only, through the client Service (rank Services carry the group label).
    assert runtime["selector"]["matchExpressions"] == [{"key": "shardline.dev/group", "operator": "DoesNotExist"}]
    assert runtime["namespaceSelector"] == {"matchNames": ["models"]}
    (rule,) = by_kind["PrometheusRule"]
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    assert set(alerts) == {"ShardlineRolloutStuck", "ShardlineMixedVersions", "ShardlineGroupFailed",
                           "ShardlineRestartBudgetNearlyUsed"}
    assert alerts["ShardlineRolloutStuck"]["for"] == "30m" and alerts["ShardlineMixedVersions"]["for"] == "10m"
    assert "{{ $labels.namespace }}" in alerts["ShardlineGroupFailed"]["annotations"]["summary"]
    (dashboard,) = by_kind["ConfigMap"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["shardline.json"])["uid"] == "shardline-overview"


def test_alert_thresholds_come_from_values(helm):
    docs = render(helm, "--set", "metrics.prometheusRule.enabled=true", "--set",
                  "metrics.prometheusRule.mixedVersionsMinutes=3", "--set-json",
                  "metrics.prometheusRule.restartBudgetFraction=0.5")
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    assert alerts["ShardlineMixedVersions"]["for"] == "3m"
    assert alerts["ShardlineRestartBudgetNearlyUsed"]["expr"].rstrip().endswith(">= 0.5")


def test_bad_monitoring_values_are_refused(helm):
    proc = helm("template", "x", str(CHART), "--set", "metrics.port=0", "--set",
                "metrics.serviceMonitor.enabled=true", check=False)
    assert proc.returncode != 0 and "metrics.serviceMonitor.enabled needs metrics.port" in proc.stderr
    proc = helm("template", "x", str(CHART), "--set", "metrics.prometheusRule.restartBudgetFraction=2", check=False)
    assert proc.returncode != 0 and "restartBudgetFraction" in proc.stderr
