"""Issue 30: ``spec.runtime.speculative.draftModel`` rolls in place with the target.

A change of the draft (alone or with ``spec.model``) is an in-place rollout whose
``/update_weights_from_disk`` carries ``draft_model_path``; a remote draft is staged on the
nodes with the target; the algorithm and ``numDraftTokens`` are flags and restart groups.
Rows as in ``test_staging_decide.py``: observations built with the real render functions.
"""

from __future__ import annotations

import pytest

from shardline_operator import labels
from shardline_operator.decide import decide
from shardline_operator.observed import GroupObservation, LeaderObservation, PodObservation
from shardline_operator.pass_plan import ApplyObject, DeletePods, Observation, StartUpdate
from shardline_operator.render import build_statefulset
from shardline_operator.rollout_state import RolloutState
from shardline_operator.rollout_view import GroupView, update_body
from shardline_operator.runtime_args import ServedModel
from shardline_operator.staging_state import StagingJob
from shardline_operator.staging_step import staging_target
from shardline_operator.weights import LeaderReport

NOW = 1_800_000_000.0
CACHE = {"hostPath": {"path": "/var/lib/shardline/model-cache", "type": "DirectoryOrCreate"}}
D1, D2 = "hf://org/draft@v1", "hf://org/draft@v2"


def uri(revision):
    return f"s3://models/tiny/{revision}"


@pytest.fixture
def draft_spec(make_spec):
    """``make(revision, draft, algorithm, tokens, cache)`` -> a spec with an s3 target and a
    STANDALONE draft ``draft`` (a uri or an absolute path)."""

    def make(revision="rev-a", draft=D1, algorithm="STANDALONE", tokens=5, cache=None):
        model = {"name": "tiny-llama", "uri": uri(revision), "revision": revision,
                 "s3": {"endpoint": "http://127.0.0.1:9000", "region": "us-east-1"},
                 "credentialsSecretRef": {"name": "s3-keys"}}
        if cache is not None:
            model["cache"] = {"volume": cache}
        draft_model = {"uri": draft} if draft.startswith(("hf://", "s3://")) else {"path": draft}
        speculative = {"algorithm": algorithm, "numDraftTokens": tokens, "draftModel": draft_model}
        return make_spec({"model": model, "parallelism": {"tensor": 1, "gpusPerPod": 1},
                          "runtime": {"image": "r:1", "speculative": speculative}})

    return make


def fleet(spec, make_pod, serving="rev-a", draft=D1, reported_draft="same"):
    """Every group Ready on ``serving`` with ``draft``, rendered from the spec it ran under;
    the leaders report ``draft`` (``reported_draft`` overrides what they report)."""
    model = ServedModel(uri(serving), serving, ServedModel.desired(spec).cuda_graph, draft)
    reported = draft if reported_draft == "same" else reported_draft
    groups = {}
    for g in range(spec.replicas):
        raw = make_pod(g, 0)
        raw["metadata"]["annotations"] = {labels.ANNOTATION_RESTART_HASH: spec.restart_hash()}
        raw["metadata"]["labels"][labels.LABEL_REVISION] = serving
        raw["spec"] = {"nodeName": f"node-{g}"}
        report = LeaderReport("serving", uri(serving), serving, f"sha256:{serving}",
                              draft_model_path=reported, draft_digest="sha256:d" if reported else None,
                              draft_source_revision="c0ffee" if reported else None)
        groups[g] = GroupObservation(g, 1, build_statefulset(spec, g, model), (PodObservation.from_api(raw),),
                                     LeaderObservation(report))
    return groups


def previous_status(spec, serving="rev-a"):
    groups = [{"index": g, "phase": "Ready", "revision": serving, "restarts": 0, "weightsDigest": f"sha256:{serving}",
               "podUIDs": {f"llama-g{g}-0": f"uid-{g}-0"}} for g in range(spec.replicas)]
    return {"phase": "Ready", "restartBudgetGeneration": 1, "groups": groups}


def run(spec, groups, previous=None, jobs=()):
    observed = Observation(1, groups, staging_jobs=jobs)
    return decide(spec, observed, previous or previous_status(spec), NOW)


