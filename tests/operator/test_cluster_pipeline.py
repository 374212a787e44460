"""spec.parallelism.pipeline against a real kube-apiserver (local cluster, marker ``cluster``):
the CRD's CEL rules, a tensor x pipeline group's pods, status ranks and ``-o wide`` column,
whole-group restarts, and a real runtime's "fewer layers than stages" error as the Failed reason.

Uses the operator fixture of ``test_cluster_operator`` (the chart's operator pod and a fake
kubelet for the pods pinned to its node).
"""

from __future__ import annotations

import json

import pytest
from test_cluster_operator import deployment, op, wait_for  # noqa: F401  (op: the module's fixture)

from hack.scenario.models import MODELS_ROOT, write_tiny_model

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

PIPELINE = {"tensor": 2, "pipeline": 2, "gpusPerPod": 1}


@pytest.mark.parametrize("change, message", [
    ({"parallelism": {"tensor": 2, "pipeline": 0}}, "spec.parallelism.pipeline"),
    ({"parallelism": {"tensor": 2, "pipeline": 65}}, "spec.parallelism.pipeline"),
    ({"parallelism": {"tensor": 1, "pipeline": 3, "gpusPerPod": 2}},
     "tensor x spec.parallelism.pipeline must be a multiple of spec.parallelism.gpusPerPod"),
    ({"parallelism": {"tensor": 3, "pipeline": 2, "gpusPerPod": 2}},
     "gpusPerPod must divide spec.parallelism.tensor or be a multiple of it"),
    ({"parallelism": {"tensor": 1024, "pipeline": 2, "gpusPerPod": 64}}, "must be at most 1024 ranks per group"),
    ({"parallelism": {"tensor": 1, "pipeline": 2, "pipelineLayerPartition": [1, 1, 1]}},
     "pipelineLayerPartition must give one layer count per pipeline stage"),
    ({"parallelism": {"tensor": 1, "pipeline": 2, "pipelineLayerPartition": [2, 0]}},
     "spec.parallelism.pipelineLayerPartition[1]"),
    ({"parallelism": {"tensor": 2, "pipeline": -1}}, "spec.parallelism.pipeline"),
    ({"parallelism": {"tensor": 2, "pipeline": "2"}}, "spec.parallelism.pipeline"),
    ({"parallelism": {"tensor": 2, "pipeline": 3, "gpusPerPod": 4}},
     "tensor x spec.parallelism.pipeline must be a multiple of spec.parallelism.gpusPerPod"),
    ({"parallelism": {"tensor": 4, "pipeline": 2, "expert": 3}}, "spec.parallelism.expert must divide spec.parallelism.tensor"),
    ({"parallelism": {"tensor": 1, "pipeline": 2, "pipelineLayerPartition": [-1, 3]}},
     "spec.parallelism.pipelineLayerPartition[0]"),
    ({"parallelism": {"tensor": 1, "pipeline": 64, "pipelineLayerPartition": [1] * 65}},
     "spec.parallelism.pipelineLayerPartition: Too many"),
    ({"parallelism": {"tensor": 1, "pipelineLayerPartition": [1, 1]}},  # pipeline defaults to 1
     "pipelineLayerPartition must give one layer count per pipeline stage"),
    ({"parallelism": {"tensor": 1, "pipeline": 2}, "loraAdapters": [{"name": "a", "path": "/adapters/a"}]},
     "spec.loraAdapters are not served with spec.parallelism.pipeline > 1"),
    ({"runtime": {"image": "r:1", "args": ["--pp-size", "2"]}}, "must not set a flag the operator renders"),
    ({"runtime": {"image": "r:1", "args": ["--pp-layer-partition=1,1"]}}, "must not set a flag the operator renders"),
])
def test_api_server_rejects_invalid_pipeline_specs(op, change, message):  # noqa: F811
    proc = op.apply(deployment("invalid", **change), check=False, dry_run=True)
    assert proc.returncode != 0, proc.stdout
    assert message in proc.stderr, proc.stderr


