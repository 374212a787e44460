"""Rollout duration and failed requests: InPlace vs Restart on the same deployment, in the local cluster.

Two groups (TP=1, one pod each) serve a tiny model, or with ``--params-200m`` a ~200M-parameter
float32 llama (written once under the models hostPath and reused). Client traffic
(``hack/scenario/traffic.py``: a fixed rate, round-robin over the Ready, non-terminating leaders, a
fresh connection per request) runs through each rollout. Measured from the patch to the status
being Ready on the new revision with every group on it:

    rev-a -> rev-b with strategy InPlace, then rev-b -> rev-a with strategy Restart.

Prints each rollout's duration and failed requests, and the InPlace / Restart duration ratio.

    python bench/rollout.py                      # starts a local cluster (binaries cached)
    SHARDLINE_CLUSTER_DIR=/tmp/kube python bench/rollout.py --params-200m
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hack.localcluster import LocalCluster  # noqa: E402
from hack.scenario.examples import tp2_example  # noqa: E402
from hack.scenario.models import MODELS_ROOT, write_revisions, write_tiny_model  # noqa: E402
from hack.scenario.operator_install import install_operator  # noqa: E402
from hack.scenario.status_watch import StatusWatcher  # noqa: E402
from hack.scenario.traffic import Traffic  # noqa: E402

# ~200M parameters (float32, ~800 MB): 12 layers x (4 x 1024^2 attention + 3 x 1024 x 4096 MLP).
LARGE = {"hidden_size": "1024", "intermediate_size": "4096", "num_hidden_layers": "12",
         "num_attention_heads": "16", "num_key_value_heads": "16"}


def revisions(large: bool) -> dict[str, Path]:
    if not large:
        return write_revisions()
    base = MODELS_ROOT / "llama-200m"
    return {"rev-a": write_tiny_model(base / "rev-a", seed=1, overrides=LARGE),
            "rev-b": write_tiny_model(base / "rev-b", seed=2, overrides=LARGE)}


def rollout(cluster, client, watch, ns: str, spec: dict, revision: str, model: str, rate: float) -> tuple[float, int, int]:
    mark = watch.mark()
    with Traffic(cluster.client(), ns, "bench", model, rate) as traffic:
        started = time.monotonic()
        cluster.kubectl("patch", "infd", "bench", "-n", ns, "--type", "merge", "-p", json.dumps({"spec": spec}))
        watch.wait(lambda s: s.phase == "Ready" and s.served_revision == revision and s.ready_replicas == 2
                   and s.observed_generation == s.generation, 900, f"Ready on {revision}", mark)
        seconds = time.monotonic() - started
    return seconds, traffic.sent, len(traffic.failures)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params-200m", action="store_true", help="a ~200M-parameter float32 model")
    parser.add_argument("--rate", type=float, default=4.0, help="client requests per second")
    args = parser.parse_args()
    existing = os.environ.get("SHARDLINE_CLUSTER_DIR")
    cluster = LocalCluster.load(Path(existing)) if existing else LocalCluster(state_dir=Path(tempfile.mkdtemp(prefix="kube-")))
    if not existing:
        cluster.start()
    try:
        revs = revisions(args.params_200m)
        install_operator(cluster)
        _, doc = tp2_example()
        ns = f"bench-{uuid.uuid4().hex[:6]}"
        cluster.kubectl("create", "namespace", ns)
        doc = json.loads(json.dumps(doc))
        doc["metadata"] = {"name": "bench", "namespace": ns}
        doc["spec"].update(replicas=2, parallelism={"tensor": 1, "gpusPerPod": 1})
        doc["spec"]["model"].update(path=str(revs["rev-a"]), revision="rev-a")
        doc["spec"]["runtime"]["startupTimeoutSeconds"] = 900
        client = cluster.client()
        watch = StatusWatcher(client, ns, "bench").start()
        cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
        watch.wait(lambda s: s.phase == "Ready" and s.ready_replicas == 2, 900, "Ready on rev-a")
        model = doc["spec"]["model"]["name"]
        in_place = rollout(cluster, client, watch, ns, {"model": {"path": str(revs["rev-b"]), "revision": "rev-b"}},
                           "rev-b", model, args.rate)
        restart = rollout(cluster, client, watch, ns, {"model": {"path": str(revs["rev-a"]), "revision": "rev-a"},
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
