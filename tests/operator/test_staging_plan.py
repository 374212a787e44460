"""The staging planner as a table: (target, nodes, Jobs seen, previous state) -> the step.

Pure (``staging.plan_staging``), after the rollout planner's table tests: each row is what a
pass would have observed, and each test reads one fact of the answer.
"""

from __future__ import annotations

import pytest

from shardline_operator.staging import plan_staging
from shardline_operator.staging_state import (
    FAILED,
    STAGED,
    STAGING,
    StagingJob,
    StagingState,
    StagingTarget,
    staging_job_from_api,
)

NOW = 1_800_000_000.0
TARGET = StagingTarget("s3://models/tiny/rev-b", "rev-b")
OLD = StagingTarget("s3://models/tiny/rev-a", "rev-a")
NODES = ("node-a", "node-b")


def job(node, state="Running", attempt=1, target=TARGET, **result):
    return StagingJob(f"j-{target.key}-{attempt}-{node}", target.key, attempt, node, state, result)


def done(node, resolved="etags-1", size=1000):
    return job(node, "Succeeded", resolvedRevision=resolved, bytes=size, bytesPerSecond=500, seconds=2.0)


def state(phase, attempt=1, generation=1, **extra):
    return StagingState(phase, TARGET.uri, TARGET.revision, TARGET.key, attempt, generation, **extra)


def plan(jobs=(), previous=None, nodes=NODES, needed=True, generation=1, target=TARGET):
    return plan_staging(target, needed, nodes, jobs, previous, generation, NOW)


def test_a_new_target_creates_a_job_on_every_node():
    assert plan().create == NODES


def test_a_new_target_holds_the_rollout():
    assert plan().holds_rollout is True


def test_a_new_target_is_staging():
    assert plan().state.phase == STAGING


def test_a_new_target_says_staging_started():
    assert [e[1] for e in plan().events] == ["StagingStarted"]


def test_running_jobs_are_not_created_again():
    assert plan([job("node-a"), job("node-b")], state(STAGING)).create == ()


def test_one_node_of_two_staged_still_holds_the_rollout():
    assert plan([done("node-a"), job("node-b")], state(STAGING)).holds_rollout is True


def test_progress_counts_the_staged_nodes():
    assert plan([done("node-a"), job("node-b")], state(STAGING)).state.message == "staging rev-b: 1/2 nodes staged"


def test_a_node_that_appears_while_staging_gets_its_job():
    step = plan([done("node-a"), job("node-b")], state(STAGING), nodes=(*NODES, "node-c"))
    assert step.create == ("node-c",)


def test_every_node_staged_releases_the_rollout():
    assert plan([done("node-a"), done("node-b")], state(STAGING)).holds_rollout is False


def test_every_node_staged_is_staged():
    assert plan([done("node-a"), done("node-b")], state(STAGING)).state.phase == STAGED


def test_staged_records_the_resolved_revision():
    assert plan([done("node-a"), done("node-b")], state(STAGING)).state.resolved_revision == "etags-1"


def test_a_node_staged_reports_its_bytes_and_rate():
    (item, _) = plan([done("node-a"), job("node-b")], state(STAGING)).state.nodes
    assert (item.bytes_done, item.bytes_per_second) == (1000, 500)


def test_nodes_that_resolved_different_revisions_fail_staging():
    step = plan([done("node-a", "etags-1"), done("node-b", "etags-2")], state(STAGING))
    assert step.state.reason == "SourceChanged"


def test_a_failed_job_fails_staging_with_its_reason():
    failed = job("node-b", "Failed", reason="ChecksumMismatch", message="model.safetensors: ETag differs")
    assert plan([done("node-a"), failed], state(STAGING)).state.reason == "ChecksumMismatch"


def test_a_failed_job_names_its_node():
    failed = job("node-b", "Failed", reason="NotFound", message="no objects under this prefix")
    assert "node node-b" in plan([job("node-a"), failed], state(STAGING)).state.message


def test_a_failed_job_holds_the_rollout():
    failed = job("node-b", "Failed", reason="Unauthorized", message="access refused")
    assert plan([job("node-a"), failed], state(STAGING)).holds_rollout is True


def test_a_job_failed_without_a_report_takes_the_job_condition():
    failed = StagingJob("j", TARGET.key, 1, "node-a", "Failed", {}, "DeadlineExceeded", "too long")
    assert plan([failed, job("node-b")], state(STAGING)).state.reason == "DeadlineExceeded"


