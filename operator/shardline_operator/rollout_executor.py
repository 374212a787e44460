"""I/O around the rollout planner: gather what the leaders report, then perform a plan.

:func:`gather` asks each group's leader for ``/get_server_info`` (and, for the group under
canary verification, runs the gate) and turns the answers into :class:`GroupView` objects;
:func:`start_updates` sends the updates a :class:`RolloutPlan` asks for. The leader is reached
through a :class:`LeaderClient` (``runtime_client.HttpLeaderClient`` in the operator), so tests
can play whole rollouts with a scripted one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from . import labels
from .observed import GroupObservation
from .rollout import GroupView, LeaderReport, RolloutPlan
from .rollout_state import VERIFYING, RolloutState
from .spec import VerifySpec, WeightUpdateSpec


class LeaderClient(Protocol):
    """Calls to a group leader's admin API (see ``runtime_client.HttpLeaderClient``)."""

    def start_update(
        self, key: str, url: str, body: Mapping[str, Any], timeout_seconds: float
    ) -> None:
        """Send ``POST {url}/update_weights_from_disk`` in the background, tracked under ``key``."""

    def poll(self, key: str) -> tuple[str, str]:
        """``(state, message)``: state is ``pending``, ``success``, ``failure`` or ``unknown``."""

    def server_info(self, url: str) -> Mapping[str, Any] | None:
        """``GET {url}/get_server_info`` as a dict, or None when unreachable."""

    def observed_phases(self, key: str) -> list[str]:
        """``weights_phase`` values sampled while the request under ``key`` ran, since the last call."""

    def update_seconds(self, key: str) -> Mapping[str, float]:
        """The runtime's ``load_seconds`` / ``recapture_seconds`` for the update ``poll`` last
        handed out under ``key`` (empty when it reported none)."""

    def verify(self, url: str, verify: VerifySpec | None) -> tuple[bool, str]:
        """The canary gate: ``/health_generate``, then ``verify``'s completion within its bound."""


def leader_url(group: GroupObservation) -> str | None:
    """``http://<podIP>:8000`` of the group's rank-0 pod, or None without an IP."""
    leader = group.leader
    return f"http://{leader.ip}:{labels.HTTP_PORT}" if leader is not None and leader.ip else None


def gather(
    state: RolloutState | None,
    groups: Sequence[GroupObservation],
    recorded_digests: Mapping[int, str | None],
    policy: WeightUpdateSpec,
    client: LeaderClient,
    key_prefix: str,
) -> list[GroupView]:
    """One :class:`GroupView` per group (leaders asked only when their pod is Running with an IP)."""
    wave = set(state.wave) if state is not None else set()
    views = []
    for group in groups:
        url, key = leader_url(group), f"{key_prefix}/g{group.index}"
        leader = group.leader
        report = None
        if url is not None and leader is not None and leader.phase == "Running":
            report = LeaderReport.from_info(client.server_info(url))
        update: tuple[str, str] = ("unknown", "")
        phases: tuple[str, ...] = ()
        seconds: dict[str, float] = {}
        if group.index in wave:
            update, phases = client.poll(key), tuple(client.observed_phases(key))
            if update[0] in ("success", "failure"):
                seconds = dict(client.update_seconds(key))
        gate = None
        if (
            state is not None
            and state.phase == VERIFYING
            and state.canary == group.index
            and group.ready
            and url is not None
            and policy.canary is not None
        ):
            gate = client.verify(url, policy.canary.verify)
        views.append(
            GroupView(
                group.index,
                group.served,
                group.ready,
                bool(group.live_pods),
                report,
                recorded_digests.get(group.index),
                update,
                phases,
                gate,
                leader.revision if leader is not None else None,
                seconds,
            )
        )
    return views


def start_updates(
    plan: RolloutPlan,
    groups: Sequence[GroupObservation],
    policy: WeightUpdateSpec,
    client: LeaderClient,
    key_prefix: str,
) -> None:
    """Send the plan's ``/update_weights_from_disk`` requests (in the background)."""
    by_index = {g.index: g for g in groups}
    for index, body in plan.start.items():
        url = leader_url(by_index[index])
        if url is not None:
            client.start_update(f"{key_prefix}/g{index}", url, body, policy.timeout_seconds)
