"""Issue 30 through ``reconcile()``: a ``draftModel`` change rolls through the fleet in place.

Leaders are simulated per URL (target, revision and draft they serve) so the reconciler's
gather -> plan -> execute loop runs the whole rollout against an in-memory API: every group
gets one update carrying the new draft, no pod is replaced, each StatefulSet ends up naming the
new draft, and the rollout completes (the new draft is no mixed version).
"""

from __future__ import annotations

import pytest
from reconcile_world import REV_A, LiveLeaders, ready_world

DRAFT_A, DRAFT_B = "/var/lib/shardline/models/draft/a", "/var/lib/shardline/models/draft/b"


class DraftLeaders(LiveLeaders):
    """:class:`LiveLeaders` whose leaders also serve a draft, changed by an update carrying
    ``draft_model_path``."""

    def __init__(self):
        super().__init__()
        self.drafts: dict[str, str] = {}
        self.bodies: list[dict] = []

    def start_update(self, key, url, body, timeout_seconds):
        self.bodies.append(dict(body))
        super().start_update(key, url, body, timeout_seconds)

    def finish(self, key, ok=True):
        flight = self.flights[key]
        if ok and "draft_model_path" in flight["body"]:
            self.drafts[flight["url"]] = flight["body"]["draft_model_path"]
        super().finish(key, ok)

    def server_info(self, url):
        info = super().server_info(url)
        info["weights"]["draft_model_path"] = self.drafts.get(url, DRAFT_A)
        info["weights"]["draft_digest"] = "sha256:" + self.drafts.get(url, DRAFT_A)[-1]
        return info


def _speculative(draft):
    return {"algorithm": "STANDALONE", "numDraftTokens": 4, "draftModel": {"path": draft}}


@pytest.fixture
def world(spec_dict):
    spec_dict["runtime"]["speculative"] = _speculative(DRAFT_A)
    passes = ready_world(spec_dict, DraftLeaders())

    def run(speculative=None):
        if speculative is None:
            return passes.run()
        return passes.run(runtime=dict(passes.body["spec"]["runtime"], speculative=speculative))

    return passes.kube, passes.leaders, run


def _draft_args(kube):
    out = []
    for g in (0, 1):
        sts = kube.get("apps/v1", "StatefulSet", "default", f"llama-g{g}")
        args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
        out.append(args[args.index("--speculative-draft-model-path") + 1])
    return out


def _roll(leaders, run):
    """Finish each update as it is sent until the rollout completes; returns its events."""
    events = []
    for _ in range(20):
        result = run()
        events += [e[1] for e in result.events]
        for key in [k for k, f in leaders.flights.items() if f["state"] == "pending"]:
            leaders.finish(key)
        if "RolloutComplete" in events:
            return events, result
    raise AssertionError(f"no RolloutComplete: {events}")


def test_a_draft_change_rolls_through_every_group_in_place(world):
    kube, leaders, run = world
    uids = sorted(p["metadata"]["uid"] for p in kube.pods().values())
    first = run(_speculative(DRAFT_B))
    assert first.status["rollout"]["targetDraftModel"] == DRAFT_B
    events, _ = _roll(leaders, run)
    assert [b["draft_model_path"] for b in leaders.bodies] == [DRAFT_B, DRAFT_B]
    assert {b["model_path"] for b in leaders.bodies} == {REV_A}
    assert sorted(p["metadata"]["uid"] for p in kube.pods().values()) == uids, "no pod was replaced"
    assert "GroupRestart" not in events and "RepairingMixedVersion" not in events
    assert _draft_args(kube) == [DRAFT_B, DRAFT_B]
    settled = run()
    assert settled.status["phase"] == "Ready"
    assert [g["draftModel"] for g in settled.status["groups"]] == [DRAFT_B, DRAFT_B]
    assert len(leaders.bodies) == 2, "nothing more was sent"


def test_a_draft_token_count_change_restarts_the_groups(world):
    kube, leaders, run = world
    result = run({**_speculative(DRAFT_A), "numDraftTokens": 6})
    assert "GroupRestart" in [e[1] for e in result.events]
    assert leaders.bodies == []