def test_a_failure_holds_until_the_spec_changes():
    failed = job("node-b", "Failed", reason="NotFound")
    step = plan([done("node-a"), failed], state(FAILED, reason="NotFound"), generation=1)
    assert (step.holds_rollout, step.create, step.state.phase) == (True, (), FAILED)


def test_a_later_generation_retries_a_failure_as_a_new_attempt():
    failed = job("node-b", "Failed", reason="NotFound")
    step = plan([done("node-a"), failed], state(FAILED, reason="NotFound"), generation=2)
    assert step.state.attempt == 2


def test_a_retry_replaces_the_jobs_of_the_failed_attempt():
    failed = job("node-b", "Failed", reason="NotFound")
    step = plan([done("node-a"), failed], state(FAILED, reason="NotFound"), generation=2)
    assert sorted(step.delete) == sorted([done("node-a").name, failed.name])


def test_a_retry_creates_every_node_again():
    step = plan([job("node-b", "Failed")], state(FAILED, reason="NotFound"), generation=2)
    assert step.create == NODES


def test_jobs_of_another_target_are_deleted():
    old = job("node-a", "Succeeded", target=OLD)
    assert plan([old], state(STAGING)).delete == (old.name,)


def test_staged_stays_staged_without_its_jobs():
    previous = state(STAGED, resolved_revision="etags-1")
    assert plan([], previous).state.phase == STAGED


def test_staged_creates_nothing():
    previous = state(STAGED, resolved_revision="etags-1")
    assert plan([], previous).create == ()


def test_nothing_to_move_stages_nothing():
    assert plan(needed=False).create == ()


def test_nothing_to_move_holds_nothing():
    assert plan(needed=False).holds_rollout is False


def test_no_running_group_stages_nothing():
    assert plan(nodes=()).state is None


def test_a_shared_claim_is_staged_by_one_job():
    shared = StagingTarget(TARGET.uri, TARGET.revision, shared=True)
    assert plan(target=shared).create == ("",)


def test_no_target_deletes_every_job():
    assert plan_staging(None, True, NODES, [job("node-a")], None, 1, NOW).delete == (job("node-a").name,)


def test_no_target_holds_nothing():
    assert plan_staging(None, True, NODES, [], state(STAGING), 1, NOW).holds_rollout is False


def test_staging_state_survives_a_status_round_trip():
    previous = state(FAILED, reason="NotFound", message="m", started_at=NOW, finished_at=NOW + 3)
    assert StagingState.from_status(previous.to_status()) == previous


def _api_job(conditions=(), active=0):
    return {"metadata": {"name": "j", "uid": "u", "annotations": {"shardline.dev/staging-node": "node-a"},
                         "labels": {"shardline.dev/staging-key": TARGET.key, "shardline.dev/staging-attempt": "2"}},
            "status": {"active": active, "conditions": [{"type": t, "status": "True", "reason": r, "message": m}
                                                        for t, r, m in conditions]}}


def _api_pod(message):
    return {"status": {"containerStatuses": [{"state": {"terminated": {"exitCode": 3, "message": message,
                                                                       "finishedAt": "2026-12-02T05:00:00Z"}}}]}}


@pytest.mark.parametrize("conditions,active,expected", [
    ((), 1, "Running"), ((), 0, "Pending"), ((("Complete", "", ""),), 0, "Succeeded"),
    ((("Failed", "PodFailurePolicy", "exit 3"),), 0, "Failed"),
])
def test_job_state_follows_its_conditions(conditions, active, expected):
    assert staging_job_from_api(_api_job(conditions, active), []).state == expected


def test_job_result_is_the_containers_json_report():
    pod = _api_pod('{"state": "Failed", "reason": "NotFound", "message": "gone"}')
    assert staging_job_from_api(_api_job(), [pod]).result["reason"] == "NotFound"


def test_job_node_comes_from_its_annotation():
    assert staging_job_from_api(_api_job(), []).node == "node-a"


def test_job_attempt_comes_from_its_label():
    assert staging_job_from_api(_api_job(), []).attempt == 2


def test_a_job_without_staging_labels_is_not_a_staging_job():
    assert staging_job_from_api({"metadata": {"name": "other"}}, []) is None
