"""``decide()`` as a table: (observation, previous status) -> the action list, with no API.

Each row builds what a pass would have observed (StatefulSets rendered by the real render
functions, pods as the API returns them, what each leader answered) and the status the last
pass wrote, and asserts the typed actions the pass performs, after LWS's planner tests
(``ComputeAllSteps``). Services, the PDB and NetworkPolicies are applied through the content
cache on every pass; the rows list the other actions.
"""

from __future__ import annotations

import copy

import pytest

from shardline_operator import labels
from shardline_operator.decide import decide
from shardline_operator.observed import GroupObservation, LeaderObservation, PodObservation
from shardline_operator.pass_plan import (
    ApplyObject,
    DeleteObject,
    DeletePods,
    LeaveRouting,
    Observation,
    RelabelPods,
    StartUpdate,
)
from shardline_operator.render import build_statefulset
from shardline_operator.runtime_args import ServedModel
from shardline_operator.weights import LeaderReport

NOW = 1_800_000_000.0
REV_A = "/var/lib/shardline/models/tiny-llama/rev-a"
REV_B = "/var/lib/shardline/models/tiny-llama/rev-b"


def served(revision="rev-a", spec=None):
    return ServedModel(REV_A.replace("rev-a", revision), revision, ServedModel.desired(spec).cuda_graph)


def pods(spec, make_pod, index, ready=True, revision="rev-a", restarts=0, leader_deleting=False, template=None):
    out = []
    for rank in range(spec.parallelism.pods_per_group):
        raw = make_pod(index, rank, ready=ready, restarts=restarts, deleting=leader_deleting and rank == 0)
        raw["metadata"]["annotations"] = {labels.ANNOTATION_RESTART_HASH: template or spec.restart_hash()}
        raw["metadata"]["labels"][labels.LABEL_REVISION] = revision
        out.append(PodObservation.from_api(raw))
    return tuple(out)


def leader(revision="rev-a", phase="serving", digest=None, update=("unknown", "")):
    path = REV_A.replace("rev-a", revision)
    report = LeaderReport(phase, path, revision, digest or f"sha256:{revision}")
    return LeaderObservation(report, update)


def observation(spec, make_pod, groups=None, declared="rev-a", extra_statefulsets=(), **group_pods):
    """Every group below ``replicas`` running ``declared``, Ready, its leader serving it;
    ``groups`` overrides ``{index: (pods, leader)}``."""
    statefulsets, all_pods, leaders = {}, {}, {}
    for index in range(spec.replicas):
        statefulsets[index] = build_statefulset(spec, index, served(declared, spec))
        all_pods[index] = pods(spec, make_pod, index, revision=declared)
        leaders[index] = leader(declared)
    for index, (members, answer) in (groups or {}).items():
        all_pods[index], leaders[index] = members, answer
    for index in extra_statefulsets:
        statefulsets[index] = build_statefulset(spec, index, served(declared, spec))
    size = spec.parallelism.pods_per_group
    groups = {i: GroupObservation(i, size, statefulsets.get(i), all_pods.get(i, ()), leaders.get(i) or LeaderObservation())
              for i in sorted(set(statefulsets) | set(all_pods))}
    return Observation(1, groups)


def previous_status(spec, revision="rev-a", rollout=None):
    groups = [{"index": i, "phase": "Ready", "revision": revision, "restarts": 0, "weightsDigest": f"sha256:{revision}",
               "podUIDs": {f"llama-g{i}-{r}": f"uid-{i}-{r}" for r in range(spec.parallelism.pods_per_group)}}
              for i in range(spec.replicas)]
    return {"phase": "Ready", "restartBudgetGeneration": 1, "groups": groups, **({"rollout": rollout} if rollout else {})}


def changes(plan):
    """The plan's actions other than the cached applies, as (kind, detail) rows."""
    rows = []
    for action in plan.actions:
        if isinstance(action, ApplyObject) and not action.cached:
            rows.append(("Apply", f"{action.obj['kind']}/{action.obj['metadata']['name']}"))
        elif isinstance(action, DeleteObject):
            rows.append(("Delete", f"{action.kind}/{action.name}"))
        elif isinstance(action, DeletePods):
            rows.append(("DeletePods", action.group))
        elif isinstance(action, RelabelPods):
            rows.append(("Relabel", action.revision))
        elif isinstance(action, StartUpdate):
            rows.append(("StartUpdate", action.group, action.body["revision"]))
    return rows


