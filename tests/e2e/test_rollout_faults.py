"""Issue 23 item 6: in-place rollouts under traffic with faults injected while a group loads,
checked continuously in the local cluster (the CI pick; ``test_rollout_faults_chaos.py`` runs
two more faults in ``make test-chaos``, ``bench/rollout_faults.py`` every one).

Two groups (TP=1) of the ~200M-parameter model (an 810 MB revision: loading takes seconds, so a
fault lands mid-load). A readiness-aware client (``hack/scenario/traffic.py``) runs throughout;
``hack/scenario/invariant_watch.py`` watches the leader pods, asks every leader's
``/get_server_info`` about four times a second and reads the CR, keeps each observation with the
times it can be valid at, and checks (``hack/scenario/availability.py``) that at no instant are
more than ``maxUnavailable`` groups certainly unavailable beyond what a fault took down, that no
update begins while the groups down (faulted ones included) fill ``maxUnavailable``, and that
status never shows a group Ready on a revision or digest its leader did not serve. Asserted: no
violation, 0 failed requests, and the fleet Ready on the last target with every leader serving
it.

The pick: the two faults that abort a load in the runtime while requests run, a revert (the
operator's ``/abort_weight_update``) and a deleted leader of the updating group (its drain
aborts the load; it answers every request that reached it, and the client sends a refused
connection to another leader). Both once killed the leader's scheduler (an aborted update
flushed the prefix cache under running requests).
"""
from __future__ import annotations

import pytest

from tests.e2e.fault_suite_checks import FaultSuiteChecks

pytestmark = [pytest.mark.e2e, pytest.mark.cluster, pytest.mark.slow]


class TestRevertAndDeletedUpdatingLeader(FaultSuiteChecks):
    SCENARIOS = [("revert", "rev-a", "rev-b"), ("delete-updating-leader", "rev-a", "rev-b")]
    FINALS = ["rev-a", "rev-b"]
