"""Judge the fault suite's availability invariant from time-stamped observations (issue 23 item 6).

Each source says what it saw together with when it can have been true, and a group is judged at
an instant ``t`` only from facts valid at ``t``: the reads of different sources need not be
simultaneous, and a violation shorter than the sampling period is still found where the data
bounds it. Times are wall-clock seconds (``time.time()``), the clock of the node agent that
writes the pod conditions.

Sources:

- **the leader pod** (:func:`pod_change`, from a LIST + WATCH of the leader pods): the group is
  up by its pod when a leader pod exists, is not terminating and is Ready. A change is bounded
  by the timestamps the API server keeps: the Ready condition's ``lastTransitionTime`` and a
  deletion's ``deletionTimestamp - deletionGracePeriodSeconds`` (both whole seconds, floored,
  so the change fell in ``[t, t + 1)``), and never later than the event's arrival;
- **the leader's runtime** (:class:`Answer`, one ``/get_server_info`` per leader at a time): the
  answer's phase held at some instant between sending and receiving; ``serving`` is up, any
  other phase down, no answer says nothing. Two consecutive answers of one leader with the same
  phase are taken to bound one stretch of it, unless their ``last_update`` records differ (an
  update ended between them).

A group is *certainly down* at ``t`` when some source's down stretch certainly covers ``t``
(:func:`down_intervals`). :func:`violations` reports each instant at which more groups below
``replicas`` are certainly down than ``maxUnavailable`` allows, not counting a group an injected
fault took down until a new leader pod of it was seen Ready (:class:`Excuse`), and each update
that began while the groups down, those a fault took down included, already filled
``maxUnavailable``. Uncertainty is always resolved towards "up", so skew between sources cannot
make a violation; a real one is missed only where no source bounds it.
"""
from __future__ import annotations

import datetime
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

INF = float("inf")
UPDATING = ("loading", "recapturing")


@dataclass(frozen=True)
class Change:
    """From an instant in ``[lo, hi]`` on, the leader pod of ``group`` shows ``up``."""

    group: int
    lo: float
    hi: float
    up: bool
    uid: str | None
    what: str


@dataclass(frozen=True)
class Answer:
    """A ``/get_server_info`` of ``group``'s leader ``uid`` sent at ``sent``, received at
    ``received``, reporting ``phase`` (``serving``, ``loading``, ``recapturing``, ``failed``)."""

    group: int
    uid: str | None
    sent: float
    received: float
    phase: str
    revision: str | None = None
    digest: str | None = None
    last_update: str | None = None  # the leader's ``last_update`` record, as JSON: an update ended between two answers that differ here


@dataclass(frozen=True)
class Interval:
    """``group`` is certainly down over ``[start, end]`` (seconds) because of ``why``."""

    group: int
    start: float
    end: float
    why: str
    starts_wave: bool = False  # the stretch is an update the operator started (the runtime's)


@dataclass(frozen=True)
class Excuse:
    """An injected fault took ``group`` down from ``start`` to ``end`` (INF: not over)."""

    group: int
    start: float
    end: float = INF


@dataclass(frozen=True)
class Budget:
    """A CR read that started at ``at``: ``spec.replicas`` and ``weightUpdate.maxUnavailable``."""

    at: float
    replicas: int
    max_unavailable: int


@dataclass(frozen=True)
class Violation:
    at: float
    groups: tuple[int, ...]
    allowed: int
    text: str


def rfc3339(value: str | None) -> float | None:
    """Seconds since the epoch of a Kubernetes timestamp (``2026-12-02T12:00:01Z``); None stays None."""
    if not value:
        return None
    return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def pod_change(pod: dict | None, group: int, received: float, previous: Change | None,
               gone: bool = False) -> Change | None:
    """The change the leader pod object ``pod`` of ``group`` (``gone``: its DELETED event; None:
    absent from a list) shows against ``previous``, received at ``received``; None when the
    group's state by its pod is unchanged. ``lo``/``hi`` come from the Ready condition's
    ``lastTransitionTime``, the deletion time, or (a new pod not Ready) its creation time."""
    meta = (pod or {}).get("metadata") or {}
    uid = None if pod is None or gone else meta.get("uid")
    ready: dict = next((c for c in ((pod or {}).get("status") or {}).get("conditions") or []
                        if c.get("type") == "Ready"), {})
    deleted_at = rfc3339(meta.get("deletionTimestamp"))
    if deleted_at is not None:
        deleted_at -= float(meta.get("deletionGracePeriodSeconds") or 0)
    up = uid is not None and deleted_at is None and ready.get("status") == "True"
    what = ("gone" if uid is None else "terminating" if deleted_at is not None
            else "Ready" if up else "not Ready")
    if previous is not None and previous.up == up and previous.uid == uid:
        return None
    floor = previous.lo if previous is not None else -INF  # changes come in order
    stamp: float | None
    if deleted_at is not None:
        stamp = deleted_at
    elif uid is not None and not up and previous is not None and uid != previous.uid:
        stamp = rfc3339(meta.get("creationTimestamp"))
    else:
        stamp = rfc3339(ready.get("lastTransitionTime")) if uid is not None else None
    if stamp is None:
        return Change(group, floor, received, up, uid, what)
    return Change(group, max(stamp, floor), min(stamp + 1.0, received), up, uid, what)


