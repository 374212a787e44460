"""The fault suite's availability rule (``hack/scenario/availability.py``) on constructed
observations: pod objects as the API server returns them and leader answers with their times.

No cluster: the rule is a pure function of what the watcher recorded. Times are seconds; pod
timestamps are whole seconds, as the API server keeps them.
"""
from __future__ import annotations

import datetime

from hack.scenario import availability as av

BUDGET = [av.Budget(0.0, replicas=2, max_unavailable=1)]


def stamp(t: float) -> str:
    return datetime.datetime.fromtimestamp(int(t), datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def pod(uid: str, ready: bool, since: float, deleted: float | None = None, grace: int = 60,
        created: float = 0.0) -> dict:
    meta = {"uid": uid, "creationTimestamp": stamp(created)}
    if deleted is not None:  # the API server writes the delete time plus the grace period
        meta.update(deletionTimestamp=stamp(deleted + grace), deletionGracePeriodSeconds=grace)
    return {"metadata": meta, "status": {"conditions": [
        {"type": "Ready", "status": "True" if ready else "False", "lastTransitionTime": stamp(since)}]}}


def changes(group: int, events: list[tuple[float, dict | None]]) -> list[av.Change]:
    """Feed ``(received, pod or None for DELETED)`` through ``pod_change`` as the watcher does."""
    out: list[av.Change] = []
    for received, obj in events:
        change = av.pod_change(obj, group, received, out[-1] if out else None, gone=obj is None)
        if change is not None:
            out.append(change)
    return out


def answers(group: int, uid: str, reads: list[tuple[float, float, str]]) -> list[av.Answer]:
    return [av.Answer(group, uid, sent, received, phase) for sent, received, phase in reads]


def judge(pod_changes, leader_answers, excuses=(), horizon=None):
    horizon = T + 1000.0 if horizon is None else horizon
    intervals = av.down_intervals(pod_changes, leader_answers, horizon)
    return av.violations(intervals, list(excuses), BUDGET)


T = 1_800_000_000.0  # an epoch second, so timestamps round-trip


def test_a_group_that_turned_ready_between_two_reads_is_not_judged_down_beside_the_wave_it_let_start():
    # The old skew: a pod list at T+99.8 saw group 0 not Ready; it turned Ready at T+100.4 (the
    # API server keeps T+100); the operator then started group 1, whose slow answer (sent
    # T+101.5, received T+103.4) said loading. Read side by side, both groups looked down.
    g0 = changes(0, [(T + 0.5, pod("a", False, T)), (T + 100.9, pod("a", True, T + 100.4))])
    g1 = changes(1, [(T + 0.5, pod("b", True, T))])
    loads = answers(1, "b", [(T + 99.0, T + 99.3, "serving"), (T + 101.5, T + 103.4, "loading"),
                             (T + 103.7, T + 104.0, "loading"), (T + 110.0, T + 110.2, "serving")])
    assert judge(g0 + g1, loads) == []


def test_a_wave_started_while_another_group_is_not_ready_is_a_violation():
    # Group 0's leader is deleted at T+100 (nobody recorded it as a fault) and its new pod is Ready
    # at T+130; group 1 loads from T+101: both certainly down over [T+101.2, T+101.5].
    g0 = changes(0, [(T + 0.5, pod("a", True, T)), (T + 100.4, pod("a", True, T, deleted=T + 100)),
                     (T + 110.0, None), (T + 111.0, pod("c", False, T + 111, created=T + 111)),
                     (T + 130.5, pod("c", True, T + 130, created=T + 111))])
    g1 = changes(1, [(T + 0.5, pod("b", True, T))])
    loads = answers(1, "b", [(T + 101.0, T + 101.2, "loading"), (T + 101.5, T + 101.7, "loading"),
                             (T + 102.0, T + 102.2, "serving")])
    found = judge(g0 + g1, loads)
    assert [(v.groups, v.allowed) for v in found] == [((0, 1), 1)]
    assert abs(found[0].at - (T + 101.2)) < 1e-6


def test_an_overlap_shorter_than_a_round_is_caught_from_the_pod_timestamps():
    # Rounds at T+99.5 and T+101.8 both see every leader serving. In between, group 0's pod was
    # not Ready over [T+100, T+101] (events received at T+100.3 and T+101.3) and group 1's leader
    # was deleted at T+100 (received T+100.4): both certainly down over [T+100.4, T+101].
    g0 = changes(0, [(T + 0.5, pod("a", True, T)), (T + 100.3, pod("a", False, T + 100)),
                     (T + 101.3, pod("a", True, T + 101))])
    g1 = changes(1, [(T + 0.5, pod("b", True, T)), (T + 100.4, pod("b", True, T, deleted=T + 100))])
    rounds = [(T + 99.5, T + 99.6, "serving"), (T + 101.8, T + 101.9, "serving")]
    found = judge(g0 + g1, answers(0, "a", rounds) + answers(1, "b", rounds[:1]))
    assert [v.groups for v in found] == [(0, 1)]
    assert found[0].at - T < 101.0  # within the second the two overlapped, between the rounds


def test_a_fault_is_excused_until_the_new_leader_is_ready_and_no_longer():
    g0 = changes(0, [(T + 0.5, pod("a", True, T)), (T + 100.4, pod("a", True, T, deleted=T + 100)),
                     (T + 105.0, None), (T + 106.0, pod("c", False, T + 106, created=T + 106)),
                     (T + 120.5, pod("c", True, T + 120, created=T + 106)),
                     (T + 140.5, pod("c", False, T + 140)), (T + 150.5, pod("c", True, T + 150))])
    g1 = changes(1, [(T + 0.5, pod("b", True, T))])
    # group 1 updates from before the fault (T+99.9) to T+116: the fault added group 0's
    # unavailability to it, the planner added nothing
    during_fault = answers(1, "b", [(T + 99.0, T + 99.2, "loading"), (T + 101.0, T + 101.2, "loading"),
                                    (T + 115.0, T + 115.2, "loading"), (T + 116.0, T + 116.2, "serving")])
    excuse = av.Excuse(0, T + 99.9, av.excuse_end(g0, 0, T + 99.9, "a"))
    assert excuse.end == T + 120.5  # the latest the new pod "c" can have turned Ready
    assert judge(g0 + g1, during_fault, [excuse]) == []
    after = answers(1, "b", [(T + 141.0, T + 141.2, "loading"), (T + 142.0, T + 142.2, "loading")])
    assert [v.groups for v in judge(g0 + g1, during_fault + after, [excuse])] == [(0, 1)]


def test_an_update_begun_while_a_faulted_group_restarts_is_a_violation():
    # Issue 23's first failure: group 0's leader is deleted while it updates (a recorded fault);
    # the operator then starts group 1 while group 0's new pod is not Ready yet.
    g0 = changes(0, [(T + 0.5, pod("a", True, T)), (T + 100.4, pod("a", True, T, deleted=T + 100)),
                     (T + 105.0, None), (T + 106.0, pod("c", False, T + 106, created=T + 106)),
                     (T + 120.5, pod("c", True, T + 120, created=T + 106))])
    g1 = changes(1, [(T + 0.5, pod("b", True, T))])
    excuse = av.Excuse(0, T + 99.9, av.excuse_end(g0, 0, T + 99.9, "a"))
    early = answers(1, "b", [(T + 110.0, T + 110.2, "loading"), (T + 111.0, T + 111.2, "loading"),
                             (T + 125.0, T + 125.2, "serving")])
    found = judge(g0 + g1, early, [excuse])
    assert [v.groups for v in found] == [(0, 1)]
    assert "update began" in found[0].text
    late = answers(1, "b", [(T + 121.0, T + 121.2, "loading"), (T + 122.0, T + 122.2, "loading")])
    assert judge(g0 + g1, late, [excuse]) == []


def test_single_answers_and_unconfirmed_states_prove_nothing():
    # One loading answer bounds no stretch, and a pod state not confirmed by a list after it
    # (the horizon) is not assumed to last.
    g0 = changes(0, [(T + 0.5, pod("a", True, T)), (T + 100.3, pod("a", False, T + 100))])
    g1 = answers(1, "b", [(T + 100.5, T + 101.5, "loading"), (T + 102.0, T + 102.2, "serving")])
    assert judge(g0, g1) == []
    assert judge(g0, g1, horizon=T + 100.0) == []


def test_an_update_that_ended_between_two_answers_splits_the_stretch():
    # Loading, then (the update cancelled and the next begun between two slow reads) loading
    # again under a new last_update: not one stretch over the serving moment in between.
    reads = [av.Answer(1, "b", T + 100.0, T + 100.2, "loading", last_update="x"),
             av.Answer(1, "b", T + 101.0, T + 101.2, "loading", last_update="x"),
             av.Answer(1, "b", T + 110.0, T + 110.2, "loading", last_update="y"),
             av.Answer(1, "b", T + 111.0, T + 111.2, "loading", last_update="y")]
    found = [(round(i.start - T, 3), round(i.end - T, 3)) for i in av.answer_intervals(reads)]
    assert found == [(100.2, 101.0), (110.2, 111.0)]


def test_groups_above_replicas_do_not_count():
    g0 = changes(0, [(T + 0.5, pod("a", False, T))])
    g2 = changes(2, [(T + 0.5, pod("z", False, T))])
    assert judge(g0 + g2, []) == []
    intervals = av.down_intervals(g0 + g2, [], T + 50)
    assert [v.groups for v in av.violations(intervals, [], [av.Budget(0.0, 3, 1)])] == [(0, 2)]


def test_pod_change_bounds_come_from_the_api_timestamps_and_the_arrival():
    ready = av.pod_change(pod("a", True, T + 10), 0, T + 10.3, None)
    assert (ready.up, ready.lo, ready.hi) == (True, T + 10, T + 10.3)
    deleting = av.pod_change(pod("a", True, T + 10, deleted=T + 20, grace=60), 0, T + 25, ready)
    assert (deleting.up, deleting.lo, deleting.hi, deleting.what) == (False, T + 20, T + 21, "terminating")
    assert av.pod_change(pod("a", True, T + 10, deleted=T + 20), 0, T + 26, deleting) is None
