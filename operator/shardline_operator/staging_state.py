"""The staging step's records (pure): what is staged, the Jobs seen, and ``status.staging``.

A *staging target* is an ``hf://`` or ``s3://`` ``spec.model.uri`` with its ``revision`` label,
named by :attr:`StagingTarget.key` (a hash of both). Each node that runs a group gets one
staging Job for the target (one Job in all when the cache is a shared PersistentVolumeClaim);
the Job runs ``shardline-runtime download`` into the cache volume and leaves one JSON line in
its container's termination message (``runtime/shardline_runtime/download_cli.py``), which
:func:`staging_job_from_api` reads back. ``status.staging`` (:class:`StagingState`) is kept in
status, so an operator restart resumes it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .clock import from_rfc3339, to_rfc3339

STAGING, STAGED, FAILED = "Staging", "Staged", "Failed"
PHASES = (STAGING, STAGED, FAILED)
# Job states as the planner sees them.
JOB_PENDING, JOB_RUNNING, JOB_SUCCEEDED, JOB_FAILED = "Pending", "Running", "Succeeded", "Failed"
LABEL_STAGING_OF = "shardline.dev/staging-of"
LABEL_STAGING_KEY = "shardline.dev/staging-key"
LABEL_STAGING_ATTEMPT = "shardline.dev/staging-attempt"
ANNOTATION_NODE = "shardline.dev/staging-node"
SHARED = ""  # the node name of the one Job that stages into a shared (RWX) claim


@dataclass(frozen=True)
class StagingTarget:
    """What to stage: ``uri`` (hf:// or s3://), its ``revision`` label, and ``shared``: the
    cache is one ReadWriteMany claim (one Job in all) rather than a node-local hostPath (one
    Job per node)."""

    uri: str
    revision: str
    shared: bool = False

    @property
    def key(self) -> str:
        """10 hex characters of sha256(uri, revision): names the target in labels and Jobs."""
        return hashlib.sha256(f"{self.uri}\n{self.revision}".encode()).hexdigest()[:10]


@dataclass(frozen=True)
class StagingJob:
    """One staging Job as observed: ``node`` (:data:`SHARED` for the shared-claim Job),
    ``state`` (one of the ``JOB_*`` names), ``result``: the JSON its container left in the
    termination message (empty while it runs), ``reason`` / ``message``: the Job's Failed
    condition when the container left none (e.g. ``DeadlineExceeded``)."""

    name: str
    key: str
    attempt: int
    node: str
    state: str
    result: Mapping[str, Any] = field(default_factory=dict)
    reason: str = ""
    message: str = ""


@dataclass(frozen=True)
class NodeStaging:
    """``status.staging.nodes[]``: one node's Job. Bytes and rate come from the Job's own
    report when it ends (``bytesDone`` is None while it runs: the download reports progress to
    its log only); ``cached``: the revision was already in the node's cache."""

    node: str
    job: str
    state: str
    bytes_done: int | None = None
    bytes_per_second: int | None = None
    seconds: float | None = None
    cached: bool = False
    resolved_revision: str | None = None
    message: str = ""

    def to_status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"node": self.node or "shared", "job": self.job, "state": self.state}
        if self.bytes_done is not None:
            out["bytesDone"] = self.bytes_done
        if self.bytes_per_second is not None:
            out["bytesPerSecond"] = self.bytes_per_second
        if self.seconds is not None:
            out["seconds"] = self.seconds
        if self.cached:
            out["cached"] = True
        if self.resolved_revision:
            out["resolvedRevision"] = self.resolved_revision
        if self.message:
            out["message"] = self.message
        return out

    @classmethod
    def from_job(cls, job: StagingJob) -> NodeStaging:
        result = job.result
        size = result.get("bytes")
        rate = result.get("bytesPerSecond")
        seconds = result.get("seconds")
        return cls(
            node=job.node,
            job=job.name,
            state=job.state,
            bytes_done=int(size) if isinstance(size, int) else None,
            bytes_per_second=int(rate) if isinstance(rate, int) else None,
            seconds=float(seconds) if isinstance(seconds, (int, float)) else None,
            cached=bool(result.get("cached", False)),
            resolved_revision=_text(result.get("resolvedRevision")),
            message=failure_of(job)[1] if job.state == JOB_FAILED else "",
        )