def test_a_new_deployment_creates_every_statefulset(make_spec):
    spec = make_spec()
    plan = decide(spec, Observation(1), {}, NOW)
    assert changes(plan) == [("Apply", "StatefulSet/llama-g0"), ("Apply", "StatefulSet/llama-g1")]


def test_a_new_deployment_applies_services_pdb_and_policies_through_the_cache(make_spec):
    spec = make_spec()
    cached = [f"{a.obj['kind']}/{a.obj['metadata']['name']}" for a in decide(spec, Observation(1), {}, NOW).actions
              if isinstance(a, ApplyObject) and a.cached]
    assert cached == ["NetworkPolicy/llama-g0", "NetworkPolicy/llama-g1", "Service/llama-g0-ranks",
                      "Service/llama-g1-ranks", "Service/llama", "PodDisruptionBudget/llama"]


def test_a_steady_fleet_changes_nothing(make_spec, make_pod):
    spec = make_spec()
    plan = decide(spec, observation(spec, make_pod), previous_status(spec), NOW)
    assert changes(plan) == []


def test_a_steady_fleet_asks_for_no_early_pass(make_spec, make_pod):
    spec = make_spec()
    plan = decide(spec, observation(spec, make_pod), previous_status(spec), NOW)
    assert plan.requeue_after_seconds is None


def test_a_steady_fleet_is_ready(make_spec, make_pod):
    spec = make_spec()
    plan = decide(spec, observation(spec, make_pod), previous_status(spec), NOW)
    assert plan.status["phase"] == "Ready"


def test_a_group_beyond_replicas_is_removed(make_spec, make_pod):
    spec = make_spec({"replicas": 1})
    plan = decide(spec, observation(spec, make_pod, extra_statefulsets=(1,)), previous_status(spec), NOW)
    assert changes(plan) == [("Delete", "StatefulSet/llama-g1"), ("Delete", "Service/llama-g1-ranks")]


def test_a_crashed_rank_restarts_its_whole_group(make_spec, make_pod):
    spec = make_spec()
    crashed = {1: (pods(spec, make_pod, 1, restarts=1), leader())}
    plan = decide(spec, observation(spec, make_pod, crashed), previous_status(spec), NOW)
    assert changes(plan) == [("DeletePods", 1)]


def test_pods_from_an_older_template_restart_their_group(make_spec, make_pod):
    spec = make_spec()
    drifted = {0: (pods(spec, make_pod, 0, template="old-hash"), leader())}
    plan = decide(spec, observation(spec, make_pod, drifted), previous_status(spec), NOW)
    assert changes(plan) == [("DeletePods", 0)]


def test_a_new_image_restarts_one_group_at_a_time(make_spec, make_pod):
    old = make_spec()
    spec = make_spec({"runtime": {**_base("runtime"), "image": "ghcr.io/shardline/shardline-runtime:0.2.0"}})
    observed = observation(old, make_pod)
    plan = decide(spec, observed, previous_status(spec), NOW)
    assert changes(plan) == [("Apply", "StatefulSet/llama-g0"), ("DeletePods", 0)]


def test_a_new_revision_starts_one_in_place_update(make_spec, make_pod):
    spec = make_spec({"model": {**_model(), "path": REV_B, "revision": "rev-b"}})
    plan = decide(spec, observation(spec, make_pod), previous_status(spec), NOW)
    assert changes(plan) == [("StartUpdate", 0, "rev-b")]


def _group_0_updated(make_spec, make_pod):
    """The pass that sees group 0's update to rev-b succeed (group 1 still on rev-a)."""
    spec = make_spec({"model": {**_model(), "path": REV_B, "revision": "rev-b"}})
    rollout = {"phase": "Updating", "targetModelPath": REV_B, "targetRevision": "rev-b", "wave": [0],
               "startedAt": "2027-01-15T08:00:00Z", "previousModelPath": REV_A, "previousRevision": "rev-a",
               "canaryPassed": True, "groupPhases": {"0": "UpdatingWeights"}}
    done = {0: (pods(spec, make_pod, 0), leader("rev-b", update=("success", "")))}
    return decide(spec, observation(spec, make_pod, done), previous_status(spec, rollout=rollout), NOW)


def test_a_finished_update_re_renders_and_relabels_its_group(make_spec, make_pod):
    plan = _group_0_updated(make_spec, make_pod)
    assert [c for c in changes(plan) if c[0] != "StartUpdate"] == [("Apply", "StatefulSet/llama-g0"),
                                                                   ("Relabel", "rev-b")]


