"""reconcile.py against an in-memory API: create, health, restart rollout one group at a time (K2), scale."""

from __future__ import annotations

import copy

import pytest

from shardline_operator import labels
from shardline_operator.reconcile import Context, reconcile

from fake_kube import FakeKube
from fake_leaders import FakeLeaders

NOW = [1_700_000_000.0]


@pytest.fixture
def world(spec_dict):
    kube = FakeKube()
    ctx = Context(kube=kube, leaders=FakeLeaders(), clock=lambda: NOW[0])
    body = {"apiVersion": "shardline.dev/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": "llama", "namespace": "default", "uid": "cr-uid", "generation": 1},
            "spec": spec_dict, "status": {}}

    def run(**changes):
        NOW[0] += 5
        for key, value in changes.items():
            body["spec"][key] = value
            body["metadata"]["generation"] += 1
        result = reconcile(ctx, copy.deepcopy(body))
        body["status"] = result.status
        return result

    return kube, body, run


def pod_hashes(kube):
    return {name: p["metadata"]["annotations"][labels.ANNOTATION_RESTART_HASH] for name, p in kube.pods().items()}


def test_create_then_ready(world):
    kube, body, run = world
    result = run()
    kinds = sorted((k, n) for (k, _, n) in kube.objects)
    assert kinds == [("NetworkPolicy", "llama-g0"), ("NetworkPolicy", "llama-g1"),
                     ("PodDisruptionBudget", "llama"), ("Secret", "llama-admin-token"),
                     ("Service", "llama"), ("Service", "llama-g0-ranks"),
                     ("Service", "llama-g1-ranks"), ("StatefulSet", "llama-g0"), ("StatefulSet", "llama-g1")]
    assert result.status["phase"] == "Pending"
    assert ("Normal", "GroupCreated", "group 0: StatefulSet llama-g0") in result.events
    kube.run_statefulsets()
    result = run()
    assert result.status["phase"] == "Ready" and result.status["readyReplicas"] == 2
    assert result.status["groups"][0]["podUIDs"].keys() == {"llama-g0-0", "llama-g0-1"}
    assert run().status["phase"] == "Ready"  # idempotent


def test_image_change_restarts_groups_one_at_a_time_and_never_mixes(world):
    """Field case K2 (logic): a rank-0 pod deleted mid-rollout never yields a mixed group."""
    kube, body, run = world
    run()
    kube.run_statefulsets()
    run()
    old = set(pod_hashes(kube).values())
    runtime = dict(body["spec"]["runtime"], image="ghcr.io/shardline/shardline-runtime:0.2.0")
    run(runtime=runtime)
    assert set(kube.pods()) == {"llama-g1-0", "llama-g1-1"}  # group 0 deleted, group 1 untouched
    assert set(pod_hashes(kube).values()) == old
    # Mid-rollout, a user deletes group 1's rank 0: the controller recreates it from group 1's
    # (still old) template, and the operator restarts group 1 as a whole.
    del kube.objects[("Pod", "default", "llama-g1-0")]
    kube.run_statefulsets(ready=False)
    hashes = pod_hashes(kube)
    for group in ("g0", "g1"):
        assert len({h for n, h in hashes.items() if f"-{group}-" in n}) == 1
    result = run()
    assert "llama-g1-0" not in kube.pods() and "llama-g1-1" not in kube.pods()
    assert any(e[1] == "GroupRestart" and "group 1" in e[2] for e in result.events)
    # Group 1 is not rolled before group 0 is Ready again.
    kube.run_statefulsets(ready=False)
    run()
    g1_template = kube.objects[("StatefulSet", "default", "llama-g1")]["spec"]["template"]
    assert g1_template["spec"]["containers"][0]["image"].endswith(":0.1.0")
    for name in kube.pods():
        kube.set_ready(name)
    run()
    g1_template = kube.objects[("StatefulSet", "default", "llama-g1")]["spec"]["template"]
    assert g1_template["spec"]["containers"][0]["image"].endswith(":0.2.0")
    assert set(kube.pods()) == {"llama-g0-0", "llama-g0-1"}
    kube.run_statefulsets()
    result = run()
    assert result.status["phase"] == "Ready"
    assert len(set(pod_hashes(kube).values())) == 1 and set(pod_hashes(kube).values()) != old


