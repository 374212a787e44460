"""The rollout planner's input and output records: one group as gathered, and the plan.

:class:`GroupView` is a group as ``decide`` hands it to the planner (what its StatefulSet
declares, whether it is Ready, what its leader reports, the state of an update this process
sent); :class:`RolloutPlan` is the planner's answer. :attr:`GroupView.available` is the
availability rule the planner keeps (issue 23), in this one place: a group is available when
its pods are Ready (none terminating), its leader serves what status records for it, and it is
back in routing (its return check passed). The planner takes a group out only while the
groups that are not available, that one included, number at most ``maxUnavailable``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .phases import GroupPhase
from .rollout_state import RolloutState
from .runtime_args import ServedModel
from .weights import LeaderReport, WeightsPhase

PHASE_BY_WEIGHTS_PHASE = {
    WeightsPhase.LOADING: GroupPhase.UPDATING_WEIGHTS,
    WeightsPhase.RECAPTURING: GroupPhase.RECAPTURING_GRAPHS,
}
POLL_SECONDS = 0.5  # next pass while a wave is in flight: a group's end is seen within this


@dataclass(frozen=True)
class GroupView:
    """One group as gathered before planning.

    ``declared``: what its StatefulSet says it serves; ``recorded_digest``: status's
    ``weightsDigest`` from the last pass; ``update``: ``(state, message)`` of an update request
    this process sent (``pending``, ``success``, ``failure``, or ``unknown`` when it sent none);
    ``phases``: weights phases sampled while it ran; ``gate``: ``(passed, message)`` of the
    canary verification when it was run this pass; ``pod_revision``: the revision label of the
    leader pod (what it was started with or last relabelled to), if known; ``update_seconds``:
    the runtime's ``load_seconds`` / ``recapture_seconds`` for the update that ``update`` reports
    ended (empty otherwise); ``leader_pod``: a rank-0 pod exists that is not being deleted;
    ``routable``: that pod is labelled ``shardline.dev/routable: "true"``, so every routing path
    lists it (it never left routing, or its return check passed; ``routing.py``).
    """

    index: int
    declared: ServedModel | None
    ready: bool = True
    live: bool = True
    leader: LeaderReport | None = None
    recorded_digest: str | None = None
    update: tuple[str, str] = ("unknown", "")
    phases: tuple[WeightsPhase, ...] = ()
    gate: tuple[bool, str] | None = None
    pod_revision: str | None = None
    update_seconds: Mapping[str, float] = field(default_factory=dict)
    leader_pod: bool = True
    routable: bool = True

    @property
    def served(self) -> ServedModel | None:
        """The leader's model when it reports one (serving or failed), else ``declared``."""
        leader, declared = self.leader, self.declared
        if (
            declared is not None
            and leader is not None
            and leader.weights_phase in (WeightsPhase.SERVING, WeightsPhase.FAILED)
            and leader.model_path
            and leader.revision is not None
        ):
            draft = leader.draft_model_path or declared.draft  # None: not reported (older runtime)
            return ServedModel(leader.model_path, leader.revision, declared.cuda_graph, draft)
        return declared

    def serves(self, target: ServedModel) -> bool:
        """Available on ``target``: every pod Ready and none terminating, and its leader serving
        ``target``'s checkpoint (a leader that cannot be asked is judged by its declared model)."""
        if not (self.live and self.ready):
            return False
        leader, served = self.leader, self.served
        if leader is not None and leader.weights_phase != WeightsPhase.SERVING:
            return False
        return served is not None and served.checkpoints() == target.checkpoints()

    @property
    def available(self) -> bool:
        """Every pod Ready and none terminating, its leader serving (not loading or failed) the
        revision and digest recorded for it (not a mixed version), and back in routing: a group
        whose return check is pending (its update ended this pass) or failed is out of service
        as surely as one that updates."""
        return self.routable and self._serves_recorded()

    @property
    def returning(self) -> bool:
        """Available but for routing: Ready on what is recorded, its return check pending or
        failed (``routing.py`` asks again each pass)."""
        return not self.routable and self._serves_recorded()

    def _serves_recorded(self) -> bool:
        if not (self.live and self.ready):
            return False
        leader = self.leader
        if leader is not None and leader.weights_phase != WeightsPhase.SERVING:
            return False
        return self.mixed_reason() is None

    def mixed_reason(self) -> str | None:
        """Why the leader serves something else than recorded, or None."""
        served, declared, leader = self.served, self.declared, self.leader
        if served is None or declared is None or leader is None:
            return None
        expected = self.pod_revision or declared.revision
        if served.revision != expected or (
            expected == declared.revision and served.path != declared.path
        ):
            return f"group {self.index}: leader serves {served.revision} ({served.path}), expected {expected}"
        if expected == declared.revision and served.draft != declared.draft:
            return (
                f"group {self.index}: leader serves draft {served.draft}, expected {declared.draft}"
            )
        if self.recorded_digest and leader.digest and leader.digest != self.recorded_digest:
            return f"group {self.index}: leader serves digest {leader.digest[:19]}, status records {self.recorded_digest[:19]}"
        return None


@dataclass
class RolloutPlan:
    """The next step: new state, updates to start, StatefulSets to re-render, status and metrics.

    ``trail`` lists (group, phase) passed through since the last pass (written as status
    transitions before ``group_phases``); ``mixed`` maps groups to their mixed-version reason;
    ``forget_digest`` lists groups whose recorded digest is stale (re-recorded from the leader);
    ``group_update_seconds`` / ``group_recapture_seconds``: (group, seconds) of updates that
    ended this pass (the operator's wall time; the runtime's reported recapture time);
    ``abort``: groups whose update in flight is cancelled (the target changed while they load);
    ``notes``: a group's status message for what the rollout does to it.
    """

    state: RolloutState | None
    start: dict[int, dict[str, Any]] = field(default_factory=dict)
    abort: list[int] = field(default_factory=list)
    notes: dict[int, str] = field(default_factory=dict)
    apply: dict[int, ServedModel] = field(default_factory=dict)
    group_phases: dict[int, str] = field(default_factory=dict)
    trail: list[tuple[int, str]] = field(default_factory=list)
    events: list[tuple[str, str, str]] = field(default_factory=list)
    mixed: dict[int, str] = field(default_factory=dict)
    forget_digest: list[int] = field(default_factory=list)
    requeue_after_seconds: float | None = None
    group_update_seconds: list[tuple[int, float]] = field(default_factory=list)
    group_recapture_seconds: list[tuple[int, float]] = field(default_factory=list)
    rollout_seconds: float | None = None
    rolled_back: bool = False
    failed_updates: int = 0


def update_body(current: ServedModel | None, target: ServedModel) -> dict[str, Any]:
    """JSON body of ``/update_weights_from_disk`` (DESIGN 2.4) moving ``current`` to ``target``;
    it carries ``draft_model_path`` when the draft changes too, so the group's runtime commits
    both or neither (issue 30)."""
    body: dict[str, Any] = {
        "model_path": target.path,
        "revision": target.revision,
        "recapture_cuda_graph": target.cuda_graph.enabled,
    }
    if target.draft is not None and (current is None or current.draft != target.draft):
        body["draft_model_path"] = target.draft
    if current is None or target.cuda_graph != current.cuda_graph:
        body.update(
            cuda_graph_max_bs=target.cuda_graph.max_batch_size,
            disable_cuda_graph=not target.cuda_graph.enabled,
        )
    return body
