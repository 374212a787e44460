"""The per-object worker of ``handlers.py``: wake-ups collapse into one pass, requeues and the
slow resync set the next unprompted pass, and the pod/StatefulSet events are registered with
the label filter that finds the owner. The pass itself is replaced by a recorder here; the
real passes against a real API server are in test_cluster_events.py."""

from __future__ import annotations

import asyncio
import threading

import kopf
import pytest

from shardline_operator import handlers, labels
from shardline_operator.reconcile import ReconcileResult


class Never:
    """A ``stopped`` flag that is never set (the test cancels the worker instead)."""

    def __bool__(self) -> bool:
        return False


def result(requeue=None, rollout=None) -> ReconcileResult:
    return ReconcileResult({"phase": "Ready", **({"rollout": rollout} if rollout else {})}, [], requeue)


def test_next_delay():
    assert handlers.next_delay(result()) == handlers.RESYNC_SECONDS >= 30
    assert handlers.next_delay(result(0.2)) == 0.2
    assert handlers.next_delay(result(10_000)) == handlers.RESYNC_SECONDS
    assert handlers.next_delay(result(rollout={"phase": "Updating", "group": 1})) == handlers.ROLLOUT_POLL_SECONDS
    assert handlers.next_delay(result(0.1, rollout={"phase": "Updating", "group": 1})) == 0.1
    assert handlers.next_delay(result(rollout={"phase": "RollingBack"})) == handlers.ROLLOUT_POLL_SECONDS
    assert handlers.next_delay(result(rollout={"phase": "Failed"})) == handlers.RESYNC_SECONDS


def test_owned_pod_and_statefulset_events_are_watched():
    registry = kopf.get_default_registry()
    watching = {h.id: h for h in registry._watching.get_all_handlers()}  # noqa: SLF001
    assert watching["on_pod_event"].labels == {labels.LABEL_DEPLOYMENT: kopf.PRESENT}
    assert watching["on_statefulset_event"].labels == {labels.LABEL_DEPLOYMENT: kopf.PRESENT}
    spawning = [h.id for h in registry._spawning.get_all_handlers()]  # noqa: SLF001
    assert spawning == ["worker"]  # one daemon per object, no timer


def test_worker_collapses_wakeups_and_honours_requeue(monkeypatch):
    calls: list[int] = []
    first_pass_running, release = threading.Event(), threading.Event()
    results = [result(), result(requeue=0.05), result()]

    def fake_pass(context, namespace, name, on_status_written):
        calls.append(len(calls))
        if len(calls) == 1:
            first_pass_running.set()
            release.wait(10)
        return results[min(len(calls), len(results)) - 1]

    monkeypatch.setattr(handlers, "run_pass", fake_pass)
    monkeypatch.setattr(handlers.metrics, "observe_status", lambda *args: None)
    workers = handlers.Workers()
    memo = kopf.Memo(context=object(), workers=workers)

    async def scenario():
        task = asyncio.create_task(handlers.worker(body={}, namespace="ns", name="x", stopped=Never(),
                                                   logger=handlers.log, memo=memo))
        await asyncio.to_thread(first_pass_running.wait, 10)
        for _ in range(20):  # a burst of pod events while the first pass runs ...
            workers.wake("ns", "x")
        workers.wake("ns", "other")  # ... and one for another object
        release.set()
        for _ in range(200):  # ... is one more pass; its requeue (0.05 s) asks for a third
            if len(calls) >= 3:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)  # the third result names no time: the next pass is the 30 s resync
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    assert len(calls) == 3
    assert ("ns", "x") not in workers  # the worker unregistered its wake-up event


def run_one_pass(monkeypatch, memo, fake_pass):
    """Run the worker until its first pass returned, then cancel it."""
    done = threading.Event()

    def recorded(context, namespace, name, on_status_written):
        try:
            return fake_pass(context, namespace, name, on_status_written)
        finally:
            done.set()

    monkeypatch.setattr(handlers, "run_pass", recorded)

    async def scenario():
        task = asyncio.create_task(handlers.worker(body={}, namespace="ns", name="x", stopped=Never(),
                                                   logger=handlers.log, memo=memo))
        await asyncio.to_thread(done.wait, 10)
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())


def test_a_pass_mirrors_its_status_into_the_gauges_when_written_not_when_it_ends(monkeypatch):
    """The pass hands its written status on before its returns to routing (each may wait for a
    health check): the gauges are set while the pass still runs."""
    seen, published = [], threading.Event()
    monkeypatch.setattr(handlers.metrics, "observe_status", lambda *args: (seen.append(args), published.set()))
    memo = kopf.Memo(context=object(), workers=handlers.Workers())
    waited = []

    def writes_then_checks_health(context, namespace, name, on_status_written):
        on_status_written({"phase": "Ready"}, 7)
        waited.append(published.wait(10))  # the return to routing's health check, still running
        return ReconcileResult({"phase": "Ready"}, [], None, restart_budget=7)

    run_one_pass(monkeypatch, memo, writes_then_checks_health)
    assert waited == [True] and seen == [("ns", "x", {"phase": "Ready"}, 7)]


def test_an_object_deleted_while_its_pass_runs_gets_no_gauges_back(monkeypatch):
    seen = []
    monkeypatch.setattr(handlers.metrics, "observe_status", lambda *args: seen.append(args))
    memo = kopf.Memo(context=object(), workers=handlers.Workers())

    def deleted_meanwhile(context, namespace, name, on_status_written):
        memo.deleted = True  # what on_delete does to the object's resource memo
        on_status_written({"phase": "Ready"}, 3)
        return ReconcileResult({"phase": "Ready"}, [], None)

    run_one_pass(monkeypatch, memo, deleted_meanwhile)
    assert seen == []