def test_crash_loop_backs_off_then_fails_and_spec_edit_resets(world):
    """Field case K4 (logic)."""
    kube, body, run = world
    body["spec"]["replicas"] = 1
    body["spec"]["restartPolicy"] = {"maxGroupRestarts": 1, "backoffSeconds": 60}
    run()
    kube.run_statefulsets(ready=False)
    run()

    def crash():
        pod = kube.objects[("Pod", "default", "llama-g0-1")]
        pod["status"]["containerStatuses"] = [{"name": "runtime", "restartCount": 1, "state": {"waiting": {}},
                                               "lastState": {"terminated": {"exitCode": 1, "message":
                                                   "FileNotFoundError: model-00002-of-00002.safetensors listed in the index is missing\nTraceback"}}}]

    crash()
    result = run()
    assert result.status["groups"][0]["restarts"] == 1 and "llama-g0-0" not in kube.pods()
    kube.run_statefulsets(ready=False)
    crash()
    result = run()
    assert result.status["phase"] == "Failed"
    assert result.status["groups"][0]["message"].startswith("FileNotFoundError: model-00002")
    assert any(e[0] == "Warning" and e[1] == "GroupFailed" for e in result.events)
    assert run().status["phase"] == "Failed"  # stays failed, no more restarts
    result = run(restartPolicy={"maxGroupRestarts": 3, "backoffSeconds": 60})
    assert result.status["groups"][0]["restarts"] == 1 and result.status["phase"] != "Failed"


def test_scale_down_removes_highest_groups(world):
    kube, body, run = world
    run()
    result = run(replicas=1)
    assert ("StatefulSet", "default", "llama-g1") not in kube.objects
    assert ("Service", "default", "llama-g1-ranks") not in kube.objects
    assert len(result.status["groups"]) == 1


def test_invalid_spec_reports_failed(world):
    kube, body, run = world
    result = run(parallelism={"tensor": 3, "gpusPerPod": 2})
    assert result.status["phase"] == "Failed"
    assert "tensor (3) must be a multiple of gpusPerPod (2)" in result.status["message"]
    assert result.events[0][:2] == ("Warning", "InvalidSpec")


def test_in_place_rollout_through_reconcile(world):
    kube, body, run = world
    run()
    kube.run_statefulsets()
    run()
    uids = {n: p["metadata"]["uid"] for n, p in kube.pods().items()}
    leaders = FakeLeaders()
    model = dict(body["spec"]["model"], path="/var/lib/shardline/models/tiny-llama/rev-b", revision="rev-b")
    ctx = Context(kube=kube, leaders=leaders, clock=lambda: NOW[0])
    body["spec"]["model"] = model
    body["metadata"]["generation"] += 1
    result = reconcile(ctx, copy.deepcopy(body))
    body["status"] = result.status
    assert result.status["phase"] == "UpdatingWeights" and [s[0] for s in leaders.sent] == ["default/llama/g0"]
    leaders.results["default/llama/g0"] = ("success", "")
    leaders.seconds["default/llama/g0"] = {"load_seconds": 0.2, "recapture_seconds": 0.4}  # it recaptured
    # it reports rev-b: back in routing after this pass, then group 1 may leave
    leaders.info["http://127.0.0.2:8000"] = {"weights_phase": "serving", "model_path": model["path"],
                                             "weights_revision": "rev-b"}
    result = reconcile(ctx, copy.deepcopy(body))
    body["status"] = result.status
    phases = [s.get("phase") for s in kube.statuses[-2:]]
    assert phases[0] == "RecapturingGraphs"  # the trail step is its own status write
    annotations = kube.objects[("StatefulSet", "default", "llama-g0")]["metadata"]["annotations"]
    assert annotations[labels.ANNOTATION_MODEL_REVISION] == "rev-b"
    assert kube.pods()["llama-g0-0"]["metadata"]["labels"][labels.LABEL_REVISION] == "rev-b"
    assert result.status["servedRevision"] == "rev-b,rev-a"
    result = reconcile(ctx, copy.deepcopy(body))
    body["status"] = result.status
    assert [s[0] for s in leaders.sent] == ["default/llama/g0", "default/llama/g1"]
    leaders.results["default/llama/g1"] = ("success", "")
    leaders.seconds["default/llama/g1"] = {"load_seconds": 0.2, "recapture_seconds": 0.0}  # a CPU pod
    leaders.info["http://127.0.1.2:8000"] = {"weights_phase": "serving", "model_path": model["path"],
                                             "weights_revision": "rev-b"}
    writes = len(kube.statuses)
    completed = reconcile(ctx, copy.deepcopy(body))  # the pass that counts the last group updated
    body["status"] = completed.status
    assert "RecapturingGraphs" not in [s.get("phase") for s in kube.statuses[writes:]]  # it captured nothing
    # group 1 returns to routing after that pass's status; the next pass completes the rollout
    assert completed.status["phase"] == "RollingOut"
    assert not any(e[1] == "RolloutComplete" for e in completed.events)
    result = reconcile(ctx, copy.deepcopy(body))
    assert any(e[1] == "RolloutComplete" for e in result.events)
    assert result.status["phase"] == "Ready" and result.status["servedRevision"] == "rev-b"
    assert {n: p["metadata"]["uid"] for n, p in kube.pods().items()} == uids  # no pod restarted


