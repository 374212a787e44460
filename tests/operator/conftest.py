"""Fixtures for operator tests: a valid spec dict and its parsed form."""

from __future__ import annotations

import copy

import pytest

from shardline_operator.spec import parse_spec

BASE_SPEC = {
    "replicas": 2,
    "model": {
        "name": "tiny-llama",
        "path": "/var/lib/shardline/models/tiny-llama/rev-a",
        "revision": "rev-a",
        "volume": {"hostPath": {"path": "/var/lib/shardline/models", "type": "DirectoryOrCreate"}},
    },
    "parallelism": {"tensor": 2, "gpusPerPod": 1},
    "runtime": {"image": "ghcr.io/shardline/shardline-runtime:0.1.0", "resources": {"limits": {"cpu": "2"}}},
}


@pytest.fixture
def spec_dict():
    """A fresh copy of a valid ``spec`` (2 groups of TP=2 over two pods)."""
    return copy.deepcopy(BASE_SPEC)


def _make_spec(overrides=None, name="llama", namespace="default"):
    raw = copy.deepcopy(BASE_SPEC)
    raw.update(copy.deepcopy(overrides or {}))
    return parse_spec(name, namespace, "0000-uid", raw)


@pytest.fixture
def make_spec():
    """``make_spec(overrides=None, name="llama", namespace="default")``: parse ``BASE_SPEC``
    updated (shallow, per top-level key) with ``overrides``."""
    return _make_spec


def _pod(group, rank, uid=None, ready=True, restarts=0, terminated_message=None, deleting=False, ip=None,
         phase="Running", name="llama", routable="true"):
    container = {"name": "runtime", "restartCount": restarts, "state": {"running": {}}}
    if terminated_message is not None:
        container["state"] = {"terminated": {"exitCode": 1, "message": terminated_message}}
    # routable from the start, as the pod template renders it (routing.py takes it out)
    meta = {"name": f"{name}-g{group}-{rank}", "uid": uid or f"uid-{group}-{rank}",
            "labels": {"shardline.dev/group": str(group), "apps.kubernetes.io/pod-index": str(rank),
                       "shardline.dev/routable": routable}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "status": {
        "phase": phase, "podIP": ip or f"127.0.{group}.{rank + 1}",
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        "containerStatuses": [container]}}


@pytest.fixture
def make_pod():
    """``make_pod(group, rank, uid=None, ready=True, restarts=0, terminated_message=None, deleting=False, ...,
    routable="true")`` -> a v1.Pod dict as the API returns it."""
    return _pod


@pytest.fixture(autouse=True)
def _no_gateway_settle(monkeypatch):
    """Passes run against the fake API server here do not wait the real second a leaving leader
    gives label-watching gateways (``routing_execute.GATEWAY_SETTLE_SECONDS``); the tests of
    that wait in test_routing.py set it back."""
    monkeypatch.setattr("shardline_operator.routing_execute.GATEWAY_SETTLE_SECONDS", 0.0)
