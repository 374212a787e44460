"""In-place rollout of weights (``spec.model``) and CUDA-graph settings, one group at a time.

State machine (kept in ``status.rollout`` so an operator restart resumes it; what each group
serves is kept in its StatefulSet's annotations, updated only after the group's leader
confirmed the update):

    Updating:    for the lowest group not serving the target: POST its leader's
                 ``/update_weights_from_disk``, mirror ``weights_phase`` (loading ->
                 UpdatingWeights, recapturing -> RecapturingGraphs), on success update the
                 group's StatefulSet (pod template, so a restart loads the new weights) and move on.
    RollingBack: after a failure with ``rollbackOnFailure``: groups already on the failed target
                 are sent back to the previous model the same way; then Failed.
    Failed:      held (``WeightsUpdated=False``) until ``spec.model`` or ``cudaGraph`` changes.

The leader is reached through a :class:`LeaderClient` so this module has no I/O of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Protocol

from . import labels
from .clock import from_rfc3339, to_rfc3339
from .observed import GroupObservation, parse_cuda_graph_key
from .runtime_args import ServedModel
from .spec import WeightUpdateSpec

UPDATING, ROLLING_BACK, FAILED = "Updating", "RollingBack", "Failed"
PHASE_BY_WEIGHTS_PHASE = {"loading": "UpdatingWeights", "recapturing": "RecapturingGraphs"}


class LeaderClient(Protocol):
    """Calls to a group leader's admin API (see ``runtime_client.HttpLeaderClient``)."""

    def start_update(self, key: str, url: str, body: Mapping[str, Any], timeout_seconds: float) -> None:
        """Send ``POST {url}/update_weights_from_disk`` in the background, tracked under ``key``."""

    def poll(self, key: str) -> tuple[str, str]:
        """``(state, message)``: state is ``pending``, ``success``, ``failure`` or ``unknown``."""

    def server_info(self, url: str) -> Mapping[str, Any] | None:
        """``GET {url}/get_server_info`` as a dict, or None when unreachable."""

    def observed_phases(self, key: str) -> list[str]:
        """``weights_phase`` values sampled while the request under ``key`` ran, since the last call."""


@dataclass(frozen=True)
class RolloutState:
    """``status.rollout``; times are Unix seconds."""

    phase: str
    target: ServedModel
    previous: ServedModel | None = None
    group: int | None = None
    started_at: float | None = None
    message: str = ""
    group_phase: str | None = None  # last phase written for ``group``

    def to_status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"phase": self.phase, "targetModelPath": self.target.path,
                               "targetRevision": self.target.revision,
                               "targetCudaGraph": self.target.cuda_graph.key(), "message": self.message}
        if self.previous is not None:
            out.update(previousModelPath=self.previous.path, previousRevision=self.previous.revision,
                       previousCudaGraph=self.previous.cuda_graph.key())
        if self.group is not None:
            out.update(group=self.group, startedAt=to_rfc3339(self.started_at or 0.0))
        if self.group_phase is not None:
            out["groupPhase"] = self.group_phase
        return out

    @classmethod
    def from_status(cls, raw: Mapping[str, Any] | None) -> "RolloutState | None":
        if not raw or raw.get("phase") not in (UPDATING, ROLLING_BACK, FAILED):
            return None
        previous = None
        if raw.get("previousModelPath"):
            previous = ServedModel(raw["previousModelPath"], raw.get("previousRevision", ""),
                                   parse_cuda_graph_key(raw.get("previousCudaGraph", "")))
        return cls(phase=raw["phase"],
                   target=ServedModel(raw.get("targetModelPath", ""), raw.get("targetRevision", ""),
                                      parse_cuda_graph_key(raw.get("targetCudaGraph", ""))),
                   previous=previous, group=raw.get("group"), started_at=from_rfc3339(raw.get("startedAt")),
                   message=raw.get("message", ""), group_phase=raw.get("groupPhase"))


@dataclass
class RolloutOutcome:
    """What :func:`advance` decided: new state, StatefulSets to re-render, phases and Events.

    ``trail`` lists (group, phase) passed through since the last pass, to be written as
    status transitions before the final ``group_phases``.
    """

    state: RolloutState | None
    apply: dict[int, ServedModel] = field(default_factory=dict)
    group_phases: dict[int, str] = field(default_factory=dict)
    trail: list[tuple[int, str]] = field(default_factory=list)
    events: list[tuple[str, str, str]] = field(default_factory=list)


def update_body(current: ServedModel, target: ServedModel) -> dict[str, Any]:
    """JSON body of ``/update_weights_from_disk`` (DESIGN 2.4) moving ``current`` to ``target``."""
    body: dict[str, Any] = {"model_path": target.path, "revision": target.revision,
                            "recapture_cuda_graph": target.cuda_graph.enabled}
    if target.cuda_graph != current.cuda_graph:
        body.update(cuda_graph_max_bs=target.cuda_graph.max_batch_size,
                    disable_cuda_graph=not target.cuda_graph.enabled)
    return body


def leader_url(group: GroupObservation) -> str | None:
    """``http://<podIP>:8000`` of the group's rank-0 pod, or None without an IP."""
    leader = group.leader
    return f"http://{leader.ip}:{labels.HTTP_PORT}" if leader is not None and leader.ip else None


