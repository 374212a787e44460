"""One level-based reconcile of an ``InferenceDeployment``: observe, decide, act, report.

Order of a pass: parse the spec -> list children -> remove groups beyond ``replicas`` ->
apply Services/PDB and create missing StatefulSets -> group health (whole-group restarts) ->
restart rollout of changed pod templates (one group at a time) -> in-place weight/graph
rollout -> status. Every decision is made by a pure module; this one only sequences the I/O,
so running it twice in a row changes nothing the second time.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

from . import labels
from .group_health import GroupRecord, decide
from .kube import KubeClient
from .observed import GroupObservation, group_pods
from .render import build_client_service, build_pod_disruption_budget, build_rank_service, build_statefulset
from .rollout import LeaderClient, RolloutState, advance, leader_url
from .runtime_args import ServedModel
from .spec import DeploymentSpec, SpecError, parse_spec
from .status import GroupReport, build_status, invalid_spec_status, record_from_status, status_patch

Event = tuple[str, str, str]  # (type, reason, message)
REAPPLY_SECONDS = 60.0


@dataclass
class Context:
    """Process-wide collaborators: the API client, the leader client, a clock, an apply cache."""

    kube: KubeClient
    leaders: LeaderClient
    clock: Callable[[], float] = time.time
    applied: dict[str, tuple[str, float]] = field(default_factory=dict)

    def apply(self, obj: Mapping[str, Any], now: float) -> None:
        """Server-side apply, skipped when the same content was applied under a minute ago."""
        key = f"{obj['kind']}/{obj['metadata']['namespace']}/{obj['metadata']['name']}"
        digest = hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()
        cached = self.applied.get(key)
        if cached is not None and cached[0] == digest and now - cached[1] < REAPPLY_SECONDS:
            return
        self.kube.apply(obj)
        self.applied[key] = (digest, now)


@dataclass
class ReconcileResult:
    """What a pass wrote and said; ``requeue_after_seconds`` asks for another pass that soon
    (for example while a group's leader is updating), or ``None`` for the slow resync."""

    status: dict[str, Any]
    events: list[Event]
    requeue_after_seconds: float | None = None


def _needs_restart(spec: DeploymentSpec, group: GroupObservation) -> bool:
    if group.restart_hash != spec.restart_hash():
        return True
    served, desired = group.served, ServedModel.desired(spec)
    return spec.weight_update.strategy == "Restart" and served is not None and (
        (served.path, served.revision) != (desired.path, desired.revision))


def _needs_in_place(spec: DeploymentSpec, group: GroupObservation) -> bool:
    return group.served is not None and group.served != ServedModel.desired(spec)


class Reconciler:
    """Runs passes for one object; holds its spec and live children for the pass."""

    def __init__(self, ctx: Context, body: Mapping[str, Any]) -> None:
        self.ctx, self.body = ctx, body
        meta = body["metadata"]
        self.name, self.namespace = meta["name"], meta["namespace"]
        self.generation = int(meta.get("generation") or 1)
        self.previous: Mapping[str, Any] = body.get("status") or {}
        self.events: list[Event] = []
        self.now = ctx.clock()

    def run(self) -> ReconcileResult:
        meta = self.body["metadata"]
        try:
            spec = parse_spec(self.name, self.namespace, meta.get("uid", ""), self.body.get("spec") or {})
        except SpecError as exc:
            if self.previous.get("message") != str(exc):
                self.events.append(("Warning", "InvalidSpec", str(exc)))
            return self._finish(invalid_spec_status(str(exc), self.generation, self.previous, self.now))
        groups, records = self._observe(spec)
        overrides: dict[int, str] = {}
        for group in groups:
            self._check_health(spec, group, records, overrides)
            self._remove_template_drift(group, records, overrides)
        rollout_state = RolloutState.from_status(self.previous.get("rollout"))
        in_flight = rollout_state is not None and rollout_state.group is not None
        stale = [g for g in groups if _needs_restart(spec, g)]
        trail: list[tuple[int, str]] = []
        if stale and not in_flight:
            self._restart_next(spec, stale[0], groups, records, overrides)
        else:
            pending = [g.index for g in groups if _needs_in_place(spec, g) and not _needs_restart(spec, g)]
            outcome = advance(rollout_state, ServedModel.desired(spec), groups, pending, spec.weight_update,
                              self.ctx.leaders, f"{self.namespace}/{self.name}", self.now)
            for index, served in outcome.apply.items():
                groups[index] = self._apply_group(spec, groups[index], served)
            overrides.update(outcome.group_phases)
            self.events.extend(outcome.events)
            rollout_state, trail = outcome.state, outcome.trail
        for index, phase in trail:  # phases passed through since the last pass, each as a status write
            reports = [GroupReport(g, records[g.index], phase if g.index == index else overrides.get(g.index))
                       for g in groups]
            step = build_status(spec, self.generation, reports, rollout_state, self.previous, self.now)
            self.events.append(("Normal", phase, f"group {index}: {phase}"))
            self._write(step)
        versions = self._weight_versions(groups)
        reports = [GroupReport(g, records[g.index], overrides.get(g.index), versions.get(g.index)) for g in groups]
        status = build_status(spec, self.generation, reports, rollout_state, self.previous, self.now)
        if status["phase"] != self.previous.get("phase"):
            kind = "Warning" if status["phase"] in ("Degraded", "Failed") else "Normal"
            self.events.append((kind, status["phase"], f"phase {self.previous.get('phase', 'None')} -> "
                                f"{status['phase']}" + (f": {status['message']}" if status["message"] else "")))
        return self._finish(status)

    def _weight_versions(self, groups: list[GroupObservation]) -> dict[int, str]:
        """Each ready group's ``weight_version`` from its leader (set by a trainer's weight sync);
        an unreachable leader keeps the last reported value."""
        previous = {item.get("index"): item.get("weightVersion") for item in self.previous.get("groups") or []}
        versions: dict[int, str] = {}
        for group in groups:
            url = leader_url(group) if group.ready else None
            info = self.ctx.leaders.server_info(url) if url else None
            version = (info or {}).get("weight_version") or previous.get(group.index)
            if isinstance(version, str):
                versions[group.index] = version
        return versions

    def _write(self, status: dict[str, Any]) -> None:
        status = {**status, "restartBudgetGeneration": self.generation}
        self.ctx.kube.patch_deployment_status(self.namespace, self.name, status_patch(self.previous, status))
        self.previous = status

    def _finish(self, status: dict[str, Any]) -> ReconcileResult:
        self._write(status)
        return ReconcileResult(dict(self.previous), self.events)

    def _observe(self, spec: DeploymentSpec) -> tuple[list[GroupObservation], dict[int, GroupRecord]]:
        kube, selector = self.ctx.kube, labels.selector_labels(self.name)
        statefulsets: dict[int, dict[str, Any]] = {}
        for sts in kube.list("apps/v1", "StatefulSet", self.namespace, selector):
            group = (sts["metadata"].get("labels") or {}).get(labels.LABEL_GROUP, "")
            if group.isdigit():
                statefulsets[int(group)] = sts
        for index in sorted(g for g in statefulsets if g >= spec.replicas):
            kube.delete("apps/v1", "StatefulSet", self.namespace, labels.statefulset_name(self.name, index))
            kube.delete("v1", "Service", self.namespace, labels.rank_service_name(self.name, index))
            self.events.append(("Normal", "GroupRemoved", f"group {index} removed (replicas={spec.replicas})"))
        for index in range(spec.replicas):
            self.ctx.apply(build_rank_service(spec, index), self.now)
        self.ctx.apply(build_client_service(spec), self.now)
        self.ctx.apply(build_pod_disruption_budget(spec), self.now)
        pods = group_pods(kube.list("v1", "Pod", self.namespace, selector))
        reset = self.previous.get("restartBudgetGeneration") != self.generation
        old = {item.get("index"): item for item in self.previous.get("groups") or []}
        groups, records = [], {}
        new_group_model = self._new_group_model(spec, statefulsets)
        for index in range(spec.replicas):
            record = record_from_status(old.get(index))
            records[index] = GroupRecord(pod_uids=record.pod_uids) if reset else record
            sts = statefulsets.get(index)
            if sts is None:
                sts = kube.apply(build_statefulset(spec, index, new_group_model))
                self.events.append(("Normal", "GroupCreated", f"group {index}: StatefulSet {sts['metadata']['name']}"))
            groups.append(GroupObservation(index, spec.parallelism.pods_per_group, sts, tuple(pods.get(index, []))))
        return groups, records

    def _new_group_model(self, spec: DeploymentSpec, statefulsets: Mapping[int, Any]) -> ServedModel:
        """What a group created now loads: the spec's model, except while a rollout is
        unfinished (or failed), when it joins the lowest existing group and is rolled with the rest."""
        if RolloutState.from_status(self.previous.get("rollout")) is not None:
            for index in sorted(statefulsets):
                served = GroupObservation(index, 0, statefulsets[index], ()).served
                if served is not None and index < spec.replicas:
                    return served
        return ServedModel.desired(spec)

    def _delete_pods(self, group: GroupObservation) -> None:
        """Delete every current pod of the group (listed afresh: a member recreated since the
        pass began must go too, or the group would mix incarnations or templates)."""
        current = self.ctx.kube.list("v1", "Pod", self.namespace, labels.group_selector_labels(self.name, group.index))
        for pod in current:
            if pod["metadata"].get("deletionTimestamp") is None:
                self.ctx.kube.delete("v1", "Pod", self.namespace, pod["metadata"]["name"])

    def _remove_template_drift(self, group: GroupObservation, records: dict[int, GroupRecord],
                               overrides: dict[int, str]) -> None:
        """Restart a group whose live pods do not all come from its StatefulSet's current
        template (e.g. one rank recreated while the operator was changing the template)."""
        hashes = {p.restart_hash for p in group.live_pods}
        if not hashes or hashes == {group.restart_hash} or overrides.get(group.index) == "Restarting":
            return
        self._delete_pods(group)
        records[group.index] = replace(records[group.index], pod_uids={})
        overrides[group.index] = "Restarting"
        self.events.append(("Normal", "GroupRestart", f"group {group.index}: pods from an older pod template"))

    def _check_health(self, spec: DeploymentSpec, group: GroupObservation, records: dict[int, GroupRecord],
                      overrides: dict[int, str]) -> None:
        decision = decide(group, records[group.index], spec.restart_policy, self.now)
        records[group.index] = decision.record
        if decision.action == "restart":
            self._delete_pods(group)
            overrides[group.index] = "Restarting"
            self.events.append(("Warning", "GroupRestart",
                                f"group {group.index} restart {decision.record.restarts}/"
                                f"{spec.restart_policy.max_group_restarts}: {decision.reason}"))
        elif decision.action == "wait":
            overrides[group.index] = "Restarting"
        elif decision.action == "fail":
            self.events.append(("Warning", "GroupFailed", f"group {group.index}: {decision.reason}"))

    def _restart_next(self, spec: DeploymentSpec, group: GroupObservation, groups: list[GroupObservation],
                      records: dict[int, GroupRecord], overrides: dict[int, str]) -> None:
        """Roll a changed pod template onto ``group`` once every other group is settled."""
        def settled(g: GroupObservation) -> bool:
            return g.ready or records[g.index].failed_message is not None

        if not all(settled(g) for g in groups if g.index != group.index):
            return
        groups[group.index] = self._apply_group(spec, group, ServedModel.desired(spec), relabel=False)
        self._delete_pods(group)
        records[group.index] = replace(records[group.index], pod_uids={}, failed_message=None)
        overrides[group.index] = "Restarting"
        self.events.append(("Normal", "GroupRestart", f"group {group.index}: rolling out the new pod template"))

    def _apply_group(self, spec: DeploymentSpec, group: GroupObservation, served: ServedModel,
                     relabel: bool = True) -> GroupObservation:
        """Re-render the group's StatefulSet for ``served``; relabel its running pods with the revision."""
        sts = self.ctx.kube.apply(build_statefulset(spec, group.index, served))
        for pod in group.live_pods if relabel else ():
            self.ctx.kube.merge_patch("v1", "Pod", self.namespace, pod.name,
                                      {"metadata": {"labels": {labels.LABEL_REVISION: served.revision}}})
        return replace(group, statefulset=sts)


def reconcile(ctx: Context, body: Mapping[str, Any]) -> ReconcileResult:
    """Run one pass for ``body`` (the object as read from the API) and patch its status."""
    return Reconciler(ctx, body).run()
