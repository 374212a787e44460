"""What the operator sees of a deployment's children, parsed from API objects (pure)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import labels
from .runtime_args import ServedModel, draft_in_args
from .spec import CudaGraphSpec
from .weights import LeaderReport, WeightsPhase


@dataclass(frozen=True)
class PodObservation:
    """One runtime pod: ``rank`` is the StatefulSet ordinal; ``restart_count`` sums its containers."""

    name: str
    uid: str
    rank: int | None
    ip: str | None
    phase: str
    ready: bool
    deleting: bool
    restart_count: int
    terminated: bool
    error_message: str | None
    restart_hash: str | None
    node: str | None = None
    revision: str | None = None
    routable: str | None = None  # the ``shardline.dev/routable`` label
    served_revision: str | None = None  # ``shardline.dev/served-revision``
    weight_version: str | None = None  # ``shardline.dev/weight-version``

    @classmethod
    def from_api(cls, pod: Mapping[str, Any]) -> PodObservation:
        """Parse a ``v1.Pod`` dict (as returned by the API, camelCase keys)."""
        meta, status = pod.get("metadata", {}), pod.get("status") or {}
        pod_labels, annotations = meta.get("labels") or {}, meta.get("annotations") or {}
        index = pod_labels.get(labels.LABEL_POD_INDEX)
        if index is None:
            index = meta.get("name", "").rsplit("-", 1)[-1]
        statuses = status.get("containerStatuses") or []
        conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
        return cls(
            name=meta.get("name", ""),
            uid=meta.get("uid", ""),
            rank=int(index) if str(index).isdigit() else None,
            ip=status.get("podIP"),
            phase=status.get("phase", "Pending"),
            ready=conditions.get("Ready") == "True",
            deleting=meta.get("deletionTimestamp") is not None,
            restart_count=sum(int(s.get("restartCount") or 0) for s in statuses),
            terminated=any("terminated" in (s.get("state") or {}) for s in statuses),
            error_message=_first_error_line(statuses),
            restart_hash=annotations.get(labels.ANNOTATION_RESTART_HASH),
            node=(pod.get("spec") or {}).get("nodeName"),
            revision=pod_labels.get(labels.LABEL_REVISION),
            routable=pod_labels.get(labels.LABEL_ROUTABLE),
            served_revision=pod_labels.get(labels.LABEL_SERVED_REVISION),
            weight_version=pod_labels.get(labels.LABEL_WEIGHT_VERSION),
        )

    @property
    def broken(self) -> bool:
        """The pod failed or one of its containers exited or restarted."""
        return self.phase in ("Failed", "Succeeded") or self.terminated or self.restart_count > 0


OOM_KILLED = "OOMKilled"


def oom_killed_line(container: str) -> str:
    """The error line of a container the kernel killed at its memory limit."""
    return (
        f"container {container} was OOMKilled (exit code 137): it exceeded its memory limit; "
        "raise spec.runtime.resources.limits.memory or load a smaller model"
    )


def _first_error_line(statuses: Iterable[Mapping[str, Any]]) -> str | None:
    """First non-empty line of a container's termination message (current state, then last
    state). A container with ``reason: OOMKilled`` (the kubelet's, for a kill at the cgroup's
    memory limit) gets :func:`oom_killed_line` instead: SIGKILL leaves no termination message,
    and with ``FallbackToLogsOnError`` the message is a log tail whose first line is no error."""
    for key in ("state", "lastState"):
        for container in statuses:
            terminated = (container.get(key) or {}).get("terminated") or {}
            if terminated.get("reason") == OOM_KILLED:
                return oom_killed_line(container.get("name", "runtime"))
            for line in (terminated.get("message") or "").splitlines():
                if line.strip():
                    return line.strip()
    return None


@dataclass(frozen=True)
class LeaderObservation:
    """What a group's leader answered this pass.

    ``report``: its ``/get_server_info`` (None: not asked or unreachable); ``update``:
    ``(state, message)`` of an update this process sent (``pending``, ``success``, ``failure``,
    ``unknown``); ``phases``: weights phases sampled while it ran; ``update_seconds``: the
    runtime's ``load_seconds`` / ``recapture_seconds`` for an update that ended; ``gate``:
    ``(passed, message)`` of the canary gate when it ran; ``adapters``: ``{name: path}`` of the
    LoRA adapters it serves (None: not asked or unreachable).
    """

    report: LeaderReport | None = None
    update: tuple[str, str] = ("unknown", "")
    phases: tuple[WeightsPhase, ...] = ()
    update_seconds: Mapping[str, float] = field(default_factory=dict)
    gate: tuple[bool, str] | None = None
    adapters: Mapping[str, str] | None = None


@dataclass(frozen=True)
class GroupObservation:
    """One TP group as observed: its StatefulSet (``None`` before creation), its current pods
    by rank, and what its leader answered this pass."""

    index: int
    size: int
    statefulset: Mapping[str, Any] | None
    pods: tuple[PodObservation, ...]
    answers: LeaderObservation = field(default_factory=LeaderObservation)

    @property
    def live_pods(self) -> tuple[PodObservation, ...]:
        """Pods not being deleted."""
        return tuple(p for p in self.pods if not p.deleting)

    @property
    def ready_pods(self) -> int:
        return sum(1 for p in self.live_pods if p.ready)

    @property
    def ready(self) -> bool:
        """Every rank exists and is Ready."""
        return len(self.live_pods) == self.size and self.ready_pods == self.size

    @property
    def leader(self) -> PodObservation | None:
        """The rank-0 pod (runs the HTTP server), if it exists."""
        return next((p for p in self.live_pods if p.rank == 0), None)

    @property
    def routable(self) -> bool:
        """Its leader exists and is labelled ``shardline.dev/routable: "true"`` (in routing)."""
        leader = self.leader
        return leader is not None and leader.routable == "true"

    @property
    def served(self) -> ServedModel | None:
        """What the group's StatefulSet says it serves (its annotations), or None without one."""
        if self.statefulset is None:
            return None
        annotations = self.statefulset.get("metadata", {}).get("annotations") or {}
        path = annotations.get(labels.ANNOTATION_MODEL_PATH)
        revision = annotations.get(labels.ANNOTATION_MODEL_REVISION)
        if path is None or revision is None:
            return None
        return ServedModel(
            path=path,
            revision=revision,
            cuda_graph=parse_cuda_graph_key(annotations.get(labels.ANNOTATION_CUDA_GRAPH, "")),
            draft=draft_in_args(self._runtime_args()),
        )

    def _runtime_args(self) -> list[str]:
        """The runtime container's args in the StatefulSet's pod template (empty: none)."""
        assert self.statefulset is not None
        pod = (self.statefulset.get("spec") or {}).get("template", {}).get("spec") or {}
        runtime = [c for c in pod.get("containers") or [] if c.get("name") == "runtime"]
        return [str(a) for a in (runtime[0].get("args") or [])] if runtime else []

    @property
    def restart_hash(self) -> str | None:
        if self.statefulset is None:
            return None
        return (self.statefulset.get("metadata", {}).get("annotations") or {}).get(
            labels.ANNOTATION_RESTART_HASH
        )


