"""``decide()`` with staging: a new hf:// / s3:// revision is staged on every node that runs a
group before the first group pauses; a failed staging leaves every group serving.

Rows as in ``test_decide_table.py``: an observation built with the real render functions, the
previous status, and one fact of the plan per test.
"""

from __future__ import annotations

import pytest

from shardline_operator import labels
from shardline_operator.decide import decide
from shardline_operator.observed import GroupObservation, LeaderObservation, PodObservation
from shardline_operator.pass_plan import ApplyObject, DeleteObject, Observation, StartUpdate
from shardline_operator.render import build_statefulset
from shardline_operator.render.staging_job import build_staging_job
from shardline_operator.runtime_args import ServedModel
from shardline_operator.staging_state import StagingJob, StagingTarget
from shardline_operator.staging_step import staging_target
from shardline_operator.weights import LeaderReport

NOW = 1_800_000_000.0
CACHE = {"hostPath": {"path": "/var/lib/shardline/model-cache", "type": "DirectoryOrCreate"}}


def uri(revision):
    return f"s3://models/tiny/{revision}"


@pytest.fixture
def s3_spec(make_spec):
    def make(revision="rev-b", cache=CACHE, tensor=1):
        model = {"name": "tiny-llama", "uri": uri(revision), "revision": revision,
                 "s3": {"endpoint": "http://127.0.0.1:9000", "region": "us-east-1"},
                 "credentialsSecretRef": {"name": "s3-keys"}, "cache": {"volume": cache}}
        return make_spec({"model": model, "parallelism": {"tensor": tensor, "gpusPerPod": 1}})
    return make


def fleet(spec, make_pod, serving="rev-a", source=None):
    """Every group Ready on ``serving`` (from s3), group g on node-g; the leaders report the
    resolved ``source`` revision they loaded."""
    model = ServedModel(uri(serving), serving, ServedModel.desired(spec).cuda_graph)
    groups = {}
    for g in range(spec.replicas):
        raw = make_pod(g, 0)
        raw["metadata"]["annotations"] = {labels.ANNOTATION_RESTART_HASH: spec.restart_hash()}
        raw["metadata"]["labels"][labels.LABEL_REVISION] = serving
        raw["spec"] = {"nodeName": f"node-{g}"}
        report = LeaderReport("serving", uri(serving), serving, f"sha256:{serving}", source_revision=source)
        groups[g] = GroupObservation(g, 1, build_statefulset(spec, g, model), (PodObservation.from_api(raw),),
                                     LeaderObservation(report))
    return groups


def previous_status(spec, serving="rev-a", staging=None):
    groups = [{"index": g, "phase": "Ready", "revision": serving, "restarts": 0, "weightsDigest": f"sha256:{serving}",
               "podUIDs": {f"llama-g{g}-0": f"uid-{g}-0"}} for g in range(spec.replicas)]
    return {"phase": "Ready", "restartBudgetGeneration": 1, "groups": groups,
            **({"staging": staging} if staging else {})}


def target(spec):
    return staging_target(spec)


def jobs_done(spec, resolved="etags-abc"):
    t = target(spec)
    return tuple(StagingJob(f"j{g}", t.key, 1, f"node-{g}", "Succeeded",
                            {"resolvedRevision": resolved, "bytes": 10, "bytesPerSecond": 5, "seconds": 2.0})
                 for g in range(spec.replicas))


def run(spec, make_pod, jobs=(), previous=None, generation=1, source=None):
    observed = Observation(generation, fleet(spec, make_pod, source=source), staging_jobs=jobs)
    return decide(spec, observed, previous or previous_status(spec), NOW)


def created_jobs(plan):
    return [a.obj for a in plan.actions if isinstance(a, ApplyObject) and a.obj["kind"] == "Job"]


def updates(plan):
    return [a.group for a in plan.actions if isinstance(a, StartUpdate)]


def staging_condition(plan):
    return next(c for c in plan.status["conditions"] if c["type"] == "Staging")


def test_a_new_revision_creates_a_staging_job_per_node(s3_spec, make_pod):
    plan = run(s3_spec(), make_pod)
    assert sorted(j["metadata"]["annotations"]["shardline.dev/staging-node"] for j in created_jobs(plan)) == [
        "node-0", "node-1"]


def test_no_group_pauses_while_the_revision_stages(s3_spec, make_pod):
    assert updates(run(s3_spec(), make_pod)) == []


def test_the_phase_is_staging_while_jobs_run(s3_spec, make_pod):
    assert run(s3_spec(), make_pod).status["phase"] == "Staging"


def test_the_staging_condition_is_true_while_jobs_run(s3_spec, make_pod):
    assert staging_condition(run(s3_spec(), make_pod))["status"] == "True"


def test_staging_asks_for_an_early_pass(s3_spec, make_pod):
    assert run(s3_spec(), make_pod).requeue_after_seconds == 2.0


def test_the_first_group_pauses_once_every_node_staged(s3_spec, make_pod):
    spec = s3_spec()
    previous = previous_status(spec, staging={"phase": "Staging", "key": target(spec).key, "uri": uri("rev-b"),
                                              "revision": "rev-b", "attempt": 1, "generation": 1})
    assert updates(run(spec, make_pod, jobs_done(spec), previous)) == [0]


def test_staged_status_names_the_resolved_revision(s3_spec, make_pod):
    spec = s3_spec()
    plan = run(spec, make_pod, jobs_done(spec))
    assert plan.status["staging"]["resolvedRevision"] == "etags-abc"