@dataclass(frozen=True)
class StagingState:
    """``status.staging``: the target (``uri``, ``revision``, ``key``), the ``phase``
    (Staging, Staged, Failed), the ``attempt`` and the object ``generation`` it started at (a
    later generation retries a failure), the ``resolved_revision`` every node agreed on (the
    Hub commit or the S3 listing digest ``etags-...``), the failure ``reason``, a ``message``,
    the per-node items and times (Unix seconds)."""

    phase: str
    uri: str
    revision: str
    key: str
    attempt: int = 1
    generation: int = 0
    resolved_revision: str | None = None
    reason: str = ""
    message: str = ""
    nodes: tuple[NodeStaging, ...] = ()
    started_at: float | None = None
    finished_at: float | None = None

    @property
    def bytes_total(self) -> int:
        """Bytes the finished nodes report (each node's copy counted)."""
        return sum(n.bytes_done or 0 for n in self.nodes)

    def to_status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "phase": self.phase,
            "uri": self.uri,
            "revision": self.revision,
            "key": self.key,
            "attempt": self.attempt,
            "generation": self.generation,
            "message": self.message,
            "nodes": [n.to_status() for n in self.nodes],
            "nodesStaged": sum(1 for n in self.nodes if n.state == JOB_SUCCEEDED),
            "bytesDone": self.bytes_total,
        }
        if self.resolved_revision:
            out["resolvedRevision"] = self.resolved_revision
        if self.reason:
            out["reason"] = self.reason
        if self.started_at is not None:
            out["startedAt"] = to_rfc3339(self.started_at)
        if self.finished_at is not None:
            out["finishedAt"] = to_rfc3339(self.finished_at)
        return out

    @classmethod
    def from_status(cls, raw: Mapping[str, Any] | None) -> StagingState | None:
        """Inverse of :meth:`to_status` (per-node items are observed afresh, not read back)."""
        if not raw or raw.get("phase") not in PHASES or not raw.get("key"):
            return None
        return cls(
            phase=raw["phase"],
            uri=str(raw.get("uri", "")),
            revision=str(raw.get("revision", "")),
            key=str(raw["key"]),
            attempt=int(raw.get("attempt") or 1),
            generation=int(raw.get("generation") or 0),
            resolved_revision=_text(raw.get("resolvedRevision")),
            reason=str(raw.get("reason", "")),
            message=str(raw.get("message", "")),
            started_at=from_rfc3339(raw.get("startedAt")),
            finished_at=from_rfc3339(raw.get("finishedAt")),
        )


def failure_of(job: StagingJob) -> tuple[str, str]:
    """``(reason, message)`` of a failed Job: its container's report (``NotFound``,
    ``Unauthorized``, ``ChecksumMismatch``, ...), else the Job's Failed condition."""
    reason = _text(job.result.get("reason")) or job.reason or "StagingFailed"
    message = _text(job.result.get("message")) or job.message or "the staging Job failed"
    return reason, message


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _termination_result(pods: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The JSON line the newest terminated download container left (empty when none did)."""
    newest: tuple[str, dict[str, Any]] | None = None
    for pod in pods:
        for status in (pod.get("status") or {}).get("containerStatuses") or []:
            terminated = (status.get("state") or {}).get("terminated") or {}
            try:
                parsed = json.loads((terminated.get("message") or "").strip().splitlines()[0])
            except (IndexError, ValueError):
                continue
            if isinstance(parsed, dict):
                stamp = str(terminated.get("finishedAt") or "")
                if newest is None or stamp >= newest[0]:
                    newest = (stamp, parsed)
    return newest[1] if newest is not None else {}


def staging_job_from_api(
    job: Mapping[str, Any], pods: Sequence[Mapping[str, Any]]
) -> StagingJob | None:
    """Parse a ``batch/v1`` Job the operator rendered and its pods (None: not a staging Job)."""
    meta = job.get("metadata") or {}
    job_labels = meta.get("labels") or {}
    key = job_labels.get(LABEL_STAGING_KEY)
    attempt = str(job_labels.get(LABEL_STAGING_ATTEMPT, ""))
    if not key or not attempt.isdigit():
        return None
    conditions = {
        c.get("type"): c
        for c in (job.get("status") or {}).get("conditions") or []
        if c.get("status") == "True"
    }
    status = job.get("status") or {}
    if "Complete" in conditions or "SuccessCriteriaMet" in conditions:
        state = JOB_SUCCEEDED
    elif "Failed" in conditions or "FailureTarget" in conditions:
        state = JOB_FAILED
    elif status.get("active") or status.get("ready"):
        state = JOB_RUNNING
    else:
        state = JOB_PENDING
    failed = conditions.get("Failed") or conditions.get("FailureTarget") or {}
    return StagingJob(
        name=str(meta.get("name", "")),
        key=str(key),
        attempt=int(attempt),
        node=str((meta.get("annotations") or {}).get(ANNOTATION_NODE, SHARED)),
        state=state,
        result=_termination_result(pods),
        reason=str(failed.get("reason", "")),
        message=str(failed.get("message", "")),
    )
