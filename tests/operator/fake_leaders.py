"""A scripted ``LeaderClient`` for reconcile tests: records requests; results and info set by the test."""

from __future__ import annotations


def with_weights_block(info):
    """``info`` (flat ``/get_server_info`` keys) with the runtime's ``weights`` block added."""
    if not info or "weights" in info:
        return info
    block = {"model_path": info.get("model_path"), "revision": info.get("weights_revision"),
             "weight_version": info.get("weight_version", "default"), "phase": info.get("weights_phase", "serving"),
             "digest": info.get("weights_digest"), "last_update": None}
    return {**info, "weights": block}


class FakeLeaders:
    """``results[key]``: what ``poll`` answers; ``info[url]``: ``/get_server_info``; ``gate``: the
    canary verification's answer; ``phases[key]``: sampled weights phases; ``seconds[key]``: the
    ``load_seconds`` / ``recapture_seconds`` the runtime's reply carried."""

    def __init__(self):
        self.sent: list[tuple[str, str, dict]] = []
        self.results: dict[str, tuple[str, str]] = {}
        self.info: dict[str, dict] = {}
        self.phases: dict[str, list[str]] = {}
        self.seconds: dict[str, dict[str, float]] = {}
        self.gate: tuple[bool, str] = (True, "ok")
        self.verified: list[str] = []
        self.aborted: list[tuple[str, str]] = []  # (key, url) of each abort sent

    def start_update(self, key, url, body, timeout_seconds):
        self.sent.append((key, url, dict(body)))
        self.results[key] = ("pending", "")

    def abort_update(self, key, url):
        self.aborted.append((key, url))

    def poll(self, key):
        return self.results.get(key, ("unknown", ""))

    def server_info(self, url):
        """``info[url]`` as the runtime serves it: the flat keys the test set, plus the
        ``weights`` block built from them (``WeightsState.model_dump(mode="json")``'s shape)."""
        return with_weights_block(self.info.get(url))

    def observed_phases(self, key):
        return self.phases.pop(key, [])

    def update_seconds(self, key):
        return dict(self.seconds.get(key, {}))

    def verify(self, url, verify):
        self.verified.append(url)
        return self.gate
