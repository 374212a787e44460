"""Issue 29, items 4 and 5 (operator side): leaders labelled with what they report serving, out
of routing before their update and back after it and a health check, one Service per served
revision (``routing.py``, ``routing_execute.py``)."""

from __future__ import annotations

import re

import pytest
from fake_kube import FakeKube

from shardline_operator import labels, routing_execute
from shardline_operator.observed import GroupObservation, LeaderObservation, PodObservation
from shardline_operator.pass_plan import (
    ApplyObject,
    DeleteObject,
    EnterRouting,
    LabelLeader,
    LeaveRouting,
    StartUpdate,
)
from shardline_operator.routing import plan_routing, with_leave_before_start
from shardline_operator.routing_execute import SLICE_POLL_SECONDS, perform_routing
from shardline_operator.weights import LeaderReport


def _group(index, phase="serving", revision="rev-b", served_label="rev-a", routable="true",
           ready=True, report=True, weight_version="default"):
    leader = PodObservation(
        name=f"llama-g{index}-0", uid=f"u{index}", rank=0, ip=f"10.0.0.{index + 1}",
        phase="Running", ready=ready, deleting=False, restart_count=0, terminated=False,
        error_message=None, restart_hash=None, routable=routable, served_revision=served_label,
        weight_version="default")
    answer = LeaderReport(phase, revision=revision, weight_version=weight_version) if report else None
    return GroupObservation(index, 1, None, (leader,), LeaderObservation(report=answer))


def _plan(make_spec, groups, wave=(), starting=(), found=()):
    return plan_routing(make_spec(), groups, frozenset(wave) | frozenset(starting), frozenset(starting),
                        tuple(found))


def _labels_of(plan, index):
    return {k: v for a in plan.labels if isinstance(a, LabelLeader) and a.group == index
            for k, v in a.labels.items()}


def test_served_revision_label_follows_the_leaders_report_not_the_old_label(make_spec):
    plan = _plan(make_spec, [_group(0, revision="rev-b", served_label="rev-a")])
    assert _labels_of(plan, 0)[labels.LABEL_SERVED_REVISION] == "rev-b"


def test_weight_version_label_follows_the_leaders_report(make_spec):
    plan = _plan(make_spec, [_group(0, weight_version="step-7")])
    assert _labels_of(plan, 0)[labels.LABEL_WEIGHT_VERSION] == "step-7"


def test_updating_leader_keeps_its_served_revision_label(make_spec):
    plan = _plan(make_spec, [_group(0, phase="loading", revision="rev-b", served_label="rev-a")], wave=[0])
    assert labels.LABEL_SERVED_REVISION not in _labels_of(plan, 0)


def test_starting_group_leaves_the_client_and_its_revision_service_before_its_update(make_spec):
    plan = _plan(make_spec, [_group(0, revision="rev-a")], starting=[0])
    assert plan.leave[0].services == ("llama", "llama-rev-rev-a")


def test_leave_routing_runs_just_before_the_groups_start_update(make_spec):
    plan = _plan(make_spec, [_group(0, revision="rev-a")], starting=[0])
    start = StartUpdate(0, "http://10.0.0.1:8000", {}, 60)
    assert with_leave_before_start([start], plan.leave) == [plan.leave[0], start]


def test_group_of_the_wave_still_routable_is_taken_out(make_spec):
    plan = _plan(make_spec, [_group(0, phase="loading", routable="true")], wave=[0])
    assert _labels_of(plan, 0)[labels.LABEL_ROUTABLE] == "false"


def test_group_back_from_its_update_returns_after_a_health_check(make_spec):
    plan = _plan(make_spec, [_group(0, routable="false")])
    assert [a.group for a in plan.labels if isinstance(a, EnterRouting)] == [0]


def test_unready_group_does_not_return_to_routing(make_spec):
    plan = _plan(make_spec, [_group(0, routable="false", ready=False)])
    assert not [a for a in plan.labels if isinstance(a, EnterRouting)]


def test_group_still_in_the_wave_does_not_return_to_routing(make_spec):
    plan = _plan(make_spec, [_group(0, routable="false")], wave=[0])
    assert not [a for a in plan.labels if isinstance(a, EnterRouting)]


def test_one_service_per_served_revision(make_spec):
    plan = _plan(make_spec, [_group(0, revision="rev-a"), _group(1, revision="rev-b")])
    names = [a.obj["metadata"]["name"] for a in plan.services if isinstance(a, ApplyObject)]
    assert names == ["llama-rev-rev-a", "llama-rev-rev-b"]


def test_revision_service_selects_routable_leaders_of_its_revision(make_spec):
    plan = _plan(make_spec, [_group(0, revision="rev-a")])
    selector = plan.services[0].obj["spec"]["selector"]
    assert selector == {labels.LABEL_DEPLOYMENT: "llama", labels.LABEL_POD_INDEX: "0",
                        labels.LABEL_ROUTABLE: "true", labels.LABEL_SERVED_REVISION: "rev-a"}


def test_status_lists_each_revision_service_with_its_groups(make_spec):
    plan = _plan(make_spec, [_group(0, revision="rev-b"), _group(1, revision="rev-b")])
    assert plan.status == [{"revision": "rev-b", "service": "llama-rev-rev-b", "groups": [0, 1]}]


