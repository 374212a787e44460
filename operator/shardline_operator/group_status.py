"""One group's part of ``status`` (pure): its report, phase and ``status.groups[]`` item.

A group's ``revision`` is what its leader reports, else a Ready leader pod's label, and empty
while no leader serves (a group still starting serves nothing yet); while it loads
another revision its message says so (``loading rev-b``): status follows the runtime, not the
spec. So do its ``graphs`` and the ``GraphsCaptured`` condition (:func:`graphs_condition`): what
the leader's ``/get_server_info`` says was captured, or why nothing was (a CPU pod: ``cpu: no
CUDA graphs``). Groups beyond ``replicas`` whose pods still drain are listed as ``Terminating``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .clock import from_rfc3339, to_rfc3339
from .group_health import GroupRecord
from .observed import GroupObservation, PodObservation
from .parallelism import ParallelismSpec
from .phases import GroupPhase
from .rollout import GroupView
from .weights import ReportedGraphs, digest_with_source


@dataclass(frozen=True)
class GroupReport:
    """A group's observation with its bookkeeping and any phase set by a running action.

    ``weight_version``: the leader's ``weight_version``; ``view``: what its leader reported this
    pass; ``digest``: the ``weightsDigest`` to record;
    ``mixed``: why it is a mixed version, or None; ``planned``: a ``Restarting`` override is part
    of a rollout (not Degraded); ``loading``: the revision an update in flight is loading into
    it (not yet served); ``draining``: a group beyond ``replicas`` whose pods still terminate.
    """

    observation: GroupObservation
    record: GroupRecord
    phase_override: str | None = None
    weight_version: str | None = (
        None  # the leader's /get_server_info weight_version (RL weight sync)
    )
    view: GroupView | None = None
    digest: str | None = None
    mixed: str | None = None
    planned: bool = False
    loading: str | None = None
    draining: bool = False
    note: str | None = None

    @property
    def graphs(self) -> ReportedGraphs | None:
        """What the group's leader reported capturing this pass (None: no report)."""
        leader = self.view.leader if self.view is not None else None
        return leader.graphs if leader is not None else None

    @property
    def revision(self) -> str:
        """The revision the group serves now: its leader's report; a Ready leader that did not
        answer this pass is judged by its pod's label (else its StatefulSet's); "" while no
        leader serves (none live, or one still starting: nothing is served before it is
        Ready, whatever the pod was started with)."""
        if self.view is not None and self.view.leader is not None and self.view.served is not None:
            return self.view.served.revision
        leader, declared = self.observation.leader, self.observation.served
        if leader is None or not leader.ready:
            return ""
        return leader.revision or (declared.revision if declared is not None else "")


def graphs_condition(reports: Sequence[GroupReport], all_ready: bool) -> tuple[bool, str, str]:
    """``(status, reason, message)`` of ``GraphsCaptured`` from the leaders' reports.

    ``True/Captured`` when every group is Ready and each leader reported captured graphs;
    ``False/Disabled`` (the runtime's flag) or ``False/NotCaptured`` with the leaders' reason
    (``cpu: no CUDA graphs``) when one captured none; ``False/Pending`` until every group is
    Ready and reported.
    """
    graphs = [r.graphs for r in reports]
    if not all_ready or not reports or any(g is None for g in graphs):
        return False, "Pending", "waiting for every group's leader to report its graphs"
    missing = {
        f"group {r.observation.index}": g.summary()
        for r, g in zip(reports, graphs)
        if g and not g.captured
    }
    if missing:
        reasons = [g.reason or "" for g in graphs if g and not g.captured]
        disabled = all(reason.startswith("disabled by") for reason in reasons)
        message = "; ".join(f"{k}: {v}" for k, v in missing.items())
        return False, "Disabled" if disabled else "NotCaptured", message
    summaries = sorted({g.summary() for g in graphs if g is not None})
    return True, "Captured", "; ".join(summaries)


def group_phase(report: GroupReport) -> GroupPhase:
    """Phase of one group: Terminating (draining) / Failed / override (Restarting,
    UpdatingWeights, ...) / observed."""
    group = report.observation
    if report.draining:
        return GroupPhase.TERMINATING
    if report.record.failed_message is not None:
        return GroupPhase.FAILED
    if report.phase_override:
        return GroupPhase(report.phase_override)
    if group.statefulset is None or not group.live_pods:
        return GroupPhase.PENDING
    if group.ready:
        return GroupPhase.READY
    running = any(p.phase == "Running" for p in group.live_pods)
    return GroupPhase.INITIALIZING if running else GroupPhase.PENDING