def _result_from_info(info: Mapping[str, Any] | None, target: ServedModel) -> tuple[str, str]:
    """Outcome of an update whose request this process did not send (operator restarted)."""
    if info is None:
        return "pending", "leader unreachable"
    phase = info.get("weights_phase", "serving")
    if phase in PHASE_BY_WEIGHTS_PHASE:
        return "pending", phase
    if phase == "failed":
        return "failure", info.get("message") or "runtime reports weights_phase=failed"
    if info.get("weights_revision") == target.revision and info.get("model_path") == target.path:
        return "success", ""
    return "unknown", ""


def advance(state: RolloutState | None, desired: ServedModel, groups: list[GroupObservation],
            pending: list[int], policy: WeightUpdateSpec, client: LeaderClient, key_prefix: str,
            now: float) -> RolloutOutcome:
    """Take one step of the in-place rollout towards ``desired``.

    ``pending`` lists the groups whose served model differs from ``desired`` in a way that is
    rolled in place (the caller excludes groups that need a restart).
    """
    by_index = {g.index: g for g in groups}
    if state is not None and state.phase == FAILED:
        if state.target == desired:
            return RolloutOutcome(state)
        state = None
    if state is not None and state.target != desired and state.phase == UPDATING and state.group is None:
        state = None
    if state is not None and state.phase == UPDATING and state.group not in pending:
        state = replace(state, target=desired, group=None, started_at=None)
    if state is None or state.phase == UPDATING:
        # A request in flight finishes towards the target it was sent for.
        target = state.target if state is not None and state.group is not None else desired
        todo = pending
    else:
        target = state.previous or desired
        todo = [g.index for g in groups if g.served is not None and g.served != target
                and g.served == state.target]
    if not todo:
        if state is None:
            return RolloutOutcome(None)
        if state.phase == ROLLING_BACK:
            message = f"{state.message}; rolled back to {target.revision}"
            return RolloutOutcome(replace(state, phase=FAILED, group=None, started_at=None, message=message),
                                  events=[("Warning", "RolledBack", message)])
        return RolloutOutcome(None, events=[("Normal", "RolloutComplete", f"all groups serve {target.revision}")])
    if state is None:
        state = RolloutState(phase=UPDATING, target=desired)
    index = state.group if state.group in todo else todo[0]
    group = by_index[index]
    key, url = f"{key_prefix}/g{index}", leader_url(group)
    if state.group != index:
        if not group.ready:
            if not group.live_pods:
                # Nothing runs: the next start loads the target from the template.
                return RolloutOutcome(state, apply={index: target})
            return RolloutOutcome(replace(state, message=f"waiting for group {index} to be Ready"))
        client.start_update(key, url, update_body(group.served, target), policy.timeout_seconds)
        progress = f"updating group {index} to {target.revision}"
        # While rolling back, the message keeps the failure that caused it.
        started = replace(state, group=index, started_at=now, group_phase="UpdatingWeights",
                          message=progress if state.phase == UPDATING else state.message)
        return RolloutOutcome(started, group_phases={index: "UpdatingWeights"},
                              events=[("Normal", "UpdatingWeights", progress)])
    result, message = client.poll(key)
    trail = _trail(state.group_phase, client.observed_phases(key))
    if result == "unknown":
        result, message = _result_from_info(client.server_info(url) if url else None, target)
        if result == "unknown":
            client.start_update(key, url, update_body(group.served, target), policy.timeout_seconds)
            result = "pending"
    started_at = state.started_at if state.started_at is not None else now
    if result == "pending" and now - started_at > policy.timeout_seconds:
        result, message = "failure", f"timed out after {policy.timeout_seconds}s"
    if result == "pending":
        info = client.server_info(url) if url else None
        phase = PHASE_BY_WEIGHTS_PHASE.get((info or {}).get("weights_phase", ""),
                                           trail[-1] if trail else state.group_phase or "UpdatingWeights")
        if trail and trail[-1] == phase:
            trail.pop()
        return RolloutOutcome(replace(state, group_phase=phase), group_phases={index: phase},
                              trail=[(index, p) for p in trail])
    if result == "success":
        # The runtime recaptures after every successful load when asked (DESIGN 2.4); a
        # recapture shorter than the sampling interval is still reported as its own step.
        last = trail[-1] if trail else state.group_phase
        if target.cuda_graph.enabled and last != "RecapturingGraphs":
            trail.append("RecapturingGraphs")
        progress = f"group {index} serves {target.revision}"
        done = replace(state, group=None, started_at=None, group_phase=None,
                       message=progress if state.phase == UPDATING else state.message)
        return RolloutOutcome(done, apply={index: target}, events=[("Normal", "GroupUpdated", progress)],
                              trail=[(index, p) for p in trail])
    reason = f"group {index}: update to {target.revision} failed: {message}"
    updated = [g.index for g in groups if g.index != index and g.served == target]
    if state.phase == UPDATING and policy.rollback_on_failure and updated:
        back = RolloutState(phase=ROLLING_BACK, target=target, previous=group.served, message=reason)
        return RolloutOutcome(back, events=[("Warning", "WeightUpdateFailed", reason + "; rolling back")])
    failed = RolloutState(phase=FAILED, target=state.target, previous=state.previous or group.served, message=reason)
    return RolloutOutcome(failed, events=[("Warning", "WeightUpdateFailed", reason)])


def _trail(reported: str | None, weights_phases: list[str]) -> list[str]:
    """Operator phases for sampled runtime phases, without repeats of the one last reported."""
    trail: list[str] = []
    last = reported
    for weights_phase in weights_phases:
        phase = PHASE_BY_WEIGHTS_PHASE.get(weights_phase)
        if phase is not None and phase != last:
            trail.append(phase)
            last = phase
    return trail
