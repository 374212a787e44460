"""Watch an InferenceDeployment's leaders and status during a rollout, and check the rollout
invariants (issue 23 item 6) from time-stamped observations.

Three sources, each read on its own and each observation kept with the times it can be valid at:

- the leader pods (pod index 0), by a LIST and WATCH: every change of a group's leader (Ready,
  not Ready, terminating, gone, a new pod) with the bounds the API server's timestamps give
  (:func:`~hack.scenario.availability.pod_change`);
- each live leader's ``/get_server_info``, asked about four times a second, one request per
  leader at a time: the phase, revision and digest, with the times it was sent and received;
- the CR, read before each round of leader requests: ``replicas``, ``maxUnavailable`` and the
  groups status shows.

Checked:

- **availability** (:func:`~hack.scenario.availability.violations`): at no instant are more
  groups below ``replicas`` certainly unavailable (leader pod missing, terminating or not Ready,
  or leader answering a phase other than ``serving``) than ``weightUpdate.maxUnavailable``,
  beyond the groups an injected fault took down whose new leader pod has not turned Ready since
  (:meth:`InvariantWatch.fault`), and no group's update begins while the groups down, those a
  fault took down included, already fill ``maxUnavailable``: the planner must never add its own
  unavailability to a fault's. A group is judged at each instant only from facts valid at that instant, so reads
  that are not simultaneous cannot make a violation, and one shorter than a round is found
  where the pod timestamps or two answers bound it;
- **status follows the runtime**: a group that status shows ``Ready`` with a ``revision`` (and a
  ``weightsDigest``) names what its leader served at some answer from :data:`LAG_SECONDS`
  before the CR read on (status is written from leaders asked before, so it may lag them by a
  pass, never lead them).

Shared by ``tests/e2e/test_rollout_faults*.py`` and ``bench/rollout_faults.py``.
"""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx

from hack.localcluster.rest import RestClient
from hack.scenario import availability as av
from hack.scenario.status_watch import GROUP, PLURAL, VERSION

LAG_SECONDS = 3.0  # a pass runs every 0.5 s in a rollout; status written from leaders asked before
SAMPLE_SECONDS = 0.25
INFO_TIMEOUT = 2.0
WATCH_SECONDS = 10  # the pod watch is renewed by a LIST this often, which confirms the state


