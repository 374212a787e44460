"""Record every status an InferenceDeployment goes through (a watch sees each write, so
short phases such as RecapturingGraphs are not missed by polling)."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from hack.localcluster.rest import RestClient

GROUP, VERSION, PLURAL = "shardline.dev", "v1alpha1", "inferencedeployments"


@dataclass(frozen=True)
class Snapshot:
    """One observed status: phase, revisions, readiness and condition statuses."""

    at: float
    phase: str
    served_revision: str
    target_revision: str
    ready_replicas: int
    replicas: int
    conditions: dict[str, tuple[str, str, str]]  # type -> (status, reason, message)
    observed_generation: int
    generation: int
    lora_adapters: tuple = ()  # status.loraAdapters entries

    def line(self) -> str:
        conds = ", ".join(f"{k}={v[0]}" for k, v in sorted(self.conditions.items()))
        return (f"phase={self.phase or '-'} served={self.served_revision or '-'} "
                f"target={self.target_revision or '-'} ready={self.ready_replicas}/"
                f"{self.replicas} [{conds}]")


def snapshot(obj: dict) -> Snapshot:
    st = obj.get("status") or {}
    conds = {c["type"]: (c.get("status", ""), c.get("reason", ""), c.get("message", ""))
             for c in st.get("conditions") or []}
    return Snapshot(time.monotonic(), st.get("phase", ""), st.get("servedRevision", ""),
                    st.get("targetRevision", ""), int(st.get("readyReplicas") or 0),
                    int(obj.get("spec", {}).get("replicas", 0)), conds,
                    int(st.get("observedGeneration") or 0),
                    int(obj["metadata"].get("generation") or 0), tuple(st.get("loraAdapters") or ()))


@dataclass
class StatusWatcher:
    """Background watch of one CR. ``history`` holds every distinct status seen."""

    client: RestClient
    namespace: str
    name: str
    on_change: Callable[[Snapshot], None] | None = None
    history: list[Snapshot] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _cond: threading.Condition = field(default_factory=threading.Condition)

    @property
    def path(self) -> str:
        return f"/apis/{GROUP}/{VERSION}/namespaces/{self.namespace}/{PLURAL}"

    def start(self) -> StatusWatcher:
        threading.Thread(target=self._run, daemon=True, name=f"watch-{self.name}").start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _record(self, obj: dict) -> None:
        snap = snapshot(obj)
        with self._cond:
            last = self.history[-1] if self.history else None
            if last and (last.line(), last.observed_generation) == (snap.line(),
                                                                   snap.observed_generation):
                return
            if self.on_change:  # before waiters wake, so output stays in order
                self.on_change(snap)
            self.history.append(snap)
            self._cond.notify_all()

    def _run(self) -> None:
        selector = {"fieldSelector": f"metadata.name={self.name}"}
        while not self._stop.is_set():
            try:
                listing = self.client.get(self.path, params=selector)
                for item in listing["items"]:
                    self._record(item)
                rv = listing["metadata"]["resourceVersion"]
                for ev in self.client.watch(self.path, rv, timeout_seconds=30, params=selector):
                    if self._stop.is_set():
                        return
                    if ev["type"] in ("ADDED", "MODIFIED"):
                        self._record(ev["object"])
            except Exception:  # relist after 410 Gone or a dropped connection
                time.sleep(0.5)

    def mark(self) -> int:
        """Index to pass to ``wait``/``phases_since`` to look only at later statuses."""
        with self._cond:
            return len(self.history)

    def wait(self, predicate: Callable[[Snapshot], bool], timeout: float, what: str,
             since: int = 0) -> Snapshot:
        """Block until a status at index >= ``since`` satisfies ``predicate``.

        Raises TimeoutError naming ``what`` and the last status seen.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for snap in self.history[since:]:
                    if predicate(snap):
                        return snap
                left = deadline - time.monotonic()
                if left <= 0:
                    last = self.history[-1].line() if self.history else "no status yet"
                    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}; "
                                       f"last status: {last}")
                self._cond.wait(min(left, 1.0))

    def phases_since(self, since: int = 0) -> list[str]:
        """Distinct consecutive phases seen from index ``since``."""
        out: list[str] = []
        with self._cond:
            for snap in self.history[since:]:
                if not out or out[-1] != snap.phase:
                    out.append(snap.phase)
        return out
