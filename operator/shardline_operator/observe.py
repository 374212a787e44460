"""The read-only first step of a pass: list the children and ask the leaders.

:func:`observe` lists the deployment's StatefulSets, pods, NetworkPolicies and per-revision
Services and asks each group's leader (a Running rank-0 pod with an IP) for
``/get_server_info``, for the state of an
update request this process sent (groups of the wave in flight), for the canary gate (the group
under verification) and for its LoRA adapters (Ready groups). It changes nothing: every change
is an action that ``decide`` plans and ``execute`` performs. The leader is reached through a
:class:`LeaderClient` (``runtime_client.HttpLeaderClient`` in the operator), so tests can play
whole rollouts with a scripted one.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from . import labels
from .kube import KubeClient
from .lora_sync import LoRALeaderClient
from .observed import GroupObservation, LeaderObservation, PodObservation, group_pods, pod_url
from .pass_plan import Observation
from .render.staging_job import staging_selector
from .rollout_state import VERIFYING, RolloutState
from .spec import DeploymentSpec, VerifySpec
from .staging_state import LABEL_STAGING_KEY, StagingJob, staging_job_from_api
from .weights import LeaderReport, WeightsPhase

LEADER_QUERIES = 16  # leaders asked at the same time in one pass
_LISTED_BESIDE = 4  # StatefulSets, NetworkPolicies, Services, staging Jobs: listed beside the pods
# Each leader's LoRA adapters, asked at the same time as its /get_server_info (process-wide).
_ADAPTER_QUERIES = ThreadPoolExecutor(max_workers=LEADER_QUERIES, thread_name_prefix="lora-list")


class LeaderClient(Protocol):
    """Calls to a group leader's admin API (see ``runtime_client.HttpLeaderClient``)."""

    def start_update(
        self, key: str, url: str, body: Mapping[str, Any], timeout_seconds: float
    ) -> None:
        """Send ``POST {url}/update_weights_from_disk`` in the background, tracked under ``key``."""

    def abort_update(self, key: str, url: str) -> None:
        """Send ``POST {url}/abort_weight_update`` in the background (once while one is in
        flight under ``key``); the update's :meth:`poll` then says ``aborted`` or ``success``."""

    def poll(self, key: str) -> tuple[str, str]:
        """``(state, message)``: state is ``pending``, ``success``, ``failure``, ``aborted`` or
        ``unknown``."""

    def server_info(self, url: str) -> Mapping[str, Any] | None:
        """``GET {url}/get_server_info`` as a dict, or None when unreachable."""

    def observed_phases(self, key: str) -> list[str]:
        """``weights_phase`` values sampled while the request under ``key`` ran, since the last call."""

    def update_seconds(self, key: str) -> Mapping[str, float]:
        """The runtime's ``load_seconds`` / ``recapture_seconds`` for the update ``poll`` last
        handed out under ``key``, until the next update under ``key`` starts (empty when it
        reported none)."""

    def verify(self, url: str, verify: VerifySpec | None) -> tuple[bool, str]:
        """The canary gate: ``/health_generate``, then ``verify``'s completion within its bound."""


def update_key(spec: DeploymentSpec, group: int) -> str:
    """The key a group's update request is tracked under in the leader client."""
    return f"{spec.namespace}/{spec.name}/g{group}"


def deployment_of(key: str) -> tuple[str, str]:
    """``(namespace, name)`` of the deployment an :func:`update_key` belongs to."""
    namespace, name, _ = key.split("/")
    return namespace, name


def _leader(pods: tuple[PodObservation, ...]) -> PodObservation | None:
    return next((p for p in pods if p.rank == 0 and not p.deleting), None)


def _ready(pods: tuple[PodObservation, ...], size: int) -> bool:
    live = [p for p in pods if not p.deleting]
    return len(live) == size and all(p.ready for p in live)


def observe_leader(
    spec: DeploymentSpec,
    index: int,
    pods: tuple[PodObservation, ...],
    rollout: RolloutState | None,
    client: LeaderClient,
) -> LeaderObservation:
    """Ask group ``index``'s leader what a pass needs to know (nothing without a Running leader)."""
    leader = _leader(pods)
    url = pod_url(leader)
    if url is None or leader is None or leader.phase != "Running":
        return LeaderObservation()
    ready = _ready(pods, spec.parallelism.pods_per_group)
    # The adapters are asked beside /get_server_info, not after it: on a loaded leader each
    # answer takes up to a second, and every pass of a rollout waits for the slowest leader.
    adapters_asked = (
        _ADAPTER_QUERIES.submit(client.lora_adapters, url)
        if ready and isinstance(client, LoRALeaderClient)
        else None
    )
    report = LeaderReport.from_info(client.server_info(url))
    key = update_key(spec, index)
    update: tuple[str, str] = ("unknown", "")
    phases: tuple[WeightsPhase, ...] = ()
    seconds: dict[str, float] = {}
    if rollout is not None and index in rollout.wave:
        update = client.poll(key)
        phases = tuple(WeightsPhase.parse(p) for p in client.observed_phases(key))
        # Also after the reply was handed out: a success counts once the group is Ready again.
        seconds = dict(client.update_seconds(key))
    gate = None
    canary = spec.weight_update.canary
    if (
        rollout is not None
        and rollout.phase == VERIFYING
        and rollout.canary == index
        and ready
        and canary is not None
    ):
        gate = client.verify(url, canary.verify)
    adapters = None if adapters_asked is None else adapters_asked.result()
    return LeaderObservation(report, update, phases, seconds, gate, adapters)


