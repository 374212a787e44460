"""One level-based reconcile of an ``InferenceDeployment``: observe, decide, act, report.

Order of a pass: parse the spec -> list children -> remove groups beyond ``replicas`` ->
apply Services/PDB and create missing StatefulSets -> group health (whole-group restarts) ->
gather the leaders' reports -> restart rollout of changed pod templates (one group at a time,
``restart_plan``) or the in-place weight/graph rollout (``rollout.plan_rollout``) -> status and
operator metrics. Every decision is made by a pure module; this one only sequences the I/O, so
running it twice in a row changes nothing the second time. ``ReconcileResult.requeue_after_seconds``
asks for the next pass soon while a wave is in flight, so a rollout is bound by the updates.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from . import labels, metrics
from .credentials import api_key_from_secret, credentials_digest, new_admin_token, secret_value
from .group_health import GroupRecord, decide
from .kube import KubeClient
from .lora_sync import LoRALeaderClient, LoRAReport, lora_status, sync
from .observed import GroupObservation, group_pods
from .render import (
    build_admin_secret,
    build_client_service,
    build_network_policy,
    build_pod_disruption_budget,
    build_rank_service,
    build_statefulset,
)
from .restart_plan import needs_restart, next_restart
from .rollout import GroupView, RolloutPlan, plan_rollout
from .rollout_executor import LeaderClient, gather, start_updates
from .rollout_state import RolloutState
from .runtime_args import ServedModel
from .spec import DeploymentSpec, SpecError, parse_spec
from .status import GroupReport, build_status, invalid_spec_status, record_from_status, status_patch

Event = tuple[str, str, str]  # (type, reason, message)
REAPPLY_SECONDS = 60.0
RESTART_POLL_SECONDS = 2.0
LORA_RETRY_SECONDS = 5.0  # adapters not yet on every group: look again soon


@dataclass
class Context:
    """Process-wide collaborators: the API client, the leader client, a clock, an apply cache,
    and the operator's own namespace (None when it runs outside the cluster)."""

    kube: KubeClient
    leaders: LeaderClient
    clock: Callable[[], float] = time.time
    applied: dict[str, tuple[str, float]] = field(default_factory=dict)
    operator_namespace: str | None = None

    def leaders_with_token(self, token: str, api_key: str | None = None) -> LeaderClient:
        """The leader client sending ``token`` as the admin key and ``api_key`` on the canary
        gate's serving calls (when it can send keys)."""
        with_token = getattr(self.leaders, "with_token", None)
        return with_token(token, api_key) if with_token is not None else self.leaders

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