def test_api_server_defaults_pipeline_to_one(op):  # noqa: F811
    accepted = json.loads(op.apply(deployment("defaults"), dry_run=True).stdout)["spec"]
    assert accepted["parallelism"]["pipeline"] == 1
    explicit = deployment("pp", parallelism={"tensor": 2, "pipeline": 2, "gpusPerPod": 4})
    assert json.loads(op.apply(explicit, dry_run=True).stdout)["spec"]["parallelism"]["pipeline"] == 2


def test_pipeline_group_pods_status_and_wide_column_and_whole_group_restart(op):  # noqa: F811
    op.kubelet.ready = lambda pod: True
    op.apply(deployment("pipe", parallelism=PIPELINE))
    status = op.wait_phase("pipe", "Ready")
    assert sorted(op.pods("pipe")) == ["pipe-g0-0", "pipe-g0-1", "pipe-g0-2", "pipe-g0-3"]
    ranks = status["groups"][0]["ranks"]
    assert [(r["pod"], r["ppRanks"], r["tpRanks"]) for r in ranks] == [
        ("pipe-g0-0", [0], [0]), ("pipe-g0-1", [0], [1]), ("pipe-g0-2", [1], [0]), ("pipe-g0-3", [1], [1])]
    args = op.pods("pipe")["pipe-g0-3"]["spec"]["containers"][0]["args"]
    assert args[args.index("--pp-size") + 1] == "2" and args[args.index("--nnodes") + 1] == "4"
    plain = op.kubectl("get", "infd", "pipe").stdout.splitlines()
    assert "PP" not in plain[0].split()
    wide = op.kubectl("get", "infd", "pipe", "-o", "wide").stdout.splitlines()
    assert wide[0].split()[:4] == ["NAME", "MODEL", "TP", "PP"]
    assert wide[1].split()[:4] == ["pipe", "tiny-llama", "2", "2"]
    # A rank of the last stage crashes: every pod of the group (both stages) is replaced.
    before = {name: p["metadata"]["uid"] for name, p in op.pods("pipe").items()}
    op.kubelet.crash = lambda pod: "RuntimeError: gloo recv from stage 0 timed out" \
        if pod["metadata"]["uid"] == before["pipe-g0-3"] else None
    try:
        wait_for(lambda: all(p["metadata"]["uid"] != before.get(name) for name, p in op.pods("pipe").items())
                 and len(op.pods("pipe")) == 4, 90, "all four pods replaced")
    finally:
        op.kubelet.crash = lambda pod: None
    status = op.wait_phase("pipe", "Ready")
    assert status["groups"][0]["restarts"] == 1
    op.kubectl("delete", "infd", "pipe", "--timeout=60s")


def test_real_runtime_with_fewer_layers_than_stages_is_failed_with_its_error(op):  # noqa: F811
    """tiny-llama has 2 decoder layers; 3 stages cannot split them. The runtime stops at start
    with an error naming --pp-size, and that line is the group's Failed reason."""
    model = write_tiny_model(MODELS_ROOT / "tiny-llama" / "rev-a", seed=1)
    doc = deployment("ppfail", restartPolicy={"maxGroupRestarts": 0, "backoffSeconds": 1},
                     parallelism={"tensor": 1, "pipeline": 3, "gpusPerPod": 3},
                     runtime={"image": "ghcr.io/shardline/shardline-runtime:0.1.0", "dtype": "float32",
                              "maxTotalTokens": 1024, "startupTimeoutSeconds": 180})
    doc["spec"]["model"]["path"] = str(model)
    del doc["spec"]["scheduling"]  # land on the node agent's nodes: real processes
    op.apply(doc)
    status = op.wait_phase("ppfail", "Failed", timeout=240)
    group = status["groups"][0]
    assert group["phase"] == "Failed" and "\n" not in group["message"]
    assert "2 layers" in group["message"] and "--pp-size" in group["message"], group["message"]
    assert group["message"] in status["message"]
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True" and group["message"] in degraded["message"]
    op.kubectl("delete", "infd", "ppfail", "--timeout=120s", timeout=180)
