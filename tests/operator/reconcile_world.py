"""An in-memory world for tests that run whole ``reconcile()`` passes: a :class:`FakeKube`, one
``InferenceDeployment`` body whose status each pass writes back, a clock that ticks a second a
pass, and :class:`LiveLeaders`, leaders simulated per URL (what each serves, its digest, an
update in flight), so the reconciler's gather -> plan -> execute loop runs whole rollouts."""

from __future__ import annotations

import copy
from typing import Any

from fake_kube import FakeKube
from fake_leaders import with_weights_block

from shardline_operator.reconcile import Context, ReconcileResult, reconcile

REV_A = "/var/lib/shardline/models/tiny-llama/rev-a"
REV_B = "/var/lib/shardline/models/tiny-llama/rev-b"


class LiveLeaders:
    """Each leader URL serves a model; an update stays ``loading`` until the test finishes it."""

    def __init__(self, path=REV_A, revision="rev-a"):
        self.default = (path, revision)
        self.serving: dict[str, tuple[str, str]] = {}
        self.digests: dict[str, str] = {}
        self.flights: dict[str, dict] = {}  # key -> {url, body, state}
        self.sent: list[tuple[str, str]] = []

    def start_update(self, key, url, body, timeout_seconds):
        self.sent.append((key, body["revision"]))
        self.flights[key] = {"url": url, "body": dict(body), "state": "pending"}

    def abort_update(self, key, url):
        """The runtime stops an update still loading (it keeps what it served)."""
        flight = self.flights.get(key)
        if flight is not None and flight["state"] == "pending":
            flight["state"] = "aborted"

    def finish(self, key, ok=True):
        flight = self.flights[key]
        flight["state"] = "success" if ok else "failure"
        if ok:
            self.serving[flight["url"]] = (flight["body"]["model_path"], flight["body"]["revision"])
            self.digests.pop(flight["url"], None)

    def poll(self, key):
        flight = self.flights.get(key)
        if flight is None:
            return "unknown", ""
        if flight["state"] != "pending":
            del self.flights[key]
        return flight["state"], ""

    def server_info(self, url):
        path, revision = self.serving.get(url, self.default)
        loading = any(f["url"] == url and f["state"] == "pending" for f in self.flights.values())
        return with_weights_block(
            {
                "weights_phase": "loading" if loading else "serving",
                "model_path": path,
                "weights_revision": revision,
                "weights_digest": self.digests.get(url, f"sha256:{revision}"),
            }
        )

    def observed_phases(self, key):
        return []

    def update_seconds(self, key):  # what a CPU runtime's reply carries (no graphs to recapture)
        return {"load_seconds": 0.25, "recapture_seconds": 0.0}

    def verify(self, url, verify):
        return True, "ok"


class Passes:
    """Passes of ``reconcile()`` over one ``InferenceDeployment`` named ``llama`` in
    ``default`` with ``spec``, read from ``kube`` and ``leaders``. ``written`` holds what each
    pass handed to ``on_status_written``: ``(phase, restart budget)``."""

    def __init__(self, spec: dict[str, Any], leaders: Any, now: float = 1_800_000_000.0) -> None:
        self.kube, self.leaders, self.now = FakeKube(), leaders, now
        self.ctx = Context(kube=self.kube, leaders=leaders, clock=lambda: self.now)
        self.body: dict[str, Any] = {
            "apiVersion": "shardline.dev/v1alpha1",
            "kind": "InferenceDeployment",
            "metadata": {"name": "llama", "namespace": "default", "uid": "cr-uid", "generation": 1},
            "spec": spec,
            "status": {},
        }
        self.written: list[tuple[str, int]] = []

    def run(self, **changes: Any) -> ReconcileResult:
        """One pass a second after the last; ``changes`` replace top-level spec fields (a new
        generation). The returned status becomes the body's."""
        self.now += 1
        if changes:
            self.body["spec"].update(changes)
            self.body["metadata"]["generation"] += 1
        result = reconcile(self.ctx, copy.deepcopy(self.body), self._status_written)
        self.body["status"] = result.status
        return result

    def _status_written(self, status: dict[str, Any], restart_budget: int) -> None:
        self.written.append((status.get("phase", ""), restart_budget))


def ready_world(spec: dict[str, Any], leaders: Any) -> Passes:
    """:class:`Passes` whose StatefulSets ran their pods and whose deployment is ``Ready``."""
    passes = Passes(spec, leaders)
    passes.run()
    passes.kube.run_statefulsets()
    assert passes.run().status["phase"] == "Ready"
    return passes