def observe_staging_jobs(kube: KubeClient, spec: DeploymentSpec) -> tuple[StagingJob, ...]:
    """The deployment's staging Jobs (not those being deleted) with their pods' reports;
    none listed unless the model is an hf:// or s3:// uri."""
    if not spec.model.is_remote:
        return ()
    selector = staging_selector(spec.name)
    pods = kube.list("v1", "Pod", spec.namespace, selector)
    found = []
    for job in kube.list("batch/v1", "Job", spec.namespace, selector):
        meta = job.get("metadata") or {}
        if meta.get("deletionTimestamp") is not None:
            continue
        uid = meta.get("uid")
        own = [
            p
            for p in pods
            if any(ref.get("uid") == uid for ref in p["metadata"].get("ownerReferences") or [])
            and (p["metadata"].get("labels") or {}).get(LABEL_STAGING_KEY)
        ]
        parsed = staging_job_from_api(job, own)
        if parsed is not None:
            found.append(parsed)
    return tuple(found)


def observe(
    kube: KubeClient,
    client: LeaderClient,
    spec: DeploymentSpec,
    generation: int,
    previous_status: Mapping[str, Any],
) -> Observation:
    """List the deployment's children and ask its leaders, up to :data:`LEADER_QUERIES` at the
    same time (read-only; raises ``KubeError``; ``client`` must be safe to call from threads).

    The five lists run at the same time, so a pass waits for the slowest rather than for their
    sum (on a loaded control plane each takes tens of milliseconds). The leaders are asked only
    once every list has succeeded: asking hands out what a leader reports once (an update's
    result, the phases seen while it ran), which a pass that then failed would lose.
    """
    selector = labels.selector_labels(spec.name)
    ns = spec.namespace
    asked = range(spec.replicas)
    workers = max(_LISTED_BESIDE, min(len(asked), LEADER_QUERIES))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="observe") as pool:
        listed_sts = pool.submit(kube.list, "apps/v1", "StatefulSet", ns, selector)
        listed_policies = pool.submit(
            kube.list, "networking.k8s.io/v1", "NetworkPolicy", ns, selector
        )
        listed_services = pool.submit(kube.list, "v1", "Service", ns, selector)
        listed_staging = pool.submit(observe_staging_jobs, kube, spec)
        listed_pods = kube.list("v1", "Pod", ns, selector)
        statefulsets: dict[int, dict[str, Any]] = {}
        for listed in listed_sts.result():
            group = (listed["metadata"].get("labels") or {}).get(labels.LABEL_GROUP, "")
            if group.isdigit():
                statefulsets[int(group)] = listed
        policies = tuple(p["metadata"]["name"] for p in listed_policies.result())
        revision_services = tuple(
            service["metadata"]["name"]
            for service in listed_services.result()
            if labels.LABEL_REVISION_SERVICE in (service["metadata"].get("labels") or {})
        )
        staging_jobs = listed_staging.result()
        pods = {i: tuple(members) for i, members in group_pods(listed_pods).items()}
        # The leaders are asked at once: a pass waits for the slowest, not for their sum (a
        # busy leader can take a second or more to answer).
        rollout = RolloutState.from_status(previous_status.get("rollout"))
        futures = {
            i: pool.submit(observe_leader, spec, i, pods.get(i, ()), rollout, client) for i in asked
        }
        answered = {i: future.result() for i, future in futures.items()}
    size = spec.parallelism.pods_per_group
    indices = sorted(set(statefulsets) | set(pods) | set(asked))
    groups = {
        index: GroupObservation(
            index,
            size,
            statefulsets.get(index),
            pods.get(index, ()),
            answered.get(index, LeaderObservation()),
        )
        for index in indices
    }
    return Observation(
        generation,
        groups,
        policies,
        lora_client=isinstance(client, LoRALeaderClient),
        revision_services=revision_services,
        staging_jobs=staging_jobs,
    )