def pod_intervals(changes: Sequence[Change], horizon: float) -> list[Interval]:
    """Certain down stretches of one group by its pod: from the latest instant a run of down
    changes can have begun to the earliest the next up change can have happened; a run still
    open lasts to ``horizon`` (the last instant the pod source confirmed the state)."""
    out = []
    first: Change | None = None
    for change in [*changes, None]:
        if change is not None and not change.up:
            first = first or change
            continue
        if first is not None:
            end = change.lo if change is not None else horizon
            if first.hi <= end:
                out.append(Interval(first.group, first.hi, end, f"pod {first.what}"))
        first = None
    return out


def answer_intervals(answers: Sequence[Answer]) -> list[Interval]:
    """Certain down stretches of one group by its runtime: each run of consecutive answers of
    one leader that are not ``serving``, with the same ``last_update`` (no update ended in
    between), covers ``[first received, last sent]`` (empty for a single answer)."""
    out: list[Interval] = []
    run: list[Answer] = []

    def close() -> None:
        if run and run[0].received <= run[-1].sent:
            phases = "/".join(dict.fromkeys(a.phase for a in run))
            out.append(Interval(run[0].group, run[0].received, run[-1].sent,
                                f"leader {phases} ({len(run)} answers)",
                                starts_wave=run[0].phase in UPDATING))
        run.clear()

    for answer in sorted(answers, key=lambda a: a.sent):
        if run and (answer.phase == "serving" or answer.uid != run[0].uid
                    or answer.last_update != run[-1].last_update):
            close()
        if answer.phase != "serving":
            run.append(answer)
    close()
    return out


def down_intervals(changes: Iterable[Change], answers: Iterable[Answer], horizon: float) -> list[Interval]:
    """Every certain down stretch of every group, from both sources."""
    by_group: dict[int, tuple[list[Change], list[Answer]]] = {}
    for change in changes:
        by_group.setdefault(change.group, ([], []))[0].append(change)
    for answer in answers:
        by_group.setdefault(answer.group, ([], []))[1].append(answer)
    out = []
    for group_changes, group_answers in by_group.values():
        out += pod_intervals(group_changes, horizon) + answer_intervals(group_answers)
    return out


def _budget_at(budgets: Sequence[Budget], t: float) -> tuple[int, int] | None:
    """``(replicas, maxUnavailable)`` at ``t``: of the CR reads just before and after ``t``,
    the fewer replicas and the larger budget (None before the first read)."""
    before = [b for b in budgets if b.at <= t]
    if not before:
        return None
    around = [before[-1]] + [b for b in budgets if b.at > t][:1]
    return min(b.replicas for b in around), max(b.max_unavailable for b in around)


def violations(intervals: Sequence[Interval], excuses: Sequence[Excuse],
               budgets: Sequence[Budget], origin: float = 0.0) -> list[Violation]:
    """Check, at each instant a down stretch begins (times in the text relative to
    ``origin``), counting only groups below ``replicas``:

    - the groups certainly down and not excused by a fault must not outnumber
      ``maxUnavailable``;
    - when a group's update begins (its leader's first ``loading``/``recapturing`` answer), the
      groups certainly down, the excused ones included, must not outnumber it either: the
      planner starts no wave while a fault has a group down (issue 23: a deleted leader's group
      restarting while the next group updates).

    One violation per episode (the same groups, overlapping stretches)."""
    budgets = sorted(budgets, key=lambda b: b.at)
    found: list[Violation] = []
    episode_end = -INF
    episode_groups: tuple[int, ...] = ()
    for t in sorted({i.start for i in intervals}):
        limits = _budget_at(budgets, t)
        if limits is None:
            continue
        replicas, allowed = limits
        down = [i for i in intervals if i.start <= t <= i.end and i.group < replicas]
        counted = [i for i in down if not any(e.group == i.group and e.start <= t <= e.end
                                              for e in excuses)]
        waves = sorted({i.group for i in down if i.starts_wave and i.start == t})
        if len({i.group for i in counted}) > allowed:
            covering, rule = counted, "certainly down"
        elif waves and len({i.group for i in down}) > allowed:
            covering, rule = down, f"certainly down when group {waves[0]}'s update began"
        else:
            continue
        groups = tuple(sorted({i.group for i in covering}))
        if groups == episode_groups and t <= episode_end:
            continue
        episode_groups = groups
        episode_end = min(max(i.end for i in covering if i.group == g) for g in groups)
        why = "; ".join(f"group {i.group}: {i.why} over [{i.start - origin:.2f}, {i.end - origin:.2f}]"
                        for i in sorted(covering, key=lambda i: (i.group, i.start)))
        found.append(Violation(t, groups, allowed,
                               f"groups {list(groups)} {rule}, allowed {allowed} ({why})"))
    return found


def excuse_end(changes: Sequence[Change], group: int, after: float, uid: str | None) -> float:
    """When a fault on ``group`` (injected at ``after``, leader ``uid``) is over: the latest
    instant a new leader pod of it can have turned Ready (INF: not yet seen)."""
    return next((c.hi for c in changes if c.group == group and c.up and c.uid != uid
                 and c.hi >= after), INF)
