"""Restart rules (pure): which groups need their pods replaced, and which one goes next.

A group needs a restart when its StatefulSet's pod template hash differs from the spec's (a
field that only a new process can take, see ``DeploymentSpec.restart_hash``), or, with
``weightUpdate.strategy: Restart``, when it serves another checkpoint than the spec asks for.
Restarts roll one group at a time, only once every other group is settled (Ready and back in
routing, or Failed) and no in-place wave is in flight, so capacity drops by at most one group.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .observed import GroupObservation
from .runtime_args import ServedModel
from .spec import DeploymentSpec


def needs_restart(spec: DeploymentSpec, group: GroupObservation) -> bool:
    """The group's pods must be replaced to reach the spec."""
    if group.restart_hash != spec.restart_hash():
        return True
    served, desired = group.served, ServedModel.desired(spec)
    return (
        spec.weight_update.strategy == "Restart"
        and served is not None
        and served.checkpoints() != desired.checkpoints()
    )


def needs_in_place(spec: DeploymentSpec, group: GroupObservation) -> bool:
    """The group serves another model or graph setting than the spec, and no restart is due."""
    return (
        group.served is not None
        and group.served != ServedModel.desired(spec)
        and not needs_restart(spec, group)
    )


def next_restart(
    spec: DeploymentSpec,
    groups: Sequence[GroupObservation],
    failed: Mapping[int, bool],
    wave_in_flight: bool,
) -> GroupObservation | None:
    """The group to restart now, or None (none stale, a wave in flight, or another group unsettled).

    A stale group that is out of service (unready, or out of routing) is taken before one that
    serves.

    ``failed``: group index -> the group is marked Failed (counts as settled).
    """
    stale = [g for g in groups if needs_restart(spec, g)]
    if not stale or wave_in_flight:
        return None
    # A stale group already out of service goes first: restarting it takes no capacity away.
    group = next((g for g in stale if not _in_service(g)), stale[0])
    settled = all(
        _in_service(g) or failed.get(g.index, False) for g in groups if g.index != group.index
    )
    return group if settled else None


def _in_service(group: GroupObservation) -> bool:
    """Ready and back in routing: a group whose pods are Ready but whose leader has not returned
    to routing yet (its ``/health_generate`` check pending or failing, after an update or a
    restart) still counts against ``maxUnavailable`` (issue 23)."""
    return group.ready and group.routable
