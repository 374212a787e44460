"""``bench/rollout.py``'s post-update latency rule (``hack/scenario/rollout_timeline.recovery``)
on constructed client records: ``(sent at, leader IP, seconds, ok)``, times in seconds.

No cluster: the rule is a pure function of the records and the group's "available again" time.
"""
from __future__ import annotations

import math

from hack.scenario.rollout_timeline import GroupTimeline, recovery

IP = "10.0.0.1"


def records(pairs: list[tuple[float, float]], ip: str = IP) -> list[tuple[float, str, float, bool]]:
    return [(sent, ip, seconds, True) for sent, seconds in pairs]


def test_a_group_back_at_once_recovers_at_zero():
    before = [(t, 1.0) for t in range(0, 20, 2)]
    after = [(30 + t * 0.5, 1.1) for t in range(20)]
    base, recovered, worst = recovery(records(before + after), GroupTimeline(0, IP, available_at=30.0), 20.0, 60.0)
    assert (base, recovered, worst) == (1.0, 0.0, 1.1)


def test_slow_requests_after_the_update_delay_recovery_until_a_window_is_fast():
    before = [(t, 1.0) for t in range(0, 20, 2)]
    slow = [(30 + t * 0.5, 4.0) for t in range(12)]  # sent 30.0 .. 35.5
    fast = [(36 + t * 0.5, 1.2) for t in range(20)]
    base, recovered, worst = recovery(records(before + slow + fast), GroupTimeline(0, IP, available_at=30.0), 20.0, 60.0)
    assert base == 1.0 and worst == 4.0
    assert recovered == 6.0  # the first window that holds no slow request starts at 36.0


def test_a_sparse_group_is_judged_on_three_requests_not_never():
    # one request every 3 s: a 5-s window never holds three
    before = [(t, 1.0) for t in range(0, 30, 3)]
    after = [(40 + 3 * t, 1.0) for t in range(6)]
    base, recovered, _ = recovery(records(before + after), GroupTimeline(0, IP, available_at=40.0), 30.0, 70.0)
    assert (base, recovered) == (1.0, 0.0)


def test_never_recovered_and_other_leaders_ignored():
    before = [(t, 1.0) for t in range(0, 20, 2)]
    after = [(30 + t, 3.0) for t in range(10)]
    elsewhere = records([(30 + t, 0.1) for t in range(10)], ip="10.0.0.2")
    base, recovered, worst = recovery(records(before + after) + elsewhere, GroupTimeline(0, IP, available_at=30.0), 20.0, 60.0)
    assert base == 1.0 and math.isinf(recovered) and worst == 3.0


def test_a_group_never_available_has_no_recovery():
    base, recovered, worst = recovery(records([(0, 1.0)]), GroupTimeline(0, IP), 20.0, 60.0)
    assert base == 1.0 and math.isinf(recovered) and math.isnan(worst)


def test_requests_beside_another_groups_load_are_split_from_those_beside_none():
    from hack.scenario.rollout_timeline import beside_loads

    g0 = GroupTimeline(0, "10.0.0.1", loading_at=10.0, available_at=20.0)
    g1 = GroupTimeline(1, "10.0.0.2", loading_at=25.0, available_at=None)  # never seen to end
    recs = [
        (5.0, "10.0.0.2", 9.0, True),  # before the start: left out
        (12.0, "10.0.0.1", 8.0, True),  # to g0 while it updates itself: left out
        (12.0, "10.0.0.2", 2.0, True),  # to g1 while g0 loads
        (22.0, "10.0.0.1", 0.5, True),  # to g0, nothing loading
        (22.0, "10.0.0.2", 0.4, True),
        (26.0, "10.0.0.1", 3.0, True),  # to g0 while g1 loads (until the end)
        (26.0, "10.0.0.2", 7.0, True),  # to g1 while it updates itself: left out
    ]
    beside, alone = beside_loads(recs, [g0, g1], start=10.0, end=30.0)
    assert sorted(beside) == [2.0, 3.0] and sorted(alone) == [0.4, 0.5]