def started(plan):
    return [a for a in plan.actions if isinstance(a, StartUpdate)]


def restarts(plan):
    return [a.group for a in plan.actions if isinstance(a, DeletePods)]


def test_a_draft_change_does_not_change_the_restart_hash(draft_spec):
    assert draft_spec(draft=D1).restart_hash() == draft_spec(draft=D2).restart_hash()
    assert draft_spec(draft=D1).restart_hash() == draft_spec(draft="/models/draft").restart_hash()


@pytest.mark.parametrize("change", [{"tokens": 6}, {"algorithm": "EAGLE"}])
def test_the_algorithm_and_draft_token_count_still_change_the_restart_hash(draft_spec, change):
    assert draft_spec().restart_hash() != draft_spec(**change).restart_hash()


def test_a_draft_change_alone_rolls_in_place_carrying_the_draft(draft_spec, make_pod):
    old, new = draft_spec(draft=D1), draft_spec(draft=D2)
    plan = run(new, fleet(old, make_pod))
    assert restarts(plan) == []
    (update,) = started(plan)  # one group at a time (maxUnavailable 1)
    assert update.body["model_path"] == uri("rev-a")
    assert update.body["draft_model_path"] == D2


def test_target_and_draft_change_in_one_update(draft_spec, make_pod):
    plan = run(draft_spec(revision="rev-b", draft=D2), fleet(draft_spec(), make_pod))
    (update,) = started(plan)
    assert (update.body["model_path"], update.body["revision"], update.body["draft_model_path"]) == (
        uri("rev-b"), "rev-b", D2)


def test_a_target_change_alone_does_not_reload_the_draft(draft_spec, make_pod):
    plan = run(draft_spec(revision="rev-b"), fleet(draft_spec(), make_pod))
    (update,) = started(plan)
    assert "draft_model_path" not in update.body


@pytest.mark.parametrize("change", [{"tokens": 6}, {"algorithm": "EAGLE", "draft": D2}])
def test_an_algorithm_or_token_count_change_restarts_instead(draft_spec, make_pod, change):
    plan = run(draft_spec(**change), fleet(draft_spec(), make_pod))
    assert started(plan) == []
    assert restarts(plan) == [0]


def test_a_group_updated_in_place_is_rendered_with_its_new_draft(draft_spec, make_pod):
    """Once the leader serves the new draft, its StatefulSet's args name it, so a pod that
    restarts later loads the target and the draft the group serves."""
    old, new = draft_spec(draft=D1), draft_spec(draft=D2)
    groups = fleet(old, make_pod)
    first = run(new, groups)
    report = LeaderReport("serving", uri("rev-a"), "rev-a", "sha256:rev-a", draft_model_path=D2)
    groups[0] = GroupObservation(0, 1, groups[0].statefulset, groups[0].pods, LeaderObservation(report))
    second = decide(new, Observation(1, groups), first.status, NOW + 1)
    (sts,) = [a.obj for a in second.actions if isinstance(a, ApplyObject) and a.obj["kind"] == "StatefulSet"
              and a.obj["metadata"]["name"] == "llama-g0"]
    args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--speculative-draft-model-path") + 1] == D2
    assert sts["metadata"]["annotations"][labels.ANNOTATION_RESTART_HASH] == new.restart_hash()


def test_the_statefulset_is_read_back_with_its_draft(draft_spec, make_pod):
    groups = fleet(draft_spec(), make_pod)
    assert groups[0].served.draft == D1


def test_a_leader_serving_another_draft_than_declared_is_a_mixed_version(draft_spec):
    declared = ServedModel(uri("rev-a"), "rev-a", ServedModel.desired(draft_spec()).cuda_graph, D1)
    leader = LeaderReport("serving", uri("rev-a"), "rev-a", "sha256:a", draft_model_path=D2)
    view = GroupView(0, declared, leader=leader)
    assert view.mixed_reason() == f"group 0: leader serves draft {D2}, expected {D1}"
    older = LeaderReport("serving", uri("rev-a"), "rev-a", "sha256:a")  # reports no draft
    assert GroupView(0, declared, leader=older).mixed_reason() is None


