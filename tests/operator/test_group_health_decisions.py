"""group_health.py: whole-group restarts, exponential backoff, budget, first error line."""

from __future__ import annotations

from shardline_operator.group_health import GroupRecord, backoff_seconds, decide
from shardline_operator.observed import GroupObservation, PodObservation
from shardline_operator.spec import RestartPolicySpec

POLICY = RestartPolicySpec(max_group_restarts=2, backoff_seconds=10)


def group(*pods, size=2):
    return GroupObservation(0, size, {"metadata": {}}, tuple(PodObservation.from_api(p) for p in pods))


def test_healthy_group_records_members(make_pod):
    decision = decide(group(make_pod(0, 0), make_pod(0, 1)), GroupRecord(), POLICY, now=100.0)
    assert decision.action == "none"
    assert decision.record.pod_uids == {"llama-g0-0": "uid-0-0", "llama-g0-1": "uid-0-1"}


def test_forming_group_is_not_recorded(make_pod):
    decision = decide(group(make_pod(0, 0, ready=False)), GroupRecord(), POLICY, now=100.0)
    assert decision.action == "none" and decision.record.pod_uids == {}


def test_member_restart_restarts_the_group_at_once(make_pod):
    g = group(make_pod(0, 0), make_pod(0, 1, restarts=1, terminated_message="RuntimeError: shard missing\nTraceback"))
    decision = decide(g, GroupRecord(), POLICY, now=100.0)
    assert decision.action == "restart"
    assert decision.record.restarts == 1 and decision.record.last_restart_time == 100.0
    assert "RuntimeError: shard missing" in decision.reason


def test_replaced_member_restarts_the_group(make_pod):
    record = GroupRecord(pod_uids={"llama-g0-0": "uid-0-0", "llama-g0-1": "uid-0-1"})
    g = group(make_pod(0, 0, uid="new-uid", ready=False), make_pod(0, 1))
    decision = decide(g, record, POLICY, now=5.0)
    assert decision.action == "restart" and "replaced" in decision.reason


def test_deleted_member_restarts_the_group(make_pod):
    record = GroupRecord(pod_uids={"llama-g0-0": "uid-0-0", "llama-g0-1": "uid-0-1"})
    decision = decide(group(make_pod(0, 0, deleting=True), make_pod(0, 1)), record, POLICY, now=5.0)
    assert decision.action == "restart"


def test_backoff_doubles_and_caps():
    policy = RestartPolicySpec(max_group_restarts=100, backoff_seconds=10)
    assert [backoff_seconds(n, policy) for n in range(6)] == [0.0, 10.0, 20.0, 40.0, 80.0, 160.0]
    assert backoff_seconds(30, policy) == 300.0


def test_backoff_waits_then_restarts(make_pod):
    broken = group(make_pod(0, 0, restarts=2), make_pod(0, 1))
    record = GroupRecord(restarts=1, last_restart_time=100.0)
    waiting = decide(broken, record, POLICY, now=105.0)
    assert waiting.action == "wait" and waiting.retry_in_seconds == 5.0
    assert decide(broken, record, POLICY, now=110.0).action == "restart"


def test_budget_exhausted_fails_with_first_error_line(make_pod):
    broken = group(make_pod(0, 0, terminated_message="\nValueError: model.safetensors missing shard 2\nmore"),
                   make_pod(0, 1))
    decision = decide(broken, GroupRecord(restarts=2, last_restart_time=0.0), POLICY, now=1000.0)
    assert decision.action == "fail"
    assert decision.record.failed_message == "ValueError: model.safetensors missing shard 2"
    # Failed stays failed (no restart) until the spec changes (the caller resets the record).
    assert decide(broken, decision.record, POLICY, now=2000.0).action == "none"


def test_zero_budget_fails_on_first_failure(make_pod):
    decision = decide(group(make_pod(0, 0, phase="Failed"), make_pod(0, 1)), GroupRecord(),
                      RestartPolicySpec(max_group_restarts=0, backoff_seconds=1), now=1.0)
    assert decision.action == "fail" and "Failed" in decision.record.failed_message


def _oom_killed(make_pod, rank, log_tail):
    pod = make_pod(0, rank, restarts=1)
    pod["status"]["containerStatuses"][0]["lastState"] = {"terminated": {
        "exitCode": 137, "reason": "OOMKilled", "message": log_tail}}
    return pod


def test_oom_killed_member_fails_the_group_naming_the_memory_limit(make_pod):
    # The real kubelet's status of a container killed at its memory limit: reason OOMKilled,
    # exit 137, and (FallbackToLogsOnError) a log tail whose first line is no error (issue 21).
    broken = group(make_pod(0, 0), _oom_killed(make_pod, 1, "INFO loading weights\nINFO shard 1/2"))
    decision = decide(broken, GroupRecord(), RestartPolicySpec(max_group_restarts=0, backoff_seconds=1),
                      now=1.0)
    assert "OOMKilled" in decision.record.failed_message


def test_oom_killed_restart_reason_names_the_memory_limit(make_pod):
    broken = group(make_pod(0, 0), _oom_killed(make_pod, 1, "INFO loading weights"))
    decision = decide(broken, GroupRecord(), POLICY, now=100.0)
    assert "spec.runtime.resources.limits.memory" in decision.reason