@dataclass
class InvariantWatch:
    """Background watcher of one deployment (``start``/``stop``); see the module notes.

    ``samples``: rounds checked (a CR read and every live leader asked); ``answers``: leader
    answers; ``pod_events``: pod list items and watch events read; ``faults``: the injected
    faults; ``violations``: what broke an invariant, in time order, times in seconds since
    :meth:`start`.
    """

    client: RestClient
    namespace: str
    name: str
    samples: int = 0
    answers: int = 0
    pod_events: int = 0
    faults: list[str] = field(default_factory=list)
    phases: dict[int, str] = field(default_factory=dict)  # each leader's weights phase, last answer
    errors: int = 0  # rounds or watches that failed to read (API or network hiccups)
    last_error: str = ""
    slowest_sample: float = 0.0  # seconds
    last_status: str = ""  # the CR's phase, rollout and groups at the last read (for messages)
    _t0: float = field(default_factory=time.time)
    _changes: dict[int, list[av.Change]] = field(default_factory=dict)
    _leaders: dict[int, dict] = field(default_factory=dict)  # group -> {uid, ip, deleting}
    _horizon: float = 0.0  # the last LIST that confirmed every group's pod state was sent then
    _answers: list[av.Answer] = field(default_factory=list)
    _budgets: list[av.Budget] = field(default_factory=list)
    _faults: list[tuple[float, int, str | None]] = field(default_factory=list)  # (at, group, uid)
    _claims: list[tuple[float, str]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(4))

    def start(self) -> InvariantWatch:
        self._t0 = time.time()
        for target, what in ((self._watch_pods, "pods"), (self._ask_leaders, "leaders")):
            thread = threading.Thread(target=target, daemon=True, name=f"invariants-{what}-{self.name}")
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        """Stop sampling; a last LIST confirms the pods' states up to now."""
        if self._stop.is_set():
            return
        self._stop.set()
        for thread in self._threads:
            thread.join(30)
        self._pool.shutdown(wait=False)
        try:
            self._list_pods()
        except Exception as exc:  # noqa: BLE001 (the watch's horizon stays where it was)
            self._error(exc)

    def fault(self, description: str, downs: tuple[int, ...] = ()) -> None:
        """Record an injected fault (call before injecting it); ``downs``: groups whose leader pod
        it takes down (allowed on top of ``maxUnavailable`` until a new leader pod is Ready)."""
        now = time.time()
        with self._lock:
            self.faults.append(description)
            self._faults += [(now, g, (self._leaders.get(g) or {}).get("uid")) for g in downs]

    def wait_loading(self, timeout: float, since: float | None = None,
                     over: Callable[[], bool] | None = None) -> int:
        """The first group whose leader answered ``loading`` in an answer sent at or after
        wall-clock ``since`` (default: now). An update that began and ended between two answers
        (a leader's ``last_weight_update`` differs between two answers sent since, none of them
        ``loading``; the first answer since is the reference, as the one before may predate the
        previous update's end) is noted, and the wait goes on for the next group's. Raises
        RuntimeError once ``over()`` is true (the rollout ended) with no load seen, TimeoutError
        past ``timeout`` seconds; both name what the watcher saw, the unseen updates and the
        CR's rollout status included."""
        since = time.time() if since is None else since
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                answers = [a for a in self._answers if a.sent >= since]
            loading = [a.group for a in answers if a.phase == "loading"]
            if loading:
                return loading[0]
            first: dict[str | None, str | None] = {}  # each leader's record in its first answer since
            for a in answers:
                first.setdefault(a.uid, a.last_update)
            unseen = sorted({a.group for a in answers if a.last_update != first[a.uid]})
            seen = f"updates ended unseen by any answer: groups {unseen}; {self._seen()}"
            if over is not None and over():
                raise RuntimeError(f"the rollout ended before any leader reported loading ({seen})")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no leader reported loading within {timeout:.0f} s ({seen})")
            time.sleep(0.05)

    def _seen(self) -> str:
        return (f"phases {self.phases}, {self.answers} answers, {self.samples} samples (slowest "
                f"{self.slowest_sample:.1f} s), {self.pod_events} pod events, leaders "
                f"{self._leaders}, {self.errors} read errors, last: {self.last_error or 'none'}; "
                f"last CR status: {self.last_status}")

    # ------------------------------------------------------------------ judging

    def availability_violations(self) -> list[av.Violation]:
        """The availability invariant judged over everything observed so far."""
        with self._lock:
            changes = [c for group in self._changes.values() for c in group]
            intervals = av.down_intervals(changes, list(self._answers), self._horizon)
            excuses = [av.Excuse(g, at, av.excuse_end(changes, g, at, uid)) for at, g, uid in self._faults]
            return av.violations(intervals, excuses, list(self._budgets), self._t0)

    def violations_since(self, since: float) -> list[str]:
        """Every violation at or after wall-clock time ``since``, in time order."""
        found = [(v.at, v.text) for v in self.availability_violations()]
        with self._lock:
            found += self._claims
        return [self._relative(text, at) for at, text in sorted(found) if at >= since]

    @property
    def violations(self) -> list[str]:
        return self.violations_since(0.0)

    def summary(self) -> str:
        return (f"{self.samples} samples ({self.answers} leader answers, {self.pod_events} pod "
                f"events; slowest round {self.slowest_sample:.1f} s, {self.errors} unreadable"
                f"{': ' + self.last_error if self.errors else ''}), {len(self.faults)} faults "
                f"({'; '.join(self.faults)})")

    def _relative(self, text: str, at: float) -> str:
        return f"+{at - self._t0:.2f} s: {text}"

    def _error(self, exc: Exception) -> None:
        self.errors += 1
        self.last_error = f"{type(exc).__name__}: {exc}"

    # ------------------------------------------------------------------ the leader pods

    @property
    def _pods_path(self) -> str:
        return f"/api/v1/namespaces/{self.namespace}/pods"

    @property
    def _selector(self) -> dict:
        return {"labelSelector": f"shardline.dev/deployment={self.name},apps.kubernetes.io/pod-index=0"}

    def _record_pod(self, pod: dict, received: float, gone: bool = False) -> None:
        group = (pod["metadata"].get("labels") or {}).get("shardline.dev/group", "")
        if not group.isdigit():
            return
        self._record(int(group), pod, received, gone)

    def _record(self, group: int, pod: dict | None, received: float, gone: bool) -> None:
        with self._lock:
            self.pod_events += 1
            history = self._changes.setdefault(group, [])
            change = av.pod_change(pod, group, received, history[-1] if history else None, gone)
            if change is not None:
                history.append(change)
            if pod is None or gone:
                self._leaders.pop(group, None)
            else:
                self._leaders[group] = {"uid": pod["metadata"].get("uid"),
                                        "ip": (pod.get("status") or {}).get("podIP"),
                                        "deleting": pod["metadata"].get("deletionTimestamp") is not None}

    def _list_pods(self) -> str:
        """LIST the leader pods, record each and the groups gone; the list's resourceVersion."""
        sent = time.time()
        listing = self.client.get(self._pods_path, params=self._selector) or {}
        received = time.time()
        seen = set()
        for pod in listing.get("items", []):
            self._record_pod(pod, received)
            seen.add((pod["metadata"].get("labels") or {}).get("shardline.dev/group", ""))
        for group in [g for g in list(self._changes) if str(g) not in seen]:
            self._record(group, None, received, True)
        with self._lock:
            self._horizon = sent
        return (listing.get("metadata") or {}).get("resourceVersion", "")

    def _watch_pods(self) -> None:
        while not self._stop.is_set():
            try:
                rv = self._list_pods()
                for event in self.client.watch(self._pods_path, rv, timeout_seconds=WATCH_SECONDS,
                                               params=self._selector):
                    if self._stop.is_set():
                        return
                    if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                        self._record_pod(event["object"], time.time(), gone=event["type"] == "DELETED")
                    elif event["type"] == "ERROR":
                        break  # 410 Gone: relist
            except Exception as exc:  # noqa: BLE001 (a dropped watch: relist)
                self._error(exc)
                time.sleep(0.5)

    # ------------------------------------------------------------------ the leaders and the CR

    def _info(self, group: int, leader: dict) -> av.Answer | None:
        sent = time.time()
        try:
            info = httpx.get(f"http://{leader['ip']}:8000/get_server_info", timeout=INFO_TIMEOUT).json()
        except (httpx.HTTPError, ValueError):
            return None
        return av.Answer(group, leader["uid"], sent, time.time(), info.get("weights_phase") or "",
                         info.get("weights_revision"), info.get("weights_digest"),
                         json.dumps(info.get("last_weight_update"), sort_keys=True))

    def _ask_leaders(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self._round()
            except Exception as exc:  # noqa: BLE001 (an API hiccup is not a violation; retry)
                self._error(exc)
            self.slowest_sample = max(self.slowest_sample, time.monotonic() - started)
            time.sleep(SAMPLE_SECONDS)

    def _round(self) -> None:
        """Read the CR, then ask every live leader (one request each, in parallel), then check
        the status the CR showed against the answers."""
        read_at = time.time()
        obj = self.client.get(f"/apis/{GROUP}/{VERSION}/namespaces/{self.namespace}/{PLURAL}/{self.name}")
        if obj is None:
            return
        spec, status = obj.get("spec") or {}, obj.get("status") or {}
        self.last_status = json.dumps(
            {"generation": (obj.get("metadata") or {}).get("generation"),
             "observedGeneration": status.get("observedGeneration"), "phase": status.get("phase"),
             "rollout": status.get("rollout"),
             "groups": [{k: g.get(k) for k in ("index", "phase", "revision", "message")}
                        for g in status.get("groups") or []]}, sort_keys=True)
        with self._lock:
            self._budgets.append(av.Budget(read_at, int(spec.get("replicas", 0)),
                                           int((spec.get("weightUpdate") or {}).get("maxUnavailable", 1))))
            leaders = {g: dict(leader) for g, leader in self._leaders.items()
                       if leader["ip"] and not leader["deleting"]}
        futures = [self._pool.submit(self._info, g, leader) for g, leader in leaders.items()]
        answers = [a for a in (f.result() for f in futures) if a is not None]
        with self._lock:
            self._answers += answers
            self.answers += len(answers)
            self.phases.update({a.group: a.phase for a in answers})
            self.samples += 1
            for item in (obj.get("status") or {}).get("groups") or []:
                self._check_claim(item, read_at)

    def _check_claim(self, item: dict, read_at: float) -> None:
        group, revision, digest = item.get("index"), item.get("revision"), item.get("weightsDigest")
        if item.get("phase") != "Ready" or not revision:
            return
        recent = [a for a in self._answers if a.group == group and a.phase == "serving"
                  and a.received >= read_at - LAG_SECONDS]
        if not recent:
            return  # the leader could not be asked lately: nothing to compare with
        if not any(a.revision == revision and (not digest or not a.digest or a.digest == digest)
                   for a in recent):
            last = recent[-1]
            self._claims.append((read_at, f"status shows group {group} Ready on {revision} "
                                 f"({(digest or '')[:19]}), its leader serves {last.revision} "
                                 f"({(last.digest or '')[:19]})"))
