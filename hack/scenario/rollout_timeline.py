"""Where an in-place rollout's time goes, group by group, and each group's latency afterwards.

:class:`Timeline` samples every :data:`SAMPLE_SECONDS` each group leader's pod (Ready, IP) and
its ``/get_server_info`` weights block, one thread per leader, and keeps per group the first
time it was seen loading, serving the target again (the runtime's update ended) and available
(pod Ready and serving the target), plus the runtime's own ``load_seconds`` /
``recapture_seconds`` of that update. :func:`breakdown` splits the rollout's duration into the
updates themselves, the runtime's work around them, the wait for readiness and the operator's
gaps; :func:`recovery` gives the time from "available again" until a group's p95 latency is back
within :data:`RECOVERED_FACTOR` of its pre-rollout p95. Used by ``bench/rollout.py``.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field

import httpx

SAMPLE_SECONDS = 0.1
RECOVERED_FACTOR = 1.5  # p95 within this factor of the pre-rollout p95 counts as recovered
WINDOW_SECONDS = 5.0  # recovery: the p95 of requests sent in a window of this length,
MIN_WINDOW_REQUESTS = 3  # ... stretched to at least this many requests


@dataclass
class GroupTimeline:
    """One group's update as sampled (monotonic seconds; None: not seen)."""

    index: int
    ip: str | None = None
    loading_at: float | None = None
    serving_at: float | None = None
    available_at: float | None = None
    load_seconds: float = 0.0
    recapture_seconds: float = 0.0

    @property
    def update_seconds(self) -> float:
        return self.load_seconds + self.recapture_seconds


@dataclass
class Timeline:
    """Background sampler of the leaders of ``name`` during a rollout to ``revision``."""

    client: object
    namespace: str
    name: str
    groups: int
    revision: str
    by_group: dict[int, GroupTimeline] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> Timeline:
        for g in range(self.groups):
            self.by_group[g] = GroupTimeline(g)
            thread = threading.Thread(target=self._follow, args=(g,), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(10)

    def _follow(self, g: int) -> None:
        pod_path = f"/api/v1/namespaces/{self.namespace}/pods/{self.name}-g{g}-0"
        record = self.by_group[g]
        with httpx.Client(timeout=2.0) as http:
            while not self._stop.is_set():
                try:
                    pod = self.client.get(pod_path) or {}
                    ip = pod.get("status", {}).get("podIP")
                    conditions = {c["type"]: c["status"] for c in pod.get("status", {}).get("conditions") or []}
                    ready = conditions.get("Ready") == "True" and not pod["metadata"].get("deletionTimestamp")
                    weights = http.get(f"http://{ip}:8000/get_server_info").json()["weights"] if ip else {}
                except (httpx.HTTPError, KeyError, ValueError):
                    time.sleep(SAMPLE_SECONDS)
                    continue
                now = time.monotonic()
                record.ip = ip
                phase, on_target = weights.get("phase"), weights.get("revision") == self.revision
                if phase in ("loading", "recapturing") and record.loading_at is None:
                    record.loading_at = now
                if phase == "serving" and on_target and record.serving_at is None:
                    record.serving_at = now
                    last = weights.get("last_update") or {}
                    record.load_seconds = float(last.get("load_seconds") or 0.0)
                    record.recapture_seconds = float(last.get("recapture_seconds") or 0.0)
                if phase == "serving" and on_target and ready and record.available_at is None:
                    record.available_at = now
                time.sleep(SAMPLE_SECONDS)


def breakdown(groups: list[GroupTimeline], patched_at: float, done_at: float) -> list[dict]:
    """Per group, in update order: ``update`` (the runtime's load + recapture), ``runtime_extra``
    (loading seen -> serving seen, less the update: pause, drain, digest, bookkeeping),
    ``ready_lag`` (serving -> pod Ready), ``gap_before`` (the previous group available, or the
    patch, -> this group loading). ``done_at``: status Ready on the target."""
    rows, previous = [], patched_at
    for g in sorted((g for g in groups if g.loading_at is not None), key=lambda g: g.loading_at):
        serving = g.serving_at if g.serving_at is not None else done_at
        available = g.available_at if g.available_at is not None else done_at
        rows.append({
            "group": g.index, "update": g.update_seconds,
            "runtime_extra": max(0.0, serving - g.loading_at - g.update_seconds),
            "ready_lag": max(0.0, available - serving), "gap_before": g.loading_at - previous,
        })
        previous = available
    if rows:
        rows[-1]["tail"] = done_at - previous  # last group available -> status Ready
    return rows


def p95(values: list[float]) -> float:
    """Nearest-rank 95th percentile (seconds); nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def recovery(records: list[tuple[float, str, float, bool]], group: GroupTimeline, baseline_until: float,
             end: float) -> tuple[float, float, float]:
    """``(pre-rollout p95, seconds to recover, worst latency after available)`` of one group from
    the client's ``(sent at, leader IP, seconds, ok)`` records (seconds; monotonic clock).

    The pre-rollout p95 is over requests sent to the group's leader before ``baseline_until``.
    Recovery is the start of the first window whose p95 is within :data:`RECOVERED_FACTOR` of it;
    the windows start at ``available_at`` and then at each later request's send time, and each
    spans :data:`WINDOW_SECONDS`, stretched to its first :data:`MIN_WINDOW_REQUESTS` requests
    where fewer were sent in that time (a group that gets one request every few seconds is
    judged on three requests, not never). inf: no window sent before ``end`` qualifies."""
    mine = [(sent, seconds) for sent, ip, seconds, _ in records if ip == group.ip]
    base = p95([s for sent, s in mine if sent < baseline_until])
    if group.available_at is None:
        return base, math.inf, math.nan
    after = sorted((sent, s) for sent, s in mine if group.available_at <= sent < end)
    worst = max((s for _, s in after), default=math.nan)
    for k in range(len(after) - MIN_WINDOW_REQUESTS + 1):
        start = group.available_at if k == 0 else after[k][0]
        window = [s for sent, s in after[k:] if sent < start + WINDOW_SECONDS]
        if len(window) < MIN_WINDOW_REQUESTS:
            window = [s for _, s in after[k:k + MIN_WINDOW_REQUESTS]]
        if p95(window) <= RECOVERED_FACTOR * base:
            return base, start - group.available_at, worst
    return base, math.inf, worst


def beside_loads(records: list[tuple[float, str, float, bool]], groups: list[GroupTimeline], start: float,
                 end: float) -> tuple[list[float], list[float]]:
    """Latencies (seconds) of the requests sent in ``[start, end)`` to a group that was not
    updating itself, split by whether another group was updating (``loading_at`` to
    ``available_at``) when the request was sent: ``(beside a load, beside none)``.

    On one machine that hosts every group (the local cluster) a load takes CPU from the groups
    still serving; the two lists show how much of the latency after a group's return is that,
    not the returned group itself. A group whose update was never seen to end counts as updating
    until ``end``."""
    spans = {g.ip: (g.loading_at, end if g.available_at is None else g.available_at)
             for g in groups if g.ip is not None and g.loading_at is not None}
    beside, alone = [], []
    for sent, ip, seconds, _ in records:
        if not start <= sent < end:
            continue
        own = spans.get(ip)
        if own is not None and own[0] <= sent < own[1]:
            continue  # sent to the updating group itself
        loading = any(lo <= sent < hi for other, (lo, hi) in spans.items() if other != ip)
        (beside if loading else alone).append(seconds)
    return beside, alone
