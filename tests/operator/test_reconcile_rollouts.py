"""Issue 9 through reconcile(): the revert case, truthful phases, mixed versions, requeue, ranks.

Leaders are simulated per URL (``reconcile_world.LiveLeaders``) so the reconciler's gather ->
plan -> execute loop runs whole rollouts against an in-memory API.
"""

from __future__ import annotations

import pytest
from reconcile_world import REV_A, REV_B, LiveLeaders, ready_world

from shardline_operator import labels, metrics


@pytest.fixture
def world(spec_dict):
    passes = ready_world(spec_dict, LiveLeaders())

    def run(spec=None, **model):
        changes = dict(spec or {})
        if model:
            changes["model"] = dict(passes.body["spec"]["model"], **model)
        return passes.run(**changes)

    return passes.kube, passes.leaders, run


def conditions(status):
    return {c["type"]: c for c in status["conditions"]}


def test_revert_mid_update_is_awaited_then_applied(world):
    """The issue's revert case: status never claims Ready on rev-a while group 0 loads rev-b,
    and the group is sent back once the update in flight ends."""
    kube, leaders, run = world
    result = run(path=REV_B, revision="rev-b")
    assert result.status["phase"] == "UpdatingWeights" and result.requeue_after_seconds == 0.5
    result = run(path=REV_A, revision="rev-a")  # reverted while group 0 loads rev-b
    assert result.status["phase"] != "Ready" and not any(e[1] == "RolloutComplete" for e in result.events)
    assert leaders.sent == [("default/llama/g0", "rev-b")]
    leaders.finish("default/llama/g0")  # the cancel came too late: the update committed
    result = run()
    assert result.status["groups"][0]["revision"] == "rev-b"  # the truth: it loaded rev-b
    assert result.status["phase"] == "UpdatingWeights" and conditions(result.status)["Ready"]["status"] == "False"
    assert leaders.sent[-1] == ("default/llama/g0", "rev-a")  # sent back in the same pass
    leaders.finish("default/llama/g0")
    run()  # the pass that counts it back on rev-a; it returns to routing after it
    completed = run()  # back in routing: the rollout completes
    assert any(e[1] == "RolloutComplete" for e in completed.events)
    result = run()
    assert result.status["phase"] == "Ready" and result.status["servedRevision"] == "rev-a"
    assert leaders.sent == [("default/llama/g0", "rev-b"), ("default/llama/g0", "rev-a")]  # g1 never moved


def test_revert_mid_update_cancels_the_load_and_the_group_keeps_its_weights(world):
    """Issue 23: the revert aborts the load before it commits; nothing is sent back, since the
    group never served the reverted weights."""
    kube, leaders, run = world
    run(path=REV_B, revision="rev-b")
    run(path=REV_A, revision="rev-a")  # reverted while group 0 loads rev-b: the load is aborted
    cancelled = run()
    result = run()
    assert (result.status["phase"], result.status["servedRevision"]) == ("Ready", "rev-a")
    assert leaders.sent == [("default/llama/g0", "rev-b")]  # nothing sent back: it never served rev-b
    assert [e[1] for e in cancelled.events if e[1] == "UpdateCancelled"] == ["UpdateCancelled"]


def recaptures() -> float:
    return metrics.REGISTRY.get_sample_value("shardline_operator_group_recapture_seconds_count",
                                             {"namespace": "default", "name": "llama"}) or 0.0


def test_progress_condition_and_no_ready_between_groups(world):
    kube, leaders, run = world
    before = recaptures()
    run(path=REV_B, revision="rev-b")
    leaders.finish("default/llama/g0")
    result = run()  # counts group 0 updated; it returns to routing after this pass's status
    assert result.status["phase"] == "RollingOut"  # between groups: never Ready, never Initializing
    assert result.requeue_after_seconds == 0.0, "the next group waits for no timer"
    progressing = conditions(result.status)["Progressing"]
    assert progressing["status"] == "True" and progressing["message"] == "1/2 groups on rev-b"
    assert conditions(result.status)["Ready"]["status"] == "False"
    result = run()  # group 0 is back in routing: group 1 starts
    assert result.status["phase"] == "UpdatingWeights"
    assert leaders.sent[-1] == ("default/llama/g1", "rev-b")
    leaders.finish("default/llama/g1")
    run()
    result = run()
    assert result.status["phase"] == "Ready" and conditions(result.status)["Progressing"]["status"] == "False"
    assert [g["weightsDigest"] for g in result.status["groups"]] == ["sha256:rev-b", "sha256:rev-b"]
    assert metrics.GROUPS_PER_REVISION.labels("default", "llama", "rev-b")._value.get() == 2
    assert recaptures() == before + 2  # each group's reported recapture_seconds, one sample each


