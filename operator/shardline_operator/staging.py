"""Staging before an in-place rollout: a pure planner.

Issue 25: a new ``hf://`` / ``s3://`` revision is downloaded and verified on every node that
runs a group *before* the first group pauses, so an in-place update reads from local disk, and
a source that cannot be staged (missing repository or revision, refused credentials, a full
disk, a checksum mismatch) fails while every group still serves the old revision.

:func:`plan_staging` takes the target (``None`` when staging does not apply: a local or
``pvc://`` model, or a per-pod ``emptyDir`` cache that no Job can fill), whether some group
still has to move to it, the nodes that run groups, the staging Jobs observed and the previous
``status.staging``, and returns the Jobs to create and delete, the new state, events, and
whether the rollout must wait (``holds_rollout``). Rules:

- One Job per (target, attempt, node); one in all for a shared claim. Jobs of other targets
  or attempts are deleted; a node that appears during staging gets its Job too.
- While Jobs run, each node's item carries the live bytes done / total and rate its pod
  annotated, and the message sums them over the running nodes.
- Staged once every node's Job succeeded and all report the same resolved revision (a source
  that changed between nodes fails with ``SourceChanged``). Staged is kept for the target
  (the rollout then proceeds even if its Jobs are gone).
- A failed Job fails staging with its reason (``NotFound``, ``Unauthorized``,
  ``ChecksumMismatch``, ``DeadlineExceeded``, ...); the rollout stays held, so every group
  keeps serving what it serves. A later spec change (a higher ``metadata.generation``)
  retries as a new attempt.
- Nothing to stage (every group serves the target, or no group runs on a node yet: pods that
  start load the target themselves) holds nothing; a Staged record of the target is kept for
  status, anything else is dropped with its Jobs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from .staging_state import (
    FAILED,
    JOB_FAILED,
    JOB_SUCCEEDED,
    SHARED,
    STAGED,
    STAGING,
    NodeStaging,
    StagingJob,
    StagingState,
    StagingTarget,
    failure_of,
)

POLL_SECONDS = 2.0  # next pass while Jobs run (their pods' events are not watched)
MIB = float(1 << 20)

Event = tuple[str, str, str]


@dataclass(frozen=True)
class StagingPlan:
    """The staging step of one pass: ``create`` the Jobs of these nodes (:data:`SHARED` for
    the shared-claim Job) at ``state.attempt``; ``delete`` these Job names; ``holds_rollout``:
    the in-place rollout to the target must not start a wave."""

    state: StagingState | None
    create: tuple[str, ...] = ()
    delete: tuple[str, ...] = ()
    events: tuple[Event, ...] = ()
    holds_rollout: bool = False
    requeue_after_seconds: float | None = None


@dataclass
class _Builder:
    create: list[str] = field(default_factory=list)
    delete: list[str] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)


def plan_staging(
    target: StagingTarget | None,
    needed: bool,
    nodes: Sequence[str],
    jobs: Sequence[StagingJob],
    previous: StagingState | None,
    generation: int,
    now: float,
) -> StagingPlan:
    """The next staging step (pure; ``now`` in Unix seconds). ``needed``: some live group
    does not serve ``target`` yet; ``nodes``: the nodes its groups' pods run on."""
    out = _Builder()
    if target is None:
        out.delete = [j.name for j in jobs]
        return StagingPlan(None, delete=tuple(out.delete))
    out.delete = [j.name for j in jobs if j.key != target.key]
    state = previous if previous is not None and previous.key == target.key else None
    wanted = [SHARED] if target.shared else sorted({n for n in nodes if n})
    if state is not None and state.phase == STAGED:
        return _plan(state, out)
    if not needed or not wanted:
        out.delete += [j.name for j in jobs if j.key == target.key]
        return _plan(None, out)
    if state is not None and state.phase == FAILED:
        if generation <= state.generation:
            return _plan(state, out, hold=True)
        state = _new_attempt(target, state.attempt + 1, generation, now)
        out.events.append(("Normal", "StagingRetried", _started(state, wanted)))
    elif state is None:
        state = _new_attempt(target, 1, generation, now)
        out.events.append(("Normal", "StagingStarted", _started(state, wanted)))
    current = {j.node: j for j in jobs if j.key == target.key and j.attempt == state.attempt}
    out.delete += [j.name for j in jobs if j.key == target.key and j.attempt != state.attempt]
    out.create = [n for n in wanted if n not in current]
    items = tuple(NodeStaging.from_job(current[n]) for n in wanted if n in current)
    for item in items:
        was = next((n for n in (previous.nodes if previous else ()) if n.node == item.node), None)
        if item.state == JOB_SUCCEEDED and (was is None or was.state != JOB_SUCCEEDED):
            out.events.append(("Normal", "NodeStaged", _node_line(item, target)))
    state = replace(state, nodes=items)
    failed = [current[n] for n in wanted if n in current and current[n].state == JOB_FAILED]
    if failed:
        reason, message = failure_of(failed[0])
        where = f"node {failed[0].node}" if failed[0].node else "the shared cache"
        line = f"staging {target.uri} ({target.revision}) failed on {where}: {reason}: {message}"
        state = replace(state, phase=FAILED, reason=reason, message=line, finished_at=now)
        out.events.append(("Warning", "StagingFailed", line))
        return _plan(state, out, hold=True)
    done = [i for i in items if i.state == JOB_SUCCEEDED]
    if out.create or len(done) < len(wanted):
        message = f"staging {target.revision}: {len(done)}/{len(wanted)} nodes staged"
        state = replace(state, phase=STAGING, message=message + _progress_line(items))
        return _plan(state, out, hold=True, poll=True)
    resolved = sorted({i.resolved_revision or "" for i in done})
    drafts = sorted({i.draft_resolved_revision or "" for i in done})
    if len(resolved) > 1 or len(drafts) > 1:
        uri, seen = (target.uri, resolved) if len(resolved) > 1 else (target.draft_uri, drafts)
        line = (
            f"staging {uri} failed: nodes resolved different revisions "
            f"({', '.join(seen)}); the source changed while it was staged"
        )
        state = replace(state, phase=FAILED, reason="SourceChanged", message=line, finished_at=now)
        out.events.append(("Warning", "StagingFailed", line))
        return _plan(state, out, hold=True)
    line = f"{target.revision} staged on {len(done)} node(s) as {resolved[0] or 'unknown'}"
    if target.draft_uri:
        line += f", with the draft {target.draft_uri} as {drafts[0] or 'unknown'}"
    state = replace(
        state,
        phase=STAGED,
        resolved_revision=resolved[0] or None,
        draft_resolved_revision=drafts[0] or None,
        message=line,
        finished_at=now,
    )
    out.events.append(("Normal", "Staged", line))
    return _plan(state, out)


