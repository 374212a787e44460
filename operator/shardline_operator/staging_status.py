"""The staging step's part of ``status`` (pure): ``status.staging``, the ``Staging``
condition and the ``Staging`` phase.

- While Jobs run and no group is changing, the phase is ``Staging`` (not ``RollingOut``: no
  group has paused); ``Progressing`` says so.
- A failed staging leaves every group serving what it served: the phase is ``Degraded`` (as for
  a failed rollout: groups serve, not the target), ``WeightsUpdated=False`` and
  ``Degraded=True`` with reason ``StagingFailed``, and the ``Staging`` condition's reason is the
  failure's (``NotFound``, ``Unauthorized``, ``ChecksumMismatch``, ...).
- A group's ``weightsDigest`` is ``<checkpoint digest>;source=<resolved revision>`` with the
  resolved revision its *leader* reports loading (``weights.digest_with_source``), not the one
  staging verified: a branch that moves between staging and a group's update shows the commit
  the group really loaded. :func:`checkpoint_digest` reads the first part back for comparisons
  with what a leader reports.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .clock import to_rfc3339
from .phases import DeploymentPhase
from .staging_state import FAILED, STAGED, STAGING, StagingState
from .status import condition
from .weights import SOURCE_SEPARATOR

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
    return out
