"""Group and deployment phases (DESIGN 3.1), as written to ``status.groups[].phase`` and
``status.phase``. Both are ``str`` enums, so a status dict holds their plain values."""

from __future__ import annotations

from enum import Enum


class TextEnum(str, Enum):
    """A ``str`` enum that prints as its value in ``str()`` and f-strings (as Python 3.11's
    ``StrEnum`` does; the operator supports 3.10)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class GroupPhase(TextEnum):
    """One TP group's phase.

    ``PENDING``: no StatefulSet or no pod yet; ``INITIALIZING``: pods run, not all Ready;
    ``READY``: every rank Ready; ``UPDATING_WEIGHTS`` / ``RECAPTURING_GRAPHS``: its leader is in
    an in-place update; ``RESTARTING``: its pods are being replaced (health or rollout);
    ``FAILED``: the restart budget ran out; ``TERMINATING``: a group beyond ``replicas`` whose
    pods are still draining.
    """

    PENDING = "Pending"
    INITIALIZING = "Initializing"
    READY = "Ready"
    UPDATING_WEIGHTS = "UpdatingWeights"
    RECAPTURING_GRAPHS = "RecapturingGraphs"
    RESTARTING = "Restarting"
    FAILED = "Failed"
    TERMINATING = "Terminating"


class DeploymentPhase(TextEnum):
    """The deployment's phase: the group phases aggregated (``status.deployment_phase``);
    ``ROLLING_OUT``: a rollout is under way; ``STAGING``: a new revision is being
    downloaded and verified on the nodes before any group pauses (``staging.py``); ``DEGRADED``: unplanned trouble (a health
    restart, a mixed version, a failed rollout); ``SCALING_DOWN``: ``replicas: 0`` while pods
    still drain; ``SCALED_TO_ZERO``: ``replicas: 0`` and no pod left."""

    PENDING = "Pending"
    INITIALIZING = "Initializing"
    READY = "Ready"
    UPDATING_WEIGHTS = "UpdatingWeights"
    RECAPTURING_GRAPHS = "RecapturingGraphs"
    ROLLING_OUT = "RollingOut"
    STAGING = "Staging"
    DEGRADED = "Degraded"
    FAILED = "Failed"
    SCALING_DOWN = "ScalingDown"
    SCALED_TO_ZERO = "ScaledToZero"