def _plan(
    state: StagingState | None, out: _Builder, hold: bool = False, poll: bool = False
) -> StagingPlan:
    return StagingPlan(
        state,
        tuple(out.create),
        tuple(out.delete),
        tuple(out.events),
        hold,
        POLL_SECONDS if poll else None,
    )


def _progress_line(items: Sequence[NodeStaging]) -> str:
    """``, 12.0 of 40.0 MiB at 4.0 MiB/s`` over the running nodes ("" before any reports)."""
    running = [i for i in items if i.state != JOB_SUCCEEDED and i.bytes_total]
    if not running:
        return ""
    done = sum(i.bytes_done or 0 for i in running) / MIB
    total = sum(i.bytes_total or 0 for i in running) / MIB
    rate = sum(i.bytes_per_second or 0 for i in running) / MIB
    return f", {done:.1f} of {total:.1f} MiB at {rate:.1f} MiB/s"


def _new_attempt(target: StagingTarget, attempt: int, generation: int, now: float) -> StagingState:
    return StagingState(
        STAGING,
        target.uri,
        target.revision,
        target.key,
        attempt=attempt,
        generation=generation,
        started_at=now,
        draft_uri=target.draft_uri,
    )


def _started(state: StagingState, wanted: Sequence[str]) -> str:
    where = "the shared cache" if wanted == [SHARED] else f"{len(wanted)} node(s)"
    draft = f" with the draft {state.draft_uri}" if state.draft_uri else ""
    return f"staging {state.uri} ({state.revision}){draft} on {where}, attempt {state.attempt}"


def _node_line(item: NodeStaging, target: StagingTarget) -> str:
    where = f"node {item.node}" if item.node else "the shared cache"
    if item.cached:
        return f"{target.revision} already in the cache of {where}"
    rate = f" at {item.bytes_per_second} B/s" if item.bytes_per_second else ""
    return f"{target.revision} staged on {where}: {item.bytes_done} bytes{rate}"