def parse_cuda_graph_key(text: str) -> CudaGraphSpec:
    """Inverse of :meth:`CudaGraphSpec.key`; unknown or malformed text gives the defaults."""
    fields = dict(part.split("=", 1) for part in text.split(",") if "=" in part)
    size = fields.get("maxBatchSize", "")
    return CudaGraphSpec(
        enabled=fields.get("enabled", "true") == "true",
        max_batch_size=int(size) if size.isdigit() else CudaGraphSpec.max_batch_size,
    )


def pod_url(pod: PodObservation | None) -> str | None:
    """``http://<podIP>:8000`` of a leader pod, or None without one or without an IP."""
    return f"http://{pod.ip}:{labels.HTTP_PORT}" if pod is not None and pod.ip else None


def group_pods(pods: Iterable[Mapping[str, Any]]) -> dict[int, list[PodObservation]]:
    """Pods by group index (from the ``shardline.dev/group`` label), each sorted by rank."""
    grouped: dict[int, list[PodObservation]] = {}
    for pod in pods:
        group = (pod.get("metadata", {}).get("labels") or {}).get(labels.LABEL_GROUP, "")
        if group.isdigit():
            grouped.setdefault(int(group), []).append(PodObservation.from_api(pod))
    for members in grouped.values():
        members.sort(key=lambda p: (p.rank is None, p.rank or 0, p.name))
    return grouped