def test_the_next_group_starts_in_the_pass_that_counts_the_last_one_updated(make_spec, make_pod):
    # No pass in between: the gap between one group serving and the next loading is one pass.
    plan = _group_0_updated(make_spec, make_pod)
    assert [c for c in changes(plan) if c[0] == "StartUpdate"] == [("StartUpdate", 1, "rev-b")]


def test_a_leader_on_another_digest_is_repaired_in_place(make_spec, make_pod):
    spec = make_spec()
    drifted = {1: (pods(spec, make_pod, 1), leader(digest="sha256:other"))}
    plan = decide(spec, observation(spec, make_pod, drifted), previous_status(spec), NOW)
    assert changes(plan) == [("StartUpdate", 1, "rev-a")]


def test_a_leader_on_another_digest_shows_degraded(make_spec, make_pod):
    spec = make_spec()
    drifted = {1: (pods(spec, make_pod, 1), leader(digest="sha256:other"))}
    plan = decide(spec, observation(spec, make_pod, drifted), previous_status(spec), NOW)
    assert plan.status["phase"] == "Degraded"


@pytest.mark.parametrize("phase", ["loading", "recapturing"])
def test_an_unfinished_update_keeps_its_wave(make_spec, make_pod, phase):
    spec = make_spec({"model": {**_model(), "path": REV_B, "revision": "rev-b"}})
    rollout = {"phase": "Updating", "targetModelPath": REV_B, "targetRevision": "rev-b", "wave": [0],
               "startedAt": "2027-01-15T08:00:00Z", "canaryPassed": True, "groupPhases": {"0": "UpdatingWeights"}}
    busy = {0: (pods(spec, make_pod, 0), leader(phase=phase, update=("pending", "")))}
    plan = decide(spec, observation(spec, make_pod, busy), previous_status(spec, rollout=rollout), NOW)
    assert changes(plan) == []


def _base(key):
    from tests.operator.conftest import BASE_SPEC

    return copy.deepcopy(BASE_SPEC[key])


def _model():
    return _base("model")


def test_a_phase_passed_through_between_passes_is_written_and_said_in_plain_words(make_spec, make_pod):
    from shardline_operator.weights import WeightsPhase

    spec = make_spec({"model": {**_model(), "path": REV_B, "revision": "rev-b"}})
    rollout = {"phase": "Updating", "targetModelPath": REV_B, "targetRevision": "rev-b", "wave": [0],
               "startedAt": "2027-01-15T08:00:00Z", "canaryPassed": True, "groupPhases": {"0": "UpdatingWeights"}}
    seen = LeaderObservation(leader("rev-b").report, ("success", ""), (WeightsPhase.RECAPTURING, WeightsPhase.SERVING))
    observed = observation(spec, make_pod, {0: (pods(spec, make_pod, 0), seen)})
    plan = decide(spec, observed, previous_status(spec, rollout=rollout), NOW)
    assert [event for _, event in plan.trail] == [("Normal", "RecapturingGraphs", "group 0: RecapturingGraphs")]


def test_the_decision_reaches_no_module_that_does_io():
    """decide() and everything it imports stay pure: no API client, no leader client."""
    import os
    import subprocess
    import sys

    code = "import sys, shardline_operator.decide; print(' '.join(sorted(sys.modules)))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}  # this checkout's operator
    loaded = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                env=env).stdout.split())
    io_modules = {f"shardline_operator.{m}" for m in ("kube", "runtime_client", "execute", "observe", "handlers")}
    assert sorted(loaded & (io_modules | {"kubernetes", "httpx", "kopf"})) == []


def test_a_group_leaves_routing_just_before_its_update_is_sent(make_spec, make_pod):
    spec = make_spec({"model": {**_model(), "path": REV_B, "revision": "rev-b"}})
    plan = decide(spec, observation(spec, make_pod), previous_status(spec), NOW)
    order = [type(a).__name__ for a in plan.actions if isinstance(a, (LeaveRouting, StartUpdate))]
    assert order == ["LeaveRouting", "StartUpdate"]


def test_status_lists_the_revision_service_of_what_leaders_report(make_spec, make_pod):
    spec = make_spec()
    plan = decide(spec, observation(spec, make_pod), previous_status(spec), NOW)
    assert plan.status["revisionServices"] == [{"revision": "rev-a", "service": "llama-rev-rev-a", "groups": [0, 1]}]
