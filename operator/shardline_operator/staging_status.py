"""The staging step's part of ``status`` (pure): ``status.staging``, the ``Staging``
condition, the ``Staging`` phase, and the resolved source revision in ``weightsDigest``.

- While Jobs run and no group is changing, the phase is ``Staging`` (not ``RollingOut``: no
  group has paused); ``Progressing`` says so.
- A failed staging leaves every group serving what it served: the phase is ``Degraded`` (as for
  a failed rollout: groups serve, not the target), ``WeightsUpdated=False`` and
  ``Degraded=True`` with reason ``StagingFailed``, and the ``Staging`` condition's reason is the
  failure's (``NotFound``, ``Unauthorized``, ``ChecksumMismatch``, ...).
- A group serving the staged revision records ``weightsDigest`` as
  ``<checkpoint digest>;source=<resolved revision>`` (the Hub commit, or the S3 listing's
  ``etags-...`` digest every node verified); :func:`checkpoint_digest` reads the first part
  back for comparisons with what a leader reports.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .clock import to_rfc3339
from .phases import DeploymentPhase
from .staging_state import FAILED, STAGED, STAGING, StagingState
from .status import condition

SOURCE_SEPARATOR = ";source="
QUIET_PHASES = (DeploymentPhase.READY.value, DeploymentPhase.ROLLING_OUT.value)


def checkpoint_digest(recorded: str | None) -> str | None:
    """The checkpoint part of a recorded ``weightsDigest`` (what leaders report)."""
    if recorded is None:
        return None
    return recorded.split(SOURCE_SEPARATOR, 1)[0]


def _replace_condition(
    conditions: list[dict[str, Any]], ctype: str, new: dict[str, Any]
) -> list[dict[str, Any]]:
    return [new if c.get("type") == ctype else c for c in conditions]


def with_staging(
    status: Mapping[str, Any],
    staging: StagingState | None,
    generation: int,
    previous: Mapping[str, Any],
    now: float,
) -> dict[str, Any]:
    """``status`` (as ``build_status`` made it) with the staging step's fields."""
    out = dict(status)
    out["staging"] = staging.to_status() if staging is not None else None
    if staging is None:
        return out
    stamp = to_rfc3339(now)
    old = previous.get("conditions") or []
    conditions = [dict(c) for c in out.get("conditions") or []]
    if staging.phase == STAGING:
        reason = "Staging"
    elif staging.phase == STAGED:
        reason = "Staged"
    else:
        reason = staging.reason or "StagingFailed"
    conditions.append(
        condition(
            "Staging", staging.phase == STAGING, reason, staging.message, generation, old, stamp
        )
    )
    if staging.phase == STAGING and out.get("phase") in QUIET_PHASES:
        out["phase"] = DeploymentPhase.STAGING.value
        out["message"] = staging.message
        progressing = condition(
            "Progressing", True, "Staging", staging.message, generation, old, stamp
        )
        conditions = _replace_condition(conditions, "Progressing", progressing)
    elif staging.phase == FAILED:
        if out.get("phase") in QUIET_PHASES:
            out["phase"] = DeploymentPhase.DEGRADED.value
        out["message"] = staging.message
        for ctype, ok in (("WeightsUpdated", False), ("Degraded", True)):
            failed = condition(ctype, ok, "StagingFailed", staging.message, generation, old, stamp)
            conditions = _replace_condition(conditions, ctype, failed)
    out["conditions"] = conditions
    if staging.phase == STAGED and staging.resolved_revision:
        out["groups"] = [_with_source(item, staging) for item in out.get("groups") or []]
    return out


def _with_source(item: Mapping[str, Any], staging: StagingState) -> dict[str, Any]:
    """A group item serving the staged revision, its digest naming the resolved source."""
    digest = checkpoint_digest(item.get("weightsDigest"))
    if not digest or item.get("revision") != staging.revision:
        return dict(item)
    return {**item, "weightsDigest": f"{digest}{SOURCE_SEPARATOR}{staging.resolved_revision}"}