def test_group_added_after_a_failed_rollout_joins_the_served_model(world):
    kube, body, run = world
    body["spec"]["replicas"] = 1
    leaders = FakeLeaders()
    ctx = Context(kube=kube, leaders=leaders, clock=lambda: NOW[0])
    body["status"] = reconcile(ctx, copy.deepcopy(body)).status
    kube.run_statefulsets()
    body["status"] = reconcile(ctx, copy.deepcopy(body)).status
    body["spec"]["model"] = dict(body["spec"]["model"], path="/var/lib/shardline/models/tiny-llama/rev-broken",
                                 revision="rev-broken")
    body["metadata"]["generation"] += 1
    body["status"] = reconcile(ctx, copy.deepcopy(body)).status
    leaders.results["default/llama/g0"] = ("failure", "embed_tokens.weight: shape [64, 128] != [64, 64]")
    status = reconcile(ctx, copy.deepcopy(body)).status
    body["status"] = status
    weights = next(c for c in status["conditions"] if c["type"] == "WeightsUpdated")
    assert weights["status"] == "False" and "shape [64, 128]" in weights["message"]
    assert status["servedRevision"] == "rev-a" and status["phase"] == "Degraded"
    body["spec"]["replicas"] = 2
    body["metadata"]["generation"] += 1
    status = reconcile(ctx, copy.deepcopy(body)).status
    annotations = kube.objects[("StatefulSet", "default", "llama-g1")]["metadata"]["annotations"]
    assert annotations[labels.ANNOTATION_MODEL_REVISION] == "rev-a"
    assert len(leaders.sent) == 1  # the failed target is not retried


