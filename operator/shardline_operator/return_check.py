"""The return-to-routing health check of a group, begun the moment its update succeeds.

A group leaves routing before its update and returns after ``/health_generate`` answers 200
(``routing_execute.perform_routing``). That check used to start only in the pass that counted
the group available, after that pass's ``observe`` and the pod's next readiness probe, and the
next group's update waited for it (a loaded 200M-parameter leader took 6-8 s to answer it;
``docs/benchmarks.md``). :class:`ReturnChecks` starts it on the update's own thread as soon as the
runtime replies success, so it runs while the operator observes and the pod turns Ready; the
pass's check then takes that result (or waits for the one in flight) instead of sending a second
request. A result is used once, only while it is at most :data:`FRESH_SECONDS` old, and only if it
passed: a failed early check is dropped and the pass asks the leader afresh, so a stale failure
(e.g. a timeout right after the update) never decides. A new update of the leader forgets any
check of the previous one (:meth:`ReturnChecks.forget`), so a check taken before an update can
never return the group after it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

FRESH_SECONDS = 20.0  # a check older than this is not trusted for a return: ask again

Check = Callable[[str, str | None], tuple[bool, str]]


class ReturnChecks:
    """Early ``/health_generate`` checks by leader URL; ``check(url, serving_key)`` runs one and
    returns ``(passed, message)``; ``clock`` is monotonic seconds."""

    def __init__(self, check: Check, clock: Callable[[], float] = time.monotonic) -> None:
        self._check, self._clock = check, clock
        self._lock = threading.Lock()
        self._running: dict[str, threading.Thread] = {}
        self._results: dict[str, tuple[bool, str, float]] = {}  # url -> (passed, message, at)

    def start(self, url: str, serving_key: str | None) -> None:
        """Begin the check of ``url`` on a thread of its own (a previous result is dropped).

        Raises what ``threading.Thread.start`` raises (``RuntimeError``: no thread could start);
        nothing is then registered for ``url``."""
        thread = threading.Thread(
            target=self._run, args=(url, serving_key), daemon=True, name=f"return-check-{url}"
        )
        with self._lock:
            self._prune()
            self._results.pop(url, None)
            self._running[url] = thread
        try:
            thread.start()
        except BaseException:
            with self._lock:
                if self._running.get(url) is thread:
                    del self._running[url]
            raise

    def forget(self, url: str) -> None:
        """Drop the result and any check in flight for ``url`` (its late result is then
        discarded): called when a new update of that leader starts."""
        with self._lock:
            self._running.pop(url, None)
            self._results.pop(url, None)

    def _prune(self) -> None:
        """Drop results too old to use (a group deleted or never returned); under the lock."""
        now = self._clock()
        for url in [u for u, (_, _, at) in self._results.items() if now - at > FRESH_SECONDS]:
            del self._results[url]

    def _run(self, url: str, serving_key: str | None) -> None:
        passed, message = self._check(url, serving_key)
        with self._lock:
            if self._running.get(url) is threading.current_thread():
                del self._running[url]
                self._results[url] = (passed, message, self._clock())

    def take(self, url: str, wait_seconds: float) -> tuple[bool, str] | None:
        """The early check of ``url``: waits up to ``wait_seconds`` for one in flight; returns
        ``(True, message)`` for a passed result at most :data:`FRESH_SECONDS` old (and forgets
        it), else None: no early check, a stale one or a failed one (the caller checks itself)."""
        with self._lock:
            running = self._running.get(url)
        if running is not None:
            running.join(wait_seconds)
        with self._lock:
            result = self._results.pop(url, None)
            self._prune()
        if result is None or self._clock() - result[2] > FRESH_SECONDS or not result[0]:
            return None
        return True, f"{result[1]} (checked as the update ended)"
