"""Routing of group leaders (pure, part of ``decide``): out of routing while a group updates,
labels that say what each leader serves, and one Service per served revision.

- **What a leader serves** (status follows the runtime, issue 23): its pod carries
  ``shardline.dev/served-revision`` and ``shardline.dev/weight-version`` as its leader *reports*
  them (``/get_server_info``) while it is not updating; an unreachable or updating leader keeps
  its labels. Never taken from the spec.
- **Out of routing while updating** (issue 29): every routing path selects
  ``shardline.dev/routable: "true"`` (the client Service, the per-revision Services, a
  gateway's label discovery). Before a group's update is sent, its leader is labelled
  ``"false"`` and the operator waits until the Services' EndpointSlices drop it
  (:class:`LeaveRouting`, inserted before the ``StartUpdate``); a group of the wave in flight
  stays out; once it has left the wave (available on the target, the planner's rule), Ready and
  serving, it comes back after ``/health_generate`` answers (:class:`EnterRouting`).
  The planner's availability rule (``GroupView.available``) counts such a group unavailable
  while it updates and until it is labelled back, so no other group leaves in the pass that
  returns it, nor while its check fails.
- **Per-revision Services**: ``<name>-rev-<revision>`` exists while some live leader serves the
  revision (created when the first group reports serving it, deleted when none does), selecting
  the routable leaders labelled with it: a client that must stay on one revision (an RL loop)
  sends there, with ``X-Shardline-Revision`` as a fence (``docs/operations.md``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import labels
from .observed import GroupObservation, pod_url
from .pass_plan import (
    Action,
    ApplyObject,
    DeleteObject,
    EnterRouting,
    LabelLeader,
    LeaveRouting,
    StartUpdate,
)
from .render import build_revision_service
from .spec import DeploymentSpec

LEAVE_TIMEOUT_SECONDS = 10.0  # EndpointSlices normally drop a relabelled pod within a second


@dataclass(frozen=True)
class LeaderServes:
    """What one group's leader serves, as label values (``revision`` None: not known yet) and
    the revision as reported (for status)."""

    revision: str | None
    weight_version: str | None
    reported_revision: str | None


def leader_serves(group: GroupObservation) -> LeaderServes | None:
    """From the leader's report while it is not updating; else the labels it already carries.
    None without a live leader."""
    leader = group.leader
    if leader is None:
        return None
    report = group.answers.report
    if report is not None and not report.weights_phase.updating and report.revision is not None:
        version = report.weight_version
        return LeaderServes(
            labels.label_value(report.revision),
            None if version is None else labels.label_value(version),
            report.revision,
        )
    return LeaderServes(leader.served_revision, leader.weight_version, leader.served_revision)


@dataclass
class RoutingPlan:
    """The routing actions of a pass: ``labels`` (relabels and returns to routing),
    ``leave`` (by group: the action to run just before that group's ``StartUpdate``),
    ``services`` (apply / delete of per-revision Services) and ``status`` (``status.
    revisionServices``: ``[{revision, service, groups}]``, sorted by revision)."""

    labels: list[Action] = field(default_factory=list)
    leave: dict[int, LeaveRouting] = field(default_factory=dict)
    services: list[Action] = field(default_factory=list)
    status: list[dict[str, Any]] = field(default_factory=list)


def _label_changes(group: GroupObservation, serves: LeaderServes) -> dict[str, str | None]:
    leader = group.leader
    assert leader is not None  # leader_serves returned a record
    changes: dict[str, str | None] = {}
    if serves.revision is not None and leader.served_revision != serves.revision:
        changes[labels.LABEL_SERVED_REVISION] = serves.revision
    if serves.revision is not None and leader.weight_version != serves.weight_version:
        changes[labels.LABEL_WEIGHT_VERSION] = serves.weight_version
    return changes


def plan_routing(
    spec: DeploymentSpec,
    groups: Sequence[GroupObservation],
    wave: frozenset[int],
    starting: frozenset[int],
    found_services: Sequence[str],
) -> RoutingPlan:
    """The routing actions for ``groups`` (those below ``replicas``), given the wave in flight
    after this pass's planning (``wave``, which includes ``starting``: the groups whose update is
    sent this pass) and the per-revision Services found (``found_services``)."""
    plan = RoutingPlan()
    served: dict[str, tuple[str, list[int]]] = {}
    for group in groups:
        serves = leader_serves(group)
        leader = group.leader
        if serves is None or leader is None:
            continue
        changes = _label_changes(group, serves)
        if group.index in starting and leader.ip:
            services = [spec.name]
            if serves.revision is not None:
                services.append(labels.revision_service_name(spec.name, serves.revision))
            plan.leave[group.index] = LeaveRouting(
                group.index, leader.name, leader.ip, tuple(services), LEAVE_TIMEOUT_SECONDS
            )
        elif group.index in wave and leader.routable != "false":
            changes[labels.LABEL_ROUTABLE] = "false"
        elif group.index not in wave and _may_return(group) and not group.routable:
            url = pod_url(leader)
            if url is not None:
                plan.labels.append(EnterRouting(group.index, leader.name, url))
        if changes:
            plan.labels.insert(0, LabelLeader(group.index, leader.name, changes))
        if serves.revision is not None:
            shown = serves.reported_revision or serves.revision
            served.setdefault(serves.revision, (shown, []))[1].append(group.index)
    wanted = set()
    for value, (shown, indices) in sorted(served.items()):
        service = build_revision_service(spec, value)
        name = service["metadata"]["name"]
        wanted.add(name)
        plan.services.append(ApplyObject(service))
        plan.status.append({"revision": shown, "service": name, "groups": sorted(indices)})
    for name in found_services:
        if name not in wanted:
            plan.services.append(DeleteObject("v1", "Service", name))
    return plan


def _may_return(group: GroupObservation) -> bool:
    """Ready, and its leader reports weights that are not changing."""
    report = group.answers.report
    return group.ready and report is not None and not report.weights_phase.updating


def with_leave_before_start(
    actions: Sequence[Action], leave: Mapping[int, LeaveRouting]
) -> list[Action]:
    """``actions`` with each group's :class:`LeaveRouting` just before its ``StartUpdate``."""
    out: list[Action] = []
    for action in actions:
        if isinstance(action, StartUpdate) and action.group in leave:
            out.append(leave[action.group])
        out.append(action)
    return out
