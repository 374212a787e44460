"""Kopf handler registration only: every handler runs one reconcile pass (level-based).

Create/update/resume react at once; the timer re-runs the pass every few seconds, which is
what watches pods, group health and rollouts (their progress lives in status and in the
StatefulSets, never in this process).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import kopf

from . import labels
from .kube import KubeClient, KubeError
from .reconcile import Context, reconcile
from .runtime_client import HttpLeaderClient

RESOURCE = (labels.API_GROUP, labels.API_VERSION, labels.PLURAL)
TIMER_INTERVAL_SECONDS = 3.0
REQUEUE_LIMIT_SECONDS = 60.0  # longest a handler keeps following a rollout before the next timer tick
_context: Context | None = None
_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()


def _lock_for(uid: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(uid, threading.Lock())


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    """Kopf progress and diff-base in annotations (status holds only our declared fields)."""
    global _context
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=labels.API_GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=labels.API_GROUP, key="last-handled-configuration")
    settings.persistence.finalizer = f"{labels.API_GROUP}/finalizer"
    settings.posting.level = 20  # logging.INFO: Events for Normal transitions too
    _context = Context(kube=KubeClient(), leaders=HttpLeaderClient())


def _run(body: kopf.Body, logger: kopf.Logger) -> None:
    """Reconcile, then again after ``requeue_after_seconds`` while a pass asks for it (a wave in
    flight), so each rollout step follows the previous one without waiting for the timer."""
    deadline = time.monotonic() + REQUEUE_LIMIT_SECONDS
    while True:
        requeue = _run_once(body, logger)
        if requeue is None or time.monotonic() + requeue > deadline:
            return
        time.sleep(requeue)


def _run_once(body: kopf.Body, logger: kopf.Logger) -> float | None:
    if _context is None:
        raise kopf.TemporaryError("operator is starting", delay=1)
    with _lock_for(body.metadata.uid or ""):
        try:
            # Read the object again under the lock: the body Kopf hands over can predate the
            # status another handler of this object has just written.
            fresh = _context.kube.get_deployment(body.metadata.namespace, body.metadata.name)
            if fresh is None or fresh["metadata"].get("deletionTimestamp"):
                return None
            result = reconcile(_context, fresh)
        except KubeError as exc:
            if exc.status == 404:  # the object was deleted meanwhile
                return None
            raise kopf.TemporaryError(f"API request failed: {exc}", delay=5) from exc
    for kind, reason, message in result.events:
        kopf.event(body, type=kind, reason=reason, message=message[:1024])
    logger.debug("reconciled: phase=%s", result.status.get("phase"))
    return result.requeue_after_seconds


@kopf.on.resume(*RESOURCE)
@kopf.on.create(*RESOURCE)
@kopf.on.update(*RESOURCE, field="spec")
def on_change(body: kopf.Body, logger: kopf.Logger, **_: Any) -> None:
    """Spec created or changed (or the operator restarted): reconcile now."""
    _run(body, logger)


@kopf.timer(*RESOURCE, interval=TIMER_INTERVAL_SECONDS, initial_delay=TIMER_INTERVAL_SECONDS)
def periodic(body: kopf.Body, logger: kopf.Logger, **_: Any) -> None:
    """Follow pods, group health and rollouts."""
    _run(body, logger)
