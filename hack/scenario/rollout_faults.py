"""In-place rollouts with a fault injected while a group loads (issue 23 item 6).

Each scenario starts from a fleet Ready on ``current`` (two groups, TP=1,
``rollout_fleet.two_group_doc``), patches ``spec.model`` to the other revision, waits until a
leader reports ``loading``, injects its fault, and waits for the fleet to be Ready on the last
target; an :class:`~hack.scenario.invariant_watch.InvariantWatch` checks the invariants at
every sample meanwhile and a readiness-aware client (``traffic.Traffic``) runs throughout.
Shared by ``tests/e2e/test_rollout_faults.py`` (CI's pick), ``test_rollout_faults_chaos.py``
and ``bench/rollout_faults.py`` (every scenario).
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from hack.scenario.invariant_watch import InvariantWatch
from hack.scenario.large_model import large_revisions
from hack.scenario.operator_install import OPERATOR_NAMESPACE, install_operator
from hack.scenario.rollout_fleet import (
    apply,
    diagnostics,
    leader_server_infos,
    patch,
    two_group_doc,
    wait_ready,
)
from hack.scenario.status_watch import StatusWatcher
from hack.scenario.traffic import Traffic

LOAD_WAIT = 300  # seconds for a leader to start loading after the patch (busy machine)
HOLD_SECONDS = 600  # a request may be held by an update this long: an 810 MB load took over 60 s
# (the runtime's default hold) on the 2-core machine shared by 9 sessions; held, never refused


def fault_fleet_doc(namespace: str, name: str, model_path: str, startup_timeout: int = 900) -> dict:
    """``two_group_doc`` on rev-a whose runtime holds requests up to :data:`HOLD_SECONDS`."""
    doc = two_group_doc(namespace, name, model_path, "rev-a", startup_timeout=startup_timeout)
    runtime = doc["spec"]["runtime"]
    runtime["args"] = [*runtime.get("args", []), "--weight-update-hold-timeout", str(HOLD_SECONDS)]
    return doc


@dataclass
class Fleet:
    """A running two-group deployment: ``revisions`` maps revision labels to model paths."""

    cluster: object
    namespace: str
    name: str
    watch: StatusWatcher
    invariants: InvariantWatch
    revisions: dict[str, str]
    timeout: float = 900

    def model(self, revision: str) -> dict:
        return {"model": {"path": self.revisions[revision], "revision": revision}}

    def delete_leader(self, group: int) -> None:
        self.cluster.kubectl("delete", "pod", f"{self.name}-g{group}-0", "-n", self.namespace, "--wait=false")

    def kill_operator(self) -> None:
        self.cluster.kubectl("delete", "pod", "-n", OPERATOR_NAMESPACE, "-l", "app.kubernetes.io/component=operator",
                             "--grace-period=0", "--force", "--wait=false")

    def scale(self, replicas: int) -> None:
        patch(self.cluster, self.namespace, self.name, {"replicas": replicas})


def _revert(fleet: Fleet, current: str, other: str, loading: int) -> str:
    fleet.invariants.fault(f"revert to {current} while group {loading} loads {other}")
    patch(fleet.cluster, fleet.namespace, fleet.name, fleet.model(current))
    return current


def _delete_updating_leader(fleet: Fleet, current: str, other: str, loading: int) -> str:
    fleet.invariants.fault(f"deleted the leader of updating group {loading}", downs=(loading,))
    fleet.delete_leader(loading)
    return other


def _delete_other_leader(fleet: Fleet, current: str, other: str, loading: int) -> str:
    group = 1 - loading
    fleet.invariants.fault(f"deleted the leader of group {group} while group {loading} loads", downs=(group,))
    fleet.delete_leader(group)
    return other


def _kill_operator(fleet: Fleet, current: str, other: str, loading: int) -> str:
    fleet.invariants.fault(f"killed the operator while group {loading} loads")
    fleet.kill_operator()
    return other


def _second_target(fleet: Fleet, current: str, other: str, loading: int) -> str:
    third = f"{current}-again"  # current's weights under a new label: a target neither serves
    fleet.revisions.setdefault(third, fleet.revisions[current])
    fleet.invariants.fault(f"second target {third} while group {loading} loads {other}")
    patch(fleet.cluster, fleet.namespace, fleet.name, fleet.model(third))
    return third


def _scale_down_and_up(fleet: Fleet, current: str, other: str, loading: int) -> str:
    fleet.invariants.fault(f"scaled to 1 and back to 2 while group {loading} loads", downs=(1,))
    fleet.scale(1)
    fleet.watch.wait(lambda s: s.replicas == 1 and s.observed_generation == s.generation, fleet.timeout,
                     "replicas 1 observed")
    fleet.scale(2)
    return other


SCENARIOS: dict[str, Callable[[Fleet, str, str, int], str]] = {
    "revert": _revert,
    "delete-updating-leader": _delete_updating_leader,
    "delete-other-leader": _delete_other_leader,
    "kill-operator": _kill_operator,
    "second-target": _second_target,
    "scale-down-and-up": _scale_down_and_up,
}


def _ready_on(watch: StatusWatcher, revision: str, since: int) -> bool:
    """A status since mark ``since`` shows the rollout to ``revision`` done (the patch observed)."""
    return any(s.phase == "Ready" and s.served_revision == revision and s.ready_replicas == s.replicas
               and s.observed_generation == s.generation for s in watch.history[since:])


def run_scenario(fleet: Fleet, scenario: str, current: str, other: str) -> str:
    """Patch ``current`` -> ``other``, inject ``scenario``'s fault once a group loads, wait until
    the fleet is Ready on the last target; returns that target's revision label."""
    mark, since = fleet.watch.mark(), time.time()
    patch(fleet.cluster, fleet.namespace, fleet.name, fleet.model(other))
    loading = fleet.invariants.wait_loading(LOAD_WAIT, since, over=lambda: _ready_on(fleet.watch, other, mark))
    final = SCENARIOS[scenario](fleet, current, other, loading)
    wait_ready(fleet.watch, final, mark, fleet.timeout)
    return final


