"""Every PromQL expression the chart ships (Grafana dashboard and PrometheusRule alerts) names
only metrics that the operator or the runtime really export, read from their live ``/metrics``:
the operator's endpoint (``metrics.serve``, what ``shardline-operator --metrics-port`` starts)
and a real runtime server on a tiny checkpoint. Expressions are parsed with a PromQL parser
(``promql-parser``), not matched by pattern."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import httpx
import promql_parser
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.chart.conftest import find_helm

CHART = Path(__file__).resolve().parents[2] / "charts" / "shardline"
# Series names a family of each type exposes (prometheus_client's exposition).
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "summary": ("", "_sum", "_count", "_created"), "gauge": ("",), "info": ("_info",),
            "unknown": ("",), "stateset": ("",), "gaugehistogram": ("_bucket", "_gsum", "_gcount")}
GRAFANA_RANGES = re.compile(r"\$__(rate_interval|interval|range)")


def exported_series(text: str) -> set[str]:
    return {family.name + suffix for family in text_string_to_metric_families(text)
            for suffix in SUFFIXES[family.type]}


def metric_names(expr) -> set[str]:
    """Metric names of every vector selector in a parsed PromQL expression."""
    if isinstance(expr, promql_parser.VectorSelector):
        names = {expr.name} if expr.name else set()
        return names | {m.value for m in expr.matchers.matchers if m.name == "__name__"}
    found: set[str] = set()
    for attr in ("lhs", "rhs", "expr", "vector_selector", "param"):
        child = getattr(expr, attr, None)
        if child is not None and not isinstance(child, (str, int, float)):
            found |= metric_names(child)
    for child in getattr(expr, "args", None) or []:
        found |= metric_names(child)
    return found


def chart_expressions() -> list[tuple[str, str]]:
    """``(where, PromQL)`` for every dashboard target and variable, and every alert."""
    helm = find_helm()
    if helm is None:
        pytest.skip("helm CLI not found (build it with `python3 -m hack.localcluster build`)")
    import subprocess

    out = subprocess.run([helm, "template", "x", str(CHART), "--set", "metrics.prometheusRule.enabled=true",
                          "--set", "metrics.dashboard.enabled=true"], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    exprs = []
    for doc in docs:
        if doc["kind"] == "PrometheusRule":
            exprs += [(f"alert {r['alert']}", r["expr"]) for g in doc["spec"]["groups"] for r in g["rules"]]
        elif doc["kind"] == "ConfigMap":
            dashboard = json.loads(doc["data"]["shardline.json"])
            exprs += [(f"panel {p['title']!r}", t["expr"]) for p in dashboard["panels"] for t in p["targets"]]
            for var in dashboard["templating"]["list"]:
                match = re.fullmatch(r"label_values\((.+), *\w+\)", var.get("query", "") if var["type"] == "query" else "")
                if var["type"] == "query":
                    assert match, f"variable {var['name']}: unexpected query {var['query']!r}"
                    exprs.append((f"variable {var['name']}", match.group(1)))
    return exprs


@pytest.fixture(scope="module")
def operator_metrics_text():
    from shardline_operator import handlers, metrics  # noqa: F401  (everything the operator registers)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server, thread = metrics.serve(port, addr="127.0.0.1")
    try:
        yield httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    finally:
        server.shutdown()
        thread.join(5)


def test_every_chart_promql_names_a_live_metric(server, operator_metrics_text):
    runtime_text = server.get("/metrics").text
    exported = exported_series(operator_metrics_text) | exported_series(runtime_text)
    assert "shardline_operator_groups" in exported and "shardline:request_success_total" in exported
    exprs = chart_expressions()
    assert len(exprs) >= 20, exprs
    unknown, uses = [], set()
    for where, text in exprs:
        names = metric_names(promql_parser.parse(GRAFANA_RANGES.sub("5m", text)))
        assert names, f"{where}: no metric in {text!r}"
        uses |= names
        unknown += [f"{where}: {n}" for n in sorted(names - exported)]
    assert not unknown, "metrics no live /metrics exports:\n" + "\n".join(unknown)
    # The alerts' inputs, each used at least once.
    assert {"shardline_operator_rollout_in_progress", "shardline_operator_mixed_version_groups",
            "shardline_operator_failed_groups", "shardline_operator_group_restarts",
            "shardline_operator_restart_budget"} <= uses
    # The dashboard's update / recapture panel (the operator feeds both from each group's update).
    assert {"shardline_operator_group_update_seconds_sum", "shardline_operator_group_recapture_seconds_sum",
            "shardline_operator_group_recapture_seconds_count"} <= uses


def test_parser_walk_finds_names_and_misses_unknown():
    """The checker itself: a misspelt metric is reported, nested names are all found."""
    expr = promql_parser.parse('sum(rate(a_total[5m])) / on(x) group_left max({__name__="b"} > 0) + count(c)')
    assert metric_names(expr) == {"a_total", "b", "c"}
    assert exported_series("# HELP a h\n# TYPE a counter\n") == {"a_total", "a_created"}
