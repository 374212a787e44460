"""crds/inferencedeployment.yaml: strictly valid, and consistent with what the operator parses and writes."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import yaml

from shardline_operator import spec as spec_module
from shardline_operator.group_health import GroupRecord
from shardline_operator.rollout import GroupView
from shardline_operator.weights import LeaderReport
from shardline_operator.phases import DeploymentPhase, GroupPhase
from shardline_operator.rollout_state import RolloutState
from shardline_operator.runtime_args import ServedModel
from shardline_operator.status import GroupReport, build_status, invalid_spec_status

from test_status_build import observed

CRD_PATH = Path(__file__).resolve().parents[2] / "crds" / "inferencedeployment.yaml"


def load_crd():
    return yaml.safe_load(CRD_PATH.read_text())


def schema():
    return load_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_crd_validates_strictly():
    kubernetes_validate.validate(load_crd(), "1.37.0", strict=True)


def test_names_columns_and_subresources():
    crd = load_crd()
    assert crd["spec"]["names"]["shortNames"] == ["infd"]
    version = crd["spec"]["versions"][0]
    assert [c["name"].upper() for c in version["additionalPrinterColumns"]] == [
        "MODEL", "TP", "PP", "REPLICAS", "READY", "PHASE", "REVISION", "KIND", "AGE"]
    wide_only = [c["name"] for c in version["additionalPrinterColumns"] if c.get("priority", 0) > 0]
    assert wide_only == ["PP", "Kind"], "kubectl get shows PP and Kind only with -o wide"
    assert version["subresources"]["scale"] == {"specReplicasPath": ".spec.replicas",
                                                "statusReplicasPath": ".status.replicas",
                                                "labelSelectorPath": ".status.selector"}
    assert version["subresources"]["status"] == {}


def undeclared(value, node, path="status"):
    """Paths in ``value`` that the structural schema ``node`` would prune."""
    missing = []
    if isinstance(value, dict):
        props, extra = node.get("properties"), node.get("additionalProperties")
        for key, child in value.items():
            if props is not None and key in props:
                missing += undeclared(child, props[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                missing += undeclared(child, extra, f"{path}.{key}")
            elif not node.get("x-kubernetes-preserve-unknown-fields"):
                missing.append(f"{path}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            missing += undeclared(item, node.get("items", {}), f"{path}[{i}]")
    return missing


def enum_ok(value, node, path="status"):
    bad = []
    if isinstance(value, dict):
        for key, child in value.items():
            sub = (node.get("properties") or {}).get(key) or node.get("additionalProperties") or {}
            bad += enum_ok(child, sub if isinstance(sub, dict) else {}, f"{path}.{key}")
    elif isinstance(value, list):
        for item in value:
            bad += enum_ok(item, node.get("items", {}), path)
    elif "enum" in node and value not in node["enum"]:
        bad.append(f"{path}={value!r}")
    return bad


def test_every_status_field_written_is_declared(make_spec, make_pod):
    """Field case K5, offline: a real API server prunes undeclared status fields."""
    spec = make_spec()
    reports = [GroupReport(observed(spec, 0, make_pod), GroupRecord(restarts=1, last_restart_time=5.0)),
               GroupReport(observed(spec, 1, make_pod, ready=False), GroupRecord(failed_message="x"))]
    view = GroupView(0, ServedModel.desired(spec), leader=LeaderReport("serving", "/m", "rev-a", "sha256:x"))
    reports[0] = GroupReport(reports[0].observation, reports[0].record, view=view, digest="sha256:x",
                             mixed="group 0: leader serves digest sha256:x")
    rollout = RolloutState("RollingBack", ServedModel.desired(spec), previous=ServedModel.desired(spec),
                           wave=(1,), started_at=10.0, rollout_started_at=5.0, group_phases={1: "UpdatingWeights"},
                           canary=1, pause_until=20.0, message="m")
    status = build_status(spec, 4, reports, rollout, {}, now=100.0)
    status["restartBudgetGeneration"] = 4
    status_schema = schema()["properties"]["status"]
    assert undeclared(status, status_schema) == []
    assert enum_ok(status, status_schema) == []
    invalid = invalid_spec_status("spec.x is bad", 2, {}, 0.0)
    assert undeclared(invalid, status_schema) == [] and enum_ok(invalid, status_schema) == []


def test_enums_and_reserved_flags_match_the_parser():
    spec_schema = schema()["properties"]["spec"]["properties"]
    runtime = spec_schema["runtime"]["properties"]
    assert tuple(runtime["dtype"]["enum"]) == spec_module.DTYPES
    assert tuple(runtime["kvCacheDtype"]["enum"]) == spec_module.KV_CACHE_DTYPES
    assert tuple(runtime["quantization"]["enum"]) == spec_module.QUANTIZATION_MODES
    assert tuple(spec_schema["model"]["properties"]["kind"]["enum"]) == spec_module.MODEL_KINDS
    assert tuple(runtime["imagePullPolicy"]["enum"]) == spec_module.PULL_POLICIES
    assert tuple(spec_schema["weightUpdate"]["properties"]["strategy"]["enum"]) == spec_module.STRATEGIES
    assert tuple(spec_schema["service"]["properties"]["type"]["enum"]) == spec_module.SERVICE_TYPES
    rule = runtime["args"]["x-kubernetes-validations"][0]["rule"]
    for flag in spec_module.RESERVED_FLAGS:
        assert f"'{flag}'" in rule
    env_rule = runtime["env"]["x-kubernetes-validations"][0]["rule"]
    for name in spec_module.RESERVED_ENV:
        assert f"'{name}'" in env_rule


def test_status_phase_enum_is_every_deployment_phase():
    status_schema = schema()["properties"]["status"]["properties"]
    assert status_schema["phase"]["enum"] == [p.value for p in DeploymentPhase]


def test_group_phase_enum_is_every_group_phase():
    group_schema = schema()["properties"]["status"]["properties"]["groups"]["items"]["properties"]
    assert group_schema["phase"]["enum"] == [p.value for p in GroupPhase]


def defaults(node, path=""):
    found = {}
    for key, child in (node.get("properties") or {}).items():
        if "default" in child and not isinstance(child["default"], dict):
            found[f"{path}{key}"] = child["default"]
        found.update(defaults(child, f"{path}{key}."))
    return found


def test_crd_defaults_equal_parser_defaults():
    parsed = spec_module.parse_spec("m", "ns", "u", {"model": {"name": "m", "path": "/var/lib/shardline/models/m/v1"},
                                                     "runtime": {"image": "i"}})
    canary = spec_module.parse_spec("m", "ns", "u", {"model": {"name": "m", "path": "/var/lib/shardline/models/m/v1"},
                                                     "runtime": {"image": "i"},
                                                     "weightUpdate": {"canary": {"verify": {"prompt": "hi"}}}})
    expected = {
        "replicas": parsed.replicas, "model.mountPath": parsed.model.mount_path, "model.kind": parsed.model.kind,
        "parallelism.tensor": parsed.parallelism.tensor, "parallelism.gpusPerPod": parsed.parallelism.gpus_per_pod,
        "parallelism.expert": parsed.parallelism.expert, "parallelism.pipeline": parsed.parallelism.pipeline,
        "runtime.imagePullPolicy": parsed.runtime.image_pull_policy, "runtime.dtype": parsed.runtime.dtype,
        "runtime.kvCacheDtype": parsed.runtime.kv_cache_dtype,
        "runtime.quantization": parsed.runtime.quantization,
        "runtime.memFractionStatic": parsed.runtime.mem_fraction_static,
        "runtime.startupTimeoutSeconds": parsed.runtime.startup_timeout_seconds,
        "runtime.cudaGraph.enabled": parsed.runtime.cuda_graph.enabled,
        "runtime.cudaGraph.maxBatchSize": parsed.runtime.cuda_graph.max_batch_size,
        "weightUpdate.strategy": parsed.weight_update.strategy,
        "weightUpdate.timeoutSeconds": parsed.weight_update.timeout_seconds,
        "weightUpdate.rollbackOnFailure": parsed.weight_update.rollback_on_failure,
        "weightUpdate.maxUnavailable": parsed.weight_update.max_unavailable,
        "weightUpdate.pauseSeconds": parsed.weight_update.pause_seconds,
        "weightUpdate.canary.enabled": canary.weight_update.canary is not None,
        "weightUpdate.canary.verify.maxTokens": canary.weight_update.canary.verify.max_tokens,
        "weightUpdate.canary.verify.maxLatencySeconds": canary.weight_update.canary.verify.max_latency_seconds,
        "restartPolicy.maxGroupRestarts": parsed.restart_policy.max_group_restarts,
        "restartPolicy.backoffSeconds": parsed.restart_policy.backoff_seconds,
        "service.type": parsed.service.type, "service.port": parsed.service.port,
        "networkPolicy.enabled": parsed.network_policy.enabled,
        "auth.apiKeySecretRef.key": spec_module.parse_auth({"apiKeySecretRef": {"name": "s"}}).api_key_secret.key,
    }
    assert defaults(schema()["properties"]["spec"]) == expected
