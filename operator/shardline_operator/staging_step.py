"""The staging step of ``decide`` (pure): from the spec and what runs to :func:`plan_staging`,
and from its plan to typed actions (create and delete staging Jobs).

Staging applies to an ``hf://`` / ``s3://`` ``spec.model.uri`` (with the draft's
``spec.runtime.speculative.draftModel.uri`` when it has one) whose cache a Job can fill for
the runtime pods: a ``hostPath`` cache volume (node-local: one Job per node that runs a group)
or a ``persistentVolumeClaim`` (shared, ReadWriteMany: one Job). The default per-pod
``emptyDir`` cache is private to each pod, so there the leader fetches and verifies the new
revision itself before its group pauses (``runtime/.../weight_update_routes.py``), one group
at a time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .observed import GroupObservation
from .pass_plan import Action, ApplyObject, DeleteObject
from .render.staging_access import build_staging_access, staging_service_account_name
from .render.staging_job import build_staging_job
from .runtime_args import ServedModel
from .spec import DeploymentSpec
from .staging import StagingPlan, plan_staging
from .staging_state import StagingJob, StagingState, StagingTarget

STAGEABLE_CACHES = ("hostPath", "persistentVolumeClaim")


def staging_target(spec: DeploymentSpec) -> StagingTarget | None:
    """What staging stages for ``spec``, or None when staging does not apply (a local path,
    a ``pvc://`` uri, or a cache volume no Job can share with the runtime pods)."""
    model = spec.model
    cache = model.cache_volume or {}
    if not model.is_remote or model.uri is None or not any(k in cache for k in STAGEABLE_CACHES):
        return None
    speculative = spec.runtime.speculative
    draft = None if speculative is None else speculative.draft_model_path
    return StagingTarget(
        model.uri,
        model.revision,
        shared="persistentVolumeClaim" in cache,
        draft_uri=draft if draft is not None and not draft.startswith("/") else None,
    )


def staging_needed(desired: ServedModel, groups: Sequence[GroupObservation]) -> bool:
    """Some group with running pods serves another checkpoint than ``desired`` (its path,
    revision or draft differ; a CUDA-graph change alone needs no new bytes)."""
    return any(
        g.live_pods and g.served is not None and g.served.checkpoints() != desired.checkpoints()
        for g in groups
    )


def group_nodes(groups: Sequence[GroupObservation]) -> list[str]:
    """The nodes the pods of ``groups`` run on (scheduled pods only)."""
    return sorted({p.node for g in groups for p in g.live_pods if p.node})


def decide_staging(
    spec: DeploymentSpec,
    groups: Sequence[GroupObservation],
    jobs: Sequence[StagingJob],
    previous_status: Mapping[str, Any],
    generation: int,
    now: float,
    cluster_role: str | None = None,
) -> tuple[StagingPlan, list[Action]]:
    """The staging plan of this pass and its actions (Job deletions first, then the staging
    ServiceAccount and RoleBinding to ``cluster_role`` when Jobs are created and a role is
    given, then the Jobs)."""
    target = staging_target(spec)
    plan = plan_staging(
        target,
        staging_needed(ServedModel.desired(spec), groups),
        group_nodes(groups),
        jobs,
        StagingState.from_status(previous_status.get("staging")),
        generation,
        now,
    )
    actions: list[Action] = [DeleteObject("batch/v1", "Job", name) for name in plan.delete]
    if target is not None and plan.state is not None and plan.create:
        attempt = plan.state.attempt
        account = None
        if cluster_role:
            account = staging_service_account_name(spec.name)
            actions += [ApplyObject(o) for o in build_staging_access(spec, target, cluster_role)]
        actions += [
            ApplyObject(build_staging_job(spec, target, node, attempt, account), cached=False)
            for node in plan.create
        ]
    return plan, actions
