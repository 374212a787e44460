"""The records one reconcile pass hands from step to step: what was observed, and the plan.

``observe`` (I/O, read-only) fills an :class:`Observation`; ``decide`` (pure) turns it, with
the spec and the previous status, into a :class:`PassPlan`; ``execute`` performs the plan's
typed actions and writes its statuses. After LWS's ``disaggregatedset`` planner/executor split.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .observed import GroupObservation
from .spec import LoRAAdapterSpec
from .staging_state import StagingJob

Event = tuple[str, str, str]  # (type, reason, message)


@dataclass(frozen=True)
class Observation:
    """Everything one pass read: the object's generation, each group found (every index with a
    StatefulSet or pods, and every index below ``replicas``; leaders asked only below
    ``replicas``), the names of its NetworkPolicies, whether the leader client can list
    and load LoRA adapters, its staging Jobs (listed only for an hf:// or s3:// model) and the
    names of its per-revision Services."""

    generation: int
    groups: Mapping[int, GroupObservation] = field(default_factory=dict)
    network_policies: tuple[str, ...] = ()
    lora_client: bool = False
    revision_services: tuple[str, ...] = ()  # names of the per-revision Services found
    staging_jobs: tuple[StagingJob, ...] = ()


@dataclass(frozen=True)
class ApplyObject:
    """Server-side apply ``obj``; ``cached``: skip when the same content was applied lately."""

    obj: Mapping[str, Any]
    cached: bool = True


@dataclass(frozen=True)
class DeleteObject:
    api_version: str
    kind: str
    name: str


@dataclass(frozen=True)
class DeletePods:
    """Delete every current pod of ``group`` (listed afresh when executed)."""

    group: int


@dataclass(frozen=True)
class RelabelPods:
    """Set the revision label of ``pods`` to ``revision``."""

    pods: tuple[str, ...]
    revision: str


@dataclass(frozen=True)
class StartUpdate:
    """``POST /update_weights_from_disk`` with ``body`` to ``group``'s leader at ``url``."""

    group: int
    url: str
    body: Mapping[str, Any]
    timeout_seconds: float


@dataclass(frozen=True)
class AbortUpdate:
    """``POST /abort_weight_update`` to ``group``'s leader at ``url``: the target changed while
    the group loads (the outcome shows in the update's own reply)."""

    group: int
    url: str


@dataclass(frozen=True)
class LabelLeader:
    """Merge ``labels`` into ``group``'s leader pod ``pod`` (a None value removes the label)."""

    group: int
    pod: str
    labels: Mapping[str, str | None]


@dataclass(frozen=True)
class LeaveRouting:
    """Take ``group``'s leader ``pod`` out of every routing path before its update: set
    ``shardline.dev/routable: "false"``, then wait (at most ``timeout_seconds``) until no
    EndpointSlice of ``services`` lists its address ``ip``."""

    group: int
    pod: str
    ip: str
    services: tuple[str, ...]
    timeout_seconds: float


@dataclass(frozen=True)
class EnterRouting:
    """Put ``group``'s leader ``pod`` back into routing once ``/health_generate`` at ``url``
    answers 200 (else it stays out, and the next pass asks again)."""

    group: int
    pod: str
    url: str


@dataclass(frozen=True)
class LoadAdapter:
    group: int
    url: str
    name: str
    path: str


@dataclass(frozen=True)
class UnloadAdapter:
    group: int
    url: str
    name: str


Action = (
    ApplyObject
    | DeleteObject
    | DeletePods
    | RelabelPods
    | LabelLeader
    | LeaveRouting
    | EnterRouting
    | StartUpdate
    | AbortUpdate
    | LoadAdapter
    | UnloadAdapter
)


@dataclass(frozen=True)
class MetricDeltas:
    """Operator metrics a pass records: ``group_updates`` as (wall seconds, runtime recapture
    seconds or None); ``rollout_seconds`` of a rollout that completed; counters to add; the
    fleet gauges (groups per served revision, groups on a mixed version)."""

    group_updates: tuple[tuple[float, float | None], ...] = ()
    rollout_seconds: float | None = None
    rollbacks: int = 0
    failed_updates: int = 0
    groups_per_revision: Mapping[str, int] | None = None
    mixed_versions: int | None = None


@dataclass(frozen=True)
class PassPlan:
    """What one pass does: ``actions`` in order, then each ``trail`` status (a phase a group
    passed through since the last pass) with its event, then ``status``; ``events`` are emitted
    in order; ``requeue_after_seconds`` asks for the next pass that soon (None: the resync);
    ``restart_budget`` is ``restartPolicy.maxGroupRestarts`` for the alerting gauges."""

    status: Mapping[str, Any]
    actions: tuple[Action, ...] = ()
    trail: tuple[tuple[Mapping[str, Any], Event], ...] = ()
    events: tuple[Event, ...] = ()
    metrics: MetricDeltas = MetricDeltas()
    requeue_after_seconds: float | None = None
    restart_budget: int = 0
    lora: LoRADecision | None = None


@dataclass(frozen=True)
class LoRADecision:
    """``spec.loraAdapters`` this pass: ``desired`` in spec order, what each synced group serves
    once the planned load/unload actions succeed, and ``pending`` (a leader was not synced: look
    again soon). ``lora_sync.settle`` folds the actions' failures back in."""

    desired: tuple[LoRAAdapterSpec, ...]
    loaded_after: Mapping[int, Mapping[str, str]]
    pending: bool
    shown: bool = True  # status carries ``loraAdapters`` (the spec names some, or it did)
