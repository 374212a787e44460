"""Issue 23 item 6, the chaos tier (``make test-chaos``, marker ``chaos``; out of ``make test``
for the CI budget): the fault suite of ``test_rollout_faults.py`` with a killed operator and a
deleted leader of the group that is not updating, each injected while a group loads. The full
matrix (also a second target, scale down and up) is ``bench/rollout_faults.py``."""
from __future__ import annotations

import pytest

from tests.e2e.fault_suite_checks import FaultSuiteChecks

pytestmark = [pytest.mark.e2e, pytest.mark.cluster, pytest.mark.slow, pytest.mark.chaos]


class TestKilledOperatorAndDeletedOtherLeader(FaultSuiteChecks):
    SCENARIOS = [("kill-operator", "rev-a", "rev-b"), ("delete-other-leader", "rev-b", "rev-a")]
    FINALS = ["rev-b", "rev-a"]
    NAME = "chaos"
