"""The staging step's records (pure): what is staged, the Jobs seen, and ``status.staging``.

A *staging target* is an ``hf://`` or ``s3://`` ``spec.model.uri`` with its ``revision`` label,
named by :attr:`StagingTarget.key` (a hash of both). Each node that runs a group gets one
staging Job for the target (one Job in all when the cache is a shared PersistentVolumeClaim);
the Job runs ``shardline-runtime download`` into the cache volume and leaves one JSON line in
its container's termination message (``runtime/shardline_runtime/download_cli.py``), which
:func:`staging_job_from_api` reads back. While it runs, the container keeps its live progress in
the :data:`ANNOTATION_PROGRESS` annotation of its own pod (``runtime/.../pod_progress.py``,
at most every 5 s), read from the same pod listing. ``status.staging`` (:class:`StagingState`) is kept in
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
ANNOTATION_PROGRESS = "shardline.dev/staging-progress"  # pod_progress.ANNOTATION in the runtime
SHARED = ""  # the node name of the one Job that stages into a shared (RWX) claim


@dataclass(frozen=True)
class StagingTarget:
    """What to stage: ``uri`` (hf:// or s3://), its ``revision`` label, and ``shared``: the
    cache is one ReadWriteMany claim (one Job in all) rather than a node-local hostPath (one
    Job per node); ``draft_uri``: the draft model's or EAGLE head's hf:// or s3:// uri, staged
    by the same Jobs (None: no remote draft)."""

    uri: str
    revision: str
    shared: bool = False
    draft_uri: str | None = None

    @property
    def key(self) -> str:
        """10 hex characters of sha256(uri, revision[, draft_uri]): names the target in labels
        and Jobs (a target without a draft keeps the key it had before drafts were staged)."""
        text = f"{self.uri}\n{self.revision}" + (f"\n{self.draft_uri}" if self.draft_uri else "")
        return hashlib.sha256(text.encode()).hexdigest()[:10]


@dataclass(frozen=True)
class StagingJob:
    """One staging Job as observed: ``node`` (:data:`SHARED` for the shared-claim Job),
    ``state`` (one of the ``JOB_*`` names), ``result``: the JSON its container left in the
    termination message (empty while it runs), ``reason`` / ``message``: the Job's Failed
    condition when the container left none (e.g. ``DeadlineExceeded``); ``progress``: the
    live ``{"bytesDone", "bytesTotal", "bytesPerSecond"}`` its running pod last annotated."""

    name: str
    key: str
    attempt: int
    node: str
    state: str
    result: Mapping[str, Any] = field(default_factory=dict)
    reason: str = ""
    message: str = ""
    progress: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class NodeStaging:
    """``status.staging.nodes[]``: one node's Job. While it runs, ``bytes_done`` /
    ``bytes_total`` / ``bytes_per_second`` are the live progress its pod annotated (None until
    the first report); when it ends, the Job's own report (bytes of the revision, average
    rate). ``cached``: the revision was already in the node's cache."""

    node: str
    job: str
    state: str
    bytes_done: int | None = None
    bytes_total: int | None = None
    bytes_per_second: int | None = None
    seconds: float | None = None
    cached: bool = False
    resolved_revision: str | None = None
    message: str = ""
    draft_resolved_revision: str | None = None

    def to_status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"node": self.node or "shared", "job": self.job, "state": self.state}
        if self.bytes_done is not None:
            out["bytesDone"] = self.bytes_done
        if self.bytes_total is not None:
            out["bytesTotal"] = self.bytes_total
        if self.bytes_per_second is not None:
            out["bytesPerSecond"] = self.bytes_per_second
        if self.seconds is not None:
            out["seconds"] = self.seconds
        if self.cached:
            out["cached"] = True
        if self.resolved_revision:
            out["resolvedRevision"] = self.resolved_revision
        if self.draft_resolved_revision:
            out["draftResolvedRevision"] = self.draft_resolved_revision
        if self.message:
            out["message"] = self.message
        return out

    @classmethod
    def from_job(cls, job: StagingJob) -> NodeStaging:
        result = job.result
        live = job.state in (JOB_PENDING, JOB_RUNNING) and not result
        size = (job.progress if live else result).get("bytesDone" if live else "bytes")
        total = job.progress.get("bytesTotal") if live else size
        rate = (job.progress if live else result).get("bytesPerSecond")
        seconds = result.get("seconds")
        return cls(
            node=job.node,
            job=job.name,
            state=job.state,
            bytes_done=_count(size),
            bytes_total=_count(total),
            bytes_per_second=_count(rate),
            seconds=float(seconds) if isinstance(seconds, (int, float)) else None,
            cached=bool(result.get("cached", False)),
            resolved_revision=_text(result.get("resolvedRevision")),
            message=failure_of(job)[1] if job.state == JOB_FAILED else "",
            draft_resolved_revision=_text(result.get("draftResolvedRevision")),
        )


@dataclass(frozen=True)
class StagingState:
    """``status.staging``: the target (``uri``, ``revision``, ``key``), the ``phase``
    (Staging, Staged, Failed), the ``attempt`` and the object ``generation`` it started at (a
    later generation retries a failure), the ``resolved_revision`` every node agreed on (the
    Hub commit or the S3 listing digest ``etags-...``), the failure ``reason``, a ``message``,
    the per-node items and times (Unix seconds); ``draft_uri`` / ``draft_resolved_revision``:
    the remote draft staged with the target and the revision every node agreed on for it."""

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
    draft_uri: str | None = None
    draft_resolved_revision: str | None = None

    @property
    def bytes_done(self) -> int:
        """Bytes over all nodes (each node's copy counted): a finished node's revision size,
        a running node's live progress."""
        return sum(n.bytes_done or 0 for n in self.nodes)

    @property
    def bytes_total(self) -> int | None:
        """Bytes to stage over the nodes that reported a total (None: none has yet)."""
        totals = [n.bytes_total for n in self.nodes if n.bytes_total is not None]
        return sum(totals) if totals else None

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
            "bytesDone": self.bytes_done,
        }
        if self.bytes_total is not None:
            out["bytesTotal"] = self.bytes_total
        if self.resolved_revision:
            out["resolvedRevision"] = self.resolved_revision
        if self.draft_uri:
            out["draftUri"] = self.draft_uri
        if self.draft_resolved_revision:
            out["draftResolvedRevision"] = self.draft_resolved_revision
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
            draft_uri=_text(raw.get("draftUri")),
            draft_resolved_revision=_text(raw.get("draftResolvedRevision")),
        )


def failure_of(job: StagingJob) -> tuple[str, str]:
    """``(reason, message)`` of a failed Job: its container's report (``NotFound``,
    ``Unauthorized``, ``ChecksumMismatch``, ...), else the Job's Failed condition."""
    reason = _text(job.result.get("reason")) or job.reason or "StagingFailed"
    message = _text(job.result.get("message")) or job.message or "the staging Job failed"
    return reason, message


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _live_progress(pods: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The progress annotation of the newest pod still running (empty when none has one)."""
    newest: tuple[str, dict[str, Any]] | None = None
    for pod in pods:
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        meta = pod.get("metadata") or {}
        try:
            parsed = json.loads((meta.get("annotations") or {}).get(ANNOTATION_PROGRESS) or "")
        except ValueError:
            continue
        if isinstance(parsed, dict):
            stamp = str(meta.get("creationTimestamp") or "")
            if newest is None or stamp >= newest[0]:
                newest = (stamp, parsed)
    return newest[1] if newest is not None else {}


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
        progress=_live_progress(pods),
    )