def rank_status(pod: PodObservation, parallelism: ParallelismSpec) -> dict[str, Any]:
    """One ``status.groups[].ranks[]`` item: which pod and node hold the node rank, its
    pipeline stages and TP ranks (``ppRanks`` x ``tpRanks``), and how it is."""
    item: dict[str, Any] = {
        "rank": pod.rank if pod.rank is not None else -1,
        "pod": pod.name,
        "node": pod.node or "",
        "ready": pod.ready,
        "phase": "Terminating" if pod.deleting else pod.phase,
    }
    if pod.rank is not None and 0 <= pod.rank < parallelism.pods_per_group:
        ranks = parallelism.pod_ranks(pod.rank)
        item["ppRanks"], item["tpRanks"] = list(ranks.pp_ranks), list(ranks.tp_ranks)
    if pod.error_message:
        item["lastError"] = pod.error_message[:256]
    return item


def restart_message(report: GroupReport, phase: str) -> str | None:
    """While a group restarts after a failure (not a rollout's planned restart): why, as the
    first error line one of its pods wrote to its termination log (None without one)."""
    if phase != GroupPhase.RESTARTING or report.planned:
        return None
    error = next((p.error_message for p in report.observation.pods if p.error_message), None)
    return f"restarting after: {error}" if error else None


def loading_message(report: GroupReport, phase: str) -> str | None:
    """While an update loads another revision into the group: ``loading rev-b`` (or
    ``recapturing graphs on rev-b``), whatever the spec says now."""
    if report.loading is None:
        return None
    if phase == GroupPhase.RECAPTURING_GRAPHS:
        return f"recapturing graphs on {report.loading}"
    return f"loading {report.loading}"


def group_status(report: GroupReport, phase: str, parallelism: ParallelismSpec) -> dict[str, Any]:
    """One ``status.groups[]`` item (``parallelism`` maps each pod to its pp and tp ranks)."""
    group, record = report.observation, report.record
    message = (
        record.failed_message
        or report.mixed
        or restart_message(report, phase)
        or report.note
        or loading_message(report, phase)
    )
    item: dict[str, Any] = {
        "index": group.index,
        "phase": GroupPhase(phase).value,
        "pods": len(group.live_pods),
        "readyPods": group.ready_pods,
        "revision": report.revision,
        "restarts": record.restarts,
        "podUIDs": dict(record.pod_uids),
        "message": message or "",
        "ranks": [rank_status(p, parallelism) for p in group.pods],
    }
    leader = report.view.leader if report.view is not None else None
    if report.digest:
        served = leader is not None and leader.digest == report.digest
        source = leader.source_revision if served and leader is not None else None
        item["weightsDigest"] = digest_with_source(report.digest, source)
    if leader is not None and leader.draft_model_path is not None:  # as the leader reports it
        item["draftModel"] = leader.draft_model_path
        if leader.draft_digest is not None:
            item["draftDigest"] = digest_with_source(
                leader.draft_digest, leader.draft_source_revision
            )
    if record.last_restart_time is not None:
        item["lastRestartTime"] = to_rfc3339(record.last_restart_time)
    if report.weight_version is not None:
        item["weightVersion"] = report.weight_version
    if report.graphs is not None:
        item["graphs"] = report.graphs.summary()
    if leader is not None and leader.quantization is not None:
        item["quantization"] = leader.quantization  # the scheme the leader serves
    if leader is not None and leader.model_kind is not None:
        item["modelKind"] = leader.model_kind  # generate or embed
    return item


def record_from_status(item: Mapping[str, Any] | None) -> GroupRecord:
    """Inverse of the bookkeeping part of :func:`group_status`."""
    if not item:
        return GroupRecord()
    failed = item.get("message") if item.get("phase") == GroupPhase.FAILED else None
    return GroupRecord(
        restarts=int(item.get("restarts") or 0),
        last_restart_time=from_rfc3339(item.get("lastRestartTime")),
        pod_uids=dict(item.get("podUIDs") or {}),
        failed_message=failed or None,
    )