def test_revision_service_no_group_serves_is_deleted(make_spec):
    plan = _plan(make_spec, [_group(0, revision="rev-b")], found=["llama-rev-rev-a", "llama-rev-rev-b"])
    assert [a.name for a in plan.services if isinstance(a, DeleteObject)] == ["llama-rev-rev-a"]


def test_unreachable_leader_keeps_its_revision_service(make_spec):
    plan = _plan(make_spec, [_group(0, report=False, served_label="rev-a")], found=["llama-rev-rev-a"])
    assert not [a for a in plan.services if isinstance(a, DeleteObject)]


@pytest.mark.parametrize("revision", ["Rev_B.1", "hf://Org/Model@0123456789abcdef0123456789abcdef01234567",
                                      "x" * 80, "étiquette"])
def test_revision_service_name_is_a_dns_label(revision):
    name = labels.revision_service_name("llama", revision)
    assert re.fullmatch(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?", name), name


@pytest.mark.parametrize("revision", ["Rev_B.1", "s3://bucket/prefix", "x" * 80, "-a-"])
def test_label_value_is_a_valid_label_value(revision):
    value = labels.label_value(revision)
    assert re.fullmatch(r"(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?", value), value


def test_label_value_keeps_distinct_revisions_distinct():
    assert labels.label_value("a/b") != labels.label_value("a:b")


def _pod_in(kube):
    kube.apply({"kind": "Pod", "metadata": {"name": "llama-g0-0", "namespace": "default",
                                            "labels": {labels.LABEL_ROUTABLE: "true"}}})


def _slice(kube, ip):
    kube.apply({"kind": "EndpointSlice", "metadata": {
        "name": "llama-abc", "namespace": "default", "labels": {"kubernetes.io/service-name": "llama"}},
        "endpoints": [{"addresses": [ip]}]})


def test_leave_routing_waits_until_the_endpoint_slice_drops_the_leader(monkeypatch):
    monkeypatch.setattr(routing_execute, "GATEWAY_SETTLE_SECONDS", 1.0)
    kube = FakeKube()
    _pod_in(kube)
    _slice(kube, "10.0.0.1")
    polls = []

    def sleep(seconds):  # the EndpointSlice controller drops the pod after three polls
        polls.append(seconds)
        if len(polls) == 3:
            kube.delete("discovery.k8s.io/v1", "EndpointSlice", "default", "llama-abc")

    perform_routing(kube, None, "default", LeaveRouting(0, "llama-g0-0", "10.0.0.1", ("llama",), 30), sleep)
    assert polls == [SLICE_POLL_SECONDS] * 3


def test_leave_routing_leaves_the_gateway_settle_to_the_update(monkeypatch):
    monkeypatch.setattr(routing_execute, "GATEWAY_SETTLE_SECONDS", 1.0)
    # No slice lists the leader (the wait ends at once), yet a gateway watching the label (the
    # GIE endpoint picker: 0.2-0.3 s) may still send requests: the leave does not sleep, it
    # returns the settle still to run, which the update must go on admitting for.
    kube = FakeKube()
    _pod_in(kube)
    slept = []
    left = perform_routing(kube, None, "default", LeaveRouting(0, "llama-g0-0", "10.0.0.1", ("llama",), 30), slept.append)
    assert slept == [] and 0.5 < left <= 1.0


def test_leave_routing_that_times_out_returns_no_settle(monkeypatch):
    # The slices still list the leader at the deadline: it did not leave routing, so its update
    # gets neither an admission window nor keep_ready (``execute.with_admission``).
    kube = FakeKube()
    _pod_in(kube)
    _slice(kube, "10.0.0.1")
    left = perform_routing(kube, None, "default", LeaveRouting(0, "llama-g0-0", "10.0.0.1", ("llama",), 0), lambda s: None)
    assert left is None


def test_leave_routing_labels_the_leader_unroutable():
    kube = FakeKube()
    _pod_in(kube)
    perform_routing(kube, None, "default", LeaveRouting(0, "llama-g0-0", "10.0.0.1", ("llama",), 30), lambda s: None)
    assert kube.get("v1", "Pod", "default", "llama-g0-0")["metadata"]["labels"][labels.LABEL_ROUTABLE] == "false"


class _Health:
    def __init__(self, passed):
        self.passed = passed

    def verify(self, url, verify):
        return self.passed, "checked"


def test_enter_routing_after_a_failed_health_check_stays_out():
    kube = FakeKube()
    _pod_in(kube)
    kube.merge_patch("v1", "Pod", "default", "llama-g0-0", {"metadata": {"labels": {labels.LABEL_ROUTABLE: "false"}}})
    perform_routing(kube, _Health(False), "default", EnterRouting(0, "llama-g0-0", "http://x"))
    assert kube.get("v1", "Pod", "default", "llama-g0-0")["metadata"]["labels"][labels.LABEL_ROUTABLE] == "false"


def test_enter_routing_after_a_passed_health_check_is_routable():
    kube = FakeKube()
    _pod_in(kube)
    perform_routing(kube, _Health(True), "default", EnterRouting(0, "llama-g0-0", "http://x"))
    assert kube.get("v1", "Pod", "default", "llama-g0-0")["metadata"]["labels"][labels.LABEL_ROUTABLE] == "true"