@contextmanager
def fault_suite(cluster, scenarios: list[tuple[str, str, str]], name: str = "faults",
                timeout: float = 900) -> Iterator[dict]:
    """Run ``scenarios`` (``(scenario, current, other)``, in order, each starting where the last
    ended) on one fault fleet under one client; yields what they left behind: ``invariants``,
    ``traffic``, ``finals`` (each scenario's last target), ``infos`` (each leader's
    ``/get_server_info``) and ``diagnostics``. The namespace is deleted on exit. Where pods
    may land on other nodes, wrap it in ``tests.kube_fixtures.agent_nodes_only``. Shared by
    ``tests/e2e/test_rollout_faults*.py``."""
    revisions = {k: str(v) for k, v in large_revisions().items()}
    install_operator(cluster)
    ns = f"e2e-{name}-{uuid.uuid4().hex[:6]}"
    doc = fault_fleet_doc(ns, name, revisions["rev-a"], int(timeout))
    watch = apply(cluster, doc)
    invariants = InvariantWatch(cluster.client(), ns, name)
    try:
        wait_ready(watch, "rev-a", 0, timeout)
        fleet = Fleet(cluster, ns, name, watch, invariants.start(), revisions, timeout)
        finals = []
        with Traffic(cluster.client(), ns, name, doc["spec"]["model"]["name"], timeout=HOLD_SECONDS) as traffic:
            for scenario, current, other in scenarios:
                finals.append(run_scenario(fleet, scenario, current, other))
        invariants.stop()
        print(f"fault suite: {invariants.summary()}, {traffic.sent} requests, "
              f"{traffic.reconnects} sent again after a refused connection")
        yield {"invariants": invariants, "traffic": traffic, "finals": finals,
               "infos": leader_server_infos(cluster.client(), ns, name),
               "diagnostics": diagnostics(cluster, watch)}
    finally:
        invariants.stop()
        watch.stop()
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