def _pruned(value: Any) -> Any:
    """``value`` without None-valued keys at any depth: what the API server stores of it."""
    if isinstance(value, Mapping):
        return {k: _pruned(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_pruned(v) for v in value]
    return value


class Reconciler:
    """Runs passes for one object; holds its spec and live children for the pass."""

    def __init__(self, ctx: Context, body: Mapping[str, Any]) -> None:
        self.ctx, self.body = ctx, body
        meta = body["metadata"]
        self.name, self.namespace = meta["name"], meta["namespace"]
        self.generation = int(meta.get("generation") or 1)
        self.previous: Mapping[str, Any] = body.get("status") or {}
        self.events: list[Event] = []
        self.leaders: LeaderClient = ctx.leaders
        self.now = ctx.clock()
        self.requeue_after: float | None = None  # soonest time-based reason for the next pass

    def run(self) -> ReconcileResult:
        meta = self.body["metadata"]
        try:
            spec = parse_spec(
                self.name, self.namespace, meta.get("uid", ""), self.body.get("spec") or {}
            )
            spec, admin_token, api_key = self._credentials(spec)
            # Control and info calls carry the admin token; the canary gate the API key.
            self.leaders = self.ctx.leaders_with_token(admin_token, api_key)
        except SpecError as exc:
            if self.previous.get("message") != str(exc):
                self.events.append(("Warning", "InvalidSpec", str(exc)))
            return self._finish(
                invalid_spec_status(str(exc), self.generation, self.previous, self.now)
            )
        groups, records = self._observe(spec)
        overrides: dict[int, str] = {}
        planned: set[int] = set()
        for group in groups:
            self._check_health(spec, group, records, overrides)
            self._remove_template_drift(group, records, overrides)
        key_prefix = f"{self.namespace}/{self.name}"
        rollout_state = RolloutState.from_status(self.previous.get("rollout"))
        digests = {
            item.get("index"): item.get("weightsDigest")
            for item in self.previous.get("groups") or []
        }
        for group in groups:  # a digest is recorded per incarnation: new pods report afresh
            if (
                overrides.get(group.index) == "Restarting"
                or group.leader is None
                or not group.ready
            ):
                digests[group.index] = None
        views = gather(rollout_state, groups, digests, spec.weight_update, self.leaders, key_prefix)
        wave_in_flight = rollout_state is not None and bool(rollout_state.wave)
        failed = {i: r.failed_message is not None for i, r in records.items()}
        stale = [g.index for g in groups if needs_restart(spec, g)]
        restart = next_restart(spec, groups, failed, wave_in_flight)
        plan = RolloutPlan(rollout_state)
        if restart is not None:
            self._restart_group(spec, restart, groups, records, overrides)
            planned.add(restart.index)
            digests[restart.index] = None
        elif not (stale and not wave_in_flight):
            plan = plan_rollout(
                rollout_state,
                ServedModel.desired(spec),
                views,
                spec.weight_update,
                self.now,
                exclude=frozenset(stale),
            )
            start_updates(plan, groups, spec.weight_update, self.leaders, key_prefix)
            for index, served in plan.apply.items():
                groups[index] = self._apply_group(spec, groups[index], served)
            overrides.update(plan.group_phases)
            self.events.extend(plan.events)
            self._observe_metrics(plan)
        for index in plan.forget_digest:
            digests[index] = None
        in_flight = set(rollout_state.wave) if rollout_state is not None else set()
        reasons = {
            v.index: v.mixed_reason()
            for v in views
            if v.index not in in_flight and v.index not in stale
        }
        mixed = {i: r for i, r in reasons.items() if r and i not in plan.apply}

        versions = self._weight_versions(groups, views)

        def reports(
            trail_index: int | None = None, trail_phase: str | None = None
        ) -> list[GroupReport]:
            out = []
            for g, v in zip(groups, views):
                digest = digests.get(g.index)
                if (
                    digest is None
                    and g.index not in plan.forget_digest
                    and v.leader is not None
                    and v.leader.weights_phase == "serving"
                    and g.index not in mixed
                    and overrides.get(g.index) != "Restarting"
                ):
                    digest = v.leader.digest
                phase = trail_phase if g.index == trail_index else overrides.get(g.index)
                out.append(
                    GroupReport(
                        g,
                        records[g.index],
                        phase,
                        versions.get(g.index),
                        view=v,
                        digest=digest,
                        mixed=mixed.get(g.index),
                        planned=g.index in planned,
                    )
                )
            return out

        for (
            index,
            phase,
        ) in plan.trail:  # phases passed through since the last pass, each as a status write
            step = build_status(
                spec,
                self.generation,
                reports(index, phase),
                plan.state,
                self.previous,
                self.now,
                restarts_pending=len(stale),
            )
            self.events.append(("Normal", phase, f"group {index}: {phase}"))
            self._write(step)
        lora = self._sync_lora(spec, groups, plan.state)
        status = build_status(
            spec,
            self.generation,
            reports(),
            plan.state,
            self.previous,
            self.now,
            restarts_pending=len(stale),
        )
        if spec.lora_adapters or self.previous.get("loraAdapters"):
            status["loraAdapters"] = lora_status(spec.lora_adapters, lora)
        self._observe_fleet(views, mixed)
        if status["phase"] != self.previous.get("phase"):
            kind = "Warning" if status["phase"] in ("Degraded", "Failed") else "Normal"
            self.events.append(
                (
                    kind,
                    status["phase"],
                    f"phase {self.previous.get('phase', 'None')} -> "
                    f"{status['phase']}" + (f": {status['message']}" if status["message"] else ""),
                )
            )
        requeue = plan.requeue_after_seconds
        if stale and requeue is None:
            requeue = RESTART_POLL_SECONDS  # follow the replaced pods until the group is Ready
        return self._finish(status, requeue)

    def _sync_lora(
        self, spec: DeploymentSpec, groups: list[GroupObservation], rollout: RolloutState | None
    ) -> LoRAReport:
        """Load/unload ``spec.loraAdapters`` on Ready leaders (not on a group updating weights)."""
        if not isinstance(self.leaders, LoRALeaderClient):
            return LoRAReport()
        busy = set(rollout.wave) if rollout is not None else set()
        report = sync(spec.lora_adapters, groups, self.leaders, busy)
        for name, error in report.errors.items():
            self.events.append(("Warning", "LoRAAdapterFailed", f"{name}: {error}"))
        if report.pending:
            self.requeue_after = min(self.requeue_after or LORA_RETRY_SECONDS, LORA_RETRY_SECONDS)
        return report

    def _weight_versions(
        self, groups: list[GroupObservation], views: list[GroupView]
    ) -> dict[int, str]:
        """Each ready group's ``weight_version`` from its leader (set by a trainer's weight sync);
        an unreachable leader keeps the last reported value."""
        previous = {
            item.get("index"): item.get("weightVersion")
            for item in self.previous.get("groups") or []
        }
        versions: dict[int, str] = {}
        for group, view in zip(groups, views):
            reported = (
                view.leader.weight_version if group.ready and view.leader is not None else None
            )
            version = reported or previous.get(group.index)
            if isinstance(version, str):
                versions[group.index] = version
        return versions

    def _observe_metrics(self, plan: RolloutPlan) -> None:
        """Operator metrics for what the plan saw happen (names in ``metrics.py``)."""
        recaptures = dict(plan.group_recapture_seconds)  # as the runtime reported them
        for index, seconds in plan.group_update_seconds:
            metrics.observe_group_update(self.namespace, self.name, seconds, recaptures.get(index))
        if plan.rollout_seconds is not None:
            metrics.observe_rollout(self.namespace, self.name, plan.rollout_seconds)
        if plan.rolled_back:
            metrics.inc_rollback(self.namespace, self.name)
        for _ in range(plan.failed_updates):
            metrics.inc_failed_update(self.namespace, self.name)

    def _observe_fleet(self, views: list[GroupView], mixed: dict[int, str]) -> None:
        counts: dict[str, int] = {}
        for view in views:
            if view.served is not None:
                counts[view.served.revision] = counts.get(view.served.revision, 0) + 1
        metrics.set_groups_per_revision(self.namespace, self.name, counts)
        metrics.set_mixed_versions(self.namespace, self.name, len(mixed))

    def _write(self, status: dict[str, Any]) -> None:
        """Patch status, skipped when nothing changed (status is updated only on change)."""
        status = {**status, "restartBudgetGeneration": self.generation}
        if _pruned(status) != _pruned(self.previous):  # an idle pass (the resync) writes nothing
            self.ctx.kube.patch_deployment_status(
                self.namespace, self.name, status_patch(self.previous, status)
            )
        self.previous = status

    def _finish(
        self, status: dict[str, Any], requeue_after_seconds: float | None = None
    ) -> ReconcileResult:
        self._write(status)
        if self.requeue_after is not None:  # a health backoff ends sooner
            requeue_after_seconds = min(
                requeue_after_seconds or self.requeue_after, self.requeue_after
            )
        return ReconcileResult(dict(self.previous), self.events, requeue_after_seconds)

    def _credentials(self, spec: DeploymentSpec) -> tuple[DeploymentSpec, str, str | None]:
        """Read (or create, once) the admin-token Secret and read the API-key Secret; returns the
        spec with the keys' digest (see ``credentials.py``), the admin token and the API key
        (None without ``spec.auth``).

        Raises:
            SpecError: the API-key Secret is missing or unusable, or the admin-token Secret has no token.
        """
        kube, name = self.ctx.kube, labels.admin_secret_name(self.name)
        secret = kube.get("v1", "Secret", self.namespace, name)
        if secret is None:
            kube.create(build_admin_secret(spec, new_admin_token()))
            secret = kube.get("v1", "Secret", self.namespace, name) or {}
            self.events.append(
                ("Normal", "AdminTokenCreated", f"Secret {name} holds the admin token")
            )
        token = secret_value(secret, labels.ADMIN_TOKEN_KEY)
        if not token:
            raise SpecError(
                f"Secret {name} has no '{labels.ADMIN_TOKEN_KEY}': delete it and the operator "
                "creates a new admin token"
            )
        api_key = None
        ref = spec.auth.api_key_secret
        if ref is not None:
            api_key = api_key_from_secret(
                kube.get("v1", "Secret", self.namespace, ref.name),
                ref.name,
                ref.key,
                self.namespace,
            )
        return replace(spec, credentials_digest=credentials_digest(token, api_key)), token, api_key

    def _network_policies(self, spec: DeploymentSpec) -> None:
        """Apply each group's NetworkPolicy (before its pods exist); delete the ones not wanted."""
        wanted = set()
        if spec.network_policy.enabled:
            for index in range(spec.replicas):
                policy = build_network_policy(spec, index, self.ctx.operator_namespace)
                self.ctx.apply(policy, self.now)
                wanted.add(policy["metadata"]["name"])
        for policy in self.ctx.kube.list(
            "networking.k8s.io/v1",
            "NetworkPolicy",
            self.namespace,
            labels.selector_labels(self.name),
        ):
            if policy["metadata"]["name"] not in wanted:
                self.ctx.kube.delete(
                    "networking.k8s.io/v1",
                    "NetworkPolicy",
                    self.namespace,
                    policy["metadata"]["name"],
                )
                self.ctx.applied.pop(
                    f"NetworkPolicy/{self.namespace}/{policy['metadata']['name']}", None
                )

    def _observe(
        self, spec: DeploymentSpec
    ) -> tuple[list[GroupObservation], dict[int, GroupRecord]]:
        kube, selector = self.ctx.kube, labels.selector_labels(self.name)
        statefulsets: dict[int, dict[str, Any]] = {}
        for listed in kube.list("apps/v1", "StatefulSet", self.namespace, selector):
            group = (listed["metadata"].get("labels") or {}).get(labels.LABEL_GROUP, "")
            if group.isdigit():
                statefulsets[int(group)] = listed
        for index in sorted(g for g in statefulsets if g >= spec.replicas):
            kube.delete(
                "apps/v1", "StatefulSet", self.namespace, labels.statefulset_name(self.name, index)
            )
            kube.delete("v1", "Service", self.namespace, labels.rank_service_name(self.name, index))
            self.events.append(
                ("Normal", "GroupRemoved", f"group {index} removed (replicas={spec.replicas})")
            )
        self._network_policies(spec)
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
                self.events.append(
                    (
                        "Normal",
                        "GroupCreated",
                        f"group {index}: StatefulSet {sts['metadata']['name']}",
                    )
                )
            groups.append(
                GroupObservation(
                    index, spec.parallelism.pods_per_group, sts, tuple(pods.get(index, []))
                )
            )
        return groups, records

    def _new_group_model(
        self, spec: DeploymentSpec, statefulsets: Mapping[int, Any]
    ) -> ServedModel:
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
        current = self.ctx.kube.list(
            "v1", "Pod", self.namespace, labels.group_selector_labels(self.name, group.index)
        )
        for pod in current:
            if pod["metadata"].get("deletionTimestamp") is None:
                self.ctx.kube.delete("v1", "Pod", self.namespace, pod["metadata"]["name"])

    def _remove_template_drift(
        self, group: GroupObservation, records: dict[int, GroupRecord], overrides: dict[int, str]
    ) -> None:
        """Restart a group whose live pods do not all come from its StatefulSet's current
        template (e.g. one rank recreated while the operator was changing the template)."""
        hashes = {p.restart_hash for p in group.live_pods}
        if (
            not hashes
            or hashes == {group.restart_hash}
            or overrides.get(group.index) == "Restarting"
        ):
            return
        self._delete_pods(group)
        records[group.index] = replace(records[group.index], pod_uids={})
        overrides[group.index] = "Restarting"
        self.events.append(
            ("Normal", "GroupRestart", f"group {group.index}: pods from an older pod template")
        )

    def _check_health(
        self,
        spec: DeploymentSpec,
        group: GroupObservation,
        records: dict[int, GroupRecord],
        overrides: dict[int, str],
    ) -> None:
        decision = decide(group, records[group.index], spec.restart_policy, self.now)
        records[group.index] = decision.record
        if decision.action == "restart":
            self._delete_pods(group)
            overrides[group.index] = "Restarting"
            self.events.append(
                (
                    "Warning",
                    "GroupRestart",
                    f"group {group.index} restart {decision.record.restarts}/"
                    f"{spec.restart_policy.max_group_restarts}: {decision.reason}",
                )
            )
        elif decision.action == "wait":
            overrides[group.index] = "Restarting"
            if decision.retry_in_seconds is not None:  # no event ends a backoff: come back then
                self.requeue_after = min(
                    self.requeue_after or decision.retry_in_seconds, decision.retry_in_seconds
                )
        elif decision.action == "fail":
            self.events.append(
                ("Warning", "GroupFailed", f"group {group.index}: {decision.reason}")
            )

    def _restart_group(
        self,
        spec: DeploymentSpec,
        group: GroupObservation,
        groups: list[GroupObservation],
        records: dict[int, GroupRecord],
        overrides: dict[int, str],
    ) -> None:
        """Roll a changed pod template onto ``group`` (``restart_plan.next_restart`` chose it)."""
        groups[group.index] = self._apply_group(
            spec, group, ServedModel.desired(spec), relabel=False
        )
        self._delete_pods(group)
        records[group.index] = replace(records[group.index], pod_uids={}, failed_message=None)
        overrides[group.index] = "Restarting"
        self.events.append(
            ("Normal", "GroupRestart", f"group {group.index}: rolling out the new pod template")
        )

    def _apply_group(
        self,
        spec: DeploymentSpec,
        group: GroupObservation,
        served: ServedModel,
        relabel: bool = True,
    ) -> GroupObservation:
        """Re-render the group's StatefulSet for ``served``; relabel its running pods with the revision."""
        sts = self.ctx.kube.apply(build_statefulset(spec, group.index, served))
        for pod in group.live_pods if relabel else ():
            self.ctx.kube.merge_patch(
                "v1",
                "Pod",
                self.namespace,
                pod.name,
                {"metadata": {"labels": {labels.LABEL_REVISION: served.revision}}},
            )
        pods = tuple(
            replace(p, revision=served.revision) if relabel and not p.deleting else p
            for p in group.pods
        )
        return replace(group, statefulset=sts, pods=pods)


def reconcile(ctx: Context, body: Mapping[str, Any]) -> ReconcileResult:
    """Run one pass for ``body`` (the object as read from the API) and patch its status."""
    return Reconciler(ctx, body).run()
