"""The checks both fault-suite files make (``test_rollout_faults.py`` in CI,
``test_rollout_faults_chaos.py`` in ``make test-chaos``): subclass :class:`FaultSuiteChecks`
with ``SCENARIOS`` (``(scenario, current, other)`` in order, see
``hack.scenario.rollout_faults.fault_suite``), ``FINALS`` (each scenario's last target) and
``NAME`` (the fleet's name)."""
from __future__ import annotations

import pytest

from hack.scenario.rollout_faults import fault_suite
from tests.kube_fixtures import agent_nodes_only


class FaultSuiteChecks:
    SCENARIOS: list[tuple[str, str, str]] = []
    FINALS: list[str] = []
    NAME = "faults"

    @pytest.fixture(scope="class")
    def run(self, request, kube_cluster):
        """Run the scenarios in order under one client; what they left behind."""
        cls = request.cls
        with agent_nodes_only(kube_cluster), fault_suite(kube_cluster, cls.SCENARIOS, name=cls.NAME) as result:
            yield result

    def test_every_sample_keeps_the_invariants(self, run):
        assert run["invariants"].violations == [], run["diagnostics"]

    def test_the_watcher_sampled_throughout(self, run):
        # a sample takes up to ~25 s when 9 sessions share the 2-core machine; far more when idle
        assert run["invariants"].samples >= 2 * len(self.SCENARIOS)

    def test_every_fault_was_injected(self, run):
        assert len(run["invariants"].faults) == len(self.SCENARIOS)

    def test_no_request_failed(self, run):
        assert run["traffic"].failures == [], run["diagnostics"]

    def test_requests_were_sent(self, run):
        assert run["traffic"].sent > 0

    def test_each_scenario_ends_on_its_last_target(self, run):
        assert run["finals"] == self.FINALS

    def test_every_leader_serves_the_last_target(self, run):
        served = sorted(info["weights_revision"] for info in run["infos"].values())
        assert served == [self.FINALS[-1]] * 2
