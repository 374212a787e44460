"""Kopf handler registration only: one worker per ``InferenceDeployment`` runs its passes.

Event-driven reconcile, as controller-runtime's work queue does it: each object has one
worker (a Kopf daemon) that sleeps until it is woken, runs one level-based pass, and sleeps
again. It is woken by

- a change of the object's spec (``on.update`` on ``spec``);
- any event on the object's own pods and StatefulSets, found through the
  ``shardline.dev/deployment`` label (and, for StatefulSets, their owner reference);
- a group's update request ending (the leader client's callback), so the pass that counts it
  (and returns it to routing, asking for the pass that starts the next wave at once) follows
  the runtime's reply at once;
- the pass's own ``ReconcileResult.requeue_after_seconds`` (a group updating, a restart
  backoff running out), or :data:`ROLLOUT_POLL_SECONDS` while ``status.rollout`` is under way
  (not ``Failed``) and the pass named no time;
- the slow resync, :data:`RESYNC_SECONDS` after the last pass.

Wake-ups that arrive while a pass runs collapse into one more pass, so a burst of pod events
costs one or two passes, never one per event. Only the worker runs passes, so passes of one
object never overlap.

State lives in Kopf's in-memory containers (docs.kopf.dev "In-memory containers"), not in
module globals: the operator memo holds the :class:`~.reconcile.Context` (``memo.context``) and
the :class:`Workers` registry (``memo.workers``); each resource memo is a shallow copy of it,
so every handler reaches the same two, and holds the object's own ``deleted`` flag (set when it
is deleted; a re-created object gets a fresh memo).
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import kopf

from . import labels, metrics
from .kube import KubeClient, KubeError
from .observe import deployment_of
from .reconcile import Context, ReconcileResult, StatusWritten, reconcile
from .runtime_client import HttpLeaderClient

RESOURCE = (labels.API_GROUP, labels.API_VERSION, labels.PLURAL)
RESYNC_SECONDS = 30.0
ROLLOUT_POLL_SECONDS = 1.0
ERROR_RETRY_SECONDS = 5.0
_OWNED = {labels.LABEL_DEPLOYMENT: kopf.PRESENT}
# Set by the chart; the runtime pods' NetworkPolicies admit the operator's pod from there.
OPERATOR_NAMESPACE_ENV = "SHARDLINE_OPERATOR_NAMESPACE"
# Set by the chart: the ClusterRole staging pods are bound to (render/staging_access.py).
STAGING_CLUSTER_ROLE_ENV = "SHARDLINE_STAGING_CLUSTER_ROLE"
log = logging.getLogger(__name__)


class Workers:
    """The wake-up event of each object's worker, by (namespace, name); one per operator."""

    def __init__(self) -> None:
        self._wakeups: dict[tuple[str, str], asyncio.Event] = {}

    def register(self, key: tuple[str, str]) -> asyncio.Event:
        """The worker of ``key`` starts: its wake-up event (call from the event loop)."""
        return self._wakeups.setdefault(key, asyncio.Event())

    def unregister(self, key: tuple[str, str], event: asyncio.Event) -> None:
        if self._wakeups.get(key) is event:
            del self._wakeups[key]

    def wake(self, namespace: str | None, name: str | None) -> None:
        """Ask the worker of ``namespace/name`` for a pass (no-op when it has none yet: a new
        worker's first pass comes at once anyway). Call from the event loop's thread."""
        event = self._wakeups.get((namespace or "", name or ""))
        if event is not None:
            event.set()

    def __contains__(self, key: tuple[str, str]) -> bool:
        return key in self._wakeups


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Kopf progress and diff-base in annotations (status holds only our declared fields); the
    operator memo's context and worker registry. A group's update ending wakes its deployment's
    worker at once (the leader client calls back from its thread)."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=labels.API_GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=labels.API_GROUP, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{labels.API_GROUP}/finalizer"
    settings.posting.level = 20  # logging.INFO: Events for Normal transitions too
    loop = asyncio.get_running_loop()
    workers = Workers()

    def update_ended(key: str) -> None:
        loop.call_soon_threadsafe(workers.wake, *deployment_of(key))

    memo.context = Context(
        kube=KubeClient(),
        leaders=HttpLeaderClient(on_update_end=update_ended),
        operator_namespace=os.environ.get(OPERATOR_NAMESPACE_ENV) or None,
        staging_cluster_role=os.environ.get(STAGING_CLUSTER_ROLE_ENV) or None,
    )
    memo.workers = workers