def test_mixed_version_is_degraded_then_repaired(world):
    kube, leaders, run = world
    assert [g["weightsDigest"] for g in run().status["groups"]] == ["sha256:rev-a", "sha256:rev-a"]
    leaders.digests["http://127.0.1.2:8000"] = "sha256:changed-files"
    result = run()
    assert result.status["phase"] == "Degraded"
    degraded = conditions(result.status)["Degraded"]
    assert degraded["status"] == "True" and degraded["reason"] == "MixedVersions"
    assert "group 1: leader serves digest sha256:changed" in degraded["message"]
    assert leaders.sent == [("default/llama/g1", "rev-a")]  # repaired by updating it to the target
    assert metrics.MIXED_VERSIONS.labels("default", "llama")._value.get() == 1
    leaders.finish("default/llama/g1")
    run()
    result = run()
    assert result.status["phase"] == "Ready" and result.status["groups"][1]["weightsDigest"] == "sha256:rev-a"


def test_restart_rollout_is_rolling_out_not_degraded(world):
    """A planned restart (strategy Restart) is RollingOut, never Degraded or Ready midway, and a
    group's revision is what its live leader runs, not the target its StatefulSet already names."""
    kube, leaders, run = world
    result = run(spec={"weightUpdate": {"strategy": "Restart"}}, path=REV_B, revision="rev-b")
    phases, revisions = [result.status["phase"]], [[g["revision"] for g in result.status["groups"]]]
    for _ in range(8):
        kube.run_statefulsets()  # the StatefulSet controller recreates deleted pods from the new template
        for url in list(leaders.serving) + [f"http://127.0.{g}.2:8000" for g in (0, 1)]:
            sts = kube.objects[("StatefulSet", "default", f"llama-g{url.split('.')[2]}")]
            annotations = sts["metadata"]["annotations"]
            pod = kube.pods().get(f"llama-g{url.split('.')[2]}-0")
            if pod and pod["metadata"]["labels"][labels.LABEL_REVISION] == "rev-b":
                leaders.serving[url] = (annotations[labels.ANNOTATION_MODEL_PATH], "rev-b")
        result = run()
        phases.append(result.status["phase"])
        revisions.append([g["revision"] for g in result.status["groups"]])
    first_ready = phases.index("Ready")
    assert set(phases[:first_ready]) == {"RollingOut"} and set(phases[first_ready:]) == {"Ready"}
    assert "RollingOut" in phases and revisions[-1] == ["rev-b", "rev-b"]
    assert not leaders.sent  # no in-place update under strategy Restart
    restarts = [r for r in revisions if r != ["rev-a", "rev-a"]]
    assert restarts[0] in (["", "rev-a"], ["rev-b", "rev-a"])  # never rev-b before its pod runs it


def test_idle_passes_write_no_status_and_ranks_are_reported(world):
    kube, leaders, run = world
    writes = len(kube.statuses)
    result = run()
    assert len(kube.statuses) == writes and result.requeue_after_seconds is None
    ranks = result.status["groups"][0]["ranks"]
    assert [(r["rank"], r["pod"], r["ready"], r["phase"]) for r in ranks] == [
        (0, "llama-g0-0", True, "Running"), (1, "llama-g0-1", True, "Running")]


def test_mixed_version_while_failed_is_repaired_to_the_last_good_weights(world):
    """Issue 9: a rollout fails on group 0 (nothing to roll back: Failed); group 0's leader then
    serves rev-b anyway (a late load). Status says so (MixedVersions), the group is updated back to
    rev-a (its StatefulSet's model), and the rollout stays Failed on rev-a, told as RolloutFailed."""
    kube, leaders, run = world
    run(path=REV_B, revision="rev-b")
    leaders.finish("default/llama/g0", ok=False)
    result = run()
    assert result.status["rollout"]["phase"] == "Failed" and result.status["phase"] == "Degraded"
    leaders.serving["http://127.0.0.2:8000"] = (REV_B, "rev-b")  # the late load lands
    result = run()
    degraded = conditions(result.status)["Degraded"]
    assert degraded["reason"] == "MixedVersions" and "group 0: leader serves rev-b" in degraded["message"]
    assert leaders.sent == [("default/llama/g0", "rev-b"), ("default/llama/g0", "rev-a")]
    result = run()
    assert result.status["groups"][0]["phase"] == "UpdatingWeights" and result.status["rollout"]["phase"] == "Failed"
    leaders.finish("default/llama/g0")
    run()
    result = run()
    assert result.status["servedRevision"] == "rev-a" and result.status["rollout"]["phase"] == "Failed"
    assert conditions(result.status)["Degraded"]["reason"] == "RolloutFailed"
    assert conditions(result.status)["WeightsUpdated"]["status"] == "False"
    assert len(leaders.sent) == 2  # the failed target is not retried
    assert metrics.MIXED_VERSIONS.labels("default", "llama")._value.get() == 0


