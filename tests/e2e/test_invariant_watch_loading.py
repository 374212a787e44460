"""The fault suite's wait for a loading leader (``InvariantWatch.wait_loading``) on constructed
leader answers: only answers sent since the patch count, an update that began and ended between
two answers is noted and the wait goes on, and a rollout over with no load seen fails at once. No
cluster (the watcher is not started; its client is never called)."""
from __future__ import annotations

import pytest

from hack.scenario import availability as av
from hack.scenario.invariant_watch import InvariantWatch

OLD, NEW = '{"model_path": "rev-a"}', '{"model_path": "rev-b"}'


def watch(*reads: tuple[int, float, str, str]) -> InvariantWatch:
    """A watcher holding answers ``(group, sent, phase, last_update)`` (received 0.1 s later)."""
    w = InvariantWatch(client=None, namespace="ns", name="faults")  # type: ignore[arg-type]
    w._answers = [av.Answer(g, f"uid-{g}", t, t + 0.1, phase, last_update=record) for g, t, phase, record in reads]
    return w


def test_a_loading_answer_since_the_patch_names_its_group():
    assert watch((0, 9.0, "serving", OLD), (1, 10.5, "loading", OLD)).wait_loading(1, since=10.0) == 1


def test_a_loading_answer_from_before_the_patch_does_not_count():
    with pytest.raises(TimeoutError, match="no leader reported loading"):
        watch((0, 9.0, "loading", OLD), (0, 10.5, "serving", OLD)).wait_loading(0.2, since=10.0)


def test_an_update_that_ended_between_two_answers_lets_the_wait_go_on_for_the_next_group():
    w = watch((0, 10.5, "serving", OLD), (0, 12.0, "serving", NEW), (1, 12.0, "loading", OLD))
    assert w.wait_loading(60, since=10.0) == 1


def test_a_rollout_over_before_any_load_was_seen_fails_at_once_naming_the_unseen_updates():
    w = watch((0, 10.5, "serving", OLD), (0, 12.0, "serving", NEW))
    with pytest.raises(RuntimeError, match=r"ended before any leader reported loading \(updates ended unseen by any answer: groups \[0\]"):
        w.wait_loading(60, since=10.0, over=lambda: True)


def test_the_previous_update_ending_after_the_last_answer_before_the_patch_is_no_alarm():
    # the answer before the patch predates the last update's end; the first since is the reference
    w = watch((0, 9.0, "serving", OLD), (0, 10.5, "serving", NEW), (0, 11.0, "serving", NEW))
    with pytest.raises(TimeoutError):
        w.wait_loading(0.2, since=10.0)


def test_the_timeout_names_the_last_cr_status():
    w = watch()
    w.last_status = '{"phase": "Ready", "rollout": null}'
    with pytest.raises(TimeoutError, match='last CR status: {"phase": "Ready", "rollout": null}'):
        w.wait_loading(0.1, since=10.0)
