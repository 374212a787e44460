"""Kopf handler registration only: one worker per ``InferenceDeployment`` runs its passes.

Event-driven reconcile, as controller-runtime's work queue does it: each object has one
worker (a Kopf daemon) that sleeps until it is woken, runs one level-based pass, and sleeps
again. It is woken by

- a change of the object's spec (``on.update`` on ``spec``);
- any event on the object's own pods and StatefulSets, found through the
  ``shardline.dev/deployment`` label (and, for StatefulSets, their owner reference);
- the pass's own ``ReconcileResult.requeue_after_seconds`` (a group updating, a restart
  backoff running out), or :data:`ROLLOUT_POLL_SECONDS` while ``status.rollout`` is under way
  (not ``Failed``) and the pass named no time;
- the slow resync, :data:`RESYNC_SECONDS` after the last pass.

Wake-ups that arrive while a pass runs collapse into one more pass, so a burst of pod events
costs one or two passes, never one per event. Only the worker runs passes, so passes of one
object never overlap.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import kopf

from . import labels, metrics
from .kube import KubeClient, KubeError
from .reconcile import Context, ReconcileResult, reconcile
from .runtime_client import HttpLeaderClient
from .spec import RestartPolicySpec

RESOURCE = (labels.API_GROUP, labels.API_VERSION, labels.PLURAL)
RESYNC_SECONDS = 30.0
ROLLOUT_POLL_SECONDS = 1.0
ERROR_RETRY_SECONDS = 5.0
_OWNED = {labels.LABEL_DEPLOYMENT: kopf.PRESENT}
# Set by the chart; the runtime pods' NetworkPolicies admit the operator's pod from there.
OPERATOR_NAMESPACE_ENV = "SHARDLINE_OPERATOR_NAMESPACE"
_context: Context | None = None
_wakeups: dict[tuple[str, str], asyncio.Event] = {}
_deleted: set[tuple[str, str]] = (
    set()
)  # objects whose gauges were dropped: no pass may set them again
log = logging.getLogger(__name__)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    """Kopf progress and diff-base in annotations (status holds only our declared fields)."""
    global _context
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=labels.API_GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=labels.API_GROUP, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{labels.API_GROUP}/finalizer"
    settings.posting.level = 20  # logging.INFO: Events for Normal transitions too
    _context = Context(
        kube=KubeClient(),
        leaders=HttpLeaderClient(),
        operator_namespace=os.environ.get(OPERATOR_NAMESPACE_ENV) or None,
    )


def wake(namespace: str | None, name: str | None) -> None:
    """Ask the worker of ``namespace/name`` for a pass (no-op when it has none yet: a new
    worker's first pass comes at once anyway). Call from the event loop's thread."""
    event = _wakeups.get((namespace or "", name or ""))
    if event is not None:
        event.set()


def next_delay(result: ReconcileResult) -> float:
    """Seconds until the next unprompted pass after ``result``."""
    if result.requeue_after_seconds is not None:
        return max(0.0, min(result.requeue_after_seconds, RESYNC_SECONDS))
    rollout_phase = (result.status.get("rollout") or {}).get("phase")
    if rollout_phase and rollout_phase != "Failed":  # a rollout under way that named no time
        return ROLLOUT_POLL_SECONDS
    return RESYNC_SECONDS


def _pass(namespace: str, name: str) -> ReconcileResult | None:
    """One pass on the object as read now (the body Kopf holds can predate our last status
    write), its status mirrored into the alerting gauges; None when it is gone or being deleted."""
    assert _context is not None
    fresh = _context.kube.get_deployment(namespace, name)
    if fresh is None or fresh["metadata"].get("deletionTimestamp"):
        return None
    result = reconcile(_context, fresh)
    budget = ((fresh.get("spec") or {}).get("restartPolicy") or {}).get("maxGroupRestarts")
    if not isinstance(budget, int):  # absent (or an invalid spec, reported in status): the default
        budget = RestartPolicySpec.max_group_restarts
    if (namespace, name) not in _deleted:  # a pass still running in its thread when the object went
        metrics.observe_status(namespace, name, result.status, budget)
    return result


@kopf.daemon(*RESOURCE, cancellation_timeout=10.0)
async def worker(
    body: kopf.Body,
    namespace: str | None,
    name: str,
    stopped: kopf.DaemonStopped,
    logger: kopf.Logger,
    **_: Any,
) -> None:
    """Run this object's passes until it is deleted or the operator stops."""
    assert namespace is not None  # InferenceDeployment is a namespaced resource
    key = (namespace, name)
    wakeup = _wakeups.setdefault(key, asyncio.Event())
    _deleted.discard(key)  # created again under the same name
    delay = 0.0
    try:
        while not stopped:
            try:
                await asyncio.wait_for(wakeup.wait(), timeout=delay)
            except asyncio.TimeoutError:
                pass
            wakeup.clear()
            if _context is None:
                delay = 1.0
                continue
            try:
                result = await asyncio.to_thread(_pass, namespace, name)
            except KubeError as exc:
                if exc.status == 404:
                    _forget(namespace, name)
                    return
                logger.warning(
                    "API request failed, retrying in %.0f s: %s", ERROR_RETRY_SECONDS, exc
                )
                delay = ERROR_RETRY_SECONDS
                continue
            except Exception:  # noqa: BLE001  (a bug in one pass must not end the object's worker)
                logger.exception("reconcile pass failed, retrying in %.0f s", ERROR_RETRY_SECONDS)
                delay = ERROR_RETRY_SECONDS
                continue
            if result is None:  # deleted, or being deleted
                _forget(namespace, name)
                return
            for kind, reason, message in result.events:
                kopf.event(body, type=kind, reason=reason, message=message[:1024])
            delay = next_delay(result)
            logger.debug(
                "reconciled: phase=%s, next pass in %.1f s", result.status.get("phase"), delay
            )
    finally:
        if _wakeups.get(key) is wakeup:
            del _wakeups[key]


@kopf.on.update(*RESOURCE, field="spec")
async def on_spec_change(namespace: str | None, name: str, **_: Any) -> None:
    """Spec changed: reconcile now (creation and operator restarts start the worker instead)."""
    wake(namespace, name)


@kopf.on.delete(*RESOURCE, optional=True)
async def on_delete(namespace: str | None, name: str, **_: Any) -> None:
    """Drop the deleted object's gauges from ``/metrics``."""
    _forget(namespace or "", name)


def _forget(namespace: str, name: str) -> None:
    _deleted.add((namespace, name))
    metrics.forget(namespace, name)
    metrics.forget_status(namespace, name)


@kopf.on.event("v1", "pods", labels=_OWNED)
async def on_pod_event(namespace: str | None, body: kopf.Body, **_: Any) -> None:
    """A pod of a deployment changed (created, status, deleted): reconcile its owner."""
    wake(namespace, body.metadata.labels.get(labels.LABEL_DEPLOYMENT))


@kopf.on.event("apps", "v1", "statefulsets", labels=_OWNED)
async def on_statefulset_event(namespace: str | None, body: kopf.Body, **_: Any) -> None:
    """A StatefulSet of a deployment changed: reconcile the InferenceDeployment that owns it."""
    for owner in body.metadata.get("ownerReferences") or []:
        if owner.get("kind") == labels.KIND and owner.get("apiVersion", "").startswith(
            f"{labels.API_GROUP}/"
        ):
            wake(namespace, owner.get("name"))
            return
    wake(namespace, body.metadata.labels.get(labels.LABEL_DEPLOYMENT))