def test_the_update_body_names_the_draft_only_when_it_changes():
    from shardline_operator.spec import CudaGraphSpec

    a = ServedModel("p", "r", CudaGraphSpec(), D1)
    assert "draft_model_path" not in update_body(a, a)
    assert update_body(a, ServedModel("p", "r", CudaGraphSpec(), D2))["draft_model_path"] == D2
    assert update_body(None, a)["draft_model_path"] == D1


def test_the_rollout_state_keeps_target_and_previous_drafts(draft_spec):
    cuda = ServedModel.desired(draft_spec()).cuda_graph
    state = RolloutState("Updating", ServedModel("p2", "r2", cuda, D2), ServedModel("p1", "r1", cuda, D1))
    raw = state.to_status()
    assert (raw["targetDraftModel"], raw["previousDraftModel"]) == (D2, D1)
    assert RolloutState.from_status(raw) == state


def test_group_status_shows_the_draft_its_leader_reports(draft_spec, make_pod):
    plan = run(draft_spec(), fleet(draft_spec(), make_pod))
    item = plan.status["groups"][0]
    assert item["draftModel"] == D1
    assert item["draftDigest"] == "sha256:d;source=c0ffee"


# Staging: a remote draft is staged on the nodes with the target.


def test_a_remote_draft_is_staged_with_the_target(draft_spec):
    target = staging_target(draft_spec(draft=D2, cache=CACHE))
    assert target.draft_uri == D2
    assert target.key != staging_target(draft_spec(draft=D1, cache=CACHE)).key


def test_a_local_draft_is_not_staged(draft_spec):
    assert staging_target(draft_spec(draft="/models/draft", cache=CACHE)).draft_uri is None


def test_a_draft_change_alone_stages_before_any_group_pauses(draft_spec, make_pod):
    old, new = draft_spec(draft=D1, cache=CACHE), draft_spec(draft=D2, cache=CACHE)
    plan = run(new, fleet(old, make_pod))
    jobs = [a.obj for a in plan.actions if isinstance(a, ApplyObject) and a.obj["kind"] == "Job"]
    assert len(jobs) == 2 and started(plan) == []
    args = jobs[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--draft-model-path") + 1] == D2
    assert plan.status["staging"]["draftUri"] == D2


def test_staged_status_names_the_drafts_resolved_revision(draft_spec, make_pod):
    old, new = draft_spec(draft=D1, cache=CACHE), draft_spec(draft=D2, cache=CACHE)
    key = staging_target(new).key
    jobs = tuple(StagingJob(f"j{g}", key, 1, f"node-{g}", "Succeeded",
                            {"resolvedRevision": "etags-a", "draftResolvedRevision": "c0ffee", "bytes": 10})
                 for g in range(new.replicas))
    previous = {**previous_status(new), "staging": {"phase": "Staging", "key": key, "uri": uri("rev-a"),
                                                    "revision": "rev-a", "attempt": 1, "generation": 1,
                                                    "draftUri": D2}}
    plan = run(new, fleet(old, make_pod), previous, jobs)
    assert plan.status["staging"]["phase"] == "Staged"
    assert plan.status["staging"]["draftResolvedRevision"] == "c0ffee"
    assert [a.group for a in started(plan)] == [0]


def test_nodes_that_resolved_different_drafts_fail_staging(draft_spec, make_pod):
    old, new = draft_spec(draft=D1, cache=CACHE), draft_spec(draft=D2, cache=CACHE)
    key = staging_target(new).key
    jobs = tuple(StagingJob(f"j{g}", key, 1, f"node-{g}", "Succeeded",
                            {"resolvedRevision": "etags-a", "draftResolvedRevision": f"c{g}", "bytes": 10})
                 for g in range(new.replicas))
    previous = {**previous_status(new), "staging": {"phase": "Staging", "key": key, "uri": uri("rev-a"),
                                                    "revision": "rev-a", "attempt": 1, "generation": 1}}
    plan = run(new, fleet(old, make_pod), previous, jobs)
    assert plan.status["staging"]["reason"] == "SourceChanged"
    assert D2 in plan.status["staging"]["message"]
    assert started(plan) == []
