"""``status.rollout``: the in-place rollout's state, kept in status so an operator restart resumes it.

Phases:

    Updating:    a wave of groups (at most ``weightUpdate.maxUnavailable``) is loading ``target``
                 in place, or the next wave is about to start.
    Verifying:   the canary group serves ``target`` and must pass the gate before the rest follow.
    Paused:      between waves, until ``pauseUntil`` (``weightUpdate.pauseSeconds``).
    RollingBack: after a failed update or gate with ``rollbackOnFailure``: groups on ``target``
                 are sent back to ``previous`` the same way; then Failed.
    Failed:      held (``WeightsUpdated=False``) until ``spec.model`` or ``cudaGraph`` changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .clock import from_rfc3339, to_rfc3339
from .observed import parse_cuda_graph_key
from .runtime_args import ServedModel

UPDATING, VERIFYING, PAUSED, ROLLING_BACK, FAILED = (
    "Updating",
    "Verifying",
    "Paused",
    "RollingBack",
    "Failed",
)
PHASES = (UPDATING, VERIFYING, PAUSED, ROLLING_BACK, FAILED)


def _model(raw: Mapping[str, Any], prefix: str) -> ServedModel | None:
    if not raw.get(f"{prefix}ModelPath"):
        return None
    return ServedModel(
        raw[f"{prefix}ModelPath"],
        raw.get(f"{prefix}Revision", ""),
        parse_cuda_graph_key(raw.get(f"{prefix}CudaGraph", "")),
        raw.get(f"{prefix}DraftModel") or None,
    )


@dataclass(frozen=True)
class RolloutState:
    """``status.rollout``; times are Unix seconds.

    ``wave``: groups whose ``/update_weights_from_disk`` to ``target`` is in flight, since
    ``started_at``; ``group_phases``: the phase last written for each of them that was sent its
    update this pass or seen loading (a group nothing loads has none, and shows its pods' phase).
    ``canary``: the group being verified (phase Verifying) or None; ``canary_passed``: the gate
    is behind us for this target (or there is none).
    """

    phase: str
    target: ServedModel
    previous: ServedModel | None = None
    wave: tuple[int, ...] = ()
    started_at: float | None = None
    rollout_started_at: float | None = None
    group_phases: Mapping[int, str] = field(default_factory=dict)
    canary: int | None = None
    canary_passed: bool = False
    pause_until: float | None = None
    message: str = ""

    def to_status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "phase": self.phase,
            "targetModelPath": self.target.path,
            "targetRevision": self.target.revision,
            "targetCudaGraph": self.target.cuda_graph.key(),
            "message": self.message,
            "canaryPassed": self.canary_passed,
        }
        if self.target.draft is not None:
            out["targetDraftModel"] = self.target.draft
        if self.previous is not None:
            out.update(
                previousModelPath=self.previous.path,
                previousRevision=self.previous.revision,
                previousCudaGraph=self.previous.cuda_graph.key(),
            )
            if self.previous.draft is not None:
                out["previousDraftModel"] = self.previous.draft
        if self.wave:
            out.update(wave=list(self.wave), startedAt=to_rfc3339(self.started_at or 0.0))
        if self.group_phases:
            out["groupPhases"] = {str(k): v for k, v in sorted(self.group_phases.items())}
        if self.rollout_started_at is not None:
            out["rolloutStartedAt"] = to_rfc3339(self.rollout_started_at)
        if self.canary is not None:
            out["canaryGroup"] = self.canary
        if self.pause_until is not None:
            out["pauseUntil"] = to_rfc3339(self.pause_until)
        return out

    @classmethod
    def from_status(cls, raw: Mapping[str, Any] | None) -> RolloutState | None:
        """Inverse of :meth:`to_status`; also reads the single-``group`` form written before waves."""
        if not raw or raw.get("phase") not in PHASES:
            return None
        wave = tuple(int(g) for g in raw.get("wave") or ())
        if not wave and raw.get("group") is not None:
            wave = (int(raw["group"]),)
        phases = {int(k): v for k, v in (raw.get("groupPhases") or {}).items() if str(k).isdigit()}
        if not phases and raw.get("groupPhase") and wave:
            phases = {wave[0]: raw["groupPhase"]}
        target = _model(raw, "target") or ServedModel(
            "", raw.get("targetRevision", ""), parse_cuda_graph_key(raw.get("targetCudaGraph", ""))
        )
        return cls(
            phase=raw["phase"],
            target=target,
            previous=_model(raw, "previous"),
            wave=wave,
            started_at=from_rfc3339(raw.get("startedAt")),
            rollout_started_at=from_rfc3339(raw.get("rolloutStartedAt")),
            group_phases=phases,
            canary=raw.get("canaryGroup"),
            canary_passed=bool(raw.get("canaryPassed", False)),
            pause_until=from_rfc3339(raw.get("pauseUntil")),
            message=raw.get("message", ""),
        )