def test_fleet_split_by_a_failure_without_rollback_is_held_and_told(world):
    kube, leaders, run = world
    run(spec={"weightUpdate": {"rollbackOnFailure": False}}, path=REV_B, revision="rev-b")
    leaders.finish("default/llama/g0")
    run(), run()
    leaders.finish("default/llama/g1", ok=False)
    run()
    result = run()
    status = result.status
    assert status["phase"] == "Degraded" and status["rollout"]["phase"] == "Failed"
    assert status["servedRevision"] == "rev-b,rev-a" and conditions(status)["Degraded"]["reason"] == "RolloutFailed"
    assert conditions(status)["Progressing"]["message"] == "1/2 groups on rev-b"
    assert conditions(status)["Ready"]["status"] == "False"
    assert leaders.sent == [("default/llama/g0", "rev-b"), ("default/llama/g1", "rev-b")]
    assert run().status["servedRevision"] == "rev-b,rev-a" and len(leaders.sent) == 2  # held


def test_operator_restart_after_the_leader_finished_moves_on_from_status_and_the_leader(world):
    """docs/operations.md "Operator restart": a new operator has no record of the update in flight
    (its client forgot it); status.rollout and the leader's /get_server_info carry the rollout on."""
    kube, leaders, run = world
    run(path=REV_B, revision="rev-b")
    assert leaders.sent == [("default/llama/g0", "rev-b")]
    leaders.finish("default/llama/g0")  # the leader finished while no operator ran ...
    leaders.flights.clear()  # ... and the new operator's client knows of no update
    run()
    result = run()
    assert leaders.sent == [("default/llama/g0", "rev-b"), ("default/llama/g1", "rev-b")]  # g0 not sent again
    assert result.status["groups"][0]["revision"] == "rev-b"
    leaders.finish("default/llama/g1")
    run()
    result = run()
    assert result.status["phase"] == "Ready"
    assert result.status["servedRevision"] == "rev-b"


def test_operator_restart_after_a_lost_update_sends_it_again(world):
    """The update never reached the leader (or died with the old operator): the leader serves the
    old revision and is not updating, so the new operator sends the update again."""
    kube, leaders, run = world
    run(path=REV_B, revision="rev-b")
    leaders.flights.clear()  # lost: the leader never loads it, and the new operator knows nothing
    run()
    run()
    assert leaders.sent[-1] == ("default/llama/g0", "rev-b")
    assert leaders.sent.count(("default/llama/g0", "rev-b")) == 2


def test_the_pass_that_ends_the_last_wave_writes_status_before_the_group_returns_to_routing(spec_dict):
    """Issue 23 item 5: a group's return to routing waits for its ``/health_generate`` (seconds
    on a busy leader); the pass writes its status first, and hands it to the gauges
    (``on_status_written``), so neither is held up by it. The group returns only after the
    check passed (issue 29), and ``Ready`` with ``RolloutComplete`` come in the pass after,
    once it is back in routing (issue 23: status never says Ready with a group out)."""
    spec_dict["restartPolicy"] = {"maxGroupRestarts": 3}
    passes = ready_world(spec_dict, LiveLeaders())
    kube, leaders = passes.kube, passes.leaders
    checked = []

    def verify(url, verify):  # what the API and the gauges hold when the health check runs
        pod = kube.pods()["llama-g1-0"]
        routable = pod["metadata"]["labels"][labels.LABEL_ROUTABLE]
        checked.append((url, kube.statuses[-1]["phase"], passes.written[-1], routable))
        return True, "ok"

    leaders.verify = verify
    passes.run(model=dict(spec_dict["model"], path=REV_B, revision="rev-b"))
    leaders.finish("default/llama/g0")
    passes.run()  # counts group 0; it returns
    passes.run()  # starts group 1
    leaders.finish("default/llama/g1")
    result = passes.run()  # counts group 1; it returns after the status write
    assert not any(e[1] == "RolloutComplete" for e in result.events)
    # status and gauges first, then the check
    assert checked[-1] == ("http://127.0.1.2:8000", "RollingOut", ("RollingOut", 3), "false")
    assert kube.pods()["llama-g1-0"]["metadata"]["labels"][labels.LABEL_ROUTABLE] == "true"
    result = passes.run()  # back in routing: the rollout ends
    assert any(e[1] == "RolloutComplete" for e in result.events)
    assert result.status["phase"] == "Ready"
    assert len(passes.written) == 7, "one hand-over a pass"


