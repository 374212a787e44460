"""Rollout duration and failed requests: InPlace vs Restart on the same deployment, in the local cluster.

Two groups (TP=1, one pod each) serve a tiny model, or with ``--params-200m`` a ~200M-parameter
float32 llama (``hack/scenario/large_model.py``: written once into ~/.cache/shardline and reused). Client traffic
(``hack/scenario/traffic.py``: a fixed rate, round-robin over the Ready, non-terminating leaders, a
fresh connection per request) runs through each rollout. Measured from the patch to the status
being Ready on the new revision with every group on it:

    rev-a -> rev-b with strategy InPlace, then rev-b -> rev-a with strategy Restart.

Prints each rollout's duration and failed requests, and the InPlace / Restart duration ratio.

With ``--staging`` it measures instead an S3 rollout with and without the staging step (issue 25:
``bench/rollout_staging.py``), in one run.

    python bench/rollout.py                      # starts a local cluster (binaries cached)
    python bench/rollout.py --staging            # S3 rollout with vs without staging
    SHARDLINE_CLUSTER_DIR=/tmp/kube python bench/rollout.py --params-200m
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
from hack.scenario.large_model import large_revisions  # noqa: E402
from hack.scenario.models import write_revisions  # noqa: E402
from hack.scenario.operator_install import install_operator  # noqa: E402
from hack.scenario.rollout_fleet import apply, patch, two_group_doc, wait_ready  # noqa: E402
from hack.scenario.traffic import Traffic  # noqa: E402


def rollout(cluster, watch, ns: str, spec: dict, revision: str, model: str, rate: float) -> tuple[float, int, int]:
    mark = watch.mark()
    with Traffic(cluster.client(), ns, "bench", model, rate) as traffic:
        started = time.monotonic()
        patch(cluster, ns, "bench", spec)
        wait_ready(watch, revision, mark, 900)
        seconds = time.monotonic() - started
    return seconds, traffic.sent, len(traffic.failures)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params-200m", action="store_true", help="a ~200M-parameter float32 model")
    parser.add_argument("--rate", type=float, default=4.0, help="client requests per second")
    parser.add_argument("--staging", action="store_true",
                        help="an S3 rollout with and without staging (bench/rollout_staging.py)")
    parser.add_argument("--staging-last", action="store_true",
                        help="with --staging: run the rollout without staging first")
    args = parser.parse_args()
    existing = os.environ.get("SHARDLINE_CLUSTER_DIR")
    cluster = LocalCluster.load(Path(existing)) if existing else LocalCluster(state_dir=Path(tempfile.mkdtemp(prefix="kube-")))
    if not existing:
        cluster.start()
    try:
        revs = large_revisions() if args.params_200m else write_revisions()
        install_operator(cluster)
        if args.staging:
            from bench.rollout_staging import compare

            compare(cluster, revs, args.rate, staging_first=not args.staging_last)
            return
        ns = f"bench-{uuid.uuid4().hex[:6]}"
        doc = two_group_doc(ns, "bench", str(revs["rev-a"]), "rev-a", startup_timeout=900)
        watch = apply(cluster, doc)
        wait_ready(watch, "rev-a", 0, 900)
        model = doc["spec"]["model"]["name"]
        in_place = rollout(cluster, watch, ns, {"model": {"path": str(revs["rev-b"]), "revision": "rev-b"}},
                           "rev-b", model, args.rate)
        restart = rollout(cluster, watch, ns, {"model": {"path": str(revs["rev-a"]), "revision": "rev-a"},
                                                       "weightUpdate": {"strategy": "Restart"}}, "rev-a", model, args.rate)
        size = "~200M params float32" if args.params_200m else "tiny"
        print(f"model: {size}; 2 groups (TP=1); client {args.rate:g} req/s")
        print(f"{'strategy':<10}{'seconds':>9}{'requests':>10}{'failed':>8}")
        for name, (seconds, sent, failed) in (("InPlace", in_place), ("Restart", restart)):
            print(f"{name:<10}{seconds:>9.1f}{sent:>10}{failed:>8}")
        print(f"InPlace / Restart duration: {in_place[0] / restart[0]:.2f}x")
        watch.stop()
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
    finally:
        if not existing:
            cluster.stop()


if __name__ == "__main__":
    main()