def test_a_failed_job_leaves_every_group_serving(s3_spec, make_pod):
    spec = s3_spec()
    failed = StagingJob("j0", target(spec).key, 1, "node-0", "Failed", {"reason": "NotFound", "message": "gone"})
    assert updates(run(spec, make_pod, (failed,))) == []


def test_a_failed_job_names_its_reason_in_the_staging_condition(s3_spec, make_pod):
    spec = s3_spec()
    failed = StagingJob("j0", target(spec).key, 1, "node-0", "Failed", {"reason": "NotFound", "message": "gone"})
    assert staging_condition(run(spec, make_pod, (failed,)))["reason"] == "NotFound"


def test_a_failed_staging_fails_weights_updated(s3_spec, make_pod):
    spec = s3_spec()
    failed = StagingJob("j0", target(spec).key, 1, "node-0", "Failed", {"reason": "ChecksumMismatch"})
    weights = next(c for c in run(spec, make_pod, (failed,)).status["conditions"] if c["type"] == "WeightsUpdated")
    assert weights["reason"] == "StagingFailed"


def test_a_group_records_the_source_its_leader_loaded_in_the_digest(s3_spec, make_pod):
    spec = s3_spec("rev-a")
    staged = {"phase": "Staged", "key": target(spec).key, "uri": uri("rev-a"), "revision": "rev-a",
              "resolvedRevision": "etags-abc"}
    plan = run(spec, make_pod, previous=previous_status(spec, staging=staged), source="etags-abc")
    assert plan.status["groups"][0]["weightsDigest"] == "sha256:rev-a;source=etags-abc"


def test_a_source_moved_after_staging_shows_what_the_leader_loaded(s3_spec, make_pod):
    spec = s3_spec("rev-a")
    staged = {"phase": "Staged", "key": target(spec).key, "uri": uri("rev-a"), "revision": "rev-a",
              "resolvedRevision": "etags-staged"}
    plan = run(spec, make_pod, previous=previous_status(spec, staging=staged), source="etags-moved")
    assert plan.status["groups"][0]["weightsDigest"] == "sha256:rev-a;source=etags-moved"


def test_a_leader_that_reports_no_source_records_the_checkpoint_digest_alone(s3_spec, make_pod):
    spec = s3_spec("rev-a")
    assert run(spec, make_pod).status["groups"][0]["weightsDigest"] == "sha256:rev-a"


def test_a_digest_with_its_source_is_no_mixed_version(s3_spec, make_pod):
    spec = s3_spec("rev-a")
    staged = {"phase": "Staged", "key": target(spec).key, "uri": uri("rev-a"), "revision": "rev-a",
              "resolvedRevision": "etags-abc"}
    previous = previous_status(spec, staging=staged)
    previous["groups"][0]["weightsDigest"] = "sha256:rev-a;source=etags-abc"
    assert run(spec, make_pod, previous=previous, source="etags-abc").status["phase"] == "Ready"


def test_a_per_pod_emptydir_cache_is_not_staged(s3_spec, make_pod):
    assert updates(run(s3_spec(cache={"emptyDir": {}}), make_pod)) == [0]


def test_jobs_of_an_old_target_are_deleted(s3_spec, make_pod):
    spec = s3_spec()
    old = StagingJob("old-job", "0123456789", 1, "node-0", "Succeeded")
    deleted = [a.name for a in run(spec, make_pod, (old,)).actions if isinstance(a, DeleteObject) and a.kind == "Job"]
    assert deleted == ["old-job"]


def test_a_shared_claim_cache_is_one_shared_job(s3_spec):
    spec = s3_spec(cache={"persistentVolumeClaim": {"claimName": "models"}}, tensor=2)
    assert target(spec).shared is True


class TestStagingJob:
    @pytest.fixture
    def job(self, s3_spec):
        spec = s3_spec()
        return build_staging_job(spec, target(spec), "node-0", 1)

    def test_runs_the_download_command(self, job):
        assert job["spec"]["template"]["spec"]["containers"][0]["command"] == ["shardline-runtime", "download"]

    def test_downloads_the_spec_uri(self, job):
        assert job["spec"]["template"]["spec"]["containers"][0]["args"][:2] == ["--model-path", uri("rev-b")]

    def test_is_pinned_to_its_node(self, job):
        terms = job["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert terms == [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node-0"]}]}]

    def test_mounts_the_runtime_pods_cache_volume(self, job):
        volumes = {v["name"]: v for v in job["spec"]["template"]["spec"]["volumes"]}
        assert volumes["model-cache"]["hostPath"] == CACHE["hostPath"]

    def test_reads_credentials_only_from_the_secret(self, job):
        env = {e["name"]: e for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "s3-keys"

    def test_fails_at_once_on_a_permanent_error(self, job):
        (rule,) = job["spec"]["podFailurePolicy"]["rules"]
        assert (rule["action"], rule["onExitCodes"]["values"]) == ("FailJob", [3])

    def test_pod_is_selected_by_no_service_of_the_deployment(self, job):
        assert labels.LABEL_DEPLOYMENT not in job["spec"]["template"]["metadata"]["labels"]

    def test_name_fits_a_label_value(self, s3_spec):
        spec = s3_spec()
        long = build_staging_job(spec, StagingTarget(uri("rev-b"), "rev-b"), "n" * 200, 12)
        assert len(long["metadata"]["name"]) <= 63