def test_cuda_graph_change_recaptures_in_place(world):
    kube, body, run = world
    body["spec"]["replicas"] = 1
    leaders = FakeLeaders()
    ctx = Context(kube=kube, leaders=leaders, clock=lambda: NOW[0])
    body["status"] = reconcile(ctx, copy.deepcopy(body)).status
    kube.run_statefulsets()
    body["status"] = reconcile(ctx, copy.deepcopy(body)).status
    uids = {n: p["metadata"]["uid"] for n, p in kube.pods().items()}
    body["spec"]["runtime"] = dict(body["spec"]["runtime"], cudaGraph={"enabled": True, "maxBatchSize": 16})
    body["metadata"]["generation"] += 1
    body["status"] = reconcile(ctx, copy.deepcopy(body)).status
    (key, _, sent), = leaders.sent
    assert sent["cuda_graph_max_bs"] == 16 and sent["recapture_cuda_graph"] and sent["revision"] == "rev-a"
    leaders.results[key] = ("success", "")
    # the leader reports it serves: it may return to routing (one without a report never does)
    leaders.info["http://127.0.0.2:8000"] = {"weights_phase": "serving", "model_path": body["spec"]["model"]["path"],
                                             "weights_revision": "rev-a"}
    body["status"] = reconcile(ctx, copy.deepcopy(body)).status  # counts it; it returns
    status = reconcile(ctx, copy.deepcopy(body)).status
    args = kube.objects[("StatefulSet", "default", "llama-g0")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--cuda-graph-max-bs") + 1] == "16"
    assert status["phase"] == "Ready"
    assert {n: p["metadata"]["uid"] for n, p in kube.pods().items()} == uids


def test_an_idle_pass_writes_no_status(world):
    """The resync of an object where nothing changed costs reads only, no status PATCH."""
    kube, body, run = world
    run()
    kube.run_statefulsets()
    run()
    writes = len(kube.statuses)
    body["status"] = {k: v for k, v in body["status"].items() if v is not None}  # as the API stores it
    assert run().status["phase"] == "Ready" and run().status["phase"] == "Ready"
    assert len(kube.statuses) == writes
    kube.set_ready("llama-g1-0", False)
    run()
    assert len(kube.statuses) == writes + 1


def test_restart_strategy_rolls_a_model_change_by_restarting_groups(world):
    """``weightUpdate.strategy: Restart``: a model change never calls a leader's
    ``/update_weights_from_disk``; groups restart one at a time from a template that loads the
    new checkpoint, and the rollout ends Ready with every pod replaced."""
    kube, body, _ = world
    body["spec"]["weightUpdate"] = {"strategy": "Restart"}
    leaders = FakeLeaders()
    ctx = Context(kube=kube, leaders=leaders, clock=lambda: NOW[0])

    def run(**changes):
        NOW[0] += 5
        for key, value in changes.items():
            body["spec"][key] = value
            body["metadata"]["generation"] += 1
        result = reconcile(ctx, copy.deepcopy(body))
        body["status"] = result.status
        return result

    run()
    kube.run_statefulsets()
    assert run().status["phase"] == "Ready"
    uids = {n: p["metadata"]["uid"] for n, p in kube.pods().items()}
    new_path = "/var/lib/shardline/models/tiny-llama/rev-b"
    result = run(model=dict(body["spec"]["model"], path=new_path, revision="rev-b"))
    assert leaders.sent == [] and not any(e[1] == "UpdatingWeights" for e in result.events)
    assert set(kube.pods()) == {"llama-g1-0", "llama-g1-1"}  # group 0 restarts first, group 1 waits
    assert any(e[1] == "GroupRestart" and "group 0" in e[2] for e in result.events)

    def args(group):
        sts = kube.objects[("StatefulSet", "default", f"llama-g{group}")]
        return sts["spec"]["template"]["spec"]["containers"][0]["args"]

    assert new_path in args(0) and new_path not in args(1)
    kube.run_statefulsets()
    run()
    assert set(kube.pods()) == {"llama-g0-0", "llama-g0-1"}  # then group 1
    assert new_path in args(1)
    kube.run_statefulsets()
    result = run()
    assert result.status["phase"] == "Ready" and result.status["servedRevision"] == "rev-b"
    assert leaders.sent == []
    assert not set(uids.values()) & {p["metadata"]["uid"] for p in kube.pods().values()}  # every pod replaced


def test_group_status_shows_the_leaders_weight_version(world, spec_dict):
    kube, body, run = world
    run()
    kube.run_statefulsets()
    leaders = FakeLeaders()
    ctx = Context(kube=kube, leaders=leaders, clock=lambda: NOW[0])
    ip = kube.pods()["llama-g0-0"]["status"]["podIP"]
    leaders.info[f"http://{ip}:{labels.HTTP_PORT}"] = {"weights_phase": "serving", "weight_version": "step-7"}
    status = reconcile(ctx, copy.deepcopy(body)).status
    assert status["groups"][0]["weightVersion"] == "step-7"
    body["status"] = status
    leaders.info.clear()  # leader unreachable for a pass: the last reported version stays
    assert reconcile(ctx, copy.deepcopy(body)).status["groups"][0]["weightVersion"] == "step-7"


def _status_with_leader_info(world, info: dict) -> dict:
    """The status of a pass whose group-0 leader answers ``/get_server_info`` with ``info``."""
    kube, body, run = world
    run()
    kube.run_statefulsets()
    leaders = FakeLeaders()
    ctx = Context(kube=kube, leaders=leaders, clock=lambda: NOW[0])
    ip = kube.pods()["llama-g0-0"]["status"]["podIP"]
    leaders.info[f"http://{ip}:{labels.HTTP_PORT}"] = info
    return reconcile(ctx, copy.deepcopy(body)).status


def test_group_status_shows_the_scheme_the_leader_serves(world, spec_dict):
    status = _status_with_leader_info(
        world, {"weights": {"phase": "serving", "model_path": "/m", "quantization": "fp8-block-128x128"}}
    )
    assert status["groups"][0]["quantization"] == "fp8-block-128x128"


def test_status_says_what_the_leaders_serve(world):
    status = _status_with_leader_info(world, {"weights_phase": "serving", "model_kind": "embed"})
    assert status["modelKind"] == "embed"


def test_group_status_says_what_its_leader_serves(world):
    status = _status_with_leader_info(world, {"weights_phase": "serving", "model_kind": "embed"})
    assert status["groups"][0]["modelKind"] == "embed"