def test_a_group_returns_to_routing_before_the_next_group_leaves_it(world):
    """With two groups, the pass that counts group 0 updated returns it (after its health
    check) and takes no other group out; group 1 leaves in the next pass, so the client Service
    and label-watching gateways never see both leaders out of routing at once (issues 23, 29;
    a failed check: test_rollout_return_to_routing.py)."""
    kube, leaders, run = world
    seen = []

    def routable():
        pods = kube.pods()
        return tuple(pods[f"llama-g{g}-0"]["metadata"]["labels"][labels.LABEL_ROUTABLE] for g in (0, 1))

    def verify(url, verify):  # the routable labels when group 0's health check runs
        seen.append(routable())
        return True, "ok"

    leaders.verify = verify
    run(path=REV_B, revision="rev-b")
    leaders.finish("default/llama/g0")
    run()  # counts group 0; it returns
    assert seen and seen[0] == ("false", "true"), "group 0 was checked while group 1 still routed"
    assert routable() == ("true", "true")
    assert leaders.sent[-1] == ("default/llama/g0", "rev-b"), "group 1 left in the pass group 0 returned"
    run()  # starts group 1
    assert leaders.sent[-1] == ("default/llama/g1", "rev-b")
    assert routable() == ("true", "false")


def test_the_gateway_settle_goes_into_the_update_as_its_admission_window(world, monkeypatch):
    """A leaving leader's gateway settle does not hold up its update: the pass sends the update
    as soon as the EndpointSlices dropped the leader, with what is left of the settle as
    ``admit_seconds`` (the runtime admits on the old weights that long while it stages)."""
    monkeypatch.setattr("shardline_operator.routing_execute.GATEWAY_SETTLE_SECONDS", 1.0)
    kube, leaders, run = world
    run(path=REV_B, revision="rev-b")
    body = leaders.flights["default/llama/g0"]["body"]
    assert 0.5 < body["admit_seconds"] <= 1.0
    assert body["keep_ready"] is True
    assert kube.pods()["llama-g0-0"]["metadata"]["labels"][labels.LABEL_ROUTABLE] == "false"


def test_an_update_without_a_settle_left_carries_no_admission_window(world):
    kube, leaders, run = world  # the conftest sets the settle to 0
    run(path=REV_B, revision="rev-b")
    body = leaders.flights["default/llama/g0"]["body"]
    assert "admit_seconds" not in body
    assert body["keep_ready"] is True  # it left routing all the same


def test_a_leader_still_listed_after_the_leave_timeout_is_updated_without_keep_ready(world, monkeypatch):
    """Issue 23 item 5: ``keep_ready`` (the runtime's ``/ready`` stays 200 during the update) only
    for a leader that left routing; one the EndpointSlices still list after the leave timeout
    may still get traffic, so its update lets it go NotReady as before."""
    monkeypatch.setattr("shardline_operator.routing.LEAVE_TIMEOUT_SECONDS", 0.0)
    kube, leaders, run = world
    leader_ip = kube.pods()["llama-g0-0"]["status"]["podIP"]
    kube.apply({"kind": "EndpointSlice", "metadata": {
        "name": "llama-abc", "namespace": "default", "labels": {"kubernetes.io/service-name": "llama"}},
        "endpoints": [{"addresses": [leader_ip]}]})
    run(path=REV_B, revision="rev-b")
    body = leaders.flights["default/llama/g0"]["body"]
    assert "keep_ready" not in body and "admit_seconds" not in body


def test_a_pass_that_fails_on_a_list_leaves_the_update_result_for_the_next_pass(world, monkeypatch):
    """A leader hands out an update's result once. ``observe`` asks the leaders only after every
    list succeeded, so a list failing on a loaded API server cannot lose a failed update (which
    the next pass would otherwise send again)."""
    from shardline_operator.kube import KubeError

    kube, leaders, run = world
    run(path=REV_B, revision="rev-b")
    leaders.finish("default/llama/g0", ok=False)
    listed = kube.list

    def list_failing_statefulsets(api_version, kind, namespace, selector):
        if kind == "StatefulSet":
            raise KubeError(500, "etcdserver: request timed out")
        return listed(api_version, kind, namespace, selector)

    monkeypatch.setattr(kube, "list", list_failing_statefulsets)
    with pytest.raises(KubeError, match="timed out"):
        run()
    monkeypatch.setattr(kube, "list", listed)
    result = run()
    assert result.status["rollout"]["phase"] == "Failed" and result.status["phase"] == "Degraded"
    assert leaders.sent == [("default/llama/g0", "rev-b")]  # the failed target is not sent again
