"""Live staging progress: what a running staging Job's pod annotates (bytes done, total, rate)
shows in ``status.staging`` while it runs, and the staging pods get the API access to write it.

Pure: ``staging_job_from_api`` on API dicts, ``plan_staging``, and ``decide`` with the real
render functions (the annotation's writer, ``pod_progress.py``, is exercised against the real
API server by ``tests/e2e/test_model_from_s3.py``).
"""

from __future__ import annotations

import json

import pytest

from shardline_operator.decide import decide
from shardline_operator.pass_plan import ApplyObject, Observation
from shardline_operator.staging import plan_staging
from shardline_operator.staging_state import (
    ANNOTATION_PROGRESS,
    NodeStaging,
    StagingJob,
    StagingTarget,
    staging_job_from_api,
)
from tests.operator.test_staging_decide import fleet, previous_status, s3_spec  # noqa: F401

NOW = 1_800_000_000.0
TARGET = StagingTarget("s3://models/tiny/rev-b", "rev-b")
PROGRESS = {"bytesDone": 3 << 20, "bytesTotal": 12 << 20, "bytesPerSecond": 1 << 20}


def _api_job(active=1, conditions=()):
    return {"metadata": {"name": "j", "uid": "u", "annotations": {"shardline.dev/staging-node": "node-a"},
                         "labels": {"shardline.dev/staging-key": TARGET.key, "shardline.dev/staging-attempt": "1"}},
            "status": {"active": active, "conditions": [{"type": t, "status": "True"} for t in conditions]}}


def _api_pod(progress=PROGRESS, phase="Running", created="2026-12-02T05:00:00Z", raw=None):
    text = raw if raw is not None else json.dumps(progress)
    return {"metadata": {"annotations": {ANNOTATION_PROGRESS: text}, "creationTimestamp": created},
            "status": {"phase": phase}}


def _running(progress=PROGRESS, node="node-a"):
    return StagingJob(f"j-{node}", TARGET.key, 1, node, "Running", progress=progress)


def test_running_job_carries_its_pods_progress():
    assert staging_job_from_api(_api_job(), [_api_pod()]).progress == PROGRESS


def test_progress_of_the_newest_running_pod_wins():
    old = _api_pod({"bytesDone": 1, "bytesTotal": 2, "bytesPerSecond": 1}, created="2026-12-02T04:00:00Z")
    assert staging_job_from_api(_api_job(), [old, _api_pod()]).progress == PROGRESS


def test_a_finished_pods_progress_is_ignored():
    assert staging_job_from_api(_api_job(), [_api_pod(phase="Failed")]).progress == {}


def test_a_malformed_progress_annotation_is_ignored():
    assert staging_job_from_api(_api_job(), [_api_pod(raw="{not json")]).progress == {}


@pytest.mark.parametrize("field,expected", [
    ("bytesDone", 3 << 20), ("bytesTotal", 12 << 20), ("bytesPerSecond", 1 << 20),
])
def test_running_node_item_shows_live_progress(field, expected):
    assert NodeStaging.from_job(_running()).to_status()[field] == expected


def test_running_node_item_without_a_report_has_no_bytes():
    assert "bytesDone" not in NodeStaging.from_job(_running(progress={})).to_status()


def test_finished_node_item_reports_the_jobs_result_not_its_last_progress():
    job = StagingJob("j", TARGET.key, 1, "node-a", "Succeeded", {"bytes": 12 << 20, "bytesPerSecond": 7},
                     progress=PROGRESS)
    assert NodeStaging.from_job(job).to_status()["bytesDone"] == 12 << 20


def test_a_negative_byte_count_is_not_shown():
    job = _running(progress={**PROGRESS, "bytesDone": -5})
    assert "bytesDone" not in NodeStaging.from_job(job).to_status()


def _plan(jobs):
    return plan_staging(TARGET, True, ("node-a", "node-b"), jobs, None, 1, NOW)


def test_staging_message_sums_the_running_nodes_progress():
    message = _plan([_running(node="node-a"), _running(node="node-b")]).state.message
    assert message.endswith("0/2 nodes staged, 6.0 of 24.0 MiB at 2.0 MiB/s")


def test_staging_status_sums_bytes_over_nodes():
    status = _plan([_running(node="node-a"), _running(node="node-b")]).state.to_status()
    assert status["bytesDone"] == 6 << 20


def test_staging_status_sums_totals_over_nodes():
    status = _plan([_running(node="node-a"), _running(node="node-b")]).state.to_status()
    assert status["bytesTotal"] == 24 << 20


def _first_pass(spec, make_pod, cluster_role):
    observed = Observation(1, fleet(spec, make_pod))
    plan = decide(spec, observed, previous_status(spec), NOW, staging_cluster_role=cluster_role)
    return [a.obj for a in plan.actions if isinstance(a, ApplyObject)]


def _kinds(applied):
    return [o["kind"] for o in applied if o["kind"] in ("ServiceAccount", "RoleBinding", "Job")]


def test_staging_access_is_applied_before_the_jobs(s3_spec, make_pod):  # noqa: F811
    assert _kinds(_first_pass(s3_spec(), make_pod, "shardline-staging")) == [
        "ServiceAccount", "RoleBinding", "Job", "Job"]


def test_role_binding_grants_the_charts_staging_role(s3_spec, make_pod):  # noqa: F811
    (binding,) = [o for o in _first_pass(s3_spec(), make_pod, "shardline-staging") if o["kind"] == "RoleBinding"]
    assert binding["roleRef"]["name"] == "shardline-staging"


def test_role_binding_binds_only_the_staging_service_account(s3_spec, make_pod):  # noqa: F811
    (binding,) = [o for o in _first_pass(s3_spec(), make_pod, "shardline-staging") if o["kind"] == "RoleBinding"]
    assert [s["name"] for s in binding["subjects"]] == ["llama-staging"]


def test_staging_pod_runs_as_the_staging_service_account(s3_spec, make_pod):  # noqa: F811
    job = next(o for o in _first_pass(s3_spec(), make_pod, "shardline-staging") if o["kind"] == "Job")
    assert job["spec"]["template"]["spec"]["serviceAccountName"] == "llama-staging"


def test_staging_pod_knows_its_own_name(s3_spec, make_pod):  # noqa: F811
    job = next(o for o in _first_pass(s3_spec(), make_pod, "shardline-staging") if o["kind"] == "Job")
    env = {e["name"]: e for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_without_a_staging_role_no_access_is_rendered(s3_spec, make_pod):  # noqa: F811
    assert _kinds(_first_pass(s3_spec(), make_pod, None)) == ["Job", "Job"]


def test_without_a_staging_role_the_pod_gets_no_token(s3_spec, make_pod):  # noqa: F811
    job = next(o for o in _first_pass(s3_spec(), make_pod, None) if o["kind"] == "Job")
    assert job["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
