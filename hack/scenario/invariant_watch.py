"""Sample an InferenceDeployment's status and every group leader's ``/get_server_info`` during a
rollout, and check the rollout invariants at every sample (issue 23 item 6).

Each sample reads the CR, the leader pods (pod index 0: Ready, terminating, IP) and each live
leader's weights block, then checks:

- **availability**: at most ``weightUpdate.maxUnavailable`` groups below ``replicas`` are
  unavailable (a leader that is not Ready in either of the sample's two pod reads, one before
  and one after the leaders are asked, is terminating, or reports a phase other than ``serving``; a Ready leader whose ``/get_server_info`` does not answer in time is judged by its
  readiness), plus one per group a fault took down whose leader pod has not been replaced and
  available since (:meth:`InvariantWatch.fault`): the planner must never add its own
  unavailability to a fault's;
- **status follows the runtime**: a group that status shows ``Ready`` with a ``revision`` (and a
  ``weightsDigest``) names what its leader served at some read from :data:`LAG_SECONDS` before
  the status was read on (status is written after the leaders are asked, so it may lag them by a
  pass, never lead them; each sample reads the CR before the leaders, so no answer compared is
  older than the status).

Violations are kept with the sample that showed them; ``samples`` counts the samples checked.
Shared by ``tests/e2e/test_rollout_faults.py`` and ``bench/rollout_faults.py``.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx

from hack.scenario.status_watch import GROUP, PLURAL, VERSION

LAG_SECONDS = 3.0  # a pass runs every 0.5 s in a rollout; status written from leaders asked before
SAMPLE_SECONDS = 0.25
INFO_TIMEOUT = 2.0


@dataclass
class Served:
    at: float
    revision: str | None
    digest: str | None


@dataclass
class InvariantWatch:
    """Background sampler of one deployment (``start``/``stop``); see the module notes."""

    client: object
    namespace: str
    name: str
    samples: int = 0
    violations: list[str] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)
    max_unavailable_seen: int = 0
    phases: dict[int, str] = field(default_factory=dict)  # each leader's weights phase, last sample
    errors: int = 0  # samples that failed to read (API or network hiccups)
    last_error: str = ""
    slowest_sample: float = 0.0  # seconds
    _down: dict[int, str | None] = field(default_factory=dict)  # group -> leader uid a fault took down
    _served: dict[int, list[Served]] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(4))

    def start(self) -> InvariantWatch:
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"invariants-{self.name}")
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        self._pool.shutdown(wait=False)

    def fault(self, description: str, downs: tuple[int, ...] = ()) -> None:
        """Record an injected fault (call before injecting it); ``downs``: groups whose leader pod
        it takes down (allowed on top of ``maxUnavailable`` until a new leader pod is available)."""
        leaders = self._leaders() if downs else {}
        with self._lock:
            self.faults.append(description)
            self._down.update({g: (leaders.get(g) or {}).get("uid") for g in downs})

    def wait_loading(self, timeout: float) -> int:
        """The first group whose leader reports ``loading`` (raises TimeoutError)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            loading = [g for g, phase in self.phases.items() if phase == "loading"]
            if loading:
                return loading[0]
            time.sleep(0.05)
        raise TimeoutError(f"no leader reported loading within {timeout:.0f} s")

    # ------------------------------------------------------------------ sampling

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self._sample()
            except Exception as exc:  # noqa: BLE001 (an API hiccup is not a violation; retry)
                self.errors += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
            self.slowest_sample = max(self.slowest_sample, time.monotonic() - started)
            time.sleep(SAMPLE_SECONDS)

    def summary(self) -> str:
        return (f"{self.samples} samples (slowest {self.slowest_sample:.1f} s, {self.errors} unreadable"
                f"{': ' + self.last_error if self.errors else ''}), {len(self.faults)} faults "
                f"({'; '.join(self.faults)}), max unavailable groups seen {self.max_unavailable_seen}")

    def _leaders(self) -> dict[int, dict]:
        pods = self.client.get(f"/api/v1/namespaces/{self.namespace}/pods", params={
            "labelSelector": f"shardline.dev/deployment={self.name},apps.kubernetes.io/pod-index=0"})
        out = {}
        for pod in (pods or {}).get("items", []):
            group = (pod["metadata"].get("labels") or {}).get("shardline.dev/group", "")
            if not group.isdigit():
                continue
            conditions = {c["type"]: c["status"] for c in pod.get("status", {}).get("conditions") or []}
            deleting = pod["metadata"].get("deletionTimestamp") is not None
            out[int(group)] = {"ready": conditions.get("Ready") == "True" and not deleting,
                               "deleting": deleting, "ip": pod.get("status", {}).get("podIP"),
                               "uid": pod["metadata"].get("uid")}
        return out

    def _info(self, ip: str | None) -> tuple[float, dict | None]:
        """``(when the read started, /get_server_info or None)``."""
        started = time.monotonic()
        if not ip:
            return started, None
        try:
            return started, httpx.get(f"http://{ip}:8000/get_server_info", timeout=INFO_TIMEOUT).json()
        except (httpx.HTTPError, ValueError):
            return started, None

    def _sample(self) -> None:
        # The CR first, then the leaders: what a leader answers is never older than the status it
        # is compared with (read side by side, a slow CR read could return a status written after
        # a leader's answer, and a truthful status would look ahead of its leader).
        obj = self.client.get(f"/apis/{GROUP}/{VERSION}/namespaces/{self.namespace}/{PLURAL}/{self.name}")
        if obj is None:
            return
        now = time.monotonic()  # the status read is at most this recent
        leaders = self._leaders()
        infos = {g: self._pool.submit(self._info, None if leader["deleting"] else leader["ip"])
                 for g, leader in leaders.items()}
        spec = obj.get("spec") or {}
        replicas = int(spec.get("replicas", 0))
        budget = int((spec.get("weightUpdate") or {}).get("maxUnavailable", 1))
        answers = {group: future.result() for group, future in infos.items()}
        # The reads of one sample are not simultaneous: the pod list comes before the leaders'
        # answers, which can take seconds under load. A group that turned Ready in between (and
        # let the planner start the next wave, which its answer then shows loading) would look
        # unavailable at the same moment as that next group. So the pods are read again after
        # the answers, and a leader Ready in either list and serving (or silent) in its answer
        # counts as available: a violation is reported only when no read shows the group up.
        again = self._leaders()
        available = set()
        for group, leader in leaders.items():
            asked, info = answers[group]
            phase = (info or {}).get("weights_phase")
            self.phases[group] = phase or ""
            if phase == "serving":
                self._served.setdefault(group, []).append(
                    Served(asked, info.get("weights_revision"), info.get("weights_digest")))
            later = again.get(group)
            ready = leader["ready"] or bool(later and later["uid"] == leader["uid"] and later["ready"])
            if ready and phase in ("serving", None):  # None: no answer in time
                available.add(group)
        with self._lock:
            for group in available:
                if group in self._down and leaders[group]["uid"] != self._down[group]:
                    del self._down[group]  # a new leader pod serves: the fault is over
            unavailable = [g for g in range(replicas) if g not in available]
            allowed = budget + len(set(self._down) & set(unavailable))
            self.samples += 1
            self.max_unavailable_seen = max(self.max_unavailable_seen, len(unavailable))
            if len(unavailable) > allowed:
                self.violations.append(
                    f"sample {self.samples}: groups {unavailable} unavailable, allowed {allowed} "
                    f"(maxUnavailable {budget}, faults down {sorted(self._down)})")
            for item in (obj.get("status") or {}).get("groups") or []:
                self._check_claim(item, now)

    def _check_claim(self, item: dict, now: float) -> None:
        group, revision, digest = item.get("index"), item.get("revision"), item.get("weightsDigest")
        if item.get("phase") != "Ready" or not revision:
            return
        recent = [s for s in self._served.get(group, []) if now - s.at <= LAG_SECONDS]
        if not recent:
            return  # the leader could not be asked lately: nothing to compare with
        if not any(s.revision == revision and (not digest or not s.digest or s.digest == digest)
                   for s in recent):
            last = recent[-1]
            self.violations.append(
                f"sample {self.samples}: status shows group {group} Ready on {revision} "
                f"({(digest or '')[:19]}), its leader serves {last.revision} ({(last.digest or '')[:19]})")
