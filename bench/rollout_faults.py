"""The full fault matrix of issue 23 item 6: in-place rollouts under traffic, one fault per
rollout injected while a group loads, invariants checked at every sample.

Scenarios (``hack/scenario/rollout_faults.py``): a revert, a deleted leader of the updating
group, a deleted leader of a group that is not updating, a killed operator, a second target,
scale down and up. Two groups (TP=1) of the ~200M-parameter model (``--tiny``: the tiny model,
where loads are too short for most faults to land mid-load). Prints per scenario the final
target, seconds, requests sent and failed, the violations, the samples checked and the requests
the client sent again to another leader after a refused connection; then the samples and faults
checked. ``tests/e2e/test_rollout_faults.py`` runs a lean pick of these in CI (a revert, a deleted
updating leader), ``tests/e2e/test_rollout_faults_chaos.py`` two more (``make test-chaos``).

    python bench/rollout_faults.py                           # starts a local cluster
    SHARDLINE_CLUSTER_DIR=/tmp/kube python bench/rollout_faults.py --scenarios revert,kill-operator
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hack.localcluster import LocalCluster  # noqa: E402
from hack.scenario.invariant_watch import InvariantWatch  # noqa: E402
from hack.scenario.large_model import large_revisions  # noqa: E402
from hack.scenario.models import write_revisions  # noqa: E402
from hack.scenario.operator_install import install_operator  # noqa: E402
from hack.scenario.rollout_faults import (  # noqa: E402
    HOLD_SECONDS,
    SCENARIOS,
    Fleet,
    fault_fleet_doc,
    run_scenario,
)
from hack.scenario.rollout_fleet import apply, wait_ready  # noqa: E402
from hack.scenario.traffic import Traffic  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, of {list(SCENARIOS)}")
    parser.add_argument("--tiny", action="store_true", help="the tiny model instead of the ~200M one")
    parser.add_argument("--rate", type=float, default=4.0, help="client requests per second")
    args = parser.parse_args()
    scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown:
        parser.error(f"--scenarios: unknown {unknown}; allowed: {list(SCENARIOS)}")
    existing = os.environ.get("SHARDLINE_CLUSTER_DIR")
    cluster = LocalCluster.load(Path(existing)) if existing else LocalCluster(state_dir=Path(tempfile.mkdtemp(prefix="kube-")))
    if not existing:
        cluster.start()
    violations = reported = 0
    try:
        revisions = {k: str(v) for k, v in (write_revisions() if args.tiny else large_revisions()).items()}
        install_operator(cluster)
        ns, name = f"faults-{uuid.uuid4().hex[:6]}", "faults"
        doc = fault_fleet_doc(ns, name, revisions["rev-a"])
        watch = apply(cluster, doc)
        wait_ready(watch, "rev-a", 0, 900)
        invariants = InvariantWatch(cluster.client(), ns, name).start()
        fleet = Fleet(cluster, ns, name, watch, invariants, revisions)
        current = "rev-a"
        for scenario in scenarios:
            other = "rev-b" if current != "rev-b" else "rev-a"
            since, samples, faults = time.time(), invariants.samples, len(invariants.faults)
            with Traffic(cluster.client(), ns, name, doc["spec"]["model"]["name"], args.rate,
                         timeout=HOLD_SECONDS) as traffic:
                started = time.monotonic()
                current = run_scenario(fleet, scenario, current, other)
                seconds = time.monotonic() - started
            new = invariants.violations_since(since)
            violations += len(new) + len(traffic.failures)
            reported += len(new)
            print(f"{scenario:24s} -> {current:14s} {seconds:6.1f}s  requests {traffic.sent:4d}  "
                  f"failed {len(traffic.failures)}  violations {len(new)}  "
                  f"samples {invariants.samples - samples}  faults {len(invariants.faults) - faults}  "
                  f"reconnects {traffic.reconnects}", flush=True)
            for line in new + traffic.failures:
                print(f"    {line}")
        invariants.stop()  # a last pod LIST confirms the states up to now: judged once more
        final = invariants.violations
        violations += max(0, len(final) - reported)
        print(f"{invariants.summary()}; violations over the whole run: {len(final)}")
        for line in final:
            print(f"    {line}")
        watch.stop()
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
    finally:
        if not existing:
            cluster.stop()
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
