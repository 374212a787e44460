"""The chart's monitoring objects against the REAL prometheus-operator CRDs (marker ``cluster``).

The CRDs come from the prometheus-operator Go module (``hack/localcluster/prometheus_crds.py``
fetches them once through the Go module proxy and caches them); they are applied to the local
API server, which then validates the chart's ServiceMonitors and PrometheusRule with the
CRDs' own OpenAPI schemas in a server-side dry run. Nothing is persisted.
"""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from hack.localcluster.prometheus_crds import ensure_crds

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

CHART = Path(__file__).resolve().parents[2] / "charts" / "shardline"
NAMESPACE = "monitoring-it"
ALL_ON = ["--set", "metrics.serviceMonitor.enabled=true", "--set", "metrics.prometheusRule.enabled=true",
          "--set", "metrics.dashboard.enabled=true"]


@pytest.fixture(scope="module")
def monitoring_crds(kube_cluster):
    try:
        paths = ensure_crds()
    except RuntimeError as exc:
        pytest.fail(f"cannot fetch the prometheus-operator CRDs: {exc}")
    for path in paths:  # server-side: the CRDs exceed the client-side last-applied annotation limit
        kube_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(path), timeout=120)
    kube_cluster.kubectl("wait", "--for", "condition=established", "--timeout=60s",
                         "crd/servicemonitors.monitoring.coreos.com", "crd/prometheusrules.monitoring.coreos.com")
    kube_cluster.kubectl("create", "namespace", NAMESPACE, check=False)
    return kube_cluster


def dry_run(cluster, docs, check=True):
    return cluster.kubectl("apply", "--dry-run=server", "-n", NAMESPACE, "-f", "-", check=check,
                           input=yaml.safe_dump_all(docs))


def chart_monitoring_docs(cluster, *extra):
    out = cluster.helm("template", "shardline", str(CHART), "--namespace", NAMESPACE, *ALL_ON, *extra).stdout
    return [d for d in yaml.safe_load_all(out) if d and d["kind"] in
            ("ServiceMonitor", "PrometheusRule", "ConfigMap", "Service")]


@pytest.mark.parametrize("extra", [[], ["--set", "watchNamespaces={models,staging}", "--set",
                                        "metrics.serviceMonitor.labels.release=prom"]])
def test_chart_objects_pass_the_real_crd_schemas(monitoring_crds, extra):
    docs = chart_monitoring_docs(monitoring_crds, *extra)
    assert sorted(d["kind"] for d in docs) == ["ConfigMap", "PrometheusRule", "Service", "ServiceMonitor",
                                               "ServiceMonitor"]
    out = dry_run(monitoring_crds, docs).stdout
    assert out.count("(server dry run)") == len(docs), out


def test_the_crd_schemas_do_reject_bad_objects(monitoring_crds):
    """The dry run above is a real check: the same objects, broken, are refused."""
    docs = chart_monitoring_docs(monitoring_crds)
    (monitor, *_) = [copy.deepcopy(d) for d in docs if d["kind"] == "ServiceMonitor"]
    monitor["spec"]["endpoints"][0]["interval"] = "every minute"
    proc = dry_run(monitoring_crds, [monitor], check=False)
    assert proc.returncode != 0 and "spec.endpoints[0].interval" in proc.stderr, proc.stderr
    (rule,) = [copy.deepcopy(d) for d in docs if d["kind"] == "PrometheusRule"]
    rule["spec"]["groups"][0]["rules"][0]["for"] = "ten minutes"
    proc = dry_run(monitoring_crds, [rule], check=False)
    assert proc.returncode != 0 and "for" in proc.stderr, proc.stderr
