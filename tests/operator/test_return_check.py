"""return_check.ReturnChecks with a constructed check and clock: which early results a return
to routing may use (issue 23: the return check begun as an update succeeds)."""

from __future__ import annotations

import threading

import pytest

from shardline_operator.return_check import FRESH_SECONDS, ReturnChecks

URL = "http://10.0.0.1:8000"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def checks(answer: tuple[bool, str], gate: threading.Event | None = None) -> tuple[ReturnChecks, Clock, list]:
    clock, calls = Clock(), []

    def check(url: str, key: str | None) -> tuple[bool, str]:
        calls.append((url, key))
        if gate is not None:
            gate.wait(10)
        return answer

    return ReturnChecks(check, clock), clock, calls


def test_a_passed_check_is_used_once():
    rc, _, calls = checks((True, "200 in 0.1 s"))
    rc.start(URL, "key")
    assert rc.take(URL, 10) == (True, "200 in 0.1 s (checked as the update ended)")
    assert rc.take(URL, 10) is None
    assert calls == [(URL, "key")]


def test_a_failed_early_check_is_not_used():
    """A failure right after the update (a timeout on a busy leader) must not decide: the pass
    checks afresh."""
    rc, _, _ = checks((False, "timed out"))
    rc.start(URL, None)
    assert rc.take(URL, 10) is None


def test_a_stale_check_is_not_used_and_is_pruned():
    rc, clock, _ = checks((True, "ok"))
    rc.start(URL, None)
    for thread in list(rc._running.values()):
        thread.join(10)
    clock.now += FRESH_SECONDS + 1
    rc.start("http://10.0.0.2:8000", None)  # a start prunes what is too old to use
    assert URL not in rc._results
    assert rc.take(URL, 10) is None


def test_forget_discards_a_check_in_flight():
    gate = threading.Event()
    rc, _, _ = checks((True, "ok"), gate)
    rc.start(URL, None)
    thread = rc._running[URL]
    rc.forget(URL)
    gate.set()
    thread.join(10)
    assert rc.take(URL, 10) is None


def test_a_thread_that_cannot_start_leaves_nothing_registered(monkeypatch):
    rc, _, _ = checks((True, "ok"))

    def refuse(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        rc.start(URL, None)
    monkeypatch.undo()
    assert rc.take(URL, 1) is None
