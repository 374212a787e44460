"""The acting step of a pass: perform a :class:`PassPlan`'s actions, record its metrics, and
write its statuses. The only I/O after ``observe``.

Server-side applies of Services, the PDB and NetworkPolicies go through a 60 s content cache
(:meth:`Context.apply`): ``decide`` renders them on every pass, and an apply of unchanged
content, though a no-op for the API server, is still one request per object per pass (every
0.5 s during a rollout); the cache bounds that to one a minute, and its expiry re-applies
anything edited out of band. StatefulSets are applied only when ``decide`` changes them.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import labels, metrics
from .kube import KubeClient
from .lora_sync import LoRALeaderClient
from .observe import LeaderClient, update_key
from .pass_plan import (
    AbortUpdate,
    ApplyObject,
    DeleteObject,
    DeletePods,
    EnterRouting,
    LabelLeader,
    LeaveRouting,
    LoadAdapter,
    MetricDeltas,
    PassPlan,
    RelabelPods,
    StartUpdate,
    UnloadAdapter,
)
from .routing_execute import perform_routing
from .spec import DeploymentSpec
from .status import status_patch

REAPPLY_SECONDS = 60.0


@dataclass
class Context:
    """Process-wide collaborators: the API client, the leader client, a clock, the apply
    cache, the operator's own namespace (None when it runs outside the cluster) and the
    ClusterRole its chart grants the staging pods (None: none)."""

    kube: KubeClient
    leaders: LeaderClient
    clock: Callable[[], float] = time.time
    applied: dict[str, tuple[str, float]] = field(default_factory=dict)
    operator_namespace: str | None = None
    staging_cluster_role: str | None = None

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


def _pruned(value: Any) -> Any:
    """``value`` without None-valued keys at any depth: what the API server stores of it."""
    if isinstance(value, Mapping):
        return {k: _pruned(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_pruned(v) for v in value]
    return value


def write_status(
    kube: KubeClient,
    spec_name: tuple[str, str],
    previous: Mapping[str, Any],
    status: Mapping[str, Any],
    generation: int,
) -> dict[str, Any]:
    """Patch ``status`` of ``spec_name`` (namespace, name), skipped when nothing changed (an
    idle pass, the resync, writes nothing); returns what status now is."""
    written = {**status, "restartBudgetGeneration": generation}
    if _pruned(written) != _pruned(previous):
        namespace, name = spec_name
        kube.patch_deployment_status(namespace, name, status_patch(previous, written))
    return written


def _delete_pods(kube: KubeClient, spec: DeploymentSpec, group: int) -> None:
    """Delete every current pod of the group (listed afresh: a member recreated since the pass
    began must go too, or the group would mix incarnations or templates)."""
    selector = labels.group_selector_labels(spec.name, group)
    for pod in kube.list("v1", "Pod", spec.namespace, selector):
        if pod["metadata"].get("deletionTimestamp") is None:
            kube.delete("v1", "Pod", spec.namespace, pod["metadata"]["name"])


def execute(
    ctx: Context, client: LeaderClient, spec: DeploymentSpec, plan: PassPlan, now: float
) -> dict[tuple[int, str], str]:
    """Perform ``plan.actions`` in order, and record ``plan.metrics``; returns the failed LoRA
    actions as ``(group, adapter name) -> message`` (raises ``KubeError`` on an API failure).

    The returns to routing (:class:`EnterRouting`) go first when another group leaves routing in
    this pass, so the Services and label-watching gateways never lose every leader at once;
    otherwise :func:`return_to_routing` performs them once the pass's status is written, so the
    pass that ends a rollout writes ``Ready`` without waiting for their health checks."""
    kube, namespace = ctx.kube, spec.namespace
    failures: dict[tuple[int, str], str] = {}
    # group -> gateway settle its update must still admit; None: its leader is still listed
    settle_left: dict[int, float | None] = {}
    if not _returns_deferred(plan):
        return_to_routing(ctx, client, namespace, plan, deferred=False)
    for action in plan.actions:
        if isinstance(action, EnterRouting):
            continue
        if isinstance(action, ApplyObject):
            if action.cached:
                ctx.apply(action.obj, now)
            else:
                kube.apply(action.obj)
        elif isinstance(action, DeleteObject):
            kube.delete(action.api_version, action.kind, namespace, action.name)
            ctx.applied.pop(f"{action.kind}/{namespace}/{action.name}", None)
        elif isinstance(action, DeletePods):
            _delete_pods(kube, spec, action.group)
        elif isinstance(action, RelabelPods):
            patch = {"metadata": {"labels": {labels.LABEL_REVISION: action.revision}}}
            for pod in action.pods:
                kube.merge_patch("v1", "Pod", namespace, pod, patch)
        elif isinstance(action, LabelLeader):
            perform_routing(kube, client, namespace, action)
        elif isinstance(action, LeaveRouting):
            settle_left[action.group] = perform_routing(kube, client, namespace, action)
        elif isinstance(action, StartUpdate):
            key = update_key(spec, action.group)
            client.start_update(
                key,
                action.url,
                with_admission(action.body, settle_left.get(action.group)),
                action.timeout_seconds,
            )
        elif isinstance(action, AbortUpdate):
            client.abort_update(update_key(spec, action.group), action.url)
        elif isinstance(action, (LoadAdapter, UnloadAdapter)):
            if isinstance(client, LoRALeaderClient):
                _adapter(client, action, failures)
    record_metrics(spec, plan.metrics)
    return failures


def with_admission(body: Mapping[str, Any], settle_seconds: float | None) -> Mapping[str, Any]:
    """The update body for a leader that left routing just before it (``settle_seconds``: what
    ``routing_execute.perform_routing`` returned; None: it did not leave, ``body`` itself).

    ``keep_ready``: its ``/ready`` stays 200 during the update, since no Service or gateway
    routes to it, so the pass after the reply need not wait for a readiness probe.
    ``admit_seconds`` (when some of the gateway settle is left): the runtime stages meanwhile
    and holds new requests only after it."""
    if settle_seconds is None:
        return body
    out = {**body, "keep_ready": True}
    if settle_seconds > 0:
        out["admit_seconds"] = round(settle_seconds, 3)
    return out


def _returns_deferred(plan: PassPlan) -> bool:
    """True when no group leaves routing in this pass: its returns can wait for the status."""
    return not any(isinstance(action, LeaveRouting) for action in plan.actions)


def return_to_routing(
    ctx: Context, client: LeaderClient, namespace: str, plan: PassPlan, deferred: bool = True
) -> None:
    """Perform the plan's :class:`EnterRouting` actions: each waits for the group's
    ``/health_generate`` (seconds on a busy leader). The pass calls this after writing its
    status (``deferred``), which performs them only when :func:`execute` left them there (no
    group leaves routing in the pass); nothing in the status depends on them (raises
    ``KubeError`` on an API failure)."""
    if deferred != _returns_deferred(plan):
        return
    for action in plan.actions:
        if isinstance(action, EnterRouting):
            perform_routing(ctx.kube, client, namespace, action)


def _adapter(
    client: LoRALeaderClient,
    action: LoadAdapter | UnloadAdapter,
    failures: dict[tuple[int, str], str],
) -> None:
    key = (action.group, action.name)
    if isinstance(action, UnloadAdapter):
        ok, message = client.unload_lora_adapter(action.url, action.name)
        if not ok:
            failures[key] = f"unload: {message}"
    elif key not in failures:  # an unload of the same name (a path change) failed: keep it
        ok, message = client.load_lora_adapter(action.url, action.name, action.path)
        if not ok:
            failures[key] = message


def record_metrics(spec: DeploymentSpec, deltas: MetricDeltas) -> None:
    """Operator metrics for what the pass saw happen (names in ``metrics.py``)."""
    namespace, name = spec.namespace, spec.name
    for seconds, recapture in deltas.group_updates:
        metrics.observe_group_update(namespace, name, seconds, recapture)
    if deltas.rollout_seconds is not None:
        metrics.observe_rollout(namespace, name, deltas.rollout_seconds)
    for _ in range(deltas.rollbacks):
        metrics.inc_rollback(namespace, name)
    for _ in range(deltas.failed_updates):
        metrics.inc_failed_update(namespace, name)
    if deltas.groups_per_revision is not None:
        metrics.set_groups_per_revision(namespace, name, deltas.groups_per_revision)
    if deltas.mixed_versions is not None:
        metrics.set_mixed_versions(namespace, name, deltas.mixed_versions)
