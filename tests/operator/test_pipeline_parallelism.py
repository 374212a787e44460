"""spec.parallelism.pipeline: parsing, the rank layout over pods, rendering, status and group health."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_status_build import observed

from shardline_operator.group_health import GroupRecord, decide
from shardline_operator.observed import GroupObservation, PodObservation
from shardline_operator.parallelism import ParallelismSpec, PodRanks
from shardline_operator.render import render_children
from shardline_operator.spec import RestartPolicySpec, SpecError
from shardline_operator.status import GroupReport, build_status

REPO = Path(__file__).resolve().parents[2]

@pytest.fixture(scope="module")
def layer_error(tmp_path_factory):
    """What the runtime itself writes to its termination log (Kubernetes' terminated message)
    when asked for more stages than the model has layers: ``serve --pp-size 4`` on a 2-layer model."""
    from shardline_runtime.tiny_checkpoint import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("pp-layers")
    make_tiny_checkpoint(root / "model", arch="llama", seed=0, num_hidden_layers=2)
    log = root / "termination-log"
    env = {**os.environ, "SHARDLINE_TERMINATION_LOG": str(log),
           "PYTHONPATH": os.pathsep.join([str(REPO / "runtime"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "shardline_runtime", "serve", "--model-path", str(root / "model"),
                           "--pp-size", "4", "--device", "cpu", "--port", "1"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode != 0, done.stdout
    message = log.read_text().strip()
    assert "--pp-size" in message, message  # the runtime's PipelineLayoutError, not another failure
    return message


def args_of(spec, group=0):
    sts = next(c for c in render_children(spec) if c["kind"] == "StatefulSet" and c["metadata"]["name"].endswith(f"-g{group}"))
    return sts, sts["spec"]["template"]["spec"]["containers"][0]["args"]


def flag(args, name):
    return args[args.index(name) + 1] if name in args else None


@pytest.mark.parametrize("tensor, pipeline, gpus, layout", [
    # SGLang: rank = pp_rank * tensor + tp_rank; pod n runs ranks n*gpus .. n*gpus + gpus - 1.
    (2, 2, 2, [PodRanks((0,), (0, 1)), PodRanks((1,), (0, 1))]),
    (2, 2, 1, [PodRanks((0,), (0,)), PodRanks((0,), (1,)), PodRanks((1,), (0,)), PodRanks((1,), (1,))]),
    (2, 2, 4, [PodRanks((0, 1), (0, 1))]),
    (4, 2, 2, [PodRanks((0,), (0, 1)), PodRanks((0,), (2, 3)), PodRanks((1,), (0, 1)), PodRanks((1,), (2, 3))]),
    (1, 4, 2, [PodRanks((0, 1), (0,)), PodRanks((2, 3), (0,))]),
    (8, 1, 4, [PodRanks((0,), (0, 1, 2, 3)), PodRanks((0,), (4, 5, 6, 7))]),
])
def test_pod_ranks_follow_sglang_layout(tensor, pipeline, gpus, layout):
    parallelism = ParallelismSpec(tensor=tensor, pipeline=pipeline, gpus_per_pod=gpus)
    assert parallelism.pods_per_group == len(layout)
    assert [parallelism.pod_ranks(n) for n in range(parallelism.pods_per_group)] == layout


def test_pod_ranks_rejects_a_node_rank_outside_the_group():
    with pytest.raises(ValueError, match=r"node_rank must be in \[0, 2\)"):
        ParallelismSpec(tensor=2, pipeline=2, gpus_per_pod=2).pod_ranks(2)


def test_pipeline_defaults_to_one(make_spec):
    spec = make_spec()
    assert spec.parallelism.pipeline == 1 and spec.parallelism.pipeline_layer_partition == ()
    _, args = args_of(spec)
    assert "--pp-size" not in args and "--pp-layer-partition" not in args


@pytest.mark.parametrize("parallelism", [
    {"tensor": 2, "pipeline": 2, "gpusPerPod": 2},
    {"tensor": 1, "pipeline": 4, "gpusPerPod": 2},
    {"tensor": 2, "pipeline": 2, "gpusPerPod": 4},
    {"tensor": 4, "pipeline": 2, "gpusPerPod": 2, "expert": 2},
])
def test_valid_pipeline_layouts_parse(make_spec, parallelism):
    spec = make_spec({"parallelism": parallelism})
    assert spec.parallelism.pods_per_group * spec.parallelism.gpus_per_pod == spec.parallelism.world_size


@pytest.mark.parametrize("parallelism, message", [
    ({"tensor": 2, "pipeline": 0}, "spec.parallelism.pipeline must be in [1, 64]"),
    ({"tensor": 2, "pipeline": 65}, "spec.parallelism.pipeline must be in [1, 64]"),
    ({"tensor": 1024, "pipeline": 2}, "spec.parallelism: tensor x pipeline (1024 x 2 = 2048) must be at most 1024"),
    ({"tensor": 1, "pipeline": 3, "gpusPerPod": 2},
     "spec.parallelism: tensor x pipeline (1 x 3 = 3) must be a multiple of gpusPerPod (2)"),
    ({"tensor": 2, "pipeline": 3, "gpusPerPod": 3},
     "spec.parallelism: gpusPerPod (3) must divide tensor (2) or be a multiple of it"),
    ({"tensor": 3, "pipeline": 2, "gpusPerPod": 2},
     "spec.parallelism: gpusPerPod (2) must divide tensor (3) or be a multiple of it"),
    ({"tensor": 1, "pipeline": 2, "pipelineLayerPartition": [1, 1, 1]},
     "spec.parallelism: pipelineLayerPartition gives 3 stages ([1, 1, 1]) but pipeline is 2"),
    ({"tensor": 1, "pipeline": 2, "pipelineLayerPartition": [2, 0]},
     "spec.parallelism.pipelineLayerPartition must be a list of layer counts >= 1"),
    ({"tensor": 1, "pipeline": 2, "pipelineLayerPartition": []},
     "spec.parallelism.pipelineLayerPartition must be a list of layer counts >= 1 (one per stage), got []"),
    ({"tensor": 1, "pipeline": 2, "pipelineLayerPartition": "1,1"},
     "spec.parallelism.pipelineLayerPartition must be of type array"),
])
def test_invalid_pipeline_layouts_name_the_field(make_spec, parallelism, message):
    with pytest.raises(SpecError) as err:
        make_spec({"parallelism": parallelism})
    assert message in str(err.value)


def test_lora_adapters_are_refused_with_a_pipeline(make_spec):
    with pytest.raises(SpecError, match=r"spec.loraAdapters are not served with spec.parallelism.pipeline > 1"):
        make_spec({"parallelism": {"tensor": 1, "pipeline": 2}, "loraAdapters": [{"name": "a", "path": "/adapters/a"}]})


def test_user_args_may_not_set_the_pipeline_flags(make_spec):
    for arg in ("--pp-size=2", "--pp-layer-partition"):
        with pytest.raises(SpecError, match=f"spec.runtime.args must not set {arg.split('=')[0]}"):
            make_spec({"runtime": {"image": "r:1", "args": [arg, "1,1"]}})


def test_rendered_group_has_tensor_times_pipeline_pods(make_spec):
    spec = make_spec({"parallelism": {"tensor": 2, "pipeline": 2, "gpusPerPod": 2, "pipelineLayerPartition": [3, 5]}})
    sts, args = args_of(spec, group=1)
    assert sts["spec"]["replicas"] == 2
    assert flag(args, "--tp-size") == "2" and flag(args, "--pp-size") == "2" and flag(args, "--nnodes") == "2"
    assert flag(args, "--pp-layer-partition") == "3,5"
    assert flag(args, "--node-rank") == "$(POD_INDEX)"
    limits = sts["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "2"
    pdb = next(c for c in render_children(spec) if c["kind"] == "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 2


def test_restart_hash_ignores_pipeline_defaults_but_not_a_pipeline(make_spec):
    base = make_spec()
    explicit = make_spec({"parallelism": {"tensor": 2, "gpusPerPod": 1, "pipeline": 1}})
    assert base.restart_hash() == explicit.restart_hash()
    assert make_spec({"parallelism": {"tensor": 2, "pipeline": 2}}).restart_hash() != base.restart_hash()
    split = make_spec({"parallelism": {"tensor": 2, "pipeline": 2, "pipelineLayerPartition": [1, 1]}})
    assert split.restart_hash() != make_spec({"parallelism": {"tensor": 2, "pipeline": 2}}).restart_hash()


def test_status_ranks_show_each_pods_pipeline_stages_and_tp_ranks(make_spec, make_pod):
    spec = make_spec({"replicas": 1, "parallelism": {"tensor": 2, "pipeline": 2, "gpusPerPod": 1}})
    group = observed(spec, 0, make_pod, pods=4)
    group = GroupObservation(0, spec.parallelism.pods_per_group, group.statefulset, group.pods)
    status = build_status(spec, 1, [GroupReport(group, GroupRecord())], None, {}, now=0.0)
    ranks = status["groups"][0]["ranks"]
    assert [(r["pod"], r["ppRanks"], r["tpRanks"]) for r in ranks] == [
        ("llama-g0-0", [0], [0]), ("llama-g0-1", [0], [1]), ("llama-g0-2", [1], [0]), ("llama-g0-3", [1], [1])]
    assert status["phase"] == "Ready" and status["groups"][0]["pods"] == 4


def pp_group(make_pod, **last_pod):
    pods = [make_pod(0, r) for r in range(3)] + [make_pod(0, 3, **last_pod)]
    return GroupObservation(0, 4, {"metadata": {}}, tuple(PodObservation.from_api(p) for p in pods))


def test_a_failed_last_stage_restarts_the_whole_group(make_pod):
    """A pipeline rank that dies leaves the other stages blocked on send/recv: all tp x pp pods go."""
    group = pp_group(make_pod, restarts=1, terminated_message="RuntimeError: gloo recv timed out")
    decision = decide(group, GroupRecord(), RestartPolicySpec(max_group_restarts=2, backoff_seconds=1), now=10.0)
    assert decision.action == "restart"
    assert decision.record.restarts == 1 and decision.record.pod_uids == {}


def test_fewer_layers_than_stages_becomes_the_groups_failed_reason(make_spec, make_pod, layer_error):
    spec = make_spec({"replicas": 1, "parallelism": {"tensor": 1, "pipeline": 4, "gpusPerPod": 1},
                      "restartPolicy": {"maxGroupRestarts": 0}})
    group = pp_group(make_pod, restarts=1, terminated_message=f"{layer_error}\nTraceback (most recent call last):")
    decision = decide(group, GroupRecord(), spec.restart_policy, now=10.0)
    assert decision.action == "fail"
    assert decision.record.failed_message == layer_error
    status = build_status(spec, 1, [GroupReport(group, decision.record)], None, {}, now=10.0)
    assert status["phase"] == "Failed"
    assert status["groups"][0]["phase"] == "Failed" and status["groups"][0]["message"] == layer_error
    assert status["message"] == f"group 0: {layer_error}"
    assert status["groups"][0]["ranks"][3]["lastError"] == layer_error[:256]


def test_a_restarting_group_shows_the_error_it_restarts_after(make_spec, make_pod, layer_error):
    """Before the budget is spent, status already says why the group restarts (not just Degraded)."""
    spec = make_spec({"replicas": 1, "parallelism": {"tensor": 1, "pipeline": 4, "gpusPerPod": 1}})
    group = pp_group(make_pod, restarts=1, terminated_message=layer_error)
    decision = decide(group, GroupRecord(), spec.restart_policy, now=10.0)
    assert decision.action == "restart"
    status = build_status(spec, 1, [GroupReport(group, decision.record, "Restarting")], None, {}, now=10.0)
    assert status["phase"] == "Degraded"
    assert status["groups"][0]["message"] == f"restarting after: {layer_error}"
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["message"] == f"group 0: restarting after: {layer_error}"
    planned = build_status(spec, 1, [GroupReport(group, decision.record, "Restarting", planned=True)], None, {},
                           now=10.0)
    assert planned["groups"][0]["message"] == ""
