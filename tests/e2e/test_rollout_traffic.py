"""Issue 9, item 7: rollouts under client traffic in the local cluster, with no failed request.

Two groups (TP=1, one pod each) serve a tiny model. A client (``hack/scenario/traffic.py``)
sends completions at a fixed rate, round-robin over the group leaders that are Ready and not
terminating, a fresh connection each. Then:
an in-place rollout to rev-b; a canary whose verification fails (latency bound too small), so
it rolls back; a Restart rollout back to rev-a. Every step: 0 failed requests.
"""
from __future__ import annotations

import time
import uuid

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hack.scenario import rollout_fleet
from hack.scenario.models import write_revisions
from hack.scenario.operator_install import OPERATOR_NAMESPACE, install_operator
from hack.scenario.rollout_fleet import apply, two_group_doc
from hack.scenario.traffic import Traffic
from tests.kube_fixtures import agent_nodes_only

pytestmark = [pytest.mark.e2e, pytest.mark.cluster, pytest.mark.slow]

READY_TIMEOUT = 420


@pytest.fixture(scope="module")
def fleet(kube_cluster):
    revisions = write_revisions()
    install_operator(kube_cluster)
    ns = f"e2e-roll-{uuid.uuid4().hex[:6]}"
    doc = two_group_doc(ns, "roll", str(revisions["rev-a"]), "rev-a")
    with agent_nodes_only(kube_cluster):
        watch = apply(kube_cluster, doc)
        state = {"cluster": kube_cluster, "ns": ns, "client": kube_cluster.client(), "watch": watch,
                 "revisions": revisions, "model": doc["spec"]["model"]["name"]}
        wait_ready(state, "rev-a", 0)
        yield state
    watch.stop()
    kube_cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def wait_ready(fleet, revision: str, since: int):
    return rollout_fleet.wait_ready(fleet["watch"], revision, since, READY_TIMEOUT)


def patch(fleet, spec: dict) -> None:
    rollout_fleet.patch(fleet["cluster"], fleet["ns"], "roll", spec)


def traffic(fleet) -> Traffic:
    return Traffic(fleet["cluster"].client(), fleet["ns"], "roll", fleet["model"])


def diagnostics(fleet) -> str:
    return rollout_fleet.diagnostics(fleet["cluster"], fleet["watch"])


def operator_sample(fleet, name: str) -> float:
    """A sample of the operator pod's live ``/metrics`` (port 8081, the chart's default) for this
    deployment (0.0 if absent)."""
    pods = fleet["client"].get(f"/api/v1/namespaces/{OPERATOR_NAMESPACE}/pods")["items"]
    ip = next(p["status"]["podIP"] for p in pods
              if p.get("status", {}).get("podIP") and not p["metadata"].get("deletionTimestamp"))
    text = httpx.get(f"http://{ip}:8081/metrics", timeout=10).text
    labels = {"namespace": fleet["ns"], "name": "roll"}
    return next((s.value for f in text_string_to_metric_families(text) for s in f.samples
                 if s.name == name and s.labels == labels), 0.0)


def test_in_place_rollout_under_traffic_fails_no_request(fleet):
    mark = fleet["watch"].mark()
    recaptures = operator_sample(fleet, "shardline_operator_group_recapture_seconds_count")
    with traffic(fleet) as client:
        started = time.monotonic()
        patch(fleet, {"model": {"path": str(fleet["revisions"]["rev-b"]), "revision": "rev-b"}})
        wait_ready(fleet, "rev-b", mark)
        print(f"in-place rollout of 2 groups: {time.monotonic() - started:.1f}s, {client.sent} requests")
    assert client.sent > 0 and client.failures == [], diagnostics(fleet)
    # Each group's update reply carried recapture_seconds, and the operator observed both.
    assert operator_sample(fleet, "shardline_operator_group_recapture_seconds_count") == recaptures + 2
    phases = fleet["watch"].phases_since(mark)
    assert "RollingOut" in phases or phases.count("UpdatingWeights") >= 1, phases
    assert "Ready" not in phases[:-1] or phases.index("Ready") == len(phases) - 1 or \
        all(p == "Ready" for p in phases[phases.index("Ready"):]), phases


def test_canary_failing_verification_rolls_back_without_failed_requests(fleet):
    mark = fleet["watch"].mark()
    with traffic(fleet) as client:
        patch(fleet, {"model": {"path": str(fleet["revisions"]["rev-a"]), "revision": "rev-a"},
                      "weightUpdate": {"canary": {"verify": {"prompt": "Hello", "maxTokens": 4,
                                                             "maxLatencySeconds": 0.000001}}}})
        snap = fleet["watch"].wait(lambda s: s.conditions.get("WeightsUpdated", ("",))[0] == "False"
                                   and "rolled back" in s.conditions["WeightsUpdated"][2], READY_TIMEOUT,
                                   "the canary rolled back", mark)
    assert "canary group 0 failed verification" in snap.conditions["WeightsUpdated"][2]
    assert snap.served_revision == "rev-b"
    assert client.sent > 0 and client.failures == [], diagnostics(fleet)


def test_restart_rollout_with_readiness_aware_clients_fails_no_request(fleet):
    mark = fleet["watch"].mark()
    with traffic(fleet) as client:
        patch(fleet, {"model": {"path": str(fleet["revisions"]["rev-a"]), "revision": "rev-a"},
                      "weightUpdate": {"strategy": "Restart", "canary": None}})
        wait_ready(fleet, "rev-a", mark)
    assert client.sent > 0 and client.failures == [], diagnostics(fleet)
    phases = fleet["watch"].phases_since(mark)
    during = phases[phases.index("RollingOut"):]  # before it: the failed canary's Degraded
    assert set(during) <= {"RollingOut", "Ready"} and during[-1] == "Ready", phases