def next_delay(result: ReconcileResult) -> float:
    """Seconds until the next unprompted pass after ``result``."""
    if result.requeue_after_seconds is not None:
        return max(0.0, min(result.requeue_after_seconds, RESYNC_SECONDS))
    rollout_phase = (result.status.get("rollout") or {}).get("phase")
    if rollout_phase and rollout_phase != "Failed":  # a rollout under way that named no time
        return ROLLOUT_POLL_SECONDS
    return RESYNC_SECONDS


def run_pass(
    context: Context, namespace: str, name: str, on_status_written: StatusWritten
) -> ReconcileResult | None:
    """One pass on the object as read now (the body Kopf holds can predate our last status
    write); None when it is gone or being deleted."""
    fresh = context.kube.get_deployment(namespace, name)
    if fresh is None or fresh["metadata"].get("deletionTimestamp"):
        return None
    return reconcile(context, fresh, on_status_written)


@kopf.daemon(*RESOURCE, cancellation_timeout=10.0)
async def worker(
    body: kopf.Body,
    namespace: str | None,
    name: str,
    stopped: kopf.DaemonStopped,
    logger: kopf.Logger,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    """Run this object's passes until it is deleted or the operator stops; each pass's status
    goes into the gauges as soon as it is written (:func:`_publish`)."""
    assert namespace is not None  # InferenceDeployment is a namespaced resource
    key = (namespace, name)
    workers: Workers = memo.workers
    wakeup = workers.register(key)
    loop = asyncio.get_running_loop()

    def status_written(status: dict[str, Any], restart_budget: int) -> None:
        # In the pass's thread, right after its status write: the gauges are set on the event
        # loop, where on_delete runs, so a deletion either comes first (and they stay unset) or
        # drops them after.
        loop.call_soon_threadsafe(_publish, memo, namespace, name, status, restart_budget)

    delay = 0.0
    try:
        while not stopped:
            try:
                await asyncio.wait_for(wakeup.wait(), timeout=delay)
            except asyncio.TimeoutError:
                pass
            woken = wakeup.is_set()
            wakeup.clear()
            try:
                result = await asyncio.to_thread(
                    run_pass, memo.context, namespace, name, status_written
                )
            except KubeError as exc:
                if exc.status == 404:
                    _forget(memo, namespace, name)
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
                _forget(memo, namespace, name)
                return
            for kind, reason, message in result.events:
                kopf.event(body, type=kind, reason=reason, message=message[:1024])
            delay = next_delay(result)
            logger.debug(
                "reconciled (%s): phase=%s, next pass in %.1f s",
                "woken" if woken else "timer",
                result.status.get("phase"),
                delay,
            )
    finally:
        workers.unregister(key, wakeup)


@kopf.on.update(*RESOURCE, field="spec")
async def on_spec_change(namespace: str | None, name: str, memo: kopf.Memo, **_: Any) -> None:
    """Spec changed: reconcile now (creation and operator restarts start the worker instead)."""
    memo.workers.wake(namespace, name)


@kopf.on.delete(*RESOURCE, optional=True)
async def on_delete(namespace: str | None, name: str, memo: kopf.Memo, **_: Any) -> None:
    """Drop the deleted object's gauges from ``/metrics``."""
    _forget(memo, namespace or "", name)


def _publish(
    memo: kopf.Memo, namespace: str, name: str, status: dict[str, Any], restart_budget: int
) -> None:
    """Mirror a written status into the object's gauges, unless it was deleted meanwhile (its
    gauges are gone and must stay gone). Call from the event loop's thread."""
    if not memo.get("deleted"):
        metrics.observe_status(namespace, name, status, restart_budget)


def _forget(memo: kopf.Memo, namespace: str, name: str) -> None:
    memo.deleted = True  # no pass of this object may set its gauges again
    metrics.forget(namespace, name)
    metrics.forget_status(namespace, name)


@kopf.on.event("v1", "pods", labels=_OWNED)
async def on_pod_event(namespace: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A pod of a deployment changed (created, status, deleted): reconcile its owner."""
    memo.workers.wake(namespace, body.metadata.labels.get(labels.LABEL_DEPLOYMENT))


@kopf.on.event("apps", "v1", "statefulsets", labels=_OWNED)
async def on_statefulset_event(
    namespace: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any
) -> None:
    """A StatefulSet of a deployment changed: reconcile the InferenceDeployment that owns it."""
    workers: Workers = memo.workers
    for owner in body.metadata.get("ownerReferences") or []:
        if owner.get("kind") == labels.KIND and owner.get("apiVersion", "").startswith(
            f"{labels.API_GROUP}/"
        ):
            workers.wake(namespace, owner.get("name"))
            return
    workers.wake(namespace, body.metadata.labels.get(labels.LABEL_DEPLOYMENT))
