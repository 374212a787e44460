"""One level-based reconcile of an ``InferenceDeployment``: observe, decide, act, write status.

A pass reads the object's Secrets (creating the admin-token Secret once), then
:func:`observe.observe` lists its children and asks its leaders (read-only),
:func:`decide.decide` turns that, the spec and the previous status into a :class:`PassPlan`
(pure), and :func:`execute.execute` performs the plan's actions; then the statuses the plan
carries are written (each phase a group passed through since the last pass, then the final
one), and ``on_status_written`` (the operator's gauges) is handed the final status at once;
last, groups return to routing (:func:`execute.return_to_routing`: each waits for a
``/health_generate``, which must not hold up the status; in a pass where another group leaves
routing, ``execute`` returned them first). Running a pass twice in a row changes
nothing the second time. ``ReconcileResult.requeue_after_seconds`` asks for the next pass soon while a wave is in flight,
so a rollout is bound by the updates.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from . import labels
from .credentials import api_key_from_secret, credentials_digest, new_admin_token, secret_value
from .decide import decide
from .execute import Context, execute, return_to_routing, write_status
from .kube import KubeClient
from .lora_sync import LORA_RETRY_SECONDS, lora_status, settle
from .observe import observe
from .pass_plan import Event
from .render import build_admin_secret
from .spec import DeploymentSpec, RestartPolicySpec, SpecError, parse_spec
from .status import invalid_spec_status

__all__ = ["Context", "ReconcileResult", "StatusWritten", "reconcile"]

# (status as written, restart budget): called once per pass, right after the final status write
StatusWritten = Callable[[dict[str, Any], int], None]

logger = logging.getLogger(__name__)


@dataclass
class ReconcileResult:
    """What a pass wrote and said: ``requeue_after_seconds`` asks for another pass that soon
    (for example while a group's leader is updating), or ``None`` for the slow resync;
    ``restart_budget`` is the spec's ``restartPolicy.maxGroupRestarts`` (the default for a spec
    that does not parse), for the alerting gauges."""

    status: dict[str, Any]
    events: list[Event]
    requeue_after_seconds: float | None = None
    restart_budget: int = RestartPolicySpec.max_group_restarts


def credentials(
    kube: KubeClient, spec: DeploymentSpec, events: list[Event]
) -> tuple[DeploymentSpec, str, str | None]:
    """Read (or create, once) the admin-token Secret and read the API-key Secret; returns the
    spec with the keys' digest (see ``credentials.py``), the admin token and the API key (None
    without ``spec.auth``).

    Raises:
        SpecError: the API-key Secret is missing or unusable, or the admin-token Secret has no
            token.
    """
    name = labels.admin_secret_name(spec.name)
    secret = kube.get("v1", "Secret", spec.namespace, name)
    if secret is None:
        kube.create(build_admin_secret(spec, new_admin_token()))
        secret = kube.get("v1", "Secret", spec.namespace, name) or {}
        events.append(("Normal", "AdminTokenCreated", f"Secret {name} holds the admin token"))
    token = secret_value(secret, labels.ADMIN_TOKEN_KEY)
    if not token:
        raise SpecError(
            f"Secret {name} has no '{labels.ADMIN_TOKEN_KEY}': delete it and the operator "
            "creates a new admin token"
        )
    api_key = None
    ref = spec.auth.api_key_secret
    if ref is not None:
        raw = kube.get("v1", "Secret", spec.namespace, ref.name)
        api_key = api_key_from_secret(raw, ref.name, ref.key, spec.namespace)
    return replace(spec, credentials_digest=credentials_digest(token, api_key)), token, api_key


def reconcile(
    ctx: Context, body: Mapping[str, Any], on_status_written: StatusWritten | None = None
) -> ReconcileResult:
    """Run one pass for ``body`` (the object as read from the API) and patch its status.

    ``on_status_written(status, restart_budget)`` runs right after the final status write, before
    the pass's returns to routing (each may wait for a health check), so whatever mirrors the
    status (the operator's gauges) follows the write, not the pass's end; ``status`` and
    ``restart_budget`` are the returned :class:`ReconcileResult`'s."""
    meta = body["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    generation = int(meta.get("generation") or 1)
    previous: Mapping[str, Any] = body.get("status") or {}
    now = ctx.clock()
    events: list[Event] = []
    try:
        spec = parse_spec(name, namespace, meta.get("uid", ""), body.get("spec") or {})
        spec, admin_token, api_key = credentials(ctx.kube, spec, events)
    except SpecError as exc:
        if previous.get("message") != str(exc):
            events.append(("Warning", "InvalidSpec", str(exc)))
        status = invalid_spec_status(str(exc), generation, previous, now)
        written = write_status(ctx.kube, (namespace, name), previous, status, generation)
        result = ReconcileResult(written, events)
        if on_status_written is not None:
            on_status_written(result.status, result.restart_budget)
        return result
    # Control and info calls carry the admin token; the canary gate's serving calls the API key.
    leaders = ctx.leaders_with_token(admin_token, api_key)
    started = time.monotonic()
    observed = observe(ctx.kube, leaders, spec, generation, previous)
    observed_at = time.monotonic()
    plan = decide(spec, observed, previous, now, ctx.operator_namespace, ctx.staging_cluster_role)
    failures = execute(ctx, leaders, spec, plan, now)
    executed_at = time.monotonic()
    events.extend(plan.events)
    for step, _ in plan.trail:
        previous = write_status(ctx.kube, (namespace, name), previous, step, generation)
    status = dict(plan.status)
    requeue = plan.requeue_after_seconds
    lora = plan.lora
    if lora is not None:
        outcome = settle(lora, failures)
        if lora.shown:
            status["loraAdapters"] = lora_status(lora.desired, outcome)
        for adapter, error in outcome.errors.items():
            events.append(("Warning", "LoRAAdapterFailed", f"{adapter}: {error}"))
        if outcome.pending:  # adapters not yet on every group: look again soon
            requeue = min(
                requeue if requeue is not None else LORA_RETRY_SECONDS, LORA_RETRY_SECONDS
            )
    written = write_status(ctx.kube, (namespace, name), previous, status, generation)
    if on_status_written is not None:
        on_status_written(written, plan.restart_budget)
    return_to_routing(ctx, leaders, namespace, plan)
    logger.debug(
        "pass %s/%s: observe %.2f s, decide+execute %.2f s (%d actions), status and "
        "returns to routing %.2f s; "
        "phase %s, rollout %s",
        namespace,
        name,
        observed_at - started,
        executed_at - observed_at,
        len(plan.actions),
        time.monotonic() - executed_at,
        written.get("phase"),
        (written.get("rollout") or {}).get("message"),
    )
    return ReconcileResult(written, events, requeue, plan.restart_budget)
